"""Find an export's buckets, and copy a remote export's catalog into the node's cache.

The catalog is what a loader reads before streaming: the bucket indexes, the
report and the chosen skip-list sidecars. Local rank 0 of each node fetches it
into the local cache directory and writes a catalog file last; the other ranks
of the node wait for that file and make no remote request. Only files that
changed since the node's last fetch are downloaded (:mod:`prx_data.stream.fetched`).
"""

from __future__ import annotations

import hashlib
import json
import os
import warnings
from collections.abc import Sequence

from prx_data.core import storage
from prx_data.core.schema import REPORT_NAME
from prx_data.export import layout, naming, safety
from prx_data.skips import sidecar as skiplist
from prx_data.stream import cache as shard_cache
from prx_data.stream.fetched import CatalogCache
from prx_data.stream.leader import lead, wait_for_leader
from prx_data.stream.spec import DatasetSpec

#: Written last by the node's fetching rank; the other ranks wait for it.
CATALOG_PREFIX = "_prx_catalog."
FETCH_TIMEOUT_S = 600.0


def discover_buckets(root: str, tiers: Sequence[int]) -> list[str]:
    """Bucket names of the given tiers that exist under an export root (local or remote)."""
    return layout.list_buckets(root, tiers)


def _catalog_name(tiers: Sequence[int], names: Sequence[str] | None) -> str:
    key = json.dumps([sorted(tiers), None if names is None else sorted(names)])
    return CATALOG_PREFIX + hashlib.sha1(key.encode()).hexdigest()[:12] + ".txt"


def check_list_names(root: str, found: set[str], names: Sequence[str] | None) -> None:
    if names:
        missing = sorted(set(names) - found)
        if missing:
            raise skiplist.SkipListError(
                f"skip list(s) {missing} not found under {root} (found: {sorted(found) or 'none'})"
            )


def check_orphan_lists(
    root: str, orphans: Sequence[skiplist.SidecarProblem], names: Sequence[str] | None
) -> None:
    """Stray ``*.skip`` files are never applied: refuse if they claim a requested list, else warn."""
    if not orphans or names == []:
        return
    wanted = {n.lower() for n in names or []}
    hit = [o for o in orphans if o.claimed is not None and o.claimed.lower() in wanted]
    if hit:
        raise skiplist.SkipListError(
            f"{root}: {len(hit)} sidecar(s) of a requested skip list cannot be applied:\n  "
            + "\n  ".join(o.text() for o in hit[:10])
            + "\nrebuild them with python -m prx_data.skips add, or delete them"
        )
    more = f" (and {len(orphans) - 5} more)" if len(orphans) > 5 else ""
    warnings.warn(
        f"{root}: {len(orphans)} stray sidecar(s) are not applied: "
        + "; ".join(o.text() for o in orphans[:5])
        + more
        + ". Run python -m prx_data.skips list to see them all.",
        stacklevel=3,
    )


def fetch_catalog(
    spec: DatasetSpec,
    tiers: Sequence[int],
    local: str,
    *,
    is_leader: bool,
    timeout: float = FETCH_TIMEOUT_S,
) -> list[str]:
    """Copy a remote export's bucket indexes and chosen sidecars into ``local``, once per node.

    The leader (local rank 0) lists and fetches, refreshes the cache (stale
    sidecars are removed) and writes a catalog file last; other ranks wait
    for that file and make no remote request. Returns the bucket names.
    """
    names = spec.skip_lists
    marker = os.path.join(local, _catalog_name(tiers, names))
    if not is_leader:
        text = wait_for_leader(marker, timeout, f"fetching {spec.root}")
        return [line for line in text.splitlines() if line]

    def fetch() -> tuple[list[str], bytes]:
        buckets = _fetch(spec, tiers, local)
        return buckets, "".join(b + "\n" for b in buckets).encode()

    return lead(marker, fetch)


def _fetch(spec: DatasetSpec, tiers: Sequence[int], local: str) -> list[str]:
    names = spec.skip_lists
    buckets = discover_buckets(spec.root, tiers)
    # Only files whose version changed since the last fetch are downloaded (stream/fetched.py).
    fetched = CatalogCache(spec.root, local)
    report = fetched.report()
    # A cached shard is reused only if it belongs to the current index entry (stream/cache.py).
    tracked = shard_cache.is_tracked(local)
    cached_report = os.path.join(local, REPORT_NAME)
    same_report = report is not None and _read_local(cached_report) == report
    found: set[str] = set()
    orphans: list[skiplist.SidecarProblem] = []
    for bucket in buckets:
        remote_b = layout.rel_join(spec.root, bucket)
        local_b = os.path.join(local, *bucket.split("/"))
        index_uri = storage.join(remote_b, naming.INDEX_NAME)
        listing = fetched.bucket_listing(bucket)
        index = fetched.read(f"{bucket}/{naming.INDEX_NAME}", listing.get(naming.INDEX_NAME))
        try:
            obj = json.loads(index)
        except ValueError as e:
            raise safety.UnsafeIndexError(f"{index_uri}: not valid JSON ({e})") from None
        entries = safety.check_index_entries(index_uri, obj, plain=True)
        cached = shard_cache.read_cached_index(local_b, naming.INDEX_NAME) if tracked else None
        shard_cache.drop_stale_shards(local_b, cached, entries, same_report=same_report)
        # Checked before it reaches the cache: streaming joins its names to ``local`` blindly.
        storage.write_bytes_atomic(os.path.join(local_b, naming.INDEX_NAME), index)
        shards = [layout.ShardInfo.from_index_entry(e) for e in entries]
        listed, stray = skiplist.scan_sidecars(spec.root, bucket, shards, listing)
        orphans += stray
        found |= set(listed)
        chosen = list(listed) if names is None else [n for n in names if n in listed]
        want = {skiplist.sidecar_basename(b, n) for n in chosen for b in listed[n]}
        fetched.sync_sidecars(bucket, want, listing)
    # Last: the cached report dates the cached shards of an index without hashes.
    if report is not None:  # the loader's completeness check reads the cached copy
        storage.write_bytes_atomic(cached_report, report)
    elif os.path.exists(cached_report):
        os.remove(cached_report)
    fetched.finish(buckets, tiers)
    shard_cache.mark_tracked(local)
    check_orphan_lists(spec.root, orphans, names)
    check_list_names(spec.root, found, names)
    return buckets


def _read_local(path: str) -> bytes | None:
    try:
        with open(path, "rb") as f:
            return f.read()
    except FileNotFoundError:
        return None
