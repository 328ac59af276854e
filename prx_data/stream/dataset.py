"""Stream bucketed exports into training: skip lists in the sample space, one shape per batch.

An export tree holds one MDS dataset per bucket (``<root>/<tier>/<ar>/``).
:class:`BucketedDataset` turns every bucket of the chosen tier(s) of one or
more export trees into a Mosaic ``Stream`` and mixes them:

* **Skip lists** (:mod:`prx_data.skips.sidecar`) are applied where streaming
  defines its sample space: each shard reader reports only its kept samples
  and maps a kept index to the stored one (:class:`SkipMDSReader`). Epoch
  size, partitioning, shuffling, proportions and resumption all see the
  filtered dataset, and no data is read to leave a sample out.
* **Same-shape batches**: ``per_stream`` batching (one bucket per global
  batch) by default; each bucket's epoch count is sized by
  :mod:`prx_data.stream.planner` so that streaming never pads a bucket.
* **Mixing**: datasets mix by ``proportion`` / ``repeat`` / ``choose``;
  within a dataset, buckets are weighted by their sample counts after skips.
  Remote roots get the same weights as local ones.
* **Remote roots**: local rank 0 of each node fetches the bucket indexes and
  sidecars into the local cache; the other ranks of the node wait and reuse.

See docs/STREAMING.md for the reasoning and the knobs.
"""

from __future__ import annotations

import hashlib
import logging
import os
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
from streaming import Stream, StreamingDataset

from prx_data.core import storage
from prx_data.core.buckets import (
    DEFAULT_SPEC,
    BucketSpec,
    bucket_name,
    parse_bucket_name,
    same_ratio_shape,
)
from prx_data.core.streaming_compat import World, maybe_init_dist
from prx_data.export import layout
from prx_data.skips import sidecar as skiplist
from prx_data.skips.reader import SkipMDSReader  # noqa: F401 (re-exported)
from prx_data.stream import cache as shard_cache
from prx_data.stream import planner

# Moved to their own modules; re-exported here, where callers import them from.
from prx_data.stream.catalog import (  # noqa: F401
    CATALOG_PREFIX,
    FETCH_TIMEOUT_S,
    _catalog_name,
    _check_names,
    _check_orphans,
    _fetch,
    _node_barrier,
    _read_local,
    discover_buckets,
    fetch_catalog,
)
from prx_data.stream.decode import decode_chw
from prx_data.stream.holdout import Holdout, merge_skips
from prx_data.stream.reader import SkipStream
from prx_data.stream.resume import (  # noqa: F401
    FINGERPRINT_KEY,
    ON_CHANGE,
    SINCE_CHECKPOINT,
    RankMismatch,
    ResumeMismatch,
    check_ranks_agree,
    describe_changes,
    describe_rank_mismatch,
    fingerprint,
)

log = logging.getLogger(__name__)


@dataclass
class DatasetSpec:
    """One export tree and how much of it to use.

    ``skip_lists``: None applies every list found; ``[]`` applies none; a list
    of names applies those (an unknown name is an error, to catch typos).
    ``allow_incomplete``: stream an export that has no ``report.json``, misses
    unit markers, or whose bucket indexes disagree with its report (refused by
    default: such an export did not finish, or was changed after it did).
    """

    root: str
    local: str | None = None
    proportion: float | None = None
    repeat: float | None = None
    choose: int | None = None
    skip_lists: list[str] | None = None
    allow_incomplete: bool = False
    #: In-memory hold-out by id hash (train side or eval side), merged with the skip lists.
    holdout: Holdout | None = None


@dataclass
class BucketSource:
    """One bucket of one export, ready to stream: where it is, its shards and its skips."""

    bucket: str
    remote: str | None  # bucket URI when the root is remote
    local: str  # bucket directory (the export itself, or the cache)
    shards: list[layout.ShardInfo]
    skips: dict[str, np.ndarray]
    #: Per skip list in force: (samples it removes here, sha1 of its indices here).
    lists: dict[str, tuple[int, str]] = field(default_factory=dict)

    @property
    def samples(self) -> int:
        return sum(s.samples for s in self.shards)

    @property
    def skipped(self) -> int:
        return sum(len(v) for v in self.skips.values())


