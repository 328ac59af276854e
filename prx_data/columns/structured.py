"""Structured attributes: a JSON schema -> guided generation, validation and an Arrow struct.

The caption job with ``--schema FILE`` asks the model for one JSON object
per image (subject categories, style, lighting, text present, ...). The
schema does three things:

1. **Guides generation** where the backend can: vLLM's offline engine gets
   ``GuidedDecodingParams(json=schema)``, an OpenAI-compatible endpoint gets
   ``response_format={"type": "json_schema", ...}``, the transformers backend
   masks the logits with xgrammar (the library vLLM's guided decoding uses).
2. **Validates every output, on every backend** (guided decoding can still
   be cut off by the token limit, and servers differ in what they enforce):
   the text must parse as JSON and pass ``jsonschema`` (Draft 2020-12). An
   output that fails is flagged ``invalid`` with the validator's message in
   ``<column>_error`` and never stored.
3. **Types the column**: :func:`arrow_type` maps the schema to a
   ``pyarrow`` struct (object -> struct, string -> string, boolean -> bool,
   integer -> int64, number -> float64, array -> list), so Lance filters read
   ``attributes.style = 'photo'`` or ``array_has(attributes.subjects, 'dog')``.

Supported schema subset (anything else is refused up front, so a schema
never means one thing to the validator and another to the column type):
``type`` (one of the above, or ``[T, "null"]``), ``properties``,
``required``, ``enum``, ``items``, ``additionalProperties``, plus the
annotation and bound keywords the validator checks without affecting the
type (``description``, ``title``, ``minimum``, ``maxItems``, ...).
"""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pyarrow as pa

from prx_data.core.errors import PrxDataError

#: JSON schema keywords that shape the Arrow type.
_SHAPE = {"type", "properties", "required", "enum", "items", "additionalProperties"}
#: Keywords the validator checks (or ignores) that leave the type alone.
_NEUTRAL = {
    "$schema",
    "$id",
    "title",
    "description",
    "examples",
    "default",
    "minimum",
    "maximum",
    "exclusiveMinimum",
    "exclusiveMaximum",
    "multipleOf",
    "minLength",
    "maxLength",
    "pattern",
    "minItems",
    "maxItems",
    "uniqueItems",
    "minProperties",
    "maxProperties",
}
_SCALARS = {
    "string": pa.string(),
    "boolean": pa.bool_(),
    "integer": pa.int64(),
    "number": pa.float64(),
}
_FENCE = re.compile(r"^\s*```(?:json)?\s*(.*?)\s*```\s*$", re.DOTALL | re.IGNORECASE)
_THINK = re.compile(r"^\s*<think>.*?</think>", re.DOTALL)
#: Longest validator message kept in ``<column>_error``.
MAX_ERROR = 200


class SchemaError(PrxDataError, ValueError):
    """The JSON schema file is unreadable or uses what the attribute job does not support."""


def _type_of(node: dict, where: str) -> str:
    t = node.get("type")
    if isinstance(t, list):
        rest = [x for x in t if x != "null"]
        if len(rest) != 1:
            raise SchemaError(
                f"{where}: type {t!r} is not supported (use one type, or [T, 'null'])"
            )
        t = rest[0]
    if t is None and "enum" in node:
        kinds = {type(v) for v in node["enum"] if v is not None}
        if kinds == {str}:
            return "string"
        raise SchemaError(f"{where}: an enum without 'type' must list strings only")
    if t is None and "properties" in node:
        return "object"
    if t not in (*_SCALARS, "object", "array"):
        raise SchemaError(
            f"{where}: type {t!r} is not supported; use object, array, string, boolean, "
            "integer or number"
        )
    return t


