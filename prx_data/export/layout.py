"""The export tree: one module owns its layout, so the exporter, rewrite, dedup, opt-out,
the loader and the tests all read and write the same thing.

::

    out/
      report.json                      written last: the export is complete
      report.txt
      _progress/config                 the pinned export config (JSON text, not *.json)
      _progress/<part>.done            one marker per finished work unit
      <tier>/<ar>/index.json           merged bucket index, written atomically
      <tier>/<ar>/<part>/index.json    the part's own MDSWriter index
      <tier>/<ar>/<part>/shard.NNNNN.mds[.zstd]
      <tier>/<ar>/<part>/ids.parquet   manifest: shard (as in the merged index), index, id
      <tier>/<ar>/<part>/shard.NNNNN.mds.<name>.skip   skip-list sidecars

``<part>`` names a work unit, ``f<fragment:06d>-<start:09d>`` (:func:`part_name`).
The merged index is built by :func:`merge_bucket`, our documented equivalent
of ``streaming.base.util.merge_index``: it prefixes each shard basename with
its part, sorts parts, writes with sorted keys and replaces the file
atomically, so reruns give identical bytes and a reader never sees half an
index (streaming's version writes in place and downloads remote parts).
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import posixpath
import re
from collections.abc import Iterable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import pyarrow as pa
import pyarrow.parquet as pq

from prx_data.core import storage
from prx_data.core.schema import MANIFEST_NAME, REPORT_NAME


def part_name(fragment_id: int, start: int) -> str:
    """The part (work unit) directory name: stable for a table version and unit plan."""
    return f"f{fragment_id:06d}-{start:09d}"


def marker_path(out: str, part: str) -> str:
    """Where a finished work unit leaves its marker (the unit's counts, JSON text)."""
    return storage.join(out, PROGRESS_DIR, f"{part}.done")


def list_markers(out: str) -> list[str]:
    """Paths of every progress marker under ``out`` (one listing of ``_progress``)."""
    root = storage.join(out, PROGRESS_DIR)
    return [
        storage.join(root, rel) for rel in storage.list_files(root, suffix=".done", recursive=False)
    ]


PROGRESS_DIR = "_progress"


CONFIG_NAME = "_progress/config"


#: Top-level entries an export may contain; anything else makes --overwrite refuse.
_EXPORT_ENTRIES_EXTRA = {PROGRESS_DIR, REPORT_NAME, "report.txt"}


class ExportError(Exception):
    """A problem with the export's configuration or output location."""


def list_top(out: str) -> list[str]:
    if storage.is_remote(out):
        return sorted({p.split("/")[0] for p in storage.list_files(out)})
    return sorted(os.listdir(out)) if os.path.isdir(out) else []


def looks_like_export(entries: list[str], tiers: tuple[int, ...]) -> bool:
    allowed = _EXPORT_ENTRIES_EXTRA | {str(t) for t in tiers}
    return all(e in allowed or e.isdigit() for e in entries)


def remove_stale_parts(out: str, keep: set[str], tiers: tuple[int, ...]) -> int:
    """Delete part directories left by units that did not finish."""
    removed = 0
    if storage.is_remote(out):
        stale = set()
        for rel in storage.list_files(out):
            bits = rel.split("/")
            if len(bits) >= 4 and bits[0].isdigit() and bits[2] not in keep:
                stale.add("/".join(bits[:3]))
        for p in sorted(stale):
            storage.delete(storage.join(out, p))
            removed += 1
        return removed
    for tier in os.listdir(out):
        tdir = os.path.join(out, tier)
        if not (tier.isdigit() and os.path.isdir(tdir)):
            continue
        for ar in os.listdir(tdir):
            bdir = os.path.join(tdir, ar)
            if not os.path.isdir(bdir):
                continue
            for part in os.listdir(bdir):
                if os.path.isdir(os.path.join(bdir, part)) and part not in keep:
                    storage.delete(os.path.join(bdir, part))
                    removed += 1
            index = os.path.join(bdir, "index.json")
            if os.path.exists(index):  # a merge from an earlier attempt; redone at the end
                os.remove(index)
    return removed


def write_manifest(bucket_dir: str, part: str, id_list: list[str]) -> None:
    """ids.parquet: (shard basename as in the merged index, index in shard, id)."""
    index = json.loads(storage.read_bytes(storage.join(bucket_dir, part, "index.json")))
    shard_col, idx_col = [], []
    for shard in index["shards"]:
        base = posixpath.join(part, shard["raw_data"]["basename"])
        shard_col += [base] * shard["samples"]
        idx_col += list(range(shard["samples"]))
    if len(shard_col) != len(id_list):
        raise ExportError(
            f"{bucket_dir}/{part}: index has {len(shard_col)} samples, wrote {len(id_list)}"
        )
    table = pa.table(
        {
            "shard": pa.array(shard_col, pa.string()),
            "index": pa.array(idx_col, pa.int32()),
            "id": pa.array(id_list, pa.string()),
        }
    )
    buf = io.BytesIO()
    pq.write_table(table, buf, compression="zstd")
    storage.write_bytes_atomic(storage.join(bucket_dir, part, MANIFEST_NAME), buf.getvalue())


def merge_bucket(bucket_dir: str, parts: list[str]) -> int:
    """Write the bucket's index.json from its parts' indexes, atomically."""
    shards = []
    for part in sorted(parts):
        index = json.loads(storage.read_bytes(storage.join(bucket_dir, part, "index.json")))
        for shard in index["shards"]:
            for key in ("raw_data", "zip_data", "raw_meta", "zip_meta"):
                if shard.get(key):
                    shard[key]["basename"] = posixpath.join(part, shard[key]["basename"])
            shards.append(shard)
    body = json.dumps({"version": 2, "shards": shards}, sort_keys=True)
    storage.write_bytes_atomic(storage.join(bucket_dir, "index.json"), body.encode())
    return sum(s["samples"] for s in shards)


def is_complete(out: str) -> bool:
    return storage.exists(storage.join(out, REPORT_NAME))


def content_digest(out: str) -> str:
    """Digest of every shard, index and manifest (not reports/progress): equal for identical exports."""
    h = hashlib.sha256()
    for rel in storage.list_files(out):
        if (
            rel.startswith(PROGRESS_DIR)
            or rel in (REPORT_NAME, "report.txt")
            or rel.endswith(".skip")
        ):
            continue
        h.update(rel.encode())
        h.update(hashlib.sha256(storage.read_bytes(storage.join(out, rel))).digest())
    return h.hexdigest()


INDEX_NAME = "index.json"


#: Tier directories are integers; bucket directories are aspect labels like ``1.000``.
_TIER_RE = re.compile(r"^\d+$")


_AR_RE = re.compile(r"^\d+\.\d{3}$")


#: Parallel small-file requests against object storage.
IO_THREADS = 16


@dataclass(frozen=True)
class ShardInfo:
    """What the merged index says about one shard (what a sidecar is bound to)."""

    basename: str
    bytes: int
    samples: int
    hashes: dict[str, str] = field(default_factory=dict, hash=False, compare=False)

    @classmethod
    def from_index_entry(cls, entry: Mapping) -> ShardInfo:
        raw = entry["raw_data"]
        return cls(
            raw["basename"], int(raw["bytes"]), int(entry["samples"]), dict(raw.get("hashes") or {})
        )


def rel_join(root: str, rel: str) -> str:
    return storage.join(root, *rel.split("/"))


def list_buckets(root: str, tiers: Iterable[int] | None = None) -> list[str]:
    """Bucket names (``"512/1.000"``) under an export root that have a merged index.

    Lists two directory levels (tiers, then ratios) rather than the whole tree,
    so it stays cheap on object storage with many shards.
    """
    import pyarrow.fs as pafs

    fs, base = storage.filesystem(root)
    want = None if tiers is None else {int(t) for t in tiers}
    out = []
    for tinfo in fs.get_file_info(pafs.FileSelector(base, allow_not_found=True)):
        tier = posixpath.basename(tinfo.path.rstrip("/"))
        if tinfo.type != pafs.FileType.Directory or not _TIER_RE.match(tier):
            continue
        if want is not None and int(tier) not in want:
            continue
        for ainfo in fs.get_file_info(pafs.FileSelector(tinfo.path, allow_not_found=True)):
            ar = posixpath.basename(ainfo.path.rstrip("/"))
            if ainfo.type == pafs.FileType.Directory and _AR_RE.match(ar):
                bucket = f"{tier}/{ar}"
                if storage.exists(rel_join(root, f"{bucket}/{INDEX_NAME}")):
                    out.append(bucket)
    return sorted(out, key=lambda b: (int(b.split("/")[0]), b))


def read_index(root: str, bucket: str) -> list[ShardInfo]:
    """The shards of one bucket, in merged-index order."""
    path = rel_join(root, f"{bucket}/{INDEX_NAME}")
    try:
        obj = json.loads(storage.read_bytes(path))
    except FileNotFoundError:
        raise FileNotFoundError(f"{path}: no merged index; is {root!r} an export root?") from None
    return [ShardInfo.from_index_entry(e) for e in obj["shards"]]


def list_suffix(base: str, suffix: str) -> list[str]:
    """Relative ``/``-separated paths of files ending in ``suffix`` under ``base``."""
    if storage.is_remote(base):
        return [r.replace("\\", "/") for r in storage.list_files(base, suffix)]
    out = []
    cut = len(base.rstrip(os.sep)) + 1
    for dirpath, _dirs, files in os.walk(base):
        rel_dir = dirpath[cut:].replace(os.sep, "/")
        for f in files:
            if f.endswith(suffix):
                out.append(f"{rel_dir}/{f}" if rel_dir else f)
    return sorted(out)


def map_io(fn, items: Sequence, remote: bool) -> list:
    if remote and len(items) > 1:
        with ThreadPoolExecutor(IO_THREADS) as ex:
            return list(ex.map(fn, items))
    return [fn(x) for x in items]


def read_manifests(export_root: str, buckets: Sequence[str] | None = None):
    """All ``ids.parquet`` rows of the chosen buckets as one Arrow table (+ ``bucket``)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    tables = []
    for bucket in buckets if buckets is not None else list_buckets(export_root):
        rels = [r for r in storage.list_files(rel_join(export_root, bucket), MANIFEST_NAME)]
        fs, _ = storage.filesystem(export_root)

        def read(rel, bucket=bucket, fs=fs):
            _, p = storage.filesystem(
                rel_join(export_root, f"{bucket}/{rel.replace(chr(92), '/')}")
            )
            t = pq.read_table(p, filesystem=fs, columns=["shard", "index", "id"])
            return t.append_column("bucket", pa.array([bucket] * len(t), pa.string()))

        tables += map_io(read, rels, storage.is_remote(export_root))
    if not tables:
        return pa.table({"shard": [], "index": pa.array([], pa.int32()), "id": [], "bucket": []})
    return pa.concat_tables(tables)
