"""Preflight for bucketed streaming: samples, batches and dropped tails per bucket.

Mosaic Streaming pads each stream's partition with repeated samples or ``-1``
holes when a stream's epoch count does not divide evenly over canonical
nodes, ranks, workers and batches. Under single-bucket batching that padding
either repeats samples, drops full batches, gives ranks different batch
counts, or lets a short device batch pull samples from the next bucket into
the same batch (mixed shapes). The planner therefore sizes every bucket's
epoch count (``choose``) to a multiple of a *unit* that makes all of those
divisions exact, reports what that costs, and refuses configurations that
streaming would crash on, before any data is read.

For ``per_stream`` the unit is ``lcm(num_canonical_nodes, global_batch * num_workers)``;
for ``device_per_stream`` it is
``lcm(num_canonical_nodes * ranks_per_node * num_workers, global_batch)``.
Bucket counts below one unit are fatal (or dropped with ``small_buckets="drop"``).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field

from prx_data.export import layout

BATCHING_METHODS = ("per_stream", "device_per_stream")
#: streaming's default: max(4_000_000 // num_canonical_nodes, 1 << 18).
DEFAULT_SHUFFLE_BLOCK = 1 << 18


class PlanError(ValueError):
    """A configuration that streaming would crash on or silently mishandle."""


@dataclass(frozen=True)
class BucketCount:
    """One bucket of one dataset: samples in its shards, and how many the skip lists remove."""

    bucket: str
    samples: int
    skipped: int = 0

    @property
    def kept(self) -> int:
        return self.samples - self.skipped


@dataclass(frozen=True)
class DatasetCount:
    """One export tree's buckets with its mixing weight (at most one of the three)."""

    name: str
    buckets: Sequence[BucketCount]
    proportion: float | None = None
    repeat: float | None = None
    choose: int | None = None

    @property
    def kept(self) -> int:
        return sum(b.kept for b in self.buckets)


@dataclass
class BucketPlan:
    dataset: int
    bucket: str
    samples: int
    skipped: int
    kept: int
    #: Samples this bucket would get this epoch from the weights alone.
    target: int
    #: Samples it gets: ``target`` rounded down to the unit (what streaming is told to choose).
    choose: int
    #: Global batches (per_stream) or device batches (device_per_stream) per epoch.
    batches: int
    excluded: bool = False

    @property
    def dropped(self) -> int:
        """Samples of the target left out by rounding to whole units (a different subset each epoch)."""
        return self.target - self.choose


@dataclass
class Plan:
    world_size: int
    num_nodes: int
    device_batch_size: int
    num_workers: int
    num_canonical_nodes: int
    replication: int
    batching_method: str
    global_batch_size: int
    unit: int
    shuffle: bool
    shuffle_block_size: int
    datasets: list[str]
    buckets: list[BucketPlan] = field(default_factory=list)
    problems: list[str] = field(default_factory=list)

    @property
    def epoch_size(self) -> int:
        return sum(b.choose for b in self.buckets)

    @property
    def active(self) -> list[BucketPlan]:
        return [b for b in self.buckets if not b.excluded and b.choose > 0]

    @property
    def batches_per_rank(self) -> int:
        """Device batches each rank gets per epoch (equal on every rank by construction)."""
        return self.epoch_size // self.global_batch_size

    def check(self) -> Plan:
        """Raise :class:`PlanError` listing every fatal problem, or return self."""
        if self.problems:
            raise PlanError("bucket plan refused:\n  - " + "\n  - ".join(self.problems))
        return self

    def report(self) -> str:
        """A table for humans: one row per bucket, then totals."""
        head = (
            f"batching={self.batching_method} world={self.world_size} nodes={self.num_nodes} "
            f"device_batch={self.device_batch_size} global_batch={self.global_batch_size} "
            f"workers={self.num_workers} canonical_nodes={self.num_canonical_nodes} "
            f"replication={self.replication} unit={self.unit}"
        )
        rows = [
            head,
            f"{'dataset':<12} {'bucket':<12} {'samples':>9} {'skipped':>8} {'kept':>9} "
            f"{'target':>9} {'epoch':>9} {'batches':>8} {'dropped':>8}",
        ]
        for b in self.buckets:
            note = "  (excluded: below one unit)" if b.excluded else ""
            rows.append(
                f"{self.datasets[b.dataset][:12]:<12} {b.bucket:<12} {b.samples:>9} {b.skipped:>8} "
                f"{b.kept:>9} {b.target:>9} {b.choose:>9} {b.batches:>8} {b.dropped:>8}{note}"
            )
        total_target = sum(b.target for b in self.buckets)
        rows.append(
            f"epoch: {self.epoch_size} samples, {self.batches_per_rank} batches per rank, "
            f"{total_target - self.epoch_size} of {total_target} targeted samples dropped at bucket tails"
        )
        rows += [f"PROBLEM: {p}" for p in self.problems]
        return "\n".join(rows)


