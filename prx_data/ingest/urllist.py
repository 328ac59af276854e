"""URL lists as img2dataset users bring them: plain text, CSV, TSV and JSON lines.

Each row becomes a table row without image bytes (``probe_error =
missing_image``), as a LAION-style parquet does, so ``python -m
prx_data.download`` can fill it. Formats:

- ``txt``: one URL per line;
- ``csv`` / ``tsv``: with a header (found when a cell names the URL column:
  ``url``, ``URL``, ``image_url``...) or without one (then the column whose
  first value is an ``http(s)://`` URL is ``url``, and with two columns the
  other is ``caption``, as in CC12M's ``url<TAB>caption``); TSV has no
  quoting (a ``"`` is text), CSV quotes as RFC 4180;
- ``jsonl``: one JSON object per line (``.jsonl``, ``.ndjson``, or ``.json``
  holding lines rather than one array).

The file is never read whole: the driver streams it once to count lines
and cuts it into units of ``items_per_unit`` lines (byte ranges that start
on a line); a load task reads only its range. Ids are stable: the key
column's value (``key``, ``uid``...) when there is one, else the line's
number (data lines from 0, the header not counted). Column types are
inferred from the first lines (integers, floats, strings; JSON lists and
booleans as they are); a later value that does not fit becomes null and is
counted (``bad_value:<column>``). A CSV field may not span lines (a quoted
newline): such a row is cut, and its pieces are dropped and counted.
"""

from __future__ import annotations

import csv
import json
import os
import posixpath
from dataclasses import dataclass

import pyarrow as pa

from prx_data.core import schema as S
from prx_data.core import storage
from prx_data.core.errors import UsageError
from prx_data.ingest.common import CAPTION_KEYS, NOTES, Counts, Plan, WorkUnit, strip_ext
from prx_data.ingest.parquet import KEY_NAMES, RESERVED

#: URL column names tried in order (LAION, COYO, DataComp, CC12M and img2dataset's ``url``).
URL_NAMES = ("url", "URL", "image_url", "img_url", "src_url")
KINDS = ("txt", "csv", "tsv", "jsonl")
#: The probe error of a row without image bytes (ingest's for every URL row).
MISSING = "missing_image"
EXTENSIONS = {
    "txt": "txt",
    "csv": "csv",
    "tsv": "tsv",
    "jsonl": "jsonl",
    "ndjson": "jsonl",
    "json": "jsonl",
}
#: Lines per work unit (URL rows are small: a unit of this many is a few MiB).
DEFAULT_ITEMS_PER_UNIT = 65536
#: Lines read by the driver to find the header, the roles and the column types.
SAMPLE_LINES = 1000
_BLOCK = 8 * 1024 * 1024


def _kind_of(path: str) -> str | None:
    base = posixpath.basename(path.rstrip("/")).lower()
    return EXTENSIONS.get(base.rsplit(".", 1)[-1]) if "." in base else None


def _is_file(path: str) -> bool:
    return storage.is_remote(path) or os.path.isfile(path)


def _open(path: str):
    fs, p = storage.filesystem(path)
    return fs.open_input_file(p)


def _sample(path: str, nbytes: int = 1 << 20) -> bytes:
    with _open(path) as f:
        return f.read(nbytes)


def _lines(data: bytes) -> list[str]:
    text = data.decode("utf-8", errors="replace")
    if text.startswith("\ufeff"):
        text = text[1:]
    return text.splitlines()


# --- parsing one line ---------------------------------------------------------


def _split(kind: str, lines: list[str]) -> list[list[str] | None]:
    """Cells of each line (None for a line the CSV reader cannot parse)."""
    if kind == "txt":
        return [[line.strip()] for line in lines]
    if kind == "tsv":
        return [line.split("\t") for line in lines]
    out: list[list[str] | None] = []
    for line in lines:
        try:
            out.append(next(csv.reader([line], strict=True), []))
        except csv.Error:
            out.append(None)
    return out


def _is_url(text: object) -> bool:
    return isinstance(text, str) and text.strip().lower().startswith(("http://", "https://"))


def _pick(names: list[str], wanted: tuple[str, ...]) -> str | None:
    lower = {n.lower(): n for n in names}
    for w in wanted:
        if w in names:
            return w
        if w.lower() in lower:
            return lower[w.lower()]
    return None


# --- types ----------------------------------------------------------------------------


def _infer_text_type(values: list[str]) -> pa.DataType:
    """int64, float64 or string: the narrowest that every non-empty sample value fits."""
    present = [v for v in values if v not in ("", None)]
    if not present:
        return pa.string()
    for t, conv in ((pa.int64(), int), (pa.float64(), float)):
        try:
            for v in present:
                conv(v)
            return t
        except ValueError:
            continue
    return pa.string()


