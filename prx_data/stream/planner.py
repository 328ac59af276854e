"""Preflight for bucketed streaming: the mix per dataset, and samples and batches per bucket.

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
``tests/test_streaming_compat.py`` checks against streaming's own
``get_partitions`` that a multiple of the unit partitions with no padding.

Units are allocated per *dataset* first, so a dataset's share is right to
within one unit however its samples spread over buckets; each dataset's
units are then shared over its buckets by largest remainder. A bucket too
small for a unit is left out with a warning (or refused with
``small_buckets="error"``); docs/STREAMING.md says why.
"""

from __future__ import annotations

import dataclasses
import heapq
import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from prx_data.core.buckets import DEFAULT_SPEC, BucketSpec
from prx_data.core.errors import PrxDataError
from prx_data.core.flags import flag
from prx_data.export import layout

__all__ = [
    "DatasetCount",
    "Plan",
    "PlanError",
    "PlanSpec",
    "count_export",
    "plan_buckets",
]

BATCHING_METHODS = ("per_stream", "device_per_stream")
#: What a plan does with a bucket too small for one unit (see :class:`PlanSpec`).
SMALL_BUCKETS = ("error", "drop", "fill")
#: streaming's default: max(4_000_000 // num_canonical_nodes, 1 << 18).
DEFAULT_SHUFFLE_BLOCK = 1 << 18
#: A dataset whose realised share is further than this from the requested one is warned about.
MIX_TOLERANCE = 0.01


class PlanError(PrxDataError, ValueError):
    """A configuration that streaming would crash on or silently mishandle."""


@dataclass(frozen=True)
class PlanSpec:
    """The settings that decide a bucketed epoch, spelt once.

    ``DataConfig.plan_spec`` (train YAML), ``BucketedDataset`` (its keyword
    arguments build one), :func:`plan_buckets` and ``python -m prx_data.planner``
    all read these, so a preview and a run cannot disagree on a setting. The
    world (ranks, nodes) is not in it: it is the run's, not the plan's.
    """

    #: Run resolution tier; with ``include_higher_tiers`` higher tiers are downsized to it.
    tier: int = flag(
        512,
        "--tier",
        type=int,
        help="training resolution tier, e.g. 512 (also the tier of a tree with one folder per "
        "aspect ratio that was not adopted)",
    )
    device_batch_size: int = flag(1, "--batch-size", type=int, help="device (per-rank) batch size")
    include_higher_tiers: bool = flag(
        False, "--include-higher-tiers", help="also stream higher tiers"
    )
    batching_method: str = flag(
        "per_stream", "--batching", choices=BATCHING_METHODS, help="batching method"
    )
    #: DataLoader workers per rank (0 counts as 1); the epoch is sized for them.
    num_workers: int = flag(1, "--workers", type=int, help="DataLoader workers per rank")
    #: None: the number of physical nodes (streaming's default).
    num_canonical_nodes: int | None = flag(
        None, "--canonical-nodes", type=int, help="num_canonical_nodes (default: nodes)"
    )
    replication: int | None = flag(None, "--replication", type=int, help="ranks per replica group")
    epoch_size: int | None = flag(
        None, "--epoch-size", type=int, help="samples per epoch (with proportions)"
    )
    shuffle: bool = True
    shuffle_seed: int = 9176
    #: None: streaming's default for the canonical node count.
    shuffle_block_size: int | None = None
    #: Buckets too small for one planning unit: "error", "drop" (with a warning), or
    #: "fill": as "drop", but when that leaves nothing to stream, every bucket with samples
    #: gets one whole unit and its samples repeat (the eval stream of a small hold-out).
    small_buckets: str = flag(
        "error",
        "--small-buckets",
        choices=SMALL_BUCKETS,
        help="buckets too small for a unit: fail (default), leave out with a warning (drop), "
        "or as drop but one unit each when that leaves nothing (fill)",
    )
    bucket_spec: BucketSpec = DEFAULT_SPEC

    def tiers(self) -> list[int]:
        """The tiers streamed: the run tier, and higher ones when asked (unknown tier: error)."""
        try:
            self.bucket_spec.shapes(self.tier)
        except ValueError as e:
            raise PlanError(str(e)) from None
        return [
            t
            for t in self.bucket_spec.tiers
            if t == self.tier or (self.include_higher_tiers and t > self.tier)
        ]

    def replace(self, **changes: Any) -> PlanSpec:
        return dataclasses.replace(self, **changes)


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
    #: This bucket's fair share of its dataset's target (kept-weighted), before rounding.
    target: int
    #: Samples it gets this epoch (a multiple of the unit; what streaming is told to ``choose``).
    choose: int
    #: Global batches (per_stream) or device batches (device_per_stream) per epoch.
    batches: int
    #: Left out of this epoch: below half a unit of its share (see docs/STREAMING.md).
    excluded: bool = False

    @property
    def planned(self) -> int:
        return self.choose

    @property
    def dropped(self) -> int:
        """Kept samples this epoch does not reach (a different subset each epoch)."""
        return max(0, self.kept - self.choose)

    @property
    def repeated(self) -> int:
        """Samples drawn a second time or more (the bucket is up-sampled past its kept count)."""
        return max(0, self.choose - self.kept)


