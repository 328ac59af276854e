"""Resume safety, in one place: the fingerprint of an epoch's sample space and its checks.

A checkpoint carries the fingerprint of the sample space it was written in
(datasets, weights, skip lists, the hold-out, the plan); a resume compares it
with its own (:func:`resume_state`), at start-up every rank compares its
fingerprint with the others' (:func:`check_ranks_agree`), the loader checks
the worker count the epoch was sized for (:func:`check_workers`), and the
trainer's checkpoint records the batch layout (:func:`check_layout`, for
datasets built by a ``data.factory`` too).
"""

from __future__ import annotations

import hashlib
import json
import logging
from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from prx_data.core.buckets import BucketSpec
from prx_data.core.errors import UsageError
from prx_data.stream import planner

if TYPE_CHECKING:
    from prx_data.stream.spec import BucketSource, DatasetSpec


#: What ``BucketedDataset.load_state_dict`` may do when the sample space changed since the
#: checkpoint: refuse (default), start the checkpoint's epoch over with the current lists, or
#: continue it leaving out what lists added or grown since remove, with new proportions
#: applied to its rest (:mod:`.midepoch`).
ON_CHANGE = ("error", "restart_epoch", "continue")
FINGERPRINT_KEY = "prx_fingerprint"
FINGERPRINT_VERSION = 2


class ResumeMismatch(planner.PlanError):
    """The checkpoint's sample space differs from this dataset's: continuing would be wrong."""


def fingerprint(
    specs: Sequence[DatasetSpec],
    sources: Sequence[Sequence[BucketSource]],
    plan: planner.Plan,
    *,
    tier: int,
    include_higher_tiers: bool,
    bucket_spec: BucketSpec,
) -> dict[str, Any]:
    """What defines the epoch's sample space, as plain JSON types (no world size in it).

    Datasets and weights, the skip lists in force with their size and a digest
    of their content, the epoch size, tier and bucket spec, the data-parallel
    global batch, replication and planning unit, and a digest of the
    per-bucket plan. Two runs with equal fingerprints see the same epoch, on
    any world size.
    """
    datasets = []
    for spec, src in zip(specs, sources, strict=True):
        per_list: dict[str, dict[str, Any]] = {}
        for name in sorted({n for b in src for n in b.lists}):
            n, digest = per_bucket_digest((b.bucket, b.lists[name]) for b in src if name in b.lists)
            per_list[name] = {"samples": n, "digest": digest}
        datasets.append(
            {
                "root": spec.root,
                "proportion": spec.proportion,
                "repeat": spec.repeat,
                "choose": spec.choose,
                "samples": sum(b.samples for b in src),
                "skip_lists": per_list,
                "holdout": _holdout_entry(spec, src),
                "shards": _shards_entry(src),
            }
        )
    return {
        # 2: skip lists and the hold-out keyed by shard content, and the shards' digest.
        "version": FINGERPRINT_VERSION,
        "tier": tier,
        "include_higher_tiers": include_higher_tiers,
        "bucket_spec": hashlib.sha1(repr(bucket_spec).encode()).hexdigest()[:16],
        "batching_method": plan.batching_method,
        # Fixed across elastic resumes (streaming's rule); a change reorders the epoch.
        "global_batch_size": plan.global_batch_size,
        "replication": plan.replication,
        "unit": plan.unit,
        "epoch_size": plan.epoch_size,
        "datasets": datasets,
        "plan": plan_digest(plan),
    }


def plan_digest(plan: planner.Plan) -> str:
    """Digest of the per-bucket plan (each bucket's dataset, name and epoch count)."""
    buckets = json.dumps([[b.dataset, b.bucket, b.choose] for b in plan.buckets])
    return hashlib.sha1(buckets.encode()).hexdigest()[:16]


def _holdout_entry(spec: DatasetSpec, src: Sequence[BucketSource]) -> dict[str, Any] | None:
    """The hold-out in force: its slice, side, size and a digest of the held-out set."""
    hold = spec.holdout
    if hold is None:
        return None
    n, digest = per_bucket_digest((b.bucket, b.held) for b in src if b.held is not None)
    return {
        "fraction": hold.fraction,
        "salt": hold.salt,
        "keep": hold.keep,
        "held_out": n,
        "digest": digest,
    }


