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


#: What :func:`part_name` produces (widths are minimums: more fragments widen them).
PART_PATTERN = r"f\d{6,}-\d{9,}"
#: A shard file as MDSWriter names it, raw or compressed (streaming's compression extensions).
SHARD_FILE_PATTERN = r"shard\.\d{5,}\.mds(?:\.(?:br|bz2|gz|snappy|zstd))?"
_PART_RE = re.compile(rf"^{PART_PATTERN}$")
_SHARD_FILE_RE = re.compile(rf"^{SHARD_FILE_PATTERN}$")
_SHARD_RE = re.compile(rf"^{PART_PATTERN}/{SHARD_FILE_PATTERN}$")
#: Index entry keys that name a file (streaming joins each to the dataset directory).
_FILE_KEYS = ("raw_data", "zip_data", "raw_meta", "zip_meta")


class UnsafeIndexError(ValueError):
    """An index (or manifest) names a file outside the layout the exporter writes."""


def check_shard_basename(index_path: str, basename: object, *, in_part: bool = False) -> str:
    """Refuse a shard name that could escape the export, naming the file it came from.

    Streaming joins ``local + basename`` with no check, so ``../../victim`` or
    ``/etc/passwd`` in an index would be read (and our tools would write next
    to it). A merged index names ``<part>/shard.NNNNN.mds[.ext]``; a part's
    own index (``in_part``) names ``shard.NNNNN.mds[.ext]``. Anything else is
    refused: absolute, ``..``, backslashes, empty segments, other names.
    """
    pattern = _SHARD_FILE_RE if in_part else _SHARD_RE
    if not isinstance(basename, str) or not pattern.match(basename):
        want = "shard.NNNNN.mds[.zstd]" if in_part else "<part>/shard.NNNNN.mds[.zstd]"
        why = _why_unsafe(basename)
        raise UnsafeIndexError(
            f"{index_path}: refusing shard name {basename!r}{why}; an export written by "
            f"prx_data.write_mds names {want} with <part> like {part_name(0, 0)}"
        )
    return basename


def _why_unsafe(name: object) -> str:
    if not isinstance(name, str):
        return " (not a string)"
    if name.startswith(("/", "\\")) or re.match(r"^[A-Za-z]:", name):
        return " (absolute path)"
    if "\\" in name:
        return " (backslash)"
    segs = name.split("/")
    if ".." in segs:
        return " (parent-directory segment)"
    if "" in segs or "." in segs:
        return " (empty segment)"
    return ""


def check_index_entries(index_path: str, obj: object, *, in_part: bool = False) -> list[dict]:
    """The ``shards`` entries of a parsed index, every file name in them checked."""
    shards = obj.get("shards") if isinstance(obj, dict) else None
    if not isinstance(shards, list):
        raise UnsafeIndexError(f"{index_path}: not a streaming index (no 'shards' list)")
    for entry in shards:
        if not isinstance(entry, dict) or not isinstance(entry.get("raw_data"), dict):
            raise UnsafeIndexError(f"{index_path}: shard entry without raw_data: {entry!r:.200}")
        for key in _FILE_KEYS:
            if entry.get(key):
                check_shard_basename(index_path, entry[key].get("basename"), in_part=in_part)
    return shards


def check_bucket(bucket: object) -> str:
    """A bucket name is ``<tier>/<ratio>`` (``512/1.000``): nothing else may reach a path."""
    if not isinstance(bucket, str) or bucket.count("/") != 1:
        raise UnsafeIndexError(
            f"bad bucket name {bucket!r}: expected <tier>/<ratio>, e.g. 512/1.000"
        )
    tier, ar = bucket.split("/")
    if not (_TIER_RE.match(tier) and _AR_RE.match(ar)):
        raise UnsafeIndexError(
            f"bad bucket name {bucket!r}: expected <tier>/<ratio>, e.g. 512/1.000"
        )
    return bucket


def load_index(path: str, *, in_part: bool = False) -> list[dict]:
    """Read and check one ``index.json``: its shard entries, every file name confined."""
    try:
        obj = json.loads(storage.read_bytes(path))
    except ValueError as e:
        raise UnsafeIndexError(f"{path}: not valid JSON ({e})") from None
    return check_index_entries(path, obj, in_part=in_part)


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
    shard_col, idx_col = [], []
    for shard in load_index(storage.join(bucket_dir, part, INDEX_NAME), in_part=True):
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
        for shard in load_index(storage.join(bucket_dir, part, INDEX_NAME), in_part=True):
            for key in _FILE_KEYS:
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


def read_index_entries(root: str, bucket: str) -> list[dict]:
    """The raw shard entries of one bucket's merged index, every file name confined."""
    path = rel_join(root, f"{check_bucket(bucket)}/{INDEX_NAME}")
    try:
        return load_index(path)
    except FileNotFoundError:
        raise FileNotFoundError(f"{path}: no merged index; is {root!r} an export root?") from None


def read_index(root: str, bucket: str) -> list[ShardInfo]:
    """The shards of one bucket, in merged-index order (names checked by :func:`load_index`)."""
    return [ShardInfo.from_index_entry(e) for e in read_index_entries(root, bucket)]


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


def check_manifest_shards(path: str, part: str, shards) -> None:
    """Shard names in a manifest are data too: each must be a shard of the manifest's own part."""
    import pyarrow.compute as pc

    for name in pc.unique(shards).to_pylist():  # a handful per part, whatever the row count
        check_shard_basename(path, name)
        if name.split("/")[0] != part:
            raise UnsafeIndexError(
                f"{path}: shard {name!r} is not in this manifest's part {part!r}"
            )


def read_manifests(export_root: str, buckets: Sequence[str] | None = None):
    """All ``ids.parquet`` rows of the chosen buckets as one Arrow table (+ ``bucket``)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    tables = []
    for bucket in buckets if buckets is not None else list_buckets(export_root):
        check_bucket(bucket)
        rels = [r for r in storage.list_files(rel_join(export_root, bucket), MANIFEST_NAME)]
        fs, _ = storage.filesystem(export_root)

        def read(rel, bucket=bucket, fs=fs):
            path = rel_join(export_root, f"{bucket}/{rel.replace(chr(92), '/')}")
            _, p = storage.filesystem(path)
            t = pq.read_table(p, filesystem=fs, columns=["shard", "index", "id"])
            check_manifest_shards(path, posixpath.dirname(rel.replace(chr(92), "/")), t["shard"])
            return t.append_column("bucket", pa.array([bucket] * len(t), pa.string()))

        tables += map_io(read, rels, storage.is_remote(export_root))
    if not tables:
        return pa.table({"shard": [], "index": pa.array([], pa.int32()), "id": [], "bucket": []})
    return pa.concat_tables(tables)