def _infer_json_type(values: list) -> pa.DataType:
    present = [v for v in values if v is not None]
    if not present:
        return pa.string()
    if any(isinstance(v, dict) for v in present):
        return pa.string()  # nested objects are kept as JSON text
    try:
        t = pa.array(present).type
    except (pa.ArrowInvalid, pa.ArrowTypeError):
        return pa.string()
    if pa.types.is_null(t) or pa.types.is_struct(t):
        return pa.string()
    return t


def _type_name(t: pa.DataType) -> str:
    return str(t)


def _type_from_name(name: str) -> pa.DataType:
    simple = {
        "int64": pa.int64(),
        "double": pa.float64(),
        "string": pa.string(),
        "bool": pa.bool_(),
    }
    if name in simple:
        return simple[name]
    if name.startswith("list<item: ") and name.endswith(">"):
        return pa.list_(_type_from_name(name[len("list<item: ") : -1]))
    return pa.string()


def _convert(value, t: pa.DataType, json_values: bool):
    """``value`` as type ``t``; raises ValueError when it does not fit."""
    if value is None or value == "":
        return None
    if not json_values:
        if pa.types.is_integer(t):
            return int(value)
        if pa.types.is_floating(t):
            return float(value)
        return value
    if pa.types.is_string(t):
        if isinstance(value, str):
            return value
        return json.dumps(value, ensure_ascii=False, sort_keys=True)
    try:
        return pa.scalar(value, t).as_py()
    except (pa.ArrowInvalid, pa.ArrowTypeError, TypeError, OverflowError) as e:
        raise ValueError(str(e)) from None


# --- roles --------------------------------------------------------------------------


@dataclass(frozen=True)
class Layout:
    """How the lines of a file map to columns (JSON-able; travels in every unit)."""

    kind: str
    header: bool
    names: tuple[str, ...]  # column names (csv/tsv: by position; jsonl: keys)
    url: str
    caption: str | None
    key: str | None
    keep: tuple[tuple[str, str], ...]  # (column, its type's name)

    def to_json(self) -> dict:
        return {
            "kind": self.kind,
            "header": self.header,
            "names": list(self.names),
            "url": self.url,
            "caption": self.caption,
            "key": self.key,
            "keep": [list(k) for k in self.keep],
        }

    @staticmethod
    def from_json(d: dict) -> Layout:
        return Layout(
            d["kind"],
            d["header"],
            tuple(d["names"]),
            d["url"],
            d["caption"],
            d["key"],
            tuple((a, b) for a, b in d["keep"]),
        )


def kept_name(col: str) -> str:
    return f"src_{col}" if col in RESERVED else col


def layout_of(
    path: str,
    kind: str,
    *,
    url_column: str | None = None,
    caption_column: str | None = None,
    key_column: str | None = None,
) -> Layout:
    """Read the first lines: header or not, the URL/caption/key columns, the others' types."""
    lines = [ln for ln in _lines(_sample(path))[: SAMPLE_LINES + 1] if ln.strip()]
    if not lines:
        raise UsageError(f"{path!r} has no lines: nothing to ingest")
    if kind == "jsonl":
        rows = []
        for ln in lines[:SAMPLE_LINES]:
            try:
                obj = json.loads(ln)
            except ValueError:
                continue
            if isinstance(obj, dict):
                rows.append(obj)
        if not rows:
            first = lines[0].lstrip()[:1]
            hint = (
                "; a JSON array is not streamable: write one object per line (jq -c '.[]')"
                if first == "["
                else ""
            )
            raise UsageError(f"{path!r} holds no JSON object per line{hint}")
        names: list[str] = []
        for r in rows:
            names.extend(k for k in r if k not in names)
        columns = {n: [r.get(n) for r in rows] for n in names}
        header = False
    else:
        cells = [c for c in _split(kind, lines) if c is not None]
        first = cells[0] if cells else []
        wanted = (url_column,) if url_column else URL_NAMES
        header = kind != "txt" and (
            any(c in wanted for c in first)
            or (url_column is None and any(c.lower() in ("url", "image_url") for c in first))
            or (
                len(cells) > 1
                and not any(_is_url(c) for c in first)
                and any(_is_url(c) for c in cells[1])
            )
        )
        if header:
            names = [c.strip() for c in first]
            body = cells[1:]
        else:
            body = cells
            width = len(first)
            at = next((i for i, c in enumerate(first) if _is_url(c)), 0)
            names = [f"column_{i}" for i in range(width)]
            names[at] = "url"
            if width == 2:
                names[1 - at] = "caption"
        if len(set(names)) != len(names):
            raise UsageError(f"{path!r} has repeated column names in its header: {names}")
        columns = {
            n: [row[i] if i < len(row) else "" for row in body[:SAMPLE_LINES]]
            for i, n in enumerate(names)
        }
    for given, what in ((url_column, "URL"), (caption_column, "caption"), (key_column, "key")):
        if given is not None and given not in names:
            raise UsageError(
                f"{what} column {given!r} is not in {path!r}; it has {names}"
                + ("" if header or kind == "jsonl" else " (no header: url, caption, column_N)")
            )
    url = url_column or _pick(names, URL_NAMES)
    if url is None:
        raise UsageError(
            f"{path!r} has no URL column (looked for {', '.join(URL_NAMES)} in {names}); "
            "name it with --url-column"
        )
    caption = caption_column or _pick([n for n in names if n != url], CAPTION_KEYS)
    key = key_column or _pick([n for n in names if n not in (url, caption)], KEY_NAMES)
    keep = []
    for n in names:
        if n in (caption, key):
            continue
        if n == url:
            t = pa.string()
        elif kind == "jsonl":
            t = _infer_json_type(columns[n])
        else:
            t = _infer_text_type(columns[n])
        keep.append((n, _type_name(t)))
    return Layout(kind, header, tuple(names), url, caption, key, tuple(keep))