def _shards_entry(src: Sequence[BucketSource]) -> str:
    """Digest of the dataset's shards by content, in bucket then index order (not their names)."""
    from prx_data.stream.spec import shards_digest

    text = ";".join(f"{b.bucket}:{shards_digest(b.shards)}" for b in src)
    return hashlib.sha1(text.encode()).hexdigest()[:16]


def _without_digests(fp: dict[str, Any]) -> dict[str, Any]:
    """A fingerprint with the per-list and hold-out digests left out: how a checkpoint of
    version 1 (digests keyed by folder names) is compared, by the counts alone."""
    out = json.loads(json.dumps(fp))
    for d in out.get("datasets", []):
        for entry in (d.get("skip_lists") or {}).values():
            entry.pop("digest", None)
        if isinstance(d.get("holdout"), dict):
            d["holdout"].pop("digest", None)
    return out


def per_bucket_digest(entries: Iterable[tuple[str, tuple[int, str]]]) -> tuple[int, str]:
    """(samples, digest) of one dataset from each bucket's ``shard_digest``, in bucket order."""
    h = hashlib.sha1()
    n = 0
    for bucket, (count, digest) in entries:
        n += count
        h.update(f"{bucket}:{digest};".encode())
    return n, h.hexdigest()[:16]


#: How :func:`describe_changes` words a list in force on one side only: since a checkpoint.
SINCE_CHECKPOINT = (
    "{root}: skip list {name!r} added since the checkpoint ({n} samples in this tier)",
    "{root}: skip list {name!r} no longer applied ({n} samples would come back)",
)


def describe_changes(
    old: dict[str, Any], new: dict[str, Any], wording: tuple[str, str] = SINCE_CHECKPOINT
) -> list[str]:
    """Human-readable differences between two fingerprints (empty when they match).

    ``wording``: format strings (``root``, ``name``, ``n``) for a skip list
    in force only in ``new``, then only in ``old``.
    """
    out: list[str] = []
    if int(old.get("version", 1)) < 2 or int(new.get("version", 1)) < 2:
        old, new = _without_digests(old), _without_digests(new)
    keys = ("tier", "include_higher_tiers", "bucket_spec", "batching_method")
    for key in (*keys, "global_batch_size", "replication", "unit"):
        if old.get(key) != new.get(key):
            out.append(f"{key}: {old.get(key)!r} -> {new.get(key)!r}")
    old_ds = {d["root"]: d for d in old.get("datasets", [])}
    new_ds = {d["root"]: d for d in new.get("datasets", [])}
    for root in old_ds.keys() - new_ds.keys():
        out.append(f"dataset {root} removed")
    for root in new_ds.keys() - old_ds.keys():
        out.append(f"dataset {root} added")
    for root in old_ds.keys() & new_ds.keys():
        a, b = old_ds[root], new_ds[root]
        for key in ("proportion", "repeat", "choose"):
            if a.get(key) != b.get(key):
                out.append(f"{root}: {key} {a.get(key)} -> {b.get(key)}")
        if a.get("samples") != b.get("samples"):
            out.append(f"{root}: {a.get('samples')} -> {b.get('samples')} samples in its shards")
        elif "shards" in a and "shards" in b and a["shards"] != b["shards"]:
            out.append(
                f"{root}: its shards changed since the checkpoint (their bytes or their order; "
                "the export was rewritten or made again from other data)"
            )
        # Checkpoints written before the hold-out joined the fingerprint have no entry.
        if "holdout" in a and a.get("holdout") != b.get("holdout"):
            out.append(f"{root}: {_describe_holdout(a.get('holdout'), b.get('holdout'))}")
        la, lb = a.get("skip_lists", {}), b.get("skip_lists", {})
        for name in sorted(lb.keys() - la.keys()):
            out.append(wording[0].format(root=root, name=name, n=lb[name]["samples"]))
        for name in sorted(la.keys() - lb.keys()):
            out.append(wording[1].format(root=root, name=name, n=la[name]["samples"]))
        for name in sorted(la.keys() & lb.keys()):
            if la[name] != lb[name]:
                out.append(
                    f"{root}: skip list {name!r} changed ({la[name]['samples']} -> "
                    f"{lb[name]['samples']} samples)"
                )
    order = [d["root"] for d in old.get("datasets", [])]
    if not out and order != [d["root"] for d in new.get("datasets", [])]:
        out.append("datasets reordered")
    if old.get("epoch_size") != new.get("epoch_size"):
        out.append(f"epoch size {old.get('epoch_size')} -> {new.get('epoch_size')}")
    if not out and old.get("plan") != new.get("plan"):
        out.append("the per-bucket plan differs")
    return out


