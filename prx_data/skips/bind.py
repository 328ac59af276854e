"""Binding row ids to the sample positions of an export's shards, and back.

Ids are bound to shards through the export's id index
(:mod:`prx_data.export.idindex`: a BTREE lookup of the lists' ids only). An
export without a current index falls back, with one log line, to reading one
bucket's manifests at a time, in batches of at most :data:`BIND_BATCH_ROWS`
rows. Either way memory is bounded by the lists and a batch, not by the export.
:func:`ids_at` goes the other way: the ids at given sample positions.
"""

from __future__ import annotations

import io
import logging
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from prx_data.core import storage
from prx_data.core.errors import OutOfRange, UnknownName
from prx_data.core.schema import MANIFEST_NAME
from prx_data.export import append, bounded, idindex, layout, naming, safety
from prx_data.skips.errors import ListError
from prx_data.skips.log import unique_ids

log = logging.getLogger(__name__)

#: Manifest rows looked up at once (about 100 MB of ids at 10^6 rows).
BIND_BATCH_ROWS = 1 << 20


@dataclass
class Bound:
    """Where one list's ids sit in an export."""

    positions: dict[tuple[str, str], np.ndarray] = field(default_factory=dict)
    samples: int = 0
    #: Ids of the list found in some manifest (of ``ids`` given).
    found: int = 0
    ids: int = 0
    missing: pa.Array | None = None


def _check_parts(root: str, bucket: str, shards: Sequence[layout.ShardInfo]) -> None:
    """Shards outside part folders: a tree another writer made, which has no id manifests yet."""
    for s in shards:
        if not naming.PART_SHARD_RE.fullmatch(s.basename):
            raise ListError(
                f"{layout.rel_join(root, bucket)}: shard {s.basename!r} is not in a part folder "
                f"of an export, so the tree has no id manifests; run python -m prx_data.adopt "
                f"{root} once (it writes them without touching the shards)"
            )


def _parts(shards: Sequence[layout.ShardInfo]) -> list[str]:
    return sorted({s.basename.split("/")[0] for s in shards})


def iter_manifests(
    root: str, bucket: str, shards: Sequence[layout.ShardInfo], batch_rows: int = BIND_BATCH_ROWS
) -> Iterator[pa.Table]:
    """The bucket's manifest rows (shard, index, id), a bounded batch at a time."""
    remote = storage.is_remote(root)
    known = {s.basename for s in shards}
    adopted = layout.adopted_manifest(root, bucket)
    if storage.exists(adopted):  # an adopted tree: one manifest per bucket
        yield from layout.read_adopted_manifest(root, bucket, known, batch_rows)
        return
    _check_parts(root, bucket, shards)
    parts = _parts(shards)
    step = bounded.IO_THREADS * 4 if remote else 64

    def read(part: str) -> pa.Table:
        path = layout.rel_join(root, f"{bucket}/{part}/{MANIFEST_NAME}")
        try:
            t = pq.read_table(
                io.BytesIO(storage.read_bytes(path)), columns=["shard", "index", "id"]
            )
        except FileNotFoundError:
            raise ListError(f"{path}: missing manifest, so list ids cannot be found") from None
        safety.check_manifest_shards(path, part, t["shard"])
        bad = set(pc.unique(t["shard"]).to_pylist()) - known
        if bad:
            raise ListError(f"{path}: shard(s) {sorted(bad)} are not in {bucket}/index.json")
        return t

    pending: list[pa.Table] = []
    rows = 0
    for i in range(0, len(parts), step):
        for t in bounded.map_io(read, parts[i : i + step], remote):
            pending.append(t)
            rows += len(t)
            if rows >= batch_rows:
                yield pa.concat_tables(pending)
                pending, rows = [], 0
    if pending:
        yield pa.concat_tables(pending)