def _targets(datasets: Sequence[DatasetCount], epoch_size: int | None) -> list[float]:
    has_p = [d.proportion is not None for d in datasets]
    for d in datasets:
        if sum(x is not None for x in (d.proportion, d.repeat, d.choose)) > 1:
            raise PlanError(f"dataset {d.name!r}: give at most one of proportion, repeat, choose")
        for k in ("proportion", "repeat", "choose"):
            v = getattr(d, k)
            if v is not None and v < 0:
                raise PlanError(f"dataset {d.name!r}: {k} must be non-negative, got {v}")
    if any(has_p) and not all(has_p):
        raise PlanError(
            "relative (proportion) and absolute (repeat/choose/none) weights cannot be mixed: "
            "give every dataset a proportion, or none of them"
        )
    kept = [d.kept for d in datasets]
    if all(has_p):
        total_p = sum(d.proportion for d in datasets)  # type: ignore[misc]
        if total_p <= 0:
            raise PlanError("the proportions sum to zero")
        epoch = epoch_size or sum(kept)
        return [epoch * d.proportion / total_p for d in datasets]  # type: ignore[operator]
    unweighted = all(d.repeat is None and d.choose is None for d in datasets)
    if epoch_size:
        if not unweighted:
            raise PlanError("epoch_size only works with proportions (or with no weights at all)")
        return [epoch_size * k / max(1, sum(kept)) for k in kept]
    out = []
    for d, k in zip(datasets, kept, strict=True):
        out.append(
            k * d.repeat
            if d.repeat is not None
            else float(d.choose)
            if d.choose is not None
            else float(k)
        )
    return out


