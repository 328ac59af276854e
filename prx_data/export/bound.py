"""Files bound to one shard of an export, beside it: their keys, their binding, their record.

Derived state lives next to the shards instead of in them (the shards are never
rewritten): precomputed VAE latents (:mod:`prx_data.export.latents`, ``_latents/``)
and attached columns (:mod:`prx_data.export.attached`, ``_columns/<name>/``). Both
keep one file per MDS shard, keyed ``<tier>/<ar>/<part>/shard.NNNNN.mds``, and a
record that binds each file to the data of the shard it was made from (its
samples, bytes and content hashes, as the bucket's merged index lists them) and
to its own bytes (xxh64). A shard whose data changed, or a file made for another
shard, no longer matches its binding and is refused or made again; the names of
folders play no part (parts are named by the ids they hold, so an identical
re-export keeps every binding).

Everything here takes the error class of its caller, so each kind of file says
in its own words what to run.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable, Mapping
from typing import Any

from prx_data.core import confined, storage
from prx_data.core.errors import NotFound, PrxDataError
from prx_data.export.durable import fsync as fsync_dir
from prx_data.export.layout import ShardInfo
from prx_data.export.naming import SHARD_FILE_RE
from prx_data.export.safety import check_bucket

#: Binding fields every per-shard entry of a record holds.
BINDING_KEYS = ("samples", "shard_bytes", "shard_hashes")


def shard_key(bucket: str, basename: str, error: type[PrxDataError]) -> str:
    """``<tier>/<ar>/<part>/shard.NNNNN.mds``: a shard's key in a record."""
    check_bucket(bucket)
    parts = basename.split("/")
    if (
        basename.startswith("/")
        or "\\" in basename
        or any(p in ("", ".", "..") for p in parts)
        or not SHARD_FILE_RE.fullmatch(parts[-1])
    ):
        raise error(f"{bucket}/{basename}: not a shard name of an export")
    return f"{bucket}/{basename}"


def check_key(key: object, error: type[PrxDataError]) -> str:
    """A key read from a record, checked as :func:`shard_key` checks the ones it makes.

    The record is data: a key like ``512/1.000/../../../x/shard.00000.mds`` would
    otherwise name a file outside its folder to read or delete.
    """
    if not isinstance(key, str) or key.count("/") < 3:
        raise error(f"{key!r}: not a shard key of an export")
    tier, ar, rest = key.split("/", 2)
    try:
        return shard_key(f"{tier}/{ar}", rest, error)
    except (ValueError, PrxDataError):
        raise error(f"{key!r}: not a shard key of an export") from None


def file_rel(folder: str, key: str, ext: str) -> str:
    """Path, relative to the export root, of the file ``folder`` holds for shard ``key``."""
    return f"{folder}/{key.split('.mds', 1)[0]}.{ext}"


def xxh64(data: bytes | memoryview) -> str:
    from prx_data.core.streaming_compat import get_hash

    return get_hash("xxh64", data)


def write_file(root: str, path: str, data: bytes) -> tuple[str, int]:
    """Write one bound file atomically, confined to ``root`` (folder fsync-ed when local).

    Returns ``(xxh64, bytes)`` of what was written.
    """
    confined.write_atomic(root, path, data)
    if not storage.is_remote(root):
        fsync_dir(os.path.dirname(path))
    return xxh64(data), len(data)


def file_digest(root: str, path: str, max_bytes: int) -> str | None:
    """xxh64 of a bound file as it is now, or None when there is none.

    A local file is hashed in 16 MB reads (a shard's tensors are gigabytes: never held
    whole; not a memory map, which a file truncated meanwhile turns into SIGBUS); an
    object is read, capped at ``max_bytes``. The digest is :func:`xxh64`'s.
    """
    import xxhash  # streaming's own xxh64 (a dependency of mosaicml-streaming)

    try:
        if storage.is_remote(root):
            return xxh64(confined.read(root, path, max_bytes))
        with confined.confined(root).open(path, max_bytes) as f:
            h, buf = xxhash.xxh64(), bytearray(1 << 24)
            view = memoryview(buf)
            while n := f.readinto(buf):
                h.update(view[:n])
            return h.hexdigest()
    except (FileNotFoundError, NotFound):
        return None


