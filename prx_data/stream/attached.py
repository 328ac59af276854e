"""Serve attached columns (:mod:`prx_data.export.attached`) as the loader serves shard columns.

A caption or extra column the export has attached (``_columns/<name>/record``)
is served from its per-shard file (:mod:`prx_data.export.attached`: an Arrow file
read whole, or an ``npy`` tensor mapped, of which only the served sample's row is
read); any other from the shards. Each
column's record is read once per node: on a local export from the export, on an
``s3://`` or ``gs://`` export by local rank 0 into the node's cache (the other
ranks wait for it, :mod:`prx_data.stream.leader`). Every stream's shards must be
the ones the record was made from, or the loader refuses in one line.

On a remote export, a shard's column files travel with the shard: each is one
more file of the shard's reader (:class:`~prx_data.stream.reader.SkipStream`
adds them), so streaming downloads it with the shard into the cache, counts it
against ``cache_limit`` and evicts it with the shard. Its cache name carries its
digest, so a re-attached file is another file, never a stale copy. Files are
read through the confined reader and checked against the record before a value
is served: an Arrow file's bytes, xxh64, schema and rows; an ``npy`` file's size,
header dtype and shape, and each served row's finiteness (its xxh64 would mean
reading gigabytes for one sample: ``verify --deep`` checks it, as for latents).
"""

from __future__ import annotations

import functools
import hashlib
import math
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import pyarrow as pa

from prx_data.core import confined, storage
from prx_data.core.errors import NotFound
from prx_data.export import attached as A
from prx_data.export import npyfile
from prx_data.export.layout import ShardInfo
from prx_data.stream.leader import lead, wait_for_leader

MARKER_PREFIX = "_prx_attached."
FETCH_TIMEOUT_S = 600.0


@dataclass
class DatasetColumns:
    """The attached columns one export serves: each name's record, and its Arrow type
    (``arrow`` columns) or storage dtype and one sample's shape (``npy`` columns)."""

    root: str
    records: dict[str, dict[str, Any]] = field(default_factory=dict)
    types: dict[str, pa.DataType] = field(default_factory=dict)
    #: Each column's type as its record spells it (a hashable key of the per-process cache).
    type_texts: dict[str, str] = field(default_factory=dict)
    npy: dict[str, tuple[str, tuple[int, ...]]] = field(default_factory=dict)

    def kind(self, name: str) -> str:
        return A.NPY if name in self.npy else A.ARROW

    @property
    def remote(self) -> bool:
        return storage.is_remote(self.root)


def fetch_small(
    root: str, local: str | None, rels: Sequence[str], *, is_leader: bool, what: str
) -> dict[str, bytes]:
    """The bytes of whichever of ``rels`` (small files, relative to the export root) exist.

    On a remote export the node's leader reads them into ``local`` (the node's
    cache; a copy of a file the export no longer has is removed) and the other
    ranks read that copy, making no remote request. On a local export they are
    read in place. Reads are confined to the export and capped.
    """
    rels = list(dict.fromkeys(rels))
    out: dict[str, bytes] = {}

    def read(rel: str) -> bytes | None:
        try:
            return confined.read(root, storage.join(root, *rel.split("/")), A.MAX_RECORD_BYTES)
        except (FileNotFoundError, NotFound):
            return None

    if not storage.is_remote(root):
        for rel in rels:
            raw = read(rel)
            if raw is not None:
                out[rel] = raw
        return out
    assert local is not None  # load_sources refused a remote root without a cache
    key = hashlib.sha1("\n".join(sorted(rels)).encode()).hexdigest()[:12]
    marker = os.path.join(local, f"{MARKER_PREFIX}{key}.txt")

    def cached(rel: str) -> str:
        return os.path.join(local, *rel.split("/"))

    if is_leader:

        def fetch() -> tuple[list[str], bytes]:
            found = []
            for rel in rels:
                raw = read(rel)
                if raw is None:
                    if os.path.exists(cached(rel)):
                        os.remove(cached(rel))
                    continue
                storage.write_bytes_atomic(cached(rel), raw)
                found.append(rel)
            return found, "".join(f"{r}\n" for r in found).encode()

        have = lead(marker, fetch)
    else:
        text = wait_for_leader(marker, FETCH_TIMEOUT_S, f"fetching {root}'s {what}")
        have = [r for r in text.splitlines() if r]
    for rel in have:
        with open(cached(rel), "rb") as f:
            out[rel] = f.read()
    return out


def load_columns(
    root: str, local: str | None, names: Sequence[str], *, is_leader: bool
) -> DatasetColumns:
    """The records of whichever of ``names`` the export at ``root`` has attached
    (read once per node, :func:`fetch_small`)."""
    out = DatasetColumns(root)
    names = [n for n in dict.fromkeys(names) if A.NAME_RE.fullmatch(n)]
    if not names:
        return out
    rels = {A.record_rel(n): n for n in names}
    raws = fetch_small(root, local, list(rels), is_leader=is_leader, what="column records")
    for rel, raw in raws.items():
        n = rels[rel]
        record = A.parse_record(raw, root, n)
        out.records[n] = record
        if A.kind_of(record) == A.NPY:
            out.npy[n] = A.npy_spec(record)
            continue
        out.types[n] = A.type_of(str(record.get("type", "")))
        out.type_texts[n] = str(record["type"])
    return out