def plan_buckets(
    datasets: Sequence[DatasetCount],
    *,
    device_batch_size: int,
    world_size: int = 1,
    num_nodes: int = 1,
    num_workers: int = 1,
    num_canonical_nodes: int | None = None,
    replication: int | None = None,
    batching_method: str = "per_stream",
    epoch_size: int | None = None,
    shuffle: bool = True,
    shuffle_block_size: int | None = None,
    small_buckets: str = "error",
) -> Plan:
    """Plan one epoch. Does not raise for bucket-level problems; call :meth:`Plan.check`.

    ``world_size`` counts ranks, ``num_nodes`` physical nodes, ``num_workers`` the
    DataLoader workers per rank (0 counts as 1). ``num_canonical_nodes`` defaults
    to ``num_nodes`` as in streaming; fix it explicitly to resume on other node counts.
    """
    if batching_method not in BATCHING_METHODS:
        raise PlanError(
            f"batching_method={batching_method!r} does not keep one shape per batch; "
            f"use one of {BATCHING_METHODS}"
        )
    if small_buckets not in ("error", "drop"):
        raise PlanError(f"small_buckets must be 'error' or 'drop', got {small_buckets!r}")
    if device_batch_size < 1 or world_size < 1 or num_nodes < 1:
        raise PlanError("device_batch_size, world_size and num_nodes must be positive")
    if world_size % num_nodes:
        raise PlanError(f"world_size={world_size} is not a multiple of num_nodes={num_nodes}")
    rep = replication or 1
    if world_size % rep:
        raise PlanError(f"world_size={world_size} is not divisible by replication={rep}")
    workers = max(1, num_workers)
    ncn = num_canonical_nodes or num_nodes
    ranks_per_node = world_size // num_nodes
    # Replication groups consecutive ranks; streaming partitions over the reduced world.
    par_ranks = world_size // rep
    # (streaming's World.replicate: keep ranks per node when possible, else one node).
    par_nodes = par_ranks // ranks_per_node if par_ranks % ranks_per_node == 0 else 1
    par_rpn = par_ranks // par_nodes
    gbs = device_batch_size * par_ranks
    problems: list[str] = []
    if batching_method == "per_stream":
        if max(ncn, par_nodes) % min(ncn, par_nodes):
            problems.append(
                f"num_canonical_nodes={ncn} and {par_nodes} physical nodes: one must divide the "
                "other. Pick num_canonical_nodes as a multiple of every node count you will run on."
            )
        unit = math.lcm(ncn, gbs * workers)
    else:
        if ncn % par_nodes:
            problems.append(
                f"device_per_stream needs num_canonical_nodes ({ncn}) divisible by the number of "
                f"physical nodes ({par_nodes})"
            )
        unit = math.lcm(ncn * par_rpn * workers, gbs)
    targets = _targets(datasets, epoch_size)
    buckets: list[BucketPlan] = []
    for di, (d, tgt) in enumerate(zip(datasets, targets, strict=True)):
        if d.kept <= 0:
            problems.append(f"dataset {d.name!r} has no samples left after skip lists in this tier")
            continue
        for b in d.buckets:
            t = int(tgt * b.kept / d.kept)
            choose = (t // unit) * unit if b.kept > 0 else 0
            bp = BucketPlan(di, b.bucket, b.samples, b.skipped, b.kept, t, choose, 0)
            if choose == 0 and t > 0:
                if small_buckets == "drop":
                    bp.excluded = True
                else:
                    problems.append(
                        f"{d.name}:{b.bucket} has {b.kept} samples after skips ({t} this epoch), "
                        f"fewer than one unit of {unit} (global batch {gbs} x {workers} workers, "
                        f"canonical nodes {ncn}); streaming would crash or pad it. Lower the batch "
                        "size, workers or num_canonical_nodes, raise this dataset's weight, or "
                        "pass small_buckets='drop' to leave such buckets out."
                    )
            per = gbs if batching_method == "per_stream" else device_batch_size
            bp.batches = choose // per
            buckets.append(bp)
    plan = Plan(
        world_size=world_size,
        num_nodes=num_nodes,
        device_batch_size=device_batch_size,
        num_workers=workers,
        num_canonical_nodes=ncn,
        replication=rep,
        batching_method=batching_method,
        global_batch_size=gbs,
        unit=unit,
        shuffle=shuffle,
        shuffle_block_size=shuffle_block_size or max(4_000_000 // ncn, DEFAULT_SHUFFLE_BLOCK),
        datasets=[d.name for d in datasets],
        buckets=buckets,
        problems=problems,
    )
    if not plan.active and not problems:
        problems.append("no bucket has a full unit of samples: nothing to train on")
    if shuffle:
        total = plan.epoch_size
        for b in plan.active:
            if int(plan.shuffle_block_size * b.choose / total) < 1:
                need = math.ceil(total / b.choose)
                problems.append(
                    f"{plan.datasets[b.dataset]}:{b.bucket} is {b.choose} of {total} samples; its "
                    f"share of shuffle_block_size={plan.shuffle_block_size} rounds to 0 and "
                    f"streaming would fail. Pass shuffle_block_size>={need}."
                )
    return plan


# --- CLI -------------------------------------------------------------------------------------


def count_export(
    root: str, tiers: Sequence[int], skip_lists: Sequence[str] | None = None
) -> list[BucketCount]:
    """Per-bucket samples and skipped samples of one export tree (reads indexes and sidecars)."""
    from prx_data.skips import sidecar as skiplist

    out = []
    for bucket in layout.list_buckets(root, tiers):
        shards = layout.read_index(root, bucket)
        skips = {} if skip_lists == [] else skiplist.load_skips(root, bucket, shards, skip_lists)
        out.append(
            BucketCount(bucket, sum(s.samples for s in shards), sum(len(v) for v in skips.values()))
        )
    return out