def extra_fields(layout: Layout) -> list[pa.Field]:
    return [pa.field(kept_name(n), _type_from_name(t)) for n, t in layout.keep]


# --- plan (driver) and load (task) ---------------------------------------------------------


def _cut(path: str, lines_per_unit: int) -> tuple[list[tuple[int, int, int]], int]:
    """(byte start, byte end, first line number) per unit, and the file's line count.

    One streaming pass finding newlines with numpy: memory is one block, and
    the Python work is per block and per unit, not per line.
    """
    import numpy as np

    units: list[tuple[int, int, int]] = []
    start = 0  # byte offset of the current unit
    unit_first = 0  # line number of its first line
    line = 0  # lines ended so far
    offset = 0
    last = b""
    with _open(path) as f:
        while True:
            block = f.read(_BLOCK)
            if not block:
                break
            ends = np.flatnonzero(np.frombuffer(block, np.uint8) == 10)
            # Line numbers (1-based count) at each newline of this block.
            counts = line + 1 + np.arange(len(ends))
            cut = ends[(counts - unit_first) % lines_per_unit == 0]
            for at in cut.tolist():
                stop = offset + at + 1
                units.append((start, stop, unit_first))
                start = stop
                unit_first += lines_per_unit
            line += len(ends)
            offset += len(block)
            last = block[-1:]
    if offset > start:
        units.append((start, offset, unit_first))
    if offset and last != b"\n":
        line += 1
    return units, line


class UrlListReader:
    """The reader of one URL-list format (a module-like object for :data:`READERS`)."""

    def __init__(self, kind: str):
        self.KIND = kind

    def detect(self, path: str) -> bool:
        if _kind_of(path) != self.KIND or not _is_file(path):
            return False
        if path.lower().endswith(".txt") and not storage.is_remote(path):
            # A caption sidecar next to images is a folder's business; a URL list starts with one.
            first = next((ln for ln in _lines(_sample(path, 4096)) if ln.strip()), "")
            return _is_url(first)
        return True

    def plan(
        self,
        path: str,
        source: str | None = None,
        *,
        url_column: str | None = None,
        caption_column: str | None = None,
        key_column: str | None = None,
        items_per_unit: int = DEFAULT_ITEMS_PER_UNIT,
    ) -> Plan:
        if not _is_file(path):
            raise UsageError(f"{path!r} is not a file: a {self.KIND} URL list is one file")
        layout = layout_of(
            path,
            self.KIND,
            url_column=url_column,
            caption_column=caption_column,
            key_column=key_column,
        )
        source = source or posixpath.basename(strip_ext(path.rstrip("/"))) or self.KIND
        ranges, lines = _cut(path, max(1, items_per_unit))
        ends = [first for _, _, first in ranges[1:]] + [lines]
        units = [
            WorkUnit(
                self.KIND,
                source,
                {
                    "file": path,
                    "start": a,
                    "end": b,
                    "line": first,
                    "rows": max(0, end - first),  # lines: how the ingest job sizes its work
                    "layout": layout.to_json(),
                },
            )
            for (a, b, first), end in zip(ranges, ends, strict=True)
        ]
        size = ranges[-1][1] if ranges else 0
        approx = size / lines if lines else None
        return Plan(units, extra_fields(layout), Counts(), approx)

    def load(self, unit: WorkUnit, counts: Counts) -> pa.Table:
        return load(unit, counts)


