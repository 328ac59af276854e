"""An opt-out follows the image: the content keys of rows, and every row of the corpus that
shares one.

A request names row ids. The image behind an id also lives under other names:
a byte-identical copy ingested from another folder (same sha256), a re-encoded
or resized copy (same pHash), the members of its dedup group (``dup_of``: the
group's keeper, or semdedup's cluster keeper). :func:`expand` finds all of them
in every table of the corpus (the tables beside the ledger, plus the ones
named), so none streams in the opted-out one's place and none is written
into a later export (:mod:`prx_data.export.removals`).

Every lookup is a Lance scan of small columns with an ``IN`` filter (BTREE-served
where the table has an index on the column): no image bytes are read except to
hash the requested rows of a table that has no ``sha256`` column yet.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

import pyarrow as pa
import pyarrow.compute as pc

from prx_data.core import schema as S
from prx_data.core import storage
from prx_data.core.errors import NotFound
from prx_data.core.keys import DEGENERATE_PHASHES, sha256_hex

log = logging.getLogger(__name__)

#: Column dedup writes: the id of the group's keeper (null for keepers and singletons).
DUP_OF = "dup_of"
#: Ids looked up per ``IN`` filter.
LOOKUP_CHUNK = 4096
#: Key columns of :func:`keys_of` (id, sha256, phash).
KEYS_SCHEMA = pa.schema([(S.ID, pa.string()), (S.SHA256, pa.string()), (S.PHASH, pa.uint64())])
#: The rules an opt-out is extended by, in the order the report lists them.
RULES = ("id", "sha256", "phash", "dedup_group")


@dataclass
class Expansion:
    """What one opt-out request reaches: the requested rows' keys and every other row found."""

    #: id, sha256, phash of every requested id that some table holds.
    keys: pa.Table
    #: {rule: ids it added beyond the requested ones}.
    added: dict[str, list[str]] = field(default_factory=dict)
    #: Tables of the corpus with no ``sha256`` column: their byte-identical copies were not
    #: looked for (``python -m prx_data.table sha256 T`` fills it).
    unhashed: list[str] = field(default_factory=list)

    def ids(self) -> list[str]:
        return sorted({i for v in self.added.values() for i in v})

    def counts(self) -> dict[str, int]:
        return {r: len(self.added.get(r, ())) for r in RULES[1:]}


def corpus_tables(folder: str | None, named: Iterable[str] = ()) -> list[str]:
    """The Lance tables of a corpus: every ``*.lance`` folder in ``folder`` that is a table
    of rows (not a ledger, registry or id index), plus ``named``. Deduplicated, in order."""
    out: list[str] = [t for t in named if t]
    if folder and storage.exists(folder):
        for name in sorted(storage.list_dirs(folder)):
            base = name.rstrip("/").rsplit("/", 1)[-1]
            if not base.endswith(".lance") or base.endswith(".lists.lance") or base.startswith("_"):
                continue
            out.append(storage.join(folder, base))
    seen, uniq = set(), []
    for t in out:
        key = t.rstrip("/")
        if key not in seen:
            seen.add(key)
            uniq.append(t)
    return uniq


def _open(table: str):
    from prx_data.table.lance_ops import open_table

    try:
        ds = open_table(table)
    except NotFound:
        return None
    return ds if S.ID in ds.schema.names else None


def _chunks(values: Sequence, n: int = LOOKUP_CHUNK):
    for i in range(0, len(values), n):
        yield list(values[i : i + n])


def _isin(column: str, typ: pa.DataType, values: list):
    """A filter keeping the rows whose ``column`` is one of ``values``.

    pHashes are 64-bit patterns: dedup stores them as uint64, so half of them
    overflow the int64 Arrow infers from Python ints, and Lance cannot push an
    Arrow expression on a uint64 column down; integers are therefore matched by
    SQL literals, with the same bits reinterpreted for a table that stored them
    signed.
    """
    if not pa.types.is_integer(typ):
        return pc.field(column).isin(values)
    bits = typ.bit_width
    mask, sign = (1 << bits) - 1, 1 << (bits - 1)
    if pa.types.is_signed_integer(typ):
        ints = [((int(v) & mask) ^ sign) - sign for v in values if v is not None]
    else:
        ints = [int(v) & mask for v in values if v is not None]
    return f"{column} IN ({', '.join(map(str, ints))})" if ints else "false"