def _describe_holdout(old: dict[str, Any] | None, new: dict[str, Any] | None) -> str:
    def one(h: dict[str, Any] | None) -> str:
        if h is None:
            return "none"
        return f"{h['fraction']!r}/{h['salt']} keep {h['keep']} ({h['held_out']} held out)"

    if old and new and one(old) == one(new):
        return f"hold-out {one(new)}: its held-out set changed (the export's ids changed)"
    return f"hold-out {one(old)} -> {one(new)}"


class RankMismatch(planner.PlanError):
    """Ranks planned different sample spaces (e.g. a skip list changed while the job started)."""


def check_ranks_agree(fp: dict[str, Any]) -> None:
    """Raise :class:`RankMismatch` on every rank unless all ranks computed the same fingerprint.

    Each rank (local roots) or node (remote roots) reads the skip lists on its
    own, so a list changed during start-up can split the job into different
    sample spaces: duplicates, misses, or a hang at the first collective. One
    all-gather of a 20-byte digest when they agree; on a mismatch every rank
    gathers every fingerprint and raises the same message. A no-op without an
    initialised process group. JSON over tensors, no pickle.
    """
    dist = torch.distributed
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return
    world = dist.get_world_size()
    device = torch.device("cpu")
    if dist.get_backend() == "nccl":
        device = torch.device("cuda", torch.cuda.current_device())

    def gather(t: torch.Tensor) -> list[torch.Tensor]:
        out = [torch.empty_like(t) for _ in range(world)]
        dist.all_gather(out, t)
        return [x.cpu() for x in out]

    def as_tensor(data: bytes, size: int) -> torch.Tensor:
        buf = np.zeros(size, np.uint8)
        buf[: len(data)] = np.frombuffer(data, np.uint8)
        return torch.from_numpy(buf).to(device)

    text = json.dumps(fp, sort_keys=True).encode()
    digests = gather(as_tensor(hashlib.sha1(text).digest(), 20))
    if all(torch.equal(d, digests[0]) for d in digests):
        return
    sizes = [int(n) for n in gather(torch.tensor([len(text)], dtype=torch.int64, device=device))]
    texts = gather(as_tensor(text, max(sizes)))
    fps = [json.loads(t.numpy()[:n].tobytes()) for t, n in zip(texts, sizes, strict=True)]
    raise RankMismatch(describe_rank_mismatch(fps))


def describe_rank_mismatch(fps: Sequence[dict[str, Any]]) -> str:
    """One message naming, per group of ranks that differ from rank 0, what differs."""
    groups: dict[str, list[int]] = {}
    for rank, fp in enumerate(fps):
        if rank and fp != fps[0]:
            groups.setdefault(json.dumps(fp, sort_keys=True), []).append(rank)
    lines = []
    for ranks in groups.values():
        who = f"rank {ranks[0]}" if len(ranks) == 1 else f"ranks {', '.join(map(str, ranks))}"
        wording = (
            "{root}: skip list {name!r} applied on " + who + ", not on rank 0 ({n} samples)",
            "{root}: skip list {name!r} applied on rank 0, not on " + who + " ({n} samples)",
        )
        changes = describe_changes(fps[0], fps[ranks[0]], wording) or ["the plans differ"]
        lines += [f"{who} vs rank 0: {c}" for c in changes]
    return (
        f"the {len(fps)} ranks do not agree on the data, so they would not stream one epoch "
        "together:\n  - " + "\n  - ".join(lines) + "\nEach rank (or node, for remote roots) "
        "reads the export and its skip lists at start-up: change skip lists only while no job "
        "is starting, give every rank the same datasets and settings, then start again."
    )


