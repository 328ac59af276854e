"""The export tree as readers see it: roots as values (:class:`Tree`), buckets, merged
indexes, manifests and completeness, so the exporter, rewrite, dedup, opt-out, the
loader and the tests all read the same thing. Names and paths are
:mod:`prx_data.export.naming`; checks and deletion :mod:`prx_data.export.safety`.

::

    out/
      report.json                      written last: the export is complete
      report.txt
      dropped.parquet                  id, reason, detail of every dropped or failed row
      .prx-export.lock                 the run lock (local); .prx-export.lease on object storage
      _progress/export.marker          written first: proof that the tree is an export of ours
      _progress/config                 the pinned export config (JSON text, not *.json)
      _progress/dropped/<unit>.parquet a unit's dropped rows, merged into dropped.parquet
      _progress/<unit>.done            one marker per finished work unit (its parts' names)
      _progress/writing/<unit>.<hex>/  a unit's parts while it writes them (local): renamed
                                       into the buckets once fsynced, then the marker
      <tier>/<ar>/index.json           merged bucket index, written atomically
      <tier>/<ar>/<part>/index.json    the part's own MDSWriter index
      <tier>/<ar>/<part>/shard.NNNNN.mds[.zstd]
      <tier>/<ar>/<part>/ids.parquet   manifest: shard (as in the merged index), index, id
      <tier>/<ar>/<part>/shard.NNNNN.mds.<name>.skip   skip-list sidecars
      _progress/packed/<tier>/<ar>/<pack>  a written pack (JSON: its unit parts, counts)
      _lists/<name>.parquet            a skip list's row ids + provenance (sidecars derive from it)
      _lists/registry                  the lists' state: table identity, log position (JSON)
      _lists/_local.parquet            the export's own (export-only) list log entries
      _ids.lance/                      id index: id -> bucket, shard, index (Lance, BTREE on id;
                                       :mod:`prx_data.export.idindex`), rebuilt after every merge

``<part>`` is named by the row ids it holds, never by where they sit in the table: a work
unit's part is ``u<digest:016x>`` (:func:`~prx_data.export.naming.content_part_name`) and,
once the pack stage ran, a pack of consecutive unit parts of the bucket is ``p<digest:016x>``
(:func:`~prx_data.export.naming.content_pack_name`, :mod:`prx_data.export.pack`), where the
digest (:func:`~prx_data.export.naming.ids_digest`) depends only on the set of ids. A table
compacted or ingested again therefore exports to the same names, and what is bound to a
shard's path (latents, skip-list sidecars, a checkpoint's fingerprint) still holds. Exports
of older versions name parts ``f<fragment:06d>-<start:09d>`` and packs
``p<ordinal:06d>-<first part>``; they stay readable. The work unit's key
(``f<fragment>-<start>``) still names its bookkeeping under ``_progress``.
The merged index is built by :func:`prx_data.export.merge.merge_bucket`, our documented equivalent
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
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field

import pyarrow as pa
import pyarrow.parquet as pq

from prx_data.core import confined, storage
from prx_data.core.errors import NotFound, PrxDataError
from prx_data.core.schema import MANIFEST_NAME, REPORT_NAME
from prx_data.export.bounded import io_workers, map_bounded
from prx_data.export.naming import (
    ADOPT_DIR,
    ADOPTED_SHARDS_NAME,
    ADOPTION_NAME,
    AR_RE,
    DROPPED_NAME,
    FILE_KEYS,
    IDS_INDEX_NAME,
    INDEX_NAME,
    LEASE_NAME,
    LISTS_DIR,
    LOCK_NAME,
    PROGRESS_DIR,
    SIDECAR_SUFFIX,
    TIER_RE,
    ExportError,
)
from prx_data.export.safety import (
    UnsafeIndexError,
    check_bucket,
    check_manifest_shards,
    check_stream_basenames,
    folded_columns,
    load_index,
)


def list_markers(out: str) -> list[str]:
    """Paths of every progress marker under ``out`` (one listing of ``_progress``)."""
    root = storage.join(out, PROGRESS_DIR)
    return [
        storage.join(root, rel) for rel in storage.list_files(root, suffix=".done", recursive=False)
    ]


def is_complete(out: str) -> bool:
    return storage.exists(storage.join(out, REPORT_NAME))


def content_digest(out: str) -> str:
    """Digest of every shard, index and manifest (not reports, progress, lists or the id index,
    whose Lance files name random uuids): equal for identical exports."""
    h = hashlib.sha256()
    for rel in storage.list_files(out):
        if (
            rel.startswith((PROGRESS_DIR, LISTS_DIR, IDS_INDEX_NAME))
            or rel in (REPORT_NAME, "report.txt", DROPPED_NAME, LOCK_NAME, LEASE_NAME)
            or rel.endswith(SIDECAR_SUFFIX)
        ):
            continue
        h.update(rel.encode())
        h.update(hashlib.sha256(storage.read_bytes(storage.join(out, rel))).digest())
    return h.hexdigest()


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


class Tree(str):
    """An export root with its layout resolved once: the root's path, and its tier layout.

    A ``str``, so it passes through every function that takes a root, and
    :func:`rel_join` reads the layout from it: no process-wide state decides
    where a path resolves. ``flat_tier`` is None for the exporter's
    ``<tier>/<ar>/`` layout, else the tier of a tree with one folder per
    aspect ratio (``<ar>/index.json``). Resolve it where a root comes in
    (:func:`tree`) and pass it on; a plain string is a ``<tier>/<ar>/`` tree,
    and a path built from a Tree (``os.path.abspath``, ``rstrip``) is plain.
    """

    flat_tier: int | None

    def __new__(cls, root: str, flat_tier: int | None = None) -> Tree:
        obj = super().__new__(cls, root)
        object.__setattr__(obj, "flat_tier", None if flat_tier is None else int(flat_tier))
        return obj

    def __setattr__(self, name: str, value: object) -> None:
        raise AttributeError(f"a Tree is frozen: cannot set {name!r}")

    def __reduce__(self):  # pickles (Ray, process pools) as a Tree, layout included
        return (Tree, (str(self), self.flat_tier))

    def __repr__(self) -> str:
        return f"Tree({str.__repr__(self)}, flat_tier={self.flat_tier})"

    @property
    def remote(self) -> bool:
        return storage.is_remote(self)


def tree(root: str, tier: int | None = None) -> Tree:
    """``root`` resolved: its adoption record's layout, or ``tier`` for a flat tree not adopted.

    ``tier`` says that ``root`` holds one folder per aspect ratio of that tier
    (``DatasetSpec(tier=...)``, the planner's ``--tier``); it must agree with
    the adoption record when there is one. One small read (the record) per
    call: resolve once per root and pass the Tree on.
    """
    if isinstance(root, Tree) and (tier is None or root.flat_tier == int(tier)):
        return root
    recorded = _recorded_flat_tier(str(root))
    if tier is not None and recorded is not None and recorded != int(tier):
        raise ForeignTreeError(
            f"{root}: its adoption record says tier {recorded}, not {tier}; declare {recorded} "
            "or adopt the tree again with python -m prx_data.adopt --tier"
        )
    return Tree(str(root), recorded if tier is None else tier)


def flat_tier(root: str) -> int | None:
    """The tier of a flat tree as resolved in ``root`` (:class:`Tree`); None otherwise."""
    return getattr(root, "flat_tier", None)


def rel_join(root: str, rel: str) -> str:
    """``root/rel``; in a flat tree (:func:`flat_tier`) ``<tier>/<ar>/...`` is ``root/<ar>/...``."""
    bits = rel.split("/")
    if len(bits) > 1 and TIER_RE.fullmatch(bits[0]) and flat_tier(root) == int(bits[0]):
        bits = bits[1:]
    return storage.join(root, *bits)


class ForeignTreeError(PrxDataError, ValueError):
    """An MDS tree not written by the exporter that cannot be used as asked (say what to do)."""


def adopted_manifest(root: str, bucket: str) -> str:
    """Where ``python -m prx_data.adopt`` keeps a bucket's manifest (shard, index, id)."""
    return storage.join(root, ADOPT_DIR, *check_bucket(bucket).split("/"), MANIFEST_NAME)


def _recorded_flat_tier(root: str) -> int | None:
    """The tier an adoption record gives a flat tree (read now: records change on adoption)."""
    try:
        path = storage.join(root, *ADOPTION_NAME.split("/"))
        obj = json.loads(confined.read(root, path, confined.SMALL_MAX_BYTES))
    except (FileNotFoundError, OSError, ValueError):
        return None
    if isinstance(obj, dict) and obj.get("layout") == "flat" and isinstance(obj.get("tier"), int):
        return obj["tier"]
    return None


def list_buckets(root: str, tiers: Iterable[int] | None = None) -> list[str]:
    """Bucket names (``"512/1.000"``) under an export root that have a merged index.

    Lists two directory levels (tiers, then ratios) rather than the whole tree,
    so it stays cheap on object storage with many shards. A flat tree
    (:func:`flat_tier`) lists one level: its ratio folders.
    """
    want = None if tiers is None else {int(t) for t in tiers}
    out = []
    flat = flat_tier(root)
    if flat is not None:
        if want is not None and flat not in want:
            return []
        return sorted(
            f"{flat}/{ar}"
            for ar in storage.list_dirs(root)
            if AR_RE.fullmatch(ar) and storage.exists(storage.join(root, ar, INDEX_NAME))
        )
    for tier in storage.list_dirs(root):
        if not TIER_RE.fullmatch(tier):
            continue
        if want is not None and int(tier) not in want:
            continue
        for ar in storage.list_dirs(storage.join(root, tier)):
            if AR_RE.fullmatch(ar):
                bucket = f"{tier}/{ar}"
                if storage.exists(rel_join(root, f"{bucket}/{INDEX_NAME}")):
                    out.append(bucket)
    if not out and not isinstance(root, Tree) and _recorded_flat_tier(root) is not None:
        # A caller that skipped tree(): never read an adopted flat tree as an empty one.
        raise ForeignTreeError(
            f"{root}: an adopted tree with one folder per aspect ratio; resolve its layout "
            "first (prx_data.export.layout.tree(root)) and pass that on"
        )
    return sorted(out, key=lambda b: (int(b.split("/")[0]), b))


def read_index_entries(
    root: str, bucket: str, *, export_columns: bool | frozenset = False
) -> list[dict]:
    """The raw shard entries of one bucket's merged index (checked by :func:`~prx_data.export.safety.load_index`)."""
    path = rel_join(root, f"{check_bucket(bucket)}/{INDEX_NAME}")
    try:
        # Our own checks (rewrite, verify) need our layout; readers take any confined name.
        entries = load_index(
            path, export_columns=export_columns, plain=not export_columns, root=root
        )
    except FileNotFoundError:
        raise NotFound(f"{path}: no merged index; is {root!r} an export root?") from None
    if not storage.is_remote(root):
        # No name may reach through a link out of the bucket (a linked part directory would
        # take sidecar writes and rewrite reads elsewhere), nor name a FIFO or device.
        names = [e[k]["basename"] for e in entries for k in FILE_KEYS if e.get(k)]
        check_stream_basenames(path, rel_join(root, bucket), names)
    return entries


def read_index(
    root: str, bucket: str, *, export_columns: bool | frozenset = False
) -> list[ShardInfo]:
    """The shards of one bucket, in merged-index order (checked by :func:`~prx_data.export.safety.load_index`)."""
    entries = read_index_entries(root, bucket, export_columns=export_columns)
    return [ShardInfo.from_index_entry(e) for e in entries]


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


def read_adopted_manifest(root: str, bucket: str, shards: set[str], batch_rows: int | None = None):
    """An adopted bucket's manifest, its shard names checked against the bucket's index.

    Refused when the bucket's ``index.json`` is not the one adopted (its sha256
    in ``_prx/<bucket>/shards``): a rewritten bucket's manifest would name the
    wrong samples. ``batch_rows`` yields it a bounded batch at a time instead
    (an iterator of tables).
    """
    import pyarrow.compute as pc

    path = adopted_manifest(root, bucket)
    record = storage.join(root, ADOPT_DIR, *bucket.split("/"), ADOPTED_SHARDS_NAME)
    index = rel_join(root, f"{bucket}/{INDEX_NAME}")
    try:
        want = json.loads(confined.read(root, record, confined.SMALL_MAX_BYTES)).get("index_sha256")
    except (FileNotFoundError, ValueError, AttributeError):
        want = None
    if want != hashlib.sha256(confined.read(root, index, confined.INDEX_MAX_BYTES)).hexdigest():
        raise ForeignTreeError(
            f"{index}: not the index adopted (or {record} is missing), so the manifest may name "
            f"the wrong samples; run python -m prx_data.adopt {root} again"
        )

    def checked(t: pa.Table) -> pa.Table:
        bad = set(pc.unique(t["shard"]).to_pylist()) - shards
        if bad:
            raise UnsafeIndexError(
                f"{path}: shard(s) {sorted(bad)[:3]} are not in the bucket's index.json; the "
                "tree changed since it was adopted: run python -m prx_data.adopt again"
            )
        return t

    src = io.BytesIO(confined.read(root, path, confined.MANIFEST_MAX_BYTES))
    if batch_rows is None:
        return checked(pq.read_table(src, columns=["shard", "index", "id"]))
    pf = pq.ParquetFile(src)
    return (
        checked(pa.Table.from_batches([b]))
        for b in pf.iter_batches(batch_size=batch_rows, columns=["shard", "index", "id"])
    )


def read_manifests(export_root: str, buckets: Sequence[str] | None = None):
    """All ``ids.parquet`` rows of the chosen buckets as one Arrow table (+ ``bucket``)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    tables = []
    for bucket in buckets if buckets is not None else list_buckets(export_root):
        check_bucket(bucket)
        adopted = adopted_manifest(export_root, bucket)
        if storage.exists(adopted):  # an adopted tree: one manifest per bucket
            names = {e["raw_data"]["basename"] for e in read_index_entries(export_root, bucket)}
            t = read_adopted_manifest(export_root, bucket, names)
            tables.append(t.append_column("bucket", pa.array([bucket] * len(t), pa.string())))
            continue
        rels = [r for r in storage.list_files(rel_join(export_root, bucket), MANIFEST_NAME)]

        def read(rel, bucket=bucket):
            path = rel_join(export_root, f"{bucket}/{rel.replace(chr(92), '/')}")
            src = io.BytesIO(confined.read(export_root, path, confined.MANIFEST_MAX_BYTES))
            t = pq.read_table(src, columns=["shard", "index", "id"])  # one part's: small
            check_manifest_shards(path, posixpath.dirname(rel.replace(chr(92), "/")), t["shard"])
            return t.append_column("bucket", pa.array([bucket] * len(t), pa.string()))

        tables += map_bounded(read, rels, io_workers(export_root))
    if not tables:
        return pa.table({"shard": [], "index": pa.array([], pa.int32()), "id": [], "bucket": []})
    return pa.concat_tables(tables)


class IncompleteExport(ExportError):
    """An export that did not finish, or whose indexes disagree with its report."""


_OVERRIDE_HINT = "pass DatasetSpec(allow_incomplete=True) to stream it anyway"


def export_columns(root: str) -> bool | frozenset:
    """What ``export_columns`` accepts in ``root``'s shards: the exporter's columns, and those
    its report names as folded (``skips rewrite --fold-columns``; :func:`safety.folded_columns`)."""
    return folded_columns(read_report(root)) or True


def read_report(root: str) -> dict | None:
    """The export's ``report.json`` (None when there is none: the export did not finish)."""
    try:
        return json.loads(
            confined.read(root, storage.join(root, REPORT_NAME), confined.SMALL_MAX_BYTES)
        )
    except FileNotFoundError:
        return None
    except confined.UnsafeFileError:
        raise
    except ValueError as e:
        raise IncompleteExport(
            f"{storage.join(root, REPORT_NAME)}: unreadable report ({e})"
        ) from None


def check_export_complete(root: str, report: dict | None, *, count_markers: bool = True) -> None:
    """Refuse an export without a report, or with fewer unit markers than it reports.

    Counting markers lists ``_progress`` once (local roots). A remote root's
    cache holds no ``_progress``: there the loader checks the report and the
    per-bucket counts, and ``python -m prx_data.verify`` checks the markers.
    """
    if report is None:
        raise IncompleteExport(
            f"{root}: no {REPORT_NAME}, so the export did not finish (finish it with "
            f"`python -m prx_data.write_mds ... --resume`, check it with `python -m prx_data.verify "
            f"{root}`); {_OVERRIDE_HINT}"
        )
    units = report.get("units")
    if units is None or not count_markers:  # e.g. a rewritten export: no work units
        return
    markers = len(list_markers(root))
    if markers != units:
        raise IncompleteExport(
            f"{root}: {REPORT_NAME} reports {units} work units but {PROGRESS_DIR}/ holds "
            f"{markers} markers; {_OVERRIDE_HINT}"
        )


def check_bucket_complete(
    root: str, bucket: str, shards: Sequence[ShardInfo], report: dict
) -> None:
    """The bucket's merged index holds exactly the samples the report counted."""
    expected = (report.get("buckets") or {}).get(bucket)
    got = sum(s.samples for s in shards)
    if expected != got:
        raise IncompleteExport(
            f"{rel_join(root, f'{bucket}/{INDEX_NAME}')}: index holds {got} samples but "
            f"{REPORT_NAME} counted {expected}; the export was changed after it finished or did "
            f"not finish. Check it with `python -m prx_data.verify {root}`; {_OVERRIDE_HINT}"
        )