def _rows_of(root: str, ids: pa.Array) -> Iterator[tuple[str, pa.Table, np.ndarray]]:
    """(bucket, rows with ``shard``, ``index``, ``id``, each row's position in ``ids``).

    ``ids`` must be unique. Through the export's id index when it is current (a
    lookup of the ids only, a chunk at a time, each chunk's hits matched to their
    positions in one pass, so the cost is linear in the ids); else, in one log line
    saying why, every manifest a batch at a time.
    """
    index, why = idindex.open_index(root)
    if index is not None:
        for start in range(0, len(ids), idindex.LOOKUP_CHUNK):
            chunk = ids.slice(start, idindex.LOOKUP_CHUNK)
            found = list(index.lookup(chunk))
            if found:
                yield from _coded(pa.concat_tables(found), chunk, start)
        return
    log.warning(
        "%s; reading every manifest to find the ids (build it with `python -m prx_data.skips "
        "index %s`)",
        why,
        root,
    )
    for bucket in layout.list_buckets(root):
        shards = layout.read_index(root, bucket)
        for batch in iter_manifests(root, bucket, shards):
            for _, sel, codes in _coded(batch, ids, 0):
                yield bucket, sel, codes


def _coded(t: pa.Table, ids: pa.Array, offset: int) -> Iterator[tuple[str, pa.Table, np.ndarray]]:
    """Per bucket of ``t`` (or the one bucket of a manifest batch): the rows whose id is in
    ``ids`` and their positions there (plus ``offset``)."""
    code = pc.index_in(t["id"], value_set=ids)
    hit = pc.is_valid(code)
    if not pc.any(hit).as_py():
        return
    t = t.filter(hit)
    codes = code.filter(hit).to_numpy(zero_copy_only=False).astype(np.int64) + offset
    if "bucket" not in t.column_names:
        yield "", t, codes
        return
    enc = pc.dictionary_encode(t["bucket"].combine_chunks())
    which = enc.indices.to_numpy(zero_copy_only=False)
    for k, b in enumerate(enc.dictionary.to_pylist()):
        m = which == k
        yield b, t.filter(pa.array(m)), codes[m]


def _is_live(root: str, bucket: str, sel: pa.Table, cache: dict[str, pa.Array]) -> np.ndarray:
    """Per row of ``sel``: whether it is the current sample of a row an append exported again
    (:func:`prx_data.export.append.update_live`); ``replaced`` skips every other sample."""
    if bucket not in cache:
        cache[bucket] = append.live_keys(root, bucket)
    if not len(cache[bucket]):
        return np.zeros(len(sel), bool)
    keys = pc.binary_join_element_wise(
        sel["shard"].cast(pa.string()), sel["index"].cast(pa.string()), "#"
    )
    return pc.is_in(keys, value_set=cache[bucket]).to_numpy(zero_copy_only=False)


def bind(
    root: str, lists: Mapping[str, pa.Array], *, want_missing: Sequence[str] = ()
) -> dict[str, Bound]:
    """{list: Bound}: the (bucket, shard) positions of each list's ids in the export."""
    out = {n: Bound(ids=len(ids)) for n, ids in lists.items()}
    if not lists:
        return out
    names = sorted(lists)
    union = pc.unique(pa.concat_arrays([lists[n].cast(pa.string()) for n in names]))
    member = {n: pc.is_in(union, value_set=lists[n]).to_numpy(zero_copy_only=False) for n in names}
    found = np.zeros(len(union), bool)
    pieces: dict[str, dict[tuple[str, str], list[np.ndarray]]] = {}
    live: dict[str, pa.Array] = {}
    if len(union):
        for bucket, sel, codes in _rows_of(root, union):
            found[codes] = True
            enc = pc.dictionary_encode(sel["shard"].combine_chunks())
            shard_names = enc.dictionary.to_pylist()
            shard_code = enc.indices.to_numpy(zero_copy_only=False).astype(np.int64)
            index_col = sel["index"].to_numpy(zero_copy_only=False).astype(np.int64)
            for n in names:
                m = member[n][codes]
                if n.lstrip("+-") == append.REPLACED_LIST:  # a replaced row's current sample stays
                    m = m & ~_is_live(root, bucket, sel, live)
                if not m.any():
                    continue
                sc, ix = shard_code[m], index_col[m]
                order = np.argsort(sc, kind="stable")
                sc, ix = sc[order], ix[order]
                cuts = np.flatnonzero(np.diff(sc)) + 1
                for chunk in np.split(np.arange(len(sc)), cuts):
                    key = (bucket, shard_names[int(sc[chunk[0]])])
                    pieces.setdefault(n, {}).setdefault(key, []).append(ix[chunk])
    for n, per_key in pieces.items():
        out[n].positions = {k: np.concatenate(v) for k, v in per_key.items()}
    for n in names:
        b = out[n]
        b.positions = {k: np.unique(v) for k, v in sorted(b.positions.items())}
        b.samples = int(sum(len(v) for v in b.positions.values()))
        f = found[pc.index_in(lists[n], value_set=union).to_numpy(zero_copy_only=False)]
        b.found = int(f.sum())
        if n in want_missing:
            b.missing = lists[n].filter(pa.array(~f))
    return out


