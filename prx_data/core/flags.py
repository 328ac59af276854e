"""One spelling per setting: a config field carries its command-line flag in its metadata.

A frozen config dataclass declares each setting once, with :func:`flag` as its
default; :func:`add_flags` adds the options to an ``argparse`` parser (names,
defaults and help from the fields) and :func:`from_args` builds the config back
from the parsed namespace. Every job that takes the config then takes the same
flags, spelled the same way. A field declared with :func:`nested` holds another
such config (every job's ``run: RunOptions``): its flags join the parser in their
own group, under their own names, and :func:`from_args` builds it back.
"""

from __future__ import annotations

import argparse
import dataclasses
from typing import Any, TypeVar

C = TypeVar("C")


#: The default of a :func:`flag` field that has none: its option is required.
REQUIRED: Any = dataclasses.MISSING


def comma_list(text: str) -> tuple[str, ...]:
    """``a, b,,c`` -> ``("a", "b", "c")``: a comma-separated option's names (``""``: none)."""
    return tuple(x.strip() for x in text.split(",") if x.strip())


def comma_ints(text: str) -> tuple[int, ...]:
    """``512,1024`` -> ``(512, 1024)``."""
    return tuple(int(x) for x in comma_list(text))


def comma_floats(text: str) -> tuple[float, ...]:
    """``0.9,0.95`` -> ``(0.9, 0.95)``; anything else is the option's one-line error."""
    try:
        return tuple(float(x) for x in comma_list(text))
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected comma-separated numbers, got {text!r}"
        ) from None


def mebibytes(text: str) -> int:
    """``--x-mb 1.5`` -> bytes (at least 1)."""
    return max(1, int(float(text) * 2**20))


def flag(
    default: Any,
    *names: str,
    help: str,
    type: Any = None,
    choices: tuple | None = None,
    metavar: str | None = None,
    negate: bool = False,
    nargs: str | None = None,
    append: bool = False,
    const: Any = dataclasses.MISSING,
) -> Any:
    """A dataclass field whose command-line option is ``names`` (the first long name wins
    for the destination). A bool field is a switch: ``--name`` sets it, or with
    ``negate`` (``--no-name``) clears a field that defaults to True. A field whose
    default is :data:`REQUIRED` has none, and its option is required. ``append``: a
    repeatable option, its values a tuple; ``const``: a switch that sets the field to
    this value."""
    meta = {
        "flags": names,
        "help": help,
        "type": type,
        "choices": choices,
        "metavar": metavar,
        "negate": negate,
        "nargs": nargs,
        "append": append,
        "const": const,
    }
    return dataclasses.field(default=default, metadata={"cli": meta})


def nested(cls: type, title: str) -> Any:
    """A field holding a ``cls`` (a config of :func:`flag` fields, built with its defaults
    when not given) whose options :func:`add_flags` adds in a group titled ``title``.

    Settings that every job shares (:class:`prx_data.core.runtime.RunOptions`) are
    declared once in their own type; each job config nests it, so the flags, their
    defaults and their checks stay in one place.
    """
    return dataclasses.field(default_factory=cls, metadata={"cli_nested": (cls, title)})


def _cli_fields(cls) -> list[tuple[dataclasses.Field, dict]]:
    return [(f, f.metadata["cli"]) for f in dataclasses.fields(cls) if "cli" in f.metadata]


def _nested_fields(cls) -> list[tuple[dataclasses.Field, type, str]]:
    return [
        (f, *f.metadata["cli_nested"])
        for f in dataclasses.fields(cls)
        if "cli_nested" in f.metadata
    ]


def _has_option(p: argparse.ArgumentParser | argparse._ArgumentGroup, name: str) -> bool:
    return name in p._option_string_actions


def add_flags(p: argparse.ArgumentParser | argparse._ArgumentGroup, cls) -> None:
    """Add an option per :func:`flag` field of ``cls`` to ``p``; each stores into the field's name.

    A :func:`nested` field's options go in their own group (once per parser: a second
    config nesting the same type shares them)."""
    _add_own_flags(p, cls)
    for _f, sub, title in _nested_fields(cls):
        first = next((n for _, m in _cli_fields(sub) for n in m["flags"]), None)
        if first is not None and _has_option(p, first):
            continue
        group = p.add_argument_group(title) if isinstance(p, argparse.ArgumentParser) else p
        add_flags(group, sub)


def _add_own_flags(p: argparse.ArgumentParser | argparse._ArgumentGroup, cls) -> None:
    for f, meta in _cli_fields(cls):
        positional = not meta["flags"][0].startswith("-")  # named as the field: no dest
        kw: dict[str, Any] = {"help": meta["help"]}
        if not positional:
            kw["dest"] = f.name
        if meta["const"] is not dataclasses.MISSING:
            kw.update(action="store_const", const=meta["const"], default=f.default)
        elif f.default is True or f.default is False:
            kw["action"] = "store_false" if meta["negate"] else "store_true"
        else:
            if meta["append"]:  # None when not given: the field keeps its default
                kw.update(action="append", default=None)
            elif f.default is not dataclasses.MISSING:
                kw["default"] = f.default
            elif not positional:  # a positional argument is required anyway
                kw["required"] = True
            for key in ("type", "choices", "metavar", "nargs"):
                if meta[key] is not None:
                    kw[key] = meta[key]
        p.add_argument(*meta["flags"], **kw)


def option_name(cls, name: str) -> str | None:
    """The long option that sets field ``name`` of ``cls`` or of a config it nests
    (None: no flag sets it)."""
    for f, meta in _cli_fields(cls):
        if f.name == name:
            return next((n for n in meta["flags"] if n.startswith("--")), None)
    for _f, sub, _title in _nested_fields(cls):
        found = option_name(sub, name)
        if found:
            return found
    return None


def from_args(cls: type[C], args: argparse.Namespace, **overrides: Any) -> C:
    """``cls`` from the options :func:`add_flags` added (fields the parser lacks keep their
    defaults; a :func:`nested` config is built from its own options); ``overrides`` win."""
    values: dict[str, Any] = {
        f.name: from_args(sub, args) for f, sub, _title in _nested_fields(cls)
    }
    for f, meta in _cli_fields(cls):
        value = getattr(args, f.name, f)
        if meta["append"]:  # given: the values in order; not given (None): the default
            value = f if value is None else tuple(value)
        if value is not f:
            values[f.name] = value
    values.update(overrides)
    return cls(**values)