@dataclass
class DatasetPlan:
    name: str
    kept: int
    #: Requested share of the epoch (from proportion / repeat / choose / natural size).
    requested: float
    #: Samples the weights ask for, before rounding to units.
    target: float
    planned: int = 0

    def realised(self, epoch_size: int) -> float:
        return self.planned / epoch_size if epoch_size else 0.0


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
    mix: list[DatasetPlan] = field(default_factory=list)
    #: Non-fatal findings (left-out buckets, a mix off by more than a point); also logged.
    warnings: list[str] = field(default_factory=list)
    #: The settings this plan was made from (the fields above are their resolved values).
    spec: PlanSpec | None = None

    @property
    def epoch_size(self) -> int:
        return sum(b.choose for b in self.buckets)

    def decisions(self) -> dict[tuple[int, str], BucketPlan]:
        """Each bucket's decision by (dataset index, bucket name): what a loader looks up."""
        out = {(b.dataset, b.bucket): b for b in self.buckets}
        if len(out) != len(self.buckets):
            raise PlanError("the plan names a bucket of one dataset twice")
        return out

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

    def to_dict(self) -> dict[str, Any]:
        """The whole plan as plain JSON types (``python -m prx_data.planner --json``)."""
        epoch = self.epoch_size
        return {
            "epoch_size": epoch,
            "unit": self.unit,
            "global_batch_size": self.global_batch_size,
            "batches_per_rank": self.batches_per_rank,
            "settings": {
                "batching_method": self.batching_method,
                "world_size": self.world_size,
                "num_nodes": self.num_nodes,
                "device_batch_size": self.device_batch_size,
                "num_workers": self.num_workers,
                "num_canonical_nodes": self.num_canonical_nodes,
                "replication": self.replication,
                "shuffle": self.shuffle,
                "shuffle_block_size": self.shuffle_block_size,
            },
            "datasets": [
                {
                    "name": d.name,
                    "requested": round(d.requested, 6),
                    "realised": round(d.realised(epoch), 6),
                    "samples": d.planned,
                    "kept": d.kept,
                    "buckets": [
                        {
                            "bucket": b.bucket,
                            "samples": b.samples,
                            "skipped": b.skipped,
                            "kept": b.kept,
                            "target": b.target,
                            "planned": b.choose,
                            "dropped": b.dropped,
                            "repeated": b.repeated,
                            "excluded": b.excluded,
                        }
                        for b in self.buckets
                        if b.dataset == i
                    ],
                }
                for i, d in enumerate(self.mix)
            ],
            "warnings": list(self.warnings),
            "problems": list(self.problems),
        }

    def mix_report(self) -> str:
        """Requested vs realised share per dataset, one line each."""
        epoch = self.epoch_size
        w = max([len("dataset"), *(len(d.name) for d in self.mix)])
        rows = [f"{'dataset':<{w}} {'requested':>9} {'realised':>9} {'samples':>9}"]
        for d in self.mix:
            rows.append(
                f"{d.name:<{w}} {d.requested:>9.4f} {d.realised(epoch):>9.4f} {d.planned:>9}"
            )
        return "\n".join(rows)

    def summary(self) -> str:
        """The epoch in one line: samples, batches per rank, what is not reached or repeated."""
        kept = sum(b.kept for b in self.buckets)
        return (
            f"epoch: {self.epoch_size} samples, {self.batches_per_rank} batches per rank; "
            f"{sum(b.dropped for b in self.buckets)} of {kept} kept samples not reached this "
            f"epoch, {sum(b.repeated for b in self.buckets)} drawn again"
        )

    def report(self, warnings: bool = True) -> str:
        """A table for humans: one row per bucket, the mix per dataset, then totals.

        ``warnings=False`` leaves out the warnings (logged on their own, once each).
        """
        head = (
            f"batching={self.batching_method} world={self.world_size} nodes={self.num_nodes} "
            f"device_batch={self.device_batch_size} global_batch={self.global_batch_size} "
            f"workers={self.num_workers} canonical_nodes={self.num_canonical_nodes} "
            f"replication={self.replication} unit={self.unit}"
        )
        w = max([len("dataset"), *(len(n) for n in self.datasets)])
        rows = [
            head,
            f"{'dataset':<{w}} {'bucket':<12} {'samples':>9} {'skipped':>8} {'kept':>9} "
            f"{'target':>9} {'epoch':>9} {'batches':>8} {'dropped':>8}",
        ]
        for b in self.buckets:
            note = "  (left out: too small for a unit)" if b.excluded else ""
            if b.repeated:
                note = f"  (up-sampled: {b.repeated} repeats)"
            rows.append(
                f"{self.datasets[b.dataset]:<{w}} {b.bucket:<12} {b.samples:>9} "
                f"{b.skipped:>8} {b.kept:>9} {b.target:>9} {b.choose:>9} {b.batches:>8} "
                f"{b.dropped:>8}{note}"
            )
        rows.append(self.mix_report())
        rows.append(self.summary())
        if warnings:
            rows += [f"WARNING: {w}" for w in self.warnings]
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


