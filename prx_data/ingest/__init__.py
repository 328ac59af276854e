"""Readers that turn image-text collections into rows of the Lance table.

Each reader module has ``plan(path, source, ...) -> Plan`` (driver side) and
``load(unit, counts) -> pa.Table`` (worker side); see
:mod:`prx_data.ingest.common`. :func:`plan_source` picks the reader from
``fmt`` or by looking at the path, and :func:`load_unit` dispatches a unit.
"""

from __future__ import annotations

import inspect
import os
import re
from dataclasses import dataclass
from typing import Any

import pyarrow as pa

from prx_data.core import storage
from prx_data.core.errors import NotFound, UsageError
from prx_data.ingest import folder, lance_table, parquet, twintar, urllist, webdataset
from prx_data.ingest.common import NOTES, Counts, Plan, WorkUnit, conform

__all__ = [
    "FORMATS",
    "NOTES",
    "Counts",
    "Plan",
    "SourceSpec",
    "WorkUnit",
    "conform",
    "detect_format",
    "load_unit",
    "parse_source",
    "plan_source",
]


#: Readers by format name (a module, or an object with the same ``KIND``, ``plan``,
#: ``load`` and ``detect``). Detection tries them in this order (folder last).
READERS: dict[str, Any] = {
    m.KIND: m for m in (lance_table, twintar, parquet, webdataset, *urllist.READERS, folder)
}
FORMATS = tuple(READERS)


@dataclass(frozen=True)
class SourceSpec:
    """A source to ingest: its location, an optional name (the id prefix) and format."""

    path: str
    name: str | None = None
    fmt: str | None = None  # None: detect from the path


_NAMED = re.compile(r"^([A-Za-z0-9_.-]+)=(.+)$")


def parse_source(text: str, fmt: str | None = None) -> SourceSpec:
    """``PATH`` or ``NAME=PATH`` (NAME becomes the id prefix instead of the base name)."""
    m = _NAMED.match(text)
    if m and "/" not in m.group(1):
        return SourceSpec(m.group(2), m.group(1), fmt)
    return SourceSpec(text, None, fmt)


def detect_format(path: str) -> str:
    """Guess the reader from the path: ``.lance`` table, parquet, tar(s), twin-tar root,
    a URL list (``.txt``, ``.csv``, ``.tsv``, ``.jsonl``), folder."""
    for kind, mod in READERS.items():
        if kind == folder.KIND:
            continue
        detect = getattr(mod, "detect", None)
        if detect is not None and detect(path):
            return kind
    if folder.is_folder(path):
        return folder.KIND
    raise UsageError(
        f"cannot tell the format of {path!r}; pass --format (one of {', '.join(FORMATS)})"
    )


def plan_source(spec: SourceSpec, **options) -> Plan:
    """Plan one source. ``options`` are reader-specific keyword arguments."""
    if not storage.is_remote(spec.path) and not os.path.exists(spec.path):
        # A typo (photoss/) is not a format question.
        raise NotFound(f"source {spec.path!r} does not exist")
    fmt = spec.fmt or detect_format(spec.path)
    if fmt not in READERS:
        raise UsageError(f"unknown format {fmt!r}; choose one of {', '.join(FORMATS)}")
    mod = READERS[fmt]
    accepted = inspect.signature(mod.plan).parameters
    kwargs = {k: v for k, v in options.items() if k in accepted and v is not None}
    return mod.plan(spec.path, spec.name, **kwargs)


def load_unit(unit: WorkUnit, counts: Counts) -> pa.Table:
    """Load one unit into a table with the row notes in the internal ``NOTES`` column.

    Filter the rows, then ``counts.tally_notes(table[NOTES])`` and
    ``conform(table, schema)`` (which drops ``NOTES``).
    """
    table = READERS[unit.kind].load(unit, counts)
    if NOTES not in table.column_names:
        table = table.append_column(NOTES, pa.nulls(table.num_rows, pa.list_(pa.string())))
    return table