def check_workers(plan: planner.Plan, running: int) -> None:
    """The DataLoader runs the worker count the epoch was sized for (else ranks would drift)."""
    if running != plan.num_workers:
        raise planner.PlanError(
            f"the epoch was planned for {plan.num_workers} DataLoader worker(s) but "
            f"{running} are running: pass num_workers={running} to BucketedDataset"
        )


def resume_state(
    obj: dict[str, Any],
    fp: dict[str, Any],
    plan: planner.Plan,
    on_change: str,
    log: logging.Logger,
) -> tuple[dict[str, Any], dict[str, Any] | None]:
    """The streaming state to resume from, and what a restarted epoch repeats (None: exact).

    Refuses a canonical node count that differs from the plan's. When the
    fingerprint differs (a skip list added, removed or changed, another
    hold-out, other weights, another tier or bucket spec, another epoch size),
    raises :class:`ResumeMismatch` naming every change, unless ``on_change`` is
    ``"restart_epoch"``: then the checkpoint's epoch starts over on the
    current sample space and the samples it had already trained repeat.
    """
    ncn = obj.get("num_canonical_nodes")
    if ncn is not None and ncn != plan.num_canonical_nodes:
        raise planner.PlanError(
            f"checkpoint was written with num_canonical_nodes={ncn} but this dataset was "
            f"planned with {plan.num_canonical_nodes}: pass num_canonical_nodes={ncn}"
        )
    obj = dict(obj)
    old = obj.pop(FINGERPRINT_KEY, None)
    done = int(obj.get("sample_in_epoch", 0))
    if old is None:
        log.warning(
            "the checkpoint's data state has no fingerprint (written before prx-data "
            "recorded one): cannot verify that skip lists and weights are unchanged"
        )
        return obj, None
    changes = describe_changes(old, fp)
    if not changes:
        return obj, None
    listed = "\n  - ".join(changes)
    if on_change == "error":
        raise ResumeMismatch(
            f"the data changed since the checkpoint (epoch {obj.get('epoch')}, "
            f"{done} samples into it):\n  - {listed}\n"
            "The epoch's sample order is fixed by its sample space, so continuing would "
            "repeat some samples and skip others, and could train on newly skipped ones. "
            "Choices (docs/STREAMING.md, 'Resuming after a change'):\n"
            "  - on_change='continue' (data.on_change): when only skip lists were added "
            "or grown, or proportions changed, finish the epoch in its order without the "
            "samples the lists remove, the new proportions applied to its rest;\n"
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
        plan.epoch_size,
        done,
    )
    obj["sample_in_epoch"] = 0
    return obj, {"changes": changes, "repeated_samples": done}


def check_layout(saved: dict[str, Any], expected: dict[str, Any], holdout: str) -> None:
    """A trainer checkpoint's batch layout and hold-out against this run's (``ResumeGuard``).

    Streaming resumes exactly (on any world size) only with the same global
    batch size and DataLoader worker count; the hold-out (``fraction/salt``,
    or ``"none"``) shapes the training sample space. A ``BucketedDataset``
    also checks all of these through its fingerprint; this covers any dataset.
    """
    got = saved.get("eval_holdout", "none")
    if got != holdout:
        raise UsageError(
            f"eval: the checkpoint's training stream held out {got!r} (fraction/salt) but "
            f"this run holds out {holdout!r}; the sample space would change and the "
            "resume would not be exact. Keep eval.source/holdout_fraction/holdout_salt"
        )
    for key, want in expected.items():
        value = saved.get(key)
        if value is not None and int(value) != want:
            raise UsageError(
                f"data.{key}: the checkpoint was written with {key}={value} but this run has "
                f"{want}; an exact resume needs the same value (the world size may change)"
            )
