"""The log of skip-list entries and the state it decides.

A skip list is a set of row ids (the Lance ``id``). Every change is an entry
``(seq, base, kind, list, id, op)`` with ``op`` ``add`` or ``remove``
(:data:`LOG_SCHEMA`). An id's state in a list is its *latest* entry;
"latest" is the order ``(base, kind, seq)`` and never a clock (``at``,
``host``, ``command``, ``reason`` are kept as information only):

- *Registry entries* (``kind`` 0, :data:`REGISTRY`) live in the table's
  registry (:mod:`prx_data.skips.registry`), where ``seq = base`` is the
  registry version their commit creates: commit order is the order, whatever
  the writers' clocks say.
- *Export-only entries* (``kind`` 1, :data:`EXPORT_ONLY`) live in one export
  (:mod:`prx_data.skips.export_state`): ``seq`` is that export's own counter,
  taken under its lease, and ``base`` is the registry version the change was
  made after. So an export-only change is newer than every registry entry it
  saw and older than every later one. Lists recovered from sidecars or from a
  store written before the log existed are imported as export-only adds with
  ``base = -1``: older than any registry entry (:mod:`prx_data.skips.recover`).

The *state* of a set of entries (:func:`state`) is, per list, the ids whose
latest entry is ``add``, as *store rows* (:data:`STORE_SCHEMA`: id and its
provenance), which is what an export keeps in ``_lists/<name>.parquet``.

This module is pure Arrow: it reads and writes nothing.
"""

from __future__ import annotations

import datetime as dt
import socket
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

#: How long a list writer waits for another writer of the same export or registry.
LOCK_TIMEOUT_S = 900.0

TS = pa.timestamp("us", tz="UTC")
STORE_SCHEMA = pa.schema(
    [("id", pa.string()), ("added", TS), ("command", pa.string()), ("reason", pa.string())]
)
LOG_SCHEMA = pa.schema(
    [
        ("seq", pa.int64()),
        ("base", pa.int64()),
        ("kind", pa.int8()),
        ("list", pa.string()),
        ("id", pa.string()),
        ("op", pa.string()),
        ("at", TS),
        ("command", pa.string()),
        ("reason", pa.string()),
        ("export", pa.string()),
        ("host", pa.string()),
        # An opt-out entry's content keys: the row's source digest and pHash (null where
        # unknown), so the removal follows the image to its copies (prx_data.core.keys).
        ("sha256", pa.string()),
        ("phash", pa.uint64()),
        ("optout", pa.bool_()),
    ]
)
#: The store file also keeps each id's kind (the entry that decided it), so an update can
#: rewrite it from the entries since the recorded position alone (:func:`materialise`).
STORE_FILE_SCHEMA = STORE_SCHEMA.append(pa.field("kind", pa.int8()))
REGISTRY, EXPORT_ONLY = 0, 1
ADD, REMOVE = "add", "remove"


@dataclass(frozen=True)
class Provenance:
    """Who added ids to a list, and why (stored with every id)."""

    command: str
    reason: str = ""
    at: dt.datetime = field(default_factory=lambda: dt.datetime.now(dt.UTC))


def unique_ids(ids: Iterable[str] | pa.Array | pa.ChunkedArray) -> pa.Array:
    if isinstance(ids, pa.ChunkedArray):
        arr = ids.combine_chunks()
    elif isinstance(ids, pa.Array):
        arr = ids
    else:
        arr = pa.array(list(ids), pa.string())
    arr = arr.cast(pa.string())
    arr = pc.drop_null(arr)
    arr = arr.filter(pc.not_equal(arr, ""))
    return pc.unique(arr).sort()


def store_table(ids: pa.Array, prov: Provenance) -> pa.Table:
    n = len(ids)
    return pa.table(
        {
            "id": ids,
            "added": pa.array([prov.at] * n, STORE_SCHEMA.field("added").type),
            "command": pa.array([prov.command] * n, pa.string()),
            "reason": pa.array([prov.reason] * n, pa.string()),
        },
        schema=STORE_SCHEMA,
    )


def merge_store(*tables: pa.Table) -> pa.Table:
    """Union by id; an id keeps its earliest provenance. Sorted by id."""
    tables = [t.select(STORE_SCHEMA.names).cast(STORE_SCHEMA) for t in tables if t is not None]
    if not tables:
        return STORE_SCHEMA.empty_table()
    t = pa.concat_tables(tables)
    if not len(t):
        return t
    return _first_per_id(t.sort_by([("id", "ascending"), ("added", "ascending")]))


def _first_per_id(t: pa.Table) -> pa.Table:
    """Rows of a table sorted by id where the id differs from the previous row's."""
    ids = t["id"].combine_chunks()
    if len(ids) < 2:
        return t
    keep = np.ones(len(ids), bool)
    keep[1:] = pc.not_equal(ids.slice(1), ids.slice(0, len(ids) - 1)).to_numpy(zero_copy_only=False)
    return t.filter(pa.array(keep))