def _read_range(path: str, start: int, end: int) -> bytes:
    with _open(path) as f:
        f.seek(start)
        return f.read(end - start)


def load(unit: WorkUnit, counts: Counts) -> pa.Table:
    """The rows of one line range, built column by column (no per-row table machinery)."""
    a = unit.args
    layout = Layout.from_json(a["layout"])
    lines = _read_range(a["file"], a["start"], a["end"]).split(b"\n")
    if lines and lines[-1] == b"":
        lines.pop()
    texts = []
    not_utf8 = set()
    for pos, raw in enumerate(lines):
        try:
            texts.append(raw.decode("utf-8").removesuffix("\r"))
        except UnicodeDecodeError:
            texts.append(raw.decode("utf-8", errors="replace").removesuffix("\r"))
            not_utf8.add(pos)
    first_line = a["line"]
    if first_line == 0 and texts and texts[0].startswith("\ufeff"):
        texts[0] = texts[0][1:]
    skip_header = layout.header and first_line == 0
    types = {n: _type_from_name(t) for n, t in layout.keep}
    strings = {n for n, t in types.items() if pa.types.is_string(t)}
    json_values = layout.kind == "jsonl"
    cells = None if json_values else _split(layout.kind, texts)
    index = {n: i for i, n in enumerate(layout.names)}
    width = len(layout.names)
    ids: list[str] = []
    captions: list[str | None] = []
    notes: list[list[str]] = []
    extra: dict[str, list] = {n: [] for n in types}
    prefix = f"{unit.source}/"
    for pos, text in enumerate(texts):
        if skip_header and pos == 0:
            continue
        if not text.strip():
            counts.dropped("blank_line")
            continue
        if json_values:
            try:
                obj = json.loads(text)
            except ValueError:
                counts.dropped("bad_json_line")
                continue
            if not isinstance(obj, dict):
                counts.dropped("bad_json_line")
                continue
            get = obj.get
        else:
            row = cells[pos]
            if row is None or (layout.kind != "txt" and len(row) != width):
                counts.dropped("bad_row")
                continue
            get = lambda n, _row=row: _row[index[n]] if n in index else None  # noqa: E731
        url = get(layout.url)
        if not isinstance(url, str) or not url.strip():
            counts.dropped("no_url")
            continue
        row_notes = ["line_not_utf8"] if pos in not_utf8 else []
        for name, t in types.items():
            if name == layout.url:
                extra[name].append(url.strip())
                continue
            value = get(name)
            if name in strings and (value is None or isinstance(value, str)):
                extra[name].append(value or None)
                continue
            try:
                extra[name].append(_convert(value, t, json_values))
            except ValueError:
                row_notes.append(f"bad_value:{name}")
                extra[name].append(None)
        caption = get(layout.caption) if layout.caption else None
        if caption is not None and not isinstance(caption, str):
            caption = json.dumps(caption, ensure_ascii=False)
        caption = caption.strip() if caption else None
        if not caption:
            caption = None
            row_notes.append("caption_missing")
        row_notes.append(f"probe_error:{MISSING}")
        key_value = get(layout.key) if layout.key else None
        if key_value in (None, ""):
            key_value = first_line + pos - (1 if layout.header else 0)
        ids.append(prefix + str(key_value))
        captions.append(caption)
        notes.append(row_notes)
    n = len(ids)
    given = {
        S.ID: pa.array(ids, pa.string()),
        S.SOURCE: pa.array([unit.source] * n, pa.string()),
        S.CAPTION: pa.array(captions, pa.string()),
        S.PROBE_ERROR: pa.array([MISSING] * n, pa.string()),
    }
    arrays = [
        given[f.name].cast(f.type) if f.name in given else pa.nulls(n, f.type)
        for f in S.TABLE_SCHEMA
    ]
    fields = list(S.TABLE_SCHEMA)
    for f, (name, t) in zip(extra_fields(layout), types.items(), strict=True):
        arrays.append(pa.array(extra[name], t))
        fields.append(f)
    arrays.append(pa.array(notes, pa.list_(pa.string())))
    fields.append(pa.field(NOTES, pa.list_(pa.string())))
    return pa.Table.from_arrays(arrays, schema=pa.schema(fields))


READERS = tuple(UrlListReader(k) for k in KINDS)
