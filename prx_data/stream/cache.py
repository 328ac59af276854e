"""Keep a node's cache of a remote export bound to the export it came from.

Streaming 0.13 treats a cached shard as present by its file name alone
(``Stream._prepare_shard_part`` checks ``os.path.isfile``; ``validate_hash``
runs only right after a download). Part and shard names are deterministic, so
after a re-export at the same remote root the old files would be streamed
under the new index, and a new skip list would hide the wrong samples.

The invariant kept here: every shard file in a tracked cache belongs to the
cached ``index.json`` entry of its bucket. Before the node's fetching rank
replaces a bucket's cached index, it drops each cached shard whose new entry
differs from the cached one (size, sample count, hashes, any other field) or
whose entry has no hash and whose export report changed. Checking costs one
stat per shard; nothing is rehashed. A cache written before tracking (no
:data:`TRACKED_NAME`) is not trusted: its shard files are dropped once and
fetched again on demand.

The same cache serves a *local* export with compressed shards
(:class:`DecompressCache`): streaming decompresses a shard next to its
``.zstd`` when the stream has no remote, which would add files to the export
(and fail ``verify``). Such a bucket streams with the export as its remote and
the cache as its local, so decompressed shards land in the cache only.
"""

from __future__ import annotations

import hashlib
import json
import os
import stat
import tempfile
from collections.abc import Mapping, Sequence
from typing import Any

from prx_data.core import confined, storage
from prx_data.core.errors import UsageError

__all__ = [
    "predownload_within_cache",
]

#: Written at the cache root once the cache follows the invariant above.
TRACKED_NAME = "_prx_cache.v1"


def is_tracked(local: str) -> bool:
    """Whether the cache's shard files are known to match their cached indexes."""
    return os.path.isfile(os.path.join(local, TRACKED_NAME))


def mark_tracked(local: str) -> None:
    storage.write_bytes_atomic(
        os.path.join(local, TRACKED_NAME),
        b"shard files here match their bucket's index.json (prx_data.stream.cache)\n",
    )


def read_cached_index(local_b: str, index_name: str) -> dict[str, Mapping[str, Any]] | None:
    """The cached index's entries by raw basename, or None when absent or unreadable."""
    try:
        with open(os.path.join(local_b, index_name), "rb") as f:
            shards = json.loads(f.read())["shards"]
        return {e["raw_data"]["basename"]: e for e in shards}
    except (OSError, ValueError, KeyError, TypeError):
        return None


def _files(entry: Mapping[str, Any]) -> list[str]:
    out = []
    for key in ("raw_data", "zip_data"):
        info = entry.get(key)
        if isinstance(info, Mapping) and info.get("basename"):
            out.append(str(info["basename"]))
    return out


def _hashed(entry: Mapping[str, Any]) -> bool:
    """Every file of the entry records a content hash (the default ``xxh64``)."""
    return all(
        bool((entry.get(key) or {}).get("hashes"))
        for key in ("raw_data", "zip_data")
        if entry.get(key)
    )


def drop_stale_shards(
    local_b: str,
    cached: Mapping[str, Mapping[str, Any]] | None,
    entries: Sequence[Mapping[str, Any]],
    *,
    same_report: bool,
) -> int:
    """Remove cached shard files that may not hold the bytes of ``entries``; returns how many.

    ``cached`` is the bucket's cached index (None: untrusted, drop every cached
    shard the indexes name). A shard is kept when its cached entry equals the
    new one and either records a hash or the export's report is unchanged
    (``same_report``), which tells a re-export of an unhashed index apart.
    Only files the old or new index names are touched, inside ``local_b``.
    """
    drop: set[str] = set()
    new_names = set()
    for e in entries:
        name = e["raw_data"]["basename"]
        new_names.add(name)
        old = None if cached is None else cached.get(name)
        if old is None or old != e or not (same_report or _hashed(e)):
            drop.update(_files(e))
    for name, old in (cached or {}).items():
        if name not in new_names:
            drop.update(_files(old))
    base = os.path.normpath(local_b) + os.sep
    n = 0
    for rel in sorted(drop):
        path = os.path.normpath(os.path.join(local_b, *rel.split("/")))
        if path.startswith(base) and os.path.isfile(path):
            os.remove(path)
            n += 1
    return n