def largest_remainder(total: int, quotas: Sequence[float]) -> list[int]:
    """Whole numbers summing to ``total``, each the floor or ceiling of its quota (Hamilton)."""
    floors = [math.floor(q) for q in quotas]
    left = total - sum(floors)
    order = sorted(range(len(quotas)), key=lambda i: (floors[i] - quotas[i], i))
    for i in order[: max(0, left)]:
        floors[i] += 1
    return floors


def split_units(
    units: int, kept: Sequence[int], unit: int, *, upsample: bool
) -> tuple[list[int], list[bool]]:
    """Share a dataset's ``units`` over its buckets by kept count; returns (units, left out).

    Largest remainder, so the dataset's total is kept whole. When the dataset
    is not up-sampled, a bucket first gets no more whole units than it holds
    (no sample twice in an epoch) and the rest goes where there is room. A bucket
    whose share is below half a unit is left out rather than repeated more
    than 2x; its units go to the dataset's other buckets.
    """
    total = sum(kept)
    quota = [units * k / total if total else 0.0 for k in kept]
    small = [0 < q < 0.5 for q in quota]
    cap = [k // unit if not upsample else units for k in kept]
    alloc = [min(math.floor(q), c) for q, c in zip(quota, cap, strict=True)]
    left = units - sum(alloc)
    # Phases: within capacity, then past it (repeats) for buckets of at least half a unit,
    # then any bucket with samples, so the dataset's share is honoured whenever it can be.
    phases = (
        lambda i: alloc[i] < cap[i] and not small[i],
        lambda i: kept[i] > 0 and not small[i],
        lambda i: kept[i] > 0,
    )
    for ok in phases:
        if left <= 0:
            break
        heap = [(alloc[i] - quota[i], i) for i in range(len(kept)) if ok(i)]
        heapq.heapify(heap)
        while left > 0 and heap:
            _, i = heapq.heappop(heap)
            alloc[i] += 1
            left -= 1
            if ok(i):
                heapq.heappush(heap, (alloc[i] - quota[i], i))
    excluded = [k > 0 and a == 0 for k, a in zip(kept, alloc, strict=True)]
    return alloc, excluded


def plan_buckets(
    datasets: Sequence[DatasetCount],
    spec: PlanSpec | None = None,
    *,
    world_size: int = 1,
    num_nodes: int = 1,
    **settings: Any,
) -> Plan:
    """Plan one epoch. Does not raise for bucket-level problems; call :meth:`Plan.check`.

    ``spec`` holds the settings; keyword ``settings`` (the :class:`PlanSpec`
    field names: ``device_batch_size``, ``num_workers``, ...) build one or
    override its fields. ``world_size`` counts ranks, ``num_nodes`` physical
    nodes; ``num_workers`` is the DataLoader workers per rank (0 counts as 1).
    ``num_canonical_nodes`` defaults to ``num_nodes`` as in streaming; fix it
    explicitly to resume on other node counts.

    Allocation is per dataset first (whole units, largest remainder over the
    datasets when weights are proportions), then per bucket inside each dataset
    (:func:`split_units`), so rounding never moves a dataset's share by more
    than one unit. ``small_buckets="error"`` refuses a plan that leaves a bucket
    out; ``"drop"`` leaves it out with a warning.
    """
    if spec is None:
        if "device_batch_size" not in settings:
            raise TypeError("plan_buckets needs spec=PlanSpec(...) or device_batch_size=")
        spec = PlanSpec(**settings)
    elif settings:
        spec = spec.replace(**settings)
    device_batch_size = spec.device_batch_size
    num_workers = spec.num_workers
    num_canonical_nodes = spec.num_canonical_nodes
    replication = spec.replication
    batching_method = spec.batching_method
    epoch_size = spec.epoch_size
    shuffle = spec.shuffle
    shuffle_block_size = spec.shuffle_block_size
    small_buckets = spec.small_buckets
    if batching_method not in BATCHING_METHODS:
        raise PlanError(
            f"batching_method={batching_method!r} does not keep one shape per batch; "
            f"use one of {BATCHING_METHODS}"
        )
    if small_buckets not in SMALL_BUCKETS:
        raise PlanError(f"small_buckets must be one of {SMALL_BUCKETS}, got {small_buckets!r}")
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
    warnings: list[str] = []
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
    unweighted = all(
        d.proportion is None and d.repeat is None and d.choose is None for d in datasets
    )
    # 1) Whole units per dataset.
    if unweighted and not epoch_size:
        # Each dataset once: no sample twice, so whole units within each bucket.
        units = [sum(b.kept // unit for b in d.buckets) for d in datasets]
    elif all(d.proportion is not None for d in datasets) or epoch_size:
        total = sum(targets)
        units = largest_remainder(round(total / unit), [t / unit for t in targets])
    else:
        units = [round(t / unit) for t in targets]
    total_target = sum(targets) or 1.0
    mix = [
        DatasetPlan(d.name, d.kept, t / total_target, t)
        for d, t in zip(datasets, targets, strict=True)
    ]
    # 2) Inside each dataset, units over buckets.
    buckets: list[BucketPlan] = []
    per = gbs if batching_method == "per_stream" else device_batch_size
    for di, (d, tgt, n) in enumerate(zip(datasets, targets, units, strict=True)):
        kept = [max(0, b.kept) for b in d.buckets]
        d_kept = sum(kept)
        if d_kept <= 0:
            problems.append(f"dataset {d.name!r} has no samples left after skip lists in this tier")
        if unweighted and not epoch_size:
            alloc = [k // unit for k in kept]
            excluded = [k > 0 and a == 0 for k, a in zip(kept, alloc, strict=True)]
        else:
            alloc, excluded = split_units(n, kept, unit, upsample=n * unit > d_kept)
        for b, a, ex in zip(d.buckets, alloc, excluded, strict=True):
            t = round(tgt * b.kept / d_kept) if d_kept > 0 else 0
            buckets.append(
                BucketPlan(
                    di, b.bucket, b.samples, b.skipped, b.kept, t, a * unit, a * unit // per, ex
                )
            )
        mix[di].planned = sum(alloc) * unit
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
        mix=mix,
        warnings=warnings,
        spec=spec,
    )
    _explain(plan, small_buckets)
    if small_buckets == "fill" and not plan.active and not problems:
        _fill(plan, per)
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


def _fill(plan: Plan, per: int) -> None:
    """One whole unit for every bucket with samples (repeating them): nothing else would stream.

    Each rank then gets whole batches of one shape. The samples that repeat
    count twice in a mean over the epoch; the warning says how many.
    """
    for b in plan.buckets:
        if b.kept > 0:
            b.choose = math.ceil(b.kept / plan.unit) * plan.unit
            b.batches = b.choose // per
            b.excluded = False
    for i, d in enumerate(plan.mix):
        d.planned = sum(b.choose for b in plan.buckets if b.dataset == i)
    repeats = sum(b.repeated for b in plan.buckets)
    plan.warnings[:] = [
        f"no bucket holds a whole unit of {plan.unit} samples (global batch "
        f"{plan.global_batch_size} x {plan.num_workers} workers); each bucket is filled to whole "
        f"units, {repeats} of {plan.epoch_size} samples drawn twice or more"
    ]


def _explain(plan: Plan, small_buckets: str) -> None:
    """Warnings (or, with ``small_buckets="error"``, problems) for left-out buckets and mix drift."""
    epoch = plan.epoch_size
    shares = ", ".join(f"{d.name} {d.realised(epoch):.4f}" for d in plan.mix)
    empty = {i for i, d in enumerate(plan.mix) if d.planned == 0 and d.kept > 0}
    for i in sorted(empty):
        d = plan.mix[i]
        msg = (
            f"dataset {d.name!r}: its weight asks for {d.target:.0f} samples this epoch, less "
            f"than half a unit of {plan.unit}, so all {d.kept} of its samples are left out. "
            f"Realised shares: {shares}"
        )
        (plan.problems if small_buckets == "error" else plan.warnings).append(msg)
    for b in plan.buckets:
        if not b.excluded or b.dataset in empty:
            continue
        name = f"{plan.datasets[b.dataset]}:{b.bucket}"
        if small_buckets == "error":
            plan.problems.append(
                f"{name} has {b.kept} samples after skips ({b.target} this epoch by weight), too "
                f"few for one unit of {plan.unit} (global batch {plan.global_batch_size} x "
                f"{plan.num_workers} workers, canonical nodes {plan.num_canonical_nodes}); "
                "streaming would crash or pad it. Lower the batch size, workers or "
                "num_canonical_nodes, raise this dataset's weight, or pass "
                "small_buckets='drop' to leave such buckets out."
            )
        else:
            plan.warnings.append(
                f"{name}: {b.kept} samples left out of the epoch (too few for a unit of "
                f"{plan.unit}); its dataset's share moves to its other buckets. "
                f"Realised shares: {shares}"
            )
    for d in plan.mix:
        if abs(d.realised(epoch) - d.requested) > MIX_TOLERANCE:
            plan.warnings.append(
                f"{d.name}: realised share {d.realised(epoch):.4f} differs from the requested "
                f"{d.requested:.4f} by more than {MIX_TOLERANCE:.0%} (unit {plan.unit}, "
                f"{d.kept} kept samples)"
            )


# --- CLI -------------------------------------------------------------------------------------


def count_export(
    root: str, tiers: Sequence[int], skip_lists: Sequence[str] | None = None
) -> list[BucketCount]:
    """Per-bucket samples and skipped samples of one export tree (reads indexes and sidecars)."""
    from prx_data.skips import sidecar as skiplist

    root = layout.tree(root)
    out = []
    for bucket in layout.list_buckets(root, tiers):
        shards = layout.read_index(root, bucket)
        skips = {} if skip_lists == [] else skiplist.load_skips(root, bucket, shards, skip_lists)
        out.append(
            BucketCount(bucket, sum(s.samples for s in shards), sum(len(v) for v in skips.values()))
        )
    return out