def load_sources(
    spec: DatasetSpec, tiers: Sequence[int], world: World | None = None
) -> list[BucketSource]:
    """Every bucket of ``tiers`` in one export with its shards and (validated) skips."""
    world = world or World.detect()
    if storage.is_remote(spec.root):
        if not spec.local:
            raise ValueError(
                f"{spec.root}: a remote root needs DatasetSpec.local (a cache directory)"
            )
        buckets = fetch_catalog(spec, tiers, spec.local, is_leader=world.is_local_leader)
        base = spec.local
    else:
        buckets = discover_buckets(spec.root, tiers)
        base = spec.root
    if not buckets:
        raise FileNotFoundError(f"no buckets of tier(s) {list(tiers)} under {spec.root}")
    out = []
    found: set[str] = set()
    report = None
    if not spec.allow_incomplete:
        report = layout.read_report(base)
        layout.check_export_complete(
            spec.root, report, count_markers=not storage.is_remote(spec.root)
        )
    orphans: list[skiplist.SidecarProblem] = []
    for bucket in buckets:
        shards = layout.read_index(base, bucket)
        if report is not None:
            layout.check_bucket_complete(spec.root, bucket, shards, report)
        skips: dict[str, np.ndarray] = {}
        lists: dict[str, tuple[int, str]] = {}
        if spec.skip_lists != []:
            listing, stray = skiplist.scan_sidecars(base, bucket, shards)
            orphans += stray
            found |= set(listing)
            skips, lists = _load_lists(base, bucket, shards, spec.skip_lists, listing)
        if spec.holdout is not None:
            skips = merge_skips(skips, spec.holdout.skips(spec.root, bucket, shards))
        remote = (
            storage.join(spec.root, *bucket.split("/")) if storage.is_remote(spec.root) else None
        )
        out.append(
            BucketSource(
                bucket, remote, os.path.join(base, *bucket.split("/")), shards, skips, lists
            )
        )
    _check_orphans(spec.root, orphans, spec.skip_lists)
    _check_names(spec.root, found, spec.skip_lists)
    return out


def _load_lists(
    base: str,
    bucket: str,
    shards: list[layout.ShardInfo],
    names: Sequence[str] | None,
    listing: dict[str, list[str]],
) -> tuple[dict[str, np.ndarray], dict[str, tuple[int, str]]]:
    """The union of the chosen lists per shard, and per list its size and content digest.

    Each sidecar is read once; the digests let a resume tell that a list was
    added, removed or changed since its checkpoint.
    """
    chosen = sorted(listing) if names is None else list(names)
    merged: dict[str, list[np.ndarray]] = {}
    lists: dict[str, tuple[int, str]] = {}
    for name in chosen:
        one = skiplist.load_skips(base, bucket, shards, [name], listing=listing)
        h = hashlib.sha1()
        n = 0
        for shard in sorted(one):
            idx = np.ascontiguousarray(one[shard], dtype=np.uint32)
            h.update(shard.encode() + b"\0" + idx.tobytes())
            n += len(idx)
            merged.setdefault(shard, []).append(idx)
        if n:
            lists[name] = (n, h.hexdigest())
    skips = {
        b: (a[0] if len(a) == 1 else np.unique(np.concatenate(a))).astype(np.uint32)
        for b, a in merged.items()
    }
    return skips, lists


# --- the dataset -----------------------------------------------------------------------------


def _specs(datasets: DatasetSpec | str | Sequence[DatasetSpec | str]) -> list[DatasetSpec]:
    if isinstance(datasets, (str, DatasetSpec)):
        datasets = [datasets]
    out = [d if isinstance(d, DatasetSpec) else DatasetSpec(root=d) for d in datasets]
    if not out:
        raise ValueError("give at least one dataset")
    return out


def _decode(data: bytes, shape: tuple[int, int]) -> torch.Tensor:
    return decode_chw(data, shape)  # higher tiers decode at reduced size (JPEG draft)