def predownload_within_cache(
    cache_limit: int, max_shard_bytes: int, workers: int, predownload: int | None
) -> int:
    """The largest look-ahead (samples per worker) whose shards all fit in ``cache_limit``.

    Streaming's reading thread waits for its next shard to become local and
    never fetches it again if the download thread, ``predownload`` samples
    ahead, evicted it to make room: the epoch then sleeps forever. A shuffled
    look-ahead of ``p`` samples can touch ``p + 1`` shards per worker, plus
    the one being read, so ``workers * (p + 2)`` of the largest shards must
    fit. ``predownload`` (the user's) is kept when it fits and refused when
    it does not; ``None`` gets the largest that fits.
    """
    fits = cache_limit // max(1, max_shard_bytes)
    most = fits // max(1, workers) - 2
    if most < 1:
        need = max(1, workers) * 3 * max_shard_bytes
        raise UsageError(
            f"cache_limit {cache_limit} bytes holds {fits} of the largest remote shards "
            f"({max_shard_bytes} bytes) for {max(1, workers)} DataLoader worker(s): raise "
            f"cache_limit to at least {need} bytes"
        )
    if predownload is None:
        return most
    if predownload > most:
        raise UsageError(
            f"predownload={predownload} looks further ahead than cache_limit {cache_limit} "
            f"bytes holds ({fits} of the largest remote shards, {max_shard_bytes} bytes, for "
            f"{max(1, workers)} worker(s)); an evicted shard would stall the epoch: use "
            f"predownload <= {most} or raise cache_limit"
        )
    return predownload


#: The export's report.json as last seen by a :class:`DecompressCache` (tells a re-export apart).
LOCAL_REPORT_NAME = "_prx_export_report"


def default_decompress_dir(root: str) -> str:
    """A per-export cache under the system temp dir: ``prx-data-cache-<uid>/<digest of root>``."""
    key = hashlib.sha256(os.path.realpath(root).encode()).hexdigest()[:16]
    uid = os.getuid() if hasattr(os, "getuid") else 0
    return os.path.join(tempfile.gettempdir(), f"prx-data-cache-{uid}", key)


def _own_dir(path: str, what: str) -> None:
    """Create ``path`` (mode 0700) and refuse one that is a link or another user's."""
    os.makedirs(path, mode=0o700, exist_ok=True)
    st = os.lstat(path)
    uid = os.getuid() if hasattr(os, "getuid") else st.st_uid
    if stat.S_ISLNK(st.st_mode) or not stat.S_ISDIR(st.st_mode) or st.st_uid != uid:
        raise UsageError(
            f"{path}: the {what} is a link or belongs to another user; pass "
            "DatasetSpec(local=<a directory of yours>) for the decompressed shards"
        )


class DecompressCache:
    """Where one local export's compressed buckets are decompressed while streaming.

    ``local`` is the loader's cache directory (``DatasetSpec.local``), or a
    per-export folder under the system temp dir (:func:`default_decompress_dir`)
    when none is given. Each bucket gets ``<cache>/<tier>/<ar>/index.json``
    (the export's, as checked), and shards that no longer match it are dropped
    first (:func:`drop_stale_shards`), so a re-export at the same root never
    serves old bytes. The cache may not lie inside the export.
    """

    def __init__(self, root: str, local: str | None) -> None:
        self.root = root
        self.dir = os.path.abspath(local) if local else default_decompress_dir(root)
        real_root = os.path.realpath(root).rstrip(os.sep) + os.sep
        if (os.path.realpath(self.dir) + os.sep).startswith(real_root):
            raise UsageError(
                f"{self.dir}: the cache for decompressed shards is inside the export {root}; "
                "pass DatasetSpec(local=) a directory outside it"
            )
        if local:
            os.makedirs(self.dir, exist_ok=True)
        else:
            _own_dir(os.path.dirname(self.dir), "shared cache folder")
            _own_dir(self.dir, "export's cache folder")
        try:
            self.report = confined.read(
                root, storage.join(root, "report.json"), confined.SMALL_MAX_BYTES
            )
        except FileNotFoundError:
            self.report = None
        self.tracked = is_tracked(self.dir)
        seen = os.path.join(self.dir, LOCAL_REPORT_NAME)
        try:
            with open(seen, "rb") as f:
                self.same_report = self.report is not None and f.read() == self.report
        except OSError:
            self.same_report = False

    def bucket(self, bucket: str, entries: Sequence[Mapping[str, Any]]) -> str:
        """The bucket's cache directory, its index in place and stale shards dropped."""
        local_b = os.path.join(self.dir, *bucket.split("/"))
        cached = read_cached_index(local_b, "index.json") if self.tracked else None
        drop_stale_shards(local_b, cached, entries, same_report=self.same_report)
        body = json.dumps({"version": 2, "shards": list(entries)}, sort_keys=True).encode()
        index = os.path.join(local_b, "index.json")
        try:
            with open(index, "rb") as f:
                current = f.read()
        except OSError:
            current = None
        if current != body:  # several ranks of a node may get here: same bytes, atomic
            storage.write_bytes_atomic(index, body)
        return local_b

    def finish(self) -> None:
        """Record the export's report and that the cache follows the invariant."""
        seen = os.path.join(self.dir, LOCAL_REPORT_NAME)
        if self.report is not None:
            storage.write_bytes_atomic(seen, self.report)
        elif os.path.exists(seen):
            os.remove(seen)
        mark_tracked(self.dir)