def ids_at(root: str, positions: Mapping[tuple[str, str], Iterable[int]]) -> pa.Array:
    """The row ids at (bucket, shard) sample positions, read from those parts' manifests.

    Positions are checked against the index first (shard known, index in range).
    """
    by_part: dict[tuple[str, str], dict[str, np.ndarray]] = {}
    indexes: dict[str, dict[str, layout.ShardInfo]] = {}
    adopted: dict[str, bool] = {}
    for (bucket, shard), idx in positions.items():
        if bucket not in indexes:
            shards = layout.read_index(root, bucket)
            indexes[bucket] = {s.basename: s for s in shards}
            adopted[bucket] = storage.exists(layout.adopted_manifest(root, bucket))
            if not adopted[bucket]:
                _check_parts(root, bucket, shards)
        info = indexes[bucket].get(shard)
        if info is None:
            raise UnknownName(
                f"shard {shard!r} is not in the index of bucket {bucket!r} under {root}"
            )
        arr = np.unique(np.asarray(list(idx), np.int64))
        if len(arr) and (arr[0] < 0 or arr[-1] >= info.samples):
            bad = int(arr[-1] if arr[-1] >= info.samples else arr[0])
            raise OutOfRange(
                f"{bucket}/{shard}: sample index {bad} is outside 0..{info.samples - 1}"
            )
        part = "" if adopted[bucket] else shard.split("/")[0]
        by_part.setdefault((bucket, part), {})[shard] = arr
    found = []
    for (bucket, part), wanted in sorted(by_part.items()):
        if adopted[bucket]:
            path = layout.adopted_manifest(root, bucket)
            t = layout.read_adopted_manifest(root, bucket, set(indexes[bucket]))
        else:
            path = layout.rel_join(root, f"{bucket}/{part}/{MANIFEST_NAME}")
            try:
                t = pq.read_table(
                    io.BytesIO(storage.read_bytes(path)), columns=["shard", "index", "id"]
                )
            except FileNotFoundError:
                raise ListError(
                    f"{path}: missing manifest, so the samples have no row ids"
                ) from None
            safety.check_manifest_shards(path, part, t["shard"])
        for shard, arr in wanted.items():
            rows = t.filter(pc.equal(t["shard"], shard))
            hit = rows.filter(pc.is_in(rows["index"], value_set=pa.array(arr, rows["index"].type)))
            if len(hit) != len(arr):
                raise ListError(f"{path}: {len(arr) - len(hit)} sample(s) of {shard} have no id")
            found.append(hit["id"].combine_chunks())
    if not found:
        return pa.array([], pa.string())
    return unique_ids(pa.concat_arrays(found))


__all__ = [
    "BIND_BATCH_ROWS",
    "Bound",
    "bind",
    "ids_at",
    "iter_manifests",
]