def bucket_columns(
    cols: DatasetColumns, bucket: str, shards: Sequence[ShardInfo], local_bucket: str
) -> dict[str, dict[str, dict]]:
    """Per attached column, its record entry per shard basename of ``bucket`` (with the
    shard's key, and the file's ``path`` and the folder it must lie in, ``base``), after
    refusing a column set not made from these shards
    (:func:`prx_data.export.attached.require_current`).

    ``local_bucket`` is the stream's local folder: for a remote export, the node's cache
    of the bucket, where a shard's column files are fetched with it.
    """
    out: dict[str, dict[str, dict]] = {}
    for name, record in cols.records.items():
        A.require_current(cols.root, name, record, bucket, shards)
        entries = record["shards"]
        out[name] = {}
        for s in shards:
            key = A.shard_key(bucket, s.basename)
            rec = entries[key]
            kind = cols.kind(name)
            if cols.remote:
                rel = A.cache_rel(name, s.basename, str(rec.get("xxh64")), kind)
                base, path = local_bucket, os.path.join(local_bucket, *rel.split("/"))
            else:
                base, path = cols.root, A.file_path(cols.root, name, key, kind)
            out[name][s.basename] = {**rec, "key": key, "base": base, "path": path}
    return out


def shard_files(
    cols: DatasetColumns | None, bucket: str, per_column: Mapping[str, Mapping[str, dict]]
) -> dict[str, list[tuple[str, str, int]]]:
    """For a remote export: per shard basename, ``(cache path in the bucket folder, remote
    URI, bytes)`` of each of its column files, which the stream fetches with the shard."""
    out: dict[str, list[tuple[str, str, int]]] = {}
    if cols is None or not cols.remote:
        return out
    for name, entries in per_column.items():
        for basename, rec in entries.items():
            key, kind = A.shard_key(bucket, basename), cols.kind(name)
            uri = storage.join(cols.root, *A.file_rel(name, key, kind).split("/"))
            rel = A.cache_rel(name, basename, str(rec.get("xxh64")), kind)
            out.setdefault(basename, []).append((rel, uri, int(rec["bytes"])))
    return out


@functools.lru_cache(maxsize=64)
def _column_file(
    base: str, name: str, key: str, xxh64: str, nbytes: int, samples: int, type_text: str, path: str
) -> list:
    """One shard's column as Python values (a fixed-shape column: one numpy array, a row
    per sample, checked finite), read and checked once per process (workers read their own)."""
    rec = {"xxh64": xxh64, "bytes": nbytes, "samples": samples}
    arr = A.read_file(base, name, key, rec, A.type_of(type_text), path)
    if pa.types.is_fixed_size_list(arr.type):  # stored embeddings, masks: numpy rows
        return A.fixed_numpy(arr, path)
    values = arr.to_pylist()
    if pa.types.is_floating(arr.type):  # as a shard column's missing float: NaN
        values = [math.nan if v is None else v for v in values]
    return values


@functools.lru_cache(maxsize=npyfile.MAPS_KEPT)
def _npy_file(
    root: str,
    base: str,
    name: str,
    xxh64: str,
    nbytes: int,
    samples: int,
    dtype: str,
    shape: tuple[int, ...],
    path: str,
) -> Any:
    """One shard's ``npy`` column, checked and mapped once per process (workers map their
    own); its rows are read as they are served. Keyed by the record's digest too: a file
    attached again at the same path and size is mapped again, not served from the old map."""
    rec = {"bytes": nbytes, "samples": samples}
    return A.open_npy(root, name, rec, dtype, shape, (base, path))


def value(cols: DatasetColumns, name: str, rec: Mapping[str, Any], stored: int) -> Any:
    """The value of column ``name`` for the sample at ``stored`` of the shard whose entry
    (:func:`bucket_columns`) is ``rec``."""
    if name in cols.npy:
        dtype, shape = cols.npy[name]
        arr = _npy_file(
            cols.root,
            rec["base"],
            name,
            str(rec["xxh64"]),
            int(rec["bytes"]),
            int(rec["samples"]),
            dtype,
            shape,
            rec["path"],
        )
        return A.npy_row(arr, stored, dtype, f"{rec['path']} sample {stored}")
    values = _column_file(
        rec["base"],
        name,
        rec["key"],
        str(rec["xxh64"]),
        int(rec["bytes"]),
        int(rec["samples"]),
        cols.type_texts[name],
        rec["path"],
    )
    return values[stored]


__all__ = ["DatasetColumns", "bucket_columns", "load_columns", "shard_files", "value"]
