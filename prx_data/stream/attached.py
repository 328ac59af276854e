"""Serve attached columns (:mod:`prx_data.export.attached`) as the loader serves shard columns.

A caption or extra column the export has attached (``_columns/<name>/record``)
is served from its per-shard Arrow file; any other from the shards. Each
column's record is read once per node: on a local export from the export, on an
``s3://`` or ``gs://`` export by local rank 0 into the node's cache (the other
ranks wait for it, :mod:`prx_data.stream.leader`). Every stream's shards must be
the ones the record was made from, or the loader refuses in one line.

On a remote export, a shard's column files travel with the shard: each is one
more file of the shard's reader (:class:`~prx_data.stream.reader.SkipStream`
adds them), so streaming downloads it with the shard into the cache, counts it
against ``cache_limit`` and evicts it with the shard. Its cache name carries its
digest, so a re-attached file is another file, never a stale copy. Files are
read through the confined reader and checked against the record (bytes, xxh64,
Arrow schema, rows) before a value is served.
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
from prx_data.export.layout import ShardInfo
from prx_data.stream.leader import lead, wait_for_leader

MARKER_PREFIX = "_prx_attached."
FETCH_TIMEOUT_S = 600.0


@dataclass
class DatasetColumns:
    """The attached columns one export serves: each name's record and Arrow type."""

    root: str
    records: dict[str, dict[str, Any]] = field(default_factory=dict)
    types: dict[str, pa.DataType] = field(default_factory=dict)

    @property
    def remote(self) -> bool:
        return storage.is_remote(self.root)


def _read_raw(root: str, name: str) -> bytes | None:
    path = storage.join(root, *A.record_rel(name).split("/"))
    try:
        return confined.read(root, path, A.MAX_RECORD_BYTES)
    except (FileNotFoundError, NotFound):
        return None


def load_columns(
    root: str, local: str | None, names: Sequence[str], *, is_leader: bool
) -> DatasetColumns:
    """The records of whichever of ``names`` the export at ``root`` has attached.

    A remote export's records are read by the node's leader into ``local`` (the
    node's cache); the other ranks read that copy and make no remote request.
    """
    out = DatasetColumns(root)
    names = [n for n in dict.fromkeys(names) if A.NAME_RE.fullmatch(n)]
    if not names:
        return out
    raws: dict[str, bytes] = {}
    if storage.is_remote(root):
        assert local is not None  # load_sources refused a remote root without a cache
        key = hashlib.sha1("\n".join(sorted(names)).encode()).hexdigest()[:12]
        marker = os.path.join(local, f"{MARKER_PREFIX}{key}.txt")

        def cached(name: str) -> str:
            return os.path.join(local, *A.record_rel(name).split("/"))

        if is_leader:

            def fetch() -> tuple[list[str], bytes]:
                found = []
                for n in names:
                    raw = _read_raw(root, n)
                    if raw is None:
                        if os.path.exists(cached(n)):
                            os.remove(cached(n))
                        continue
                    storage.write_bytes_atomic(cached(n), raw)
                    found.append(n)
                return found, "".join(f"{n}\n" for n in found).encode()

            have = lead(marker, fetch)
        else:
            text = wait_for_leader(marker, FETCH_TIMEOUT_S, f"fetching {root}'s column records")
            have = [n for n in text.splitlines() if n]
        for n in have:
            with open(cached(n), "rb") as f:
                raws[n] = f.read()
    else:
        for n in names:
            raw = _read_raw(root, n)
            if raw is not None:
                raws[n] = raw
    for n, raw in raws.items():
        where = storage.join(root, *A.record_rel(n).split("/"))
        record = A.parse_record(raw, where, n)
        out.records[n] = record
        out.types[n] = A.type_of(str(record.get("type", "")))
    return out


def bucket_columns(
    cols: DatasetColumns, bucket: str, shards: Sequence[ShardInfo]
) -> dict[str, dict[str, dict]]:
    """Per attached column, its record entry per shard basename of ``bucket``, after refusing
    a column set not made from these shards (:func:`prx_data.export.attached.require_current`)."""
    out: dict[str, dict[str, dict]] = {}
    for name, record in cols.records.items():
        A.require_current(cols.root, name, record, bucket, shards)
        entries = record["shards"]
        out[name] = {s.basename: entries[A.shard_key(bucket, s.basename)] for s in shards}
    return out


def shard_files(
    cols: DatasetColumns, bucket: str, per_column: Mapping[str, Mapping[str, dict]]
) -> dict[str, list[tuple[str, str, int]]]:
    """For a remote export: per shard basename, ``(cache path in the bucket folder, remote
    URI, bytes)`` of each of its column files, which the stream fetches with the shard."""
    out: dict[str, list[tuple[str, str, int]]] = {}
    if not cols.remote:
        return out
    for name, entries in per_column.items():
        for basename, rec in entries.items():
            key = A.shard_key(bucket, basename)
            uri = storage.join(cols.root, *A.file_rel(name, key).split("/"))
            rel = A.cache_rel(name, basename, str(rec.get("xxh64")))
            out.setdefault(basename, []).append((rel, uri, int(rec["bytes"])))
    return out


@functools.lru_cache(maxsize=64)
def _column_file(
    base: str, name: str, key: str, xxh64: str, nbytes: int, samples: int, type_text: str, path: str
) -> list:
    """One shard's column as Python values, read and checked once per process (workers
    read their own)."""
    rec = {"xxh64": xxh64, "bytes": nbytes, "samples": samples}
    arr = A.read_file(base, name, key, rec, A.type_of(type_text), path)
    values = arr.to_pylist()
    if pa.types.is_floating(arr.type):  # as a shard column's missing float: NaN
        values = [math.nan if v is None else v for v in values]
    return values


def value(
    cols: DatasetColumns,
    name: str,
    bucket: str,
    basename: str,
    rec: Mapping[str, Any],
    stored: int,
    local_bucket: str,
) -> Any:
    """The value of column ``name`` for the sample at ``stored`` of a shard.

    ``local_bucket`` is the stream's local folder (the node's cache of a remote
    export's bucket, where the file was fetched with the shard).
    """
    key = A.shard_key(bucket, basename)
    if cols.remote:
        base = local_bucket
        path = os.path.join(
            local_bucket, *A.cache_rel(name, basename, str(rec["xxh64"])).split("/")
        )
    else:
        base = cols.root
        path = A.file_path(cols.root, name, key)
    values = _column_file(
        base,
        name,
        key,
        str(rec["xxh64"]),
        int(rec["bytes"]),
        int(rec["samples"]),
        A.type_text(cols.types[name]),
        path,
    )
    return values[stored]


__all__ = ["DatasetColumns", "bucket_columns", "load_columns", "shard_files", "value"]