class BucketedDataset(StreamingDataset):
    """A StreamingDataset over the buckets of one or more export trees.

    Each item: ``image`` (uint8 [3, H, W] at the run tier's shape for the
    sample's aspect ratio; higher-tier samples are Lanczos-downsized), ``id``,
    each caption column, ``tier`` (the run tier), ``bucket`` (its run-tier
    bucket name), ``width``/``height`` (the original image size), and
    ``source_bucket``. Every device batch comes from one bucket.

    Extra keyword arguments go to ``StreamingDataset`` (e.g. ``predownload``,
    ``cache_limit``, ``download_retry``, ``shuffle_block_size``), except
    ``allow_unsafe_types=True``, which is refused.
    ``num_workers`` must equal the DataLoader's: the epoch is sized for it.
    ``small_buckets="drop"`` leaves out buckets too small for one planning unit
    (with a warning) instead of failing. The preflight plan is ``self.plan``
    (logged on rank 0). ``state_dict`` carries a fingerprint of the sample
    space; ``on_change`` says what a resume does when it differs (see
    :meth:`load_state_dict`).
    """

    #: False: ``image`` stays the encoded bytes, for decoding on the GPU (``decode.decode_batch``).
    decode_images = True

    def __init__(
        self,
        datasets: DatasetSpec | str | Sequence[DatasetSpec | str],
        *,
        tier: int,
        batch_size: int,
        include_higher_tiers: bool = False,
        caption_columns: Sequence[str] = ("caption",),
        batching_method: str = "per_stream",
        shuffle: bool = True,
        shuffle_seed: int = 9176,
        num_canonical_nodes: int | None = None,
        replication: int | None = None,
        epoch_size: int | None = None,
        num_workers: int | None = None,
        small_buckets: str = "error",
        bucket_spec: BucketSpec = DEFAULT_SPEC,
        on_change: str = "error",
        **streaming_kwargs: Any,
    ) -> None:
        if on_change not in ON_CHANGE:
            raise ValueError(f"on_change must be one of {ON_CHANGE}, got {on_change!r}")
        if streaming_kwargs.get("allow_unsafe_types"):
            raise ValueError(
                "BucketedDataset refuses allow_unsafe_types=True: it streams only safe column "
                "encodings (no pickle, which runs code from the data); re-export the data with a "
                "safe encoding"
            )
        self.on_change = on_change
        #: Set by a resume that restarted its epoch: what changed and how many samples repeat.
        self.restarted_epoch: dict[str, Any] | None = None
        specs = _specs(datasets)
        bucket_spec.shapes(tier)  # unknown tier -> clear error
        tiers = [t for t in bucket_spec.tiers if t == tier or (include_higher_tiers and t > tier)]
        self.run_tier = tier
        self.caption_columns = tuple(caption_columns)
        self.bucket_spec = bucket_spec
        destroy_dist = maybe_init_dist()
        try:
            world = World.detect()
            sources = [load_sources(s, tiers, world) for s in specs]
            counts = [
                planner.DatasetCount(
                    s.root,
                    [planner.BucketCount(b.bucket, b.samples, b.skipped) for b in src],
                    s.proportion,
                    s.repeat,
                    s.choose,
                )
                for s, src in zip(specs, sources, strict=True)
            ]
            self.plan = planner.plan_buckets(
                counts,
                device_batch_size=batch_size,
                world_size=world.num_ranks,
                num_nodes=world.num_nodes,
                num_workers=num_workers or 1,
                num_canonical_nodes=num_canonical_nodes,
                replication=replication,
                batching_method=batching_method,
                epoch_size=epoch_size,
                shuffle=shuffle,
                shuffle_block_size=streaming_kwargs.get("shuffle_block_size"),
                small_buckets=small_buckets,
            ).check()
            if world.rank == 0:
                log.info("bucket plan:\n%s", self.plan.report())
                for w in self.plan.warnings:
                    log.warning("bucket plan: %s", w)
            self.fingerprint = fingerprint(
                specs,
                sources,
                self.plan,
                tier=tier,
                include_higher_tiers=include_higher_tiers,
                bucket_spec=bucket_spec,
            )
            check_ranks_agree(self.fingerprint)  # before streaming's first collective
            streams: list[Stream] = []
            self.stream_info: list[tuple[int, str, tuple[int, int]]] = []
            plans = iter(self.plan.buckets)
            for di, src in enumerate(sources):
                for b in src:
                    bp = next(plans)
                    if bp.excluded or bp.choose == 0:
                        continue
                    streams.append(
                        SkipStream(
                            remote=b.remote,
                            local=b.local,
                            choose=bp.choose,
                            skips=b.skips,
                        )
                    )
                    shape = same_ratio_shape(
                        parse_bucket_name(b.bucket, bucket_spec), tier, bucket_spec
                    )
                    self.stream_info.append((di, b.bucket, shape))
            super().__init__(
                streams=streams,
                batch_size=batch_size,
                shuffle=shuffle,
                shuffle_seed=shuffle_seed,
                num_canonical_nodes=self.plan.num_canonical_nodes,
                batching_method=batching_method,
                replication=replication,
                **streaming_kwargs,
            )
            if self.cache_limit and self.max_shard_size_across_all_streams:
                # A look-ahead past what the cache holds can stall the epoch for good.
                asked = streaming_kwargs.get("predownload")
                most = shard_cache.predownload_within_cache(
                    self.cache_limit,
                    int(self.max_shard_size_across_all_streams),
                    num_workers or 1,
                    asked,
                )
                self.predownload = most if asked is not None else min(self.predownload, most)
        finally:
            if destroy_dist:
                torch.distributed.destroy_process_group()

    # Streaming calls this for every sample id of the epoch (after partitioning).
    def get_item(self, sample_id: int, retry: int = 7) -> dict[str, Any]:
        raw = super().get_item(sample_id, retry)
        bucket = parse_bucket_name(raw["bucket"], self.bucket_spec)
        shape = same_ratio_shape(bucket, self.run_tier, self.bucket_spec)
        item: dict[str, Any] = {
            "image": _decode(raw["image"], shape) if self.decode_images else raw["image"],
            "id": raw["id"],
            "tier": self.run_tier,
            "bucket": bucket_name(self.run_tier, *shape),
            "source_bucket": raw["bucket"],
            "width": int(raw["width"]),
            "height": int(raw["height"]),
        }
        for c in self.caption_columns:
            if c not in raw:
                raise KeyError(
                    f"caption column {c!r} is not in the export (columns: {sorted(raw)})"
                )
            item[c] = raw[c]
        return item

    def __iter__(self):
        info = torch.utils.data.get_worker_info()
        running = info.num_workers if info is not None else 1
        if running != self.plan.num_workers:
            raise planner.PlanError(
                f"the epoch was planned for {self.plan.num_workers} DataLoader worker(s) but "
                f"{running} are running: pass num_workers={running} to BucketedDataset"
            )
        return super().__iter__()

    def state_dict(self, num_samples: int, from_beginning: bool) -> dict[str, Any]:
        """Streaming's resume position plus the fingerprint of this epoch's sample space."""
        obj = super().state_dict(num_samples, from_beginning)
        obj[FINGERPRINT_KEY] = self.fingerprint
        return obj

    def load_state_dict(self, obj: dict[str, Any]) -> None:
        """Resume, never silently onto a different sample space.

        Refuses a canonical node count that differs from the plan's. When the
        fingerprint differs (a skip list added, removed or changed, other
        weights, another tier or bucket spec, another epoch size), raises
        :class:`ResumeMismatch` naming every change, unless ``on_change`` is
        ``"restart_epoch"``: then the checkpoint's epoch starts over on the
        current sample space and the samples it had already trained repeat.
        """
        ncn = obj.get("num_canonical_nodes")
        if ncn is not None and ncn != self.plan.num_canonical_nodes:
            raise planner.PlanError(
                f"checkpoint was written with num_canonical_nodes={ncn} but this dataset was "
                f"planned with {self.plan.num_canonical_nodes}: pass num_canonical_nodes={ncn}"
            )
        obj = dict(obj)
        old = obj.pop(FINGERPRINT_KEY, None)
        done = int(obj.get("sample_in_epoch", 0))
        if old is None:
            log.warning(
                "the checkpoint's data state has no fingerprint (written before prx-data "
                "recorded one): cannot verify that skip lists and weights are unchanged"
            )
        elif changes := describe_changes(old, self.fingerprint):
            listed = "\n  - ".join(changes)
            if self.on_change == "error":
                raise ResumeMismatch(
                    f"the data changed since the checkpoint (epoch {obj.get('epoch')}, "
                    f"{done} samples into it):\n  - {listed}\n"
                    "The epoch's sample order is fixed by its sample space, so continuing would "
                    "repeat some samples and skip others, and could train on newly skipped ones. "
                    "Choices (docs/STREAMING.md, 'Resuming after a change'):\n"
                    f"  - on_change='restart_epoch' (data.on_change): start epoch "
                    f"{obj.get('epoch')} over with the current lists and weights; the {done} "
                    "samples already trained this epoch are seen again, newly skipped ones never;\n"
                    "  - restore the checkpoint's lists and weights to finish the epoch as planned "
                    "(only when the change is not an opt-out that must take effect now)."
                )
            log.warning(
                "the data changed since the checkpoint:\n  - %s\nrestarting epoch %s with the "
                "current sample space (%d samples); the %d samples already trained this epoch "
                "repeat",
                listed,
                obj.get("epoch"),
                self.plan.epoch_size,
                done,
            )
            obj["sample_in_epoch"] = 0
            self.restarted_epoch = {"changes": changes, "repeated_samples": done}
        super().load_state_dict(obj)