def log_rows(
    name: str,
    ids: pa.Array,
    op: str,
    prov: Provenance | pa.Table,
    *,
    seq: int,
    base: int,
    kind: int,
    export: str,
    keys: pa.Table | None = None,
) -> pa.Table:
    """Log entries for ``ids`` (``prov``: one provenance, or a store table of per-id ones).

    ``keys`` (``id``, ``sha256``, ``phash``): the ids are opt-outs, with these content keys
    where an id has a row there (:mod:`prx_data.skips.content`).
    """
    n = len(ids)
    sha = pa.nulls(n, pa.string())
    ph = pa.nulls(n, pa.uint64())
    if keys is not None and n:
        at_key = pc.index_in(ids.cast(pa.string()), value_set=keys["id"].combine_chunks())
        sha = pc.take(keys["sha256"].combine_chunks(), at_key)
        ph = pc.take(keys["phash"].combine_chunks(), at_key)
    if isinstance(prov, pa.Table):
        at, command, reason = prov["added"], prov["command"], prov["reason"]
    else:
        at = pa.array([prov.at] * n, TS)
        command = pa.array([prov.command] * n, pa.string())
        reason = pa.array([prov.reason] * n, pa.string())
    return pa.table(
        {
            "seq": pa.array(np.full(n, seq, np.int64)),
            "base": pa.array(np.full(n, base, np.int64)),
            "kind": pa.array(np.full(n, kind, np.int8)),
            "list": pa.array([name] * n, pa.string()),
            "id": ids.cast(pa.string()),
            "op": pa.array([op] * n, pa.string()),
            "at": at,
            "command": command,
            "reason": reason,
            "export": pa.array([export] * n, pa.string()),
            "host": pa.array([socket.gethostname()] * n, pa.string()),
            "sha256": sha,
            "phash": ph,
            "optout": pa.array(np.full(n, keys is not None), pa.bool_()),
        },
        schema=LOG_SCHEMA,
    )


def conform_entries(t: pa.Table) -> pa.Table:
    """Entries as :data:`LOG_SCHEMA`, whatever version wrote them (columns added since
    read as null; ``optout`` as false)."""
    cols = []
    for f in LOG_SCHEMA:
        if f.name in t.column_names:
            cols.append(t[f.name].cast(f.type))
        elif f.name == "optout":
            cols.append(pa.array(np.zeros(len(t), bool)))
        else:
            cols.append(pa.nulls(len(t), f.type))
    return pa.Table.from_arrays(cols, schema=LOG_SCHEMA)


def concat_entries(tables: Sequence[pa.Table]) -> pa.Table:
    tables = [conform_entries(t) for t in tables if t is not None]
    return pa.concat_tables(tables) if tables else LOG_SCHEMA.empty_table()


def latest(entries: pa.Table) -> pa.Table:
    """The latest entry of every (list, id), by ``(base, kind, seq)`` (see the module docstring)."""
    if not len(entries):
        return entries
    t = entries.sort_by(
        [
            ("list", "ascending"),
            ("id", "ascending"),
            ("base", "descending"),
            ("kind", "descending"),
            ("seq", "descending"),
        ]
    )
    key = pc.binary_join_element_wise(t["list"], t["id"], "\x00").combine_chunks()
    keep = np.ones(len(key), bool)
    if len(key) > 1:
        keep[1:] = pc.not_equal(key.slice(1), key.slice(0, len(key) - 1)).to_numpy(
            zero_copy_only=False
        )
    return t.filter(pa.array(keep))


def state(entries: pa.Table, *, kinds: bool = False) -> dict[str, pa.Table]:
    """{list: store table} of the ids whose latest entry is ``add`` (empty lists left out);
    ``kinds``: with each id's ``kind`` (registry or export-only), as the store file keeps it."""
    last = latest(entries)
    if not len(last):
        return {}
    last = last.filter(pc.equal(last["op"], ADD))
    out = {}
    schema = STORE_FILE_SCHEMA if kinds else STORE_SCHEMA
    for name in sorted(pc.unique(last["list"]).to_pylist()):
        rows = last.filter(pc.equal(last["list"], name)).sort_by("id")
        out[name] = store_rows(rows, schema)
    return out


def store_rows(rows: pa.Table, schema: pa.Schema = STORE_SCHEMA) -> pa.Table:
    """Log entries (latest ``add`` per id) as store rows."""
    cols = {"id": rows["id"], "added": rows["at"], "command": rows["command"]}
    cols["reason"] = rows["reason"]
    if "kind" in schema.names:
        cols["kind"] = rows["kind"]
    return pa.table(cols, schema=schema)


def source_text(kinds: Iterable[int]) -> str:
    kinds = set(kinds)
    return ", ".join(
        w for k, w in ((REGISTRY, "registry"), (EXPORT_ONLY, "export-only")) if k in kinds
    )


__all__ = [
    "ADD",
    "EXPORT_ONLY",
    "LOCK_TIMEOUT_S",
    "LOG_SCHEMA",
    "Provenance",
    "REGISTRY",
    "REMOVE",
    "STORE_FILE_SCHEMA",
    "STORE_SCHEMA",
    "TS",
    "concat_entries",
    "conform_entries",
    "latest",
    "log_rows",
    "merge_store",
    "source_text",
    "state",
    "store_rows",
    "store_table",
    "unique_ids",
]
