"""Resume safety: the fingerprint of an epoch's sample space, and checks that ranks agree.

A checkpoint carries the fingerprint of the sample space it was written in; a
resume compares it with its own (:func:`describe_changes`), and at start-up
every rank compares its fingerprint with the others' (:func:`check_ranks_agree`).
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from prx_data.core.buckets import BucketSpec
from prx_data.stream import planner

if TYPE_CHECKING:
    from prx_data.stream.dataset import BucketSource, DatasetSpec


#: What ``BucketedDataset.load_state_dict`` may do when the sample space changed since the
#: checkpoint: refuse (default), or start the checkpoint's epoch over with the current lists.
ON_CHANGE = ("error", "restart_epoch")
FINGERPRINT_KEY = "prx_fingerprint"


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
            h = hashlib.sha1()
            n = 0
            for b in src:
                if name in b.lists:
                    n += b.lists[name][0]
                    h.update(f"{b.bucket}:{b.lists[name][1]};".encode())
            per_list[name] = {"samples": n, "digest": h.hexdigest()[:16]}
        datasets.append(
            {
                "root": spec.root,
                "proportion": spec.proportion,
                "repeat": spec.repeat,
                "choose": spec.choose,
                "samples": sum(b.samples for b in src),
                "skip_lists": per_list,
            }
        )
    buckets = json.dumps([[b.dataset, b.bucket, b.choose] for b in plan.buckets])
    return {
        "version": 1,
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
        "plan": hashlib.sha1(buckets.encode()).hexdigest()[:16],
    }


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