def _scan(ds, columns: list[str], column: str, values: Sequence) -> pa.Table:
    cols = [c for c in columns if c in ds.schema.names]
    typ = ds.schema.field(column).type
    parts = [
        ds.to_table(columns=cols, filter=_isin(column, typ, chunk))
        for chunk in _chunks(list(values))
    ]
    return pa.concat_tables(parts) if parts else pa.table({c: [] for c in cols})


def keys_of(tables: Sequence[str], ids: Sequence[str]) -> pa.Table:
    """(id, sha256, phash) of each of ``ids`` that one of ``tables`` holds (first table wins).

    A row without a recorded digest is hashed from its bytes (older tables).
    """
    want = sorted(set(ids))
    rows: dict[str, tuple[str | None, int | None]] = {}
    for table in tables:
        ds = _open(table)
        todo = [i for i in want if i not in rows]
        if ds is None or not todo:
            continue
        names = ds.schema.names
        cols = [S.ID, S.SHA256, S.PHASH]
        if S.SHA256 not in names:
            cols.append(S.IMAGE)
        t = _scan(ds, cols, S.ID, todo)
        got = {c: t[c].to_pylist() if c in t.column_names else [None] * len(t) for c in cols}
        for k, rid in enumerate(got[S.ID]):
            digest = got[S.SHA256][k]
            if not digest and got.get(S.IMAGE) and got[S.IMAGE][k]:
                digest = sha256_hex(got[S.IMAGE][k])
            ph = got[S.PHASH][k]
            ph = None if ph is None else ph & ((1 << 64) - 1)  # a signed column's bits
            rows.setdefault(rid, (digest or None, ph))
    order = sorted(rows)
    return pa.table(
        {
            S.ID: pa.array(order, pa.string()),
            S.SHA256: pa.array([rows[i][0] for i in order], pa.string()),
            S.PHASH: pa.array([rows[i][1] for i in order], pa.uint64()),
        },
        schema=KEYS_SCHEMA,
    )


def expand(tables: Sequence[str], ids: Sequence[str]) -> Expansion:
    """Every row of ``tables`` that shares a content key or a dedup group with ``ids``."""
    keys = keys_of(tables, ids)
    requested = set(ids)
    digests = sorted({d for d in keys[S.SHA256].to_pylist() if d})
    phashes = sorted(
        {
            p
            for p in keys[S.PHASH].to_pylist()
            if p is not None and (p & ((1 << 64) - 1)) not in DEGENERATE_PHASHES
        }
    )
    added: dict[str, set[str]] = {r: set() for r in RULES[1:]}
    seen = set(requested)
    unhashed = []
    for table in tables:
        ds = _open(table)
        if ds is None:
            continue
        names = ds.schema.names
        if digests and S.SHA256 in names:
            added["sha256"] |= set(_scan(ds, [S.ID], S.SHA256, digests)[S.ID].to_pylist())
        elif digests:
            unhashed.append(table)
        if phashes and S.PHASH in names:
            added["phash"] |= set(_scan(ds, [S.ID], S.PHASH, phashes)[S.ID].to_pylist())
        if DUP_OF in names:
            anchors = sorted(requested)
            keepers = _scan(ds, [S.ID, DUP_OF], S.ID, anchors)
            roots = set(anchors) | {k for k in keepers[DUP_OF].to_pylist() if k}
            group = set(_scan(ds, [S.ID], DUP_OF, sorted(roots))[S.ID].to_pylist())
            added["dedup_group"] |= group | (roots - set(anchors))
    out: dict[str, list[str]] = {}
    for rule in RULES[1:]:
        new = sorted(added[rule] - seen)
        seen |= set(new)
        out[rule] = new
    return Expansion(keys=keys, added=out, unhashed=unhashed)


__all__ = [
    "DUP_OF",
    "Expansion",
    "RULES",
    "corpus_tables",
    "expand",
    "keys_of",
]
