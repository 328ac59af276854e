"""What one loader streams: every bucket of each dataset with its skips, and the epoch plan.

Each dataset's buckets are found (or fetched into the node's cache, for a
remote root), checked against the export's report, and given the union of
the skip lists in force and the hold-out; :func:`plan_sources` then sizes
the epoch per bucket (:mod:`prx_data.stream.planner`). Both what
:class:`~prx_data.stream.dataset.BucketedDataset` streams and what
``python -m prx_data.planner`` previews.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Sequence

import numpy as np

from prx_data.core import storage
from prx_data.core.errors import NotFound, UsageError
from prx_data.core.streaming_compat import World
from prx_data.export import layout, naming
from prx_data.skips import sidecar as skiplist
from prx_data.stream import cache as shard_cache
from prx_data.stream import foreign as foreign_tree
from prx_data.stream import planner
from prx_data.stream.catalog import (
    check_list_names,
    check_orphan_lists,
    discover_buckets,
    fetch_catalog,
)
from prx_data.stream.holdout import holdout_skips, merge_skips
from prx_data.stream.spec import BucketSource, DatasetSpec, shard_digest


def load_sources(
    spec: DatasetSpec,
    tiers: Sequence[int],
    world: World | None = None,
    caption_columns: Sequence[str] = ("caption",),
) -> list[BucketSource]:
    """Every bucket of ``tiers`` in one export with its shards and (validated) skips.

    A tree another writer made (no export marker or report, or adopted:
    :mod:`prx_data.stream.foreign`) has no report to check, and its columns are
    resolved per bucket.
    """
    from prx_data.export import adopt

    world = world or World.detect()
    # The tree's layout, resolved once: every path below reads it from the root.
    spec = dataclasses.replace(spec, root=layout.tree(spec.root, spec.tier))
    plain = adopt.is_foreign_tree(spec.root)
    mapping = dict(spec.columns or {})
    if plain:  # ids as adopted: skip lists name samples by them
        rec = adopt.read_record(spec.root)
        if rec is not None:
            mapping["id"] = rec.get("id_column") or ""  # "": synthetic ids
    if storage.is_remote(spec.root):
        if not spec.local:
            raise UsageError(
                f"{spec.root}: a remote root needs DatasetSpec.local (a cache directory)"
            )
        buckets = fetch_catalog(spec, tiers, spec.local, is_leader=world.is_local_leader)
        base = spec.local
    else:
        buckets = discover_buckets(spec.root, tiers)
        base = spec.root
    if not buckets:
        raise NotFound(f"no buckets of tier(s) {list(tiers)} under {spec.root}")
    out = []
    found: set[str] = set()
    report = None
    if not spec.allow_incomplete and not plain:
        report = layout.read_report(base)
        layout.check_export_complete(
            spec.root, report, count_markers=not storage.is_remote(spec.root)
        )
    orphans: list[skiplist.SidecarProblem] = []
    decompress: shard_cache.DecompressCache | None = None
    for bucket in buckets:
        entries = layout.read_index_entries(base, bucket)
        shards = [layout.ShardInfo.from_index_entry(e) for e in entries]
        cols = None
        if plain:
            index_path = layout.rel_join(spec.root, f"{bucket}/{naming.INDEX_NAME}")
            cols = foreign_tree.resolve_columns(index_path, entries, mapping, caption_columns)
        if report is not None:
            layout.check_bucket_complete(spec.root, bucket, shards, report)
        skips: dict[str, np.ndarray] = {}
        lists: dict[str, tuple[int, str]] = {}
        per_list: dict[str, dict[str, np.ndarray]] = {}
        if spec.skip_lists != []:
            listing, stray = skiplist.scan_sidecars(base, bucket, shards)
            orphans += stray
            found |= set(listing)
            skips, lists, per_list = _load_lists(base, bucket, shards, spec.skip_lists, listing)
        remote = layout.rel_join(spec.root, bucket) if storage.is_remote(spec.root) else None
        local_b = os.path.join(base, *bucket.split("/"))
        if not storage.is_remote(spec.root):
            local_b = layout.rel_join(base, bucket)
            if any(e.get("zip_data") for e in entries):
                # Decompressed shards go to a cache, never next to their .zstd in the export.
                if decompress is None:
                    decompress = shard_cache.DecompressCache(spec.root, spec.local)
                remote, local_b = local_b, decompress.bucket(bucket, entries)
        out.append(
            BucketSource(
                bucket, remote, local_b, shards, skips, lists, foreign=cols, per_list=per_list
            )
        )
    if decompress is not None:
        decompress.finish()
    check_orphan_lists(spec.root, orphans, spec.skip_lists)
    check_list_names(spec.root, found, spec.skip_lists)
    if spec.holdout is not None:
        sets = holdout_skips(
            spec.holdout,
            spec.root,
            base,
            {b.bucket: b.shards for b in out},
            spec.local,
            is_leader=world.is_local_leader,
        )
        for b in out:
            held, side = sets[b.bucket]
            b.skips = merge_skips(b.skips, side)
            b.held_side = dict(side)
            b.held = shard_digest(held, b.shards)
    return out


def _load_lists(
    base: str,
    bucket: str,
    shards: list[layout.ShardInfo],
    names: Sequence[str] | None,
    listing: dict[str, list[str]],
) -> tuple[dict[str, np.ndarray], dict[str, tuple[int, str]], dict[str, dict[str, np.ndarray]]]:
    """The union of the chosen lists per shard, per list its size and content digest, and
    per list its indices per shard.

    Each sidecar is read once; the digests let a resume tell that a list was
    added, removed or changed since its checkpoint.
    """
    chosen = sorted(listing) if names is None else list(names)
    merged: dict[str, list[np.ndarray]] = {}
    lists: dict[str, tuple[int, str]] = {}
    per_list: dict[str, dict[str, np.ndarray]] = {}
    for name in chosen:
        one = skiplist.load_skips(base, bucket, shards, [name], listing=listing)
        n, digest = shard_digest(one, shards)
        for shard, idx in one.items():
            merged.setdefault(shard, []).append(np.asarray(idx, dtype=np.uint32))
        if n:
            lists[name] = (n, digest)
            per_list[name] = {k: np.asarray(v, np.uint32) for k, v in one.items() if len(v)}
    skips = {
        b: (a[0] if len(a) == 1 else np.unique(np.concatenate(a))).astype(np.uint32)
        for b, a in merged.items()
    }
    return skips, lists, per_list


def plan_sources(
    specs: Sequence[DatasetSpec],
    spec: planner.PlanSpec,
    world: World | None = None,
    *,
    world_size: int | None = None,
    num_nodes: int | None = None,
    caption_columns: Sequence[str] = ("caption",),
) -> tuple[list[list[BucketSource]], planner.Plan]:
    """Every dataset's buckets (skip lists and hold-out applied) and the checked epoch plan.

    What ``BucketedDataset`` streams and what ``python -m prx_data.planner``
    previews; ``world_size`` / ``num_nodes`` plan for another world than the
    one this process is in (the preview).
    """
    world = world or World.detect()
    sources = [load_sources(s, spec.tiers(), world, caption_columns) for s in specs]
    counts = [
        planner.DatasetCount(
            s.label,
            [planner.BucketCount(b.bucket, b.samples, b.skipped) for b in src],
            s.proportion,
            s.repeat,
            s.choose,
        )
        for s, src in zip(specs, sources, strict=True)
    ]
    plan = planner.plan_buckets(
        counts,
        spec,
        world_size=world.num_ranks if world_size is None else world_size,
        num_nodes=world.num_nodes if num_nodes is None else num_nodes,
    )
    return sources, plan