def shard_binding(entry: Mapping[str, Any]) -> dict[str, Any]:
    """What ties a file to the shard it came from: samples, bytes and hashes of its data."""
    raw = entry["raw_data"]
    return {
        "samples": int(entry["samples"]),
        "shard_bytes": int(raw["bytes"]),
        "shard_hashes": dict(sorted((raw.get("hashes") or {}).items())),
    }


def info_binding(s: ShardInfo) -> dict[str, Any]:
    """:func:`shard_binding` of a shard as :class:`ShardInfo` gives it (the loader's view)."""
    return {
        "samples": int(s.samples),
        "shard_bytes": int(s.bytes),
        "shard_hashes": dict(sorted(s.hashes.items())),
    }


def matches(recorded: Mapping[str, Any] | None, binding: Mapping[str, Any]) -> bool:
    """Whether a record's entry was made from the shard ``binding`` describes."""
    return recorded is not None and all(recorded.get(k) == v for k, v in binding.items())


def stale_shards(
    shards: Mapping[str, Any],
    bucket: str,
    infos: Iterable[ShardInfo],
    error: type[PrxDataError],
) -> list[str]:
    """Keys of shards of ``bucket`` whose file is missing from a record's ``shards`` or was
    made from other data (samples, bytes or hashes differ)."""
    return [
        key
        for s in infos
        if not matches(shards.get(key := shard_key(bucket, s.basename, error)), info_binding(s))
    ]


def read_record(
    root: str,
    rel: str,
    *,
    fmt: str,
    version: int,
    max_bytes: int,
    error: type[PrxDataError],
    job: str,
    args: str,
) -> dict[str, Any] | None:
    """A record (JSON) at ``root/rel``, checked by :func:`parse_record`; None when there is none.

    ``job`` (``python -m prx_data.<job>``) and its ``args`` make it again, for the
    one-line errors.
    """
    path = storage.join(root, *rel.split("/"))
    try:
        raw = confined.read(root, path, max_bytes)
    except (FileNotFoundError, NotFound):
        return None
    return parse_record(raw, root, rel, fmt=fmt, version=version, error=error, job=job, args=args)


def parse_record(
    raw: bytes,
    root: str,
    rel: str,
    *,
    fmt: str,
    version: int,
    error: type[PrxDataError],
    job: str,
    args: str,
) -> dict[str, Any]:
    """A record's bytes (read from the export, or from a node's cache of a remote one),
    checked: its format, its version, and every shard key."""
    path = storage.join(root, *rel.split("/"))
    redo = f"{job} {root} {args}"
    try:
        record = json.loads(raw)
    except ValueError:
        raise error(f"{path}: not a {fmt} record (bad JSON); run {redo} again") from None
    if not isinstance(record, dict) or record.get("format") != fmt:
        raise error(f"{path}: not a {fmt} record")
    shards = record.get("shards")
    if not isinstance(shards, dict) or not all(isinstance(v, dict) for v in shards.values()):
        raise error(f"{path}: its shards are not a mapping of shard records")
    for key in shards:
        try:
            check_key(key, error)
        except PrxDataError as e:
            raise error(
                f"{path}: {e}; the record was not written by {job}. Delete "
                f"{rel.rsplit('/', 1)[0]}/ and run {redo} again"
            ) from None
    if record.get("version") != version:
        raise error(
            f"{path}: {fmt} record version {record.get('version')!r}; this prx-data reads "
            f"version {version}: run {redo} --replace"
        )
    return record


def write_record(root: str, rel: str, body: Mapping[str, Any]) -> None:
    """Write a record atomically, its shards sorted by key."""
    shards = body.get("shards") or {}
    record = {**body, "shards": {k: shards[k] for k in sorted(shards)}}
    path = storage.join(root, *rel.split("/"))
    write_file(root, path, json.dumps(record, indent=1, sort_keys=True).encode())