def arrow_type(schema: dict, where: str = "schema") -> pa.DataType:
    """The Arrow type of the values ``schema`` accepts (see the module docstring)."""
    if not isinstance(schema, dict):
        raise SchemaError(f"{where} must be a JSON object, got {type(schema).__name__}")
    unknown = sorted(set(schema) - _SHAPE - _NEUTRAL)
    if unknown:
        raise SchemaError(
            f"{where}: keyword(s) {unknown} are not supported (supported: "
            f"{sorted(_SHAPE)} and annotations/bounds such as description, minimum, maxItems)"
        )
    t = _type_of(schema, where)
    if t in _SCALARS:
        return _SCALARS[t]
    if t == "array":
        items = schema.get("items")
        if not isinstance(items, dict):
            raise SchemaError(f"{where}: an array needs 'items' (one schema)")
        return pa.list_(arrow_type(items, f"{where}.items"))
    props = schema.get("properties")
    if not isinstance(props, dict) or not props:
        raise SchemaError(f"{where}: an object needs at least one entry in 'properties'")
    req = schema.get("required", [])
    if not isinstance(req, list) or set(req) - set(props):
        raise SchemaError(f"{where}: 'required' must list names from 'properties'")
    return pa.struct(
        [pa.field(name, arrow_type(p, f"{where}.{name}")) for name, p in props.items()]
    )


#: Schemas shipped with the package, by name (``--schema attributes``).
BUILTIN_SCHEMAS = {"attributes": "attributes.schema.json"}


def schema_path(path: str | Path) -> Path:
    """``path``, or the packaged schema of that name when no such file exists."""
    p = Path(path)
    if not p.exists() and str(path) in BUILTIN_SCHEMAS:
        return Path(__file__).with_name("schemas") / BUILTIN_SCHEMAS[str(path)]
    return p


def load_schema(path: str | Path) -> dict:
    """Read and check a schema file (or a packaged one by name, e.g. ``attributes``)."""
    p = schema_path(path)
    try:
        schema = json.loads(p.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise SchemaError(f"schema file not found: {p}") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise SchemaError(f"schema file {p} is not valid JSON: {e}") from None
    check_schema(schema, str(p))
    return schema


def check_schema(schema: Any, where: str = "schema") -> pa.StructType:
    """Raise :class:`SchemaError` unless ``schema`` is a supported object schema; its struct."""
    import jsonschema

    t = arrow_type(schema, where)
    if not pa.types.is_struct(t):
        raise SchemaError(f"{where}: the top level must be an object (a struct column)")
    try:
        jsonschema.Draft202012Validator.check_schema(schema)
    except jsonschema.SchemaError as e:
        raise SchemaError(f"{where} is not a valid JSON schema: {e.message}") from None
    return t


def canonical(schema: dict) -> str:
    """The schema as compact, key-sorted JSON (hashable, picklable; what the backends send)."""
    return json.dumps(schema, sort_keys=True, separators=(",", ":"))


def strip_wrapping(text: str) -> str:
    """Remove a leading ``<think>`` block and a Markdown code fence around the JSON."""
    text = _THINK.sub("", text or "").strip()
    m = _FENCE.match(text)
    return m.group(1) if m else text


class Validator:
    """Parses and validates model outputs against one schema (build once per actor)."""

    def __init__(self, schema: dict):
        import jsonschema

        self.schema = schema
        self.type = check_schema(schema)
        self._validator = jsonschema.Draft202012Validator(schema)

    def parse(self, text: str | None) -> tuple[dict | None, str | None]:
        """``(value, None)`` for a valid object, else ``(None, why)``."""
        body = strip_wrapping(text or "")
        if not body:
            return None, "empty output"
        try:
            value = json.loads(body)
        except json.JSONDecodeError as e:
            return None, f"not JSON: {e.msg} at char {e.pos}"[:MAX_ERROR]
        errors = sorted(self._validator.iter_errors(value), key=lambda e: list(e.path))
        if errors:
            e = errors[0]
            at = "/".join(str(p) for p in e.path) or "(root)"
            return None, f"schema: {at}: {e.message}"[:MAX_ERROR]
        return value, None

    def to_arrow(self, values: Sequence[dict | None]) -> tuple[pa.Array, list[str | None]]:
        """Values as one struct array; a value Arrow cannot hold (an int over 64 bits) is null
        with its reason."""
        try:
            return pa.array(list(values), self.type), [None] * len(values)
        except (pa.ArrowInvalid, pa.ArrowTypeError, OverflowError):
            pass
        out: list[dict | None] = []
        why: list[str | None] = []
        for v in values:
            try:
                pa.array([v], self.type)
            except (pa.ArrowInvalid, pa.ArrowTypeError, OverflowError) as e:
                out.append(None)
                why.append(f"schema: value does not fit the column: {e}"[:MAX_ERROR])
            else:
                out.append(v)
                why.append(None)
        return pa.array(out, self.type), why
