"""Continue an interrupted epoch after skip lists grew or proportions changed:
``on_change="continue"``.

Streaming derives an epoch's whole order from per-shard sample counts, so an
epoch planned on one sample space has no "rest" on another. This module keeps
the epoch's order as it was planned on the checkpoint's space (the *base*
space) and leaves out what the lists now remove:

1. The base space is rebuilt from the lists and weights the checkpoint's
   fingerprint names (each list must still be in force with the same content
   digest; the hold-out must be the same), and its plan is made again and
   checked against the fingerprint's plan digest, so the order rebuilt is the
   order trained.
2. Streaming's own ``per_stream`` work generation runs on the base space; its
   global batches, in the order they are consumed, give each stream's base
   sequence (each batch's ids sorted: its order within the batch is the ranks'
   order, which depends on the world size). A base sample id is mapped to its
   shard and stored index, then to the current space's id, or to -1 when a
   list now skips it. Each stream's samples the epoch never planned (a bucket
   whose epoch takes fewer samples than it holds) are put in an order fixed by
   the seed, the epoch and the stream (:func:`unplanned`).
3. What was consumed is a prefix of each stream's base sequence and of its
   unplanned order, and the samples trained are counted per stream: three ints
   per stream (O(streams), nothing per sample).
4. Lists only: the rest of each stream, less the samples now skipped, is cut
   into full global batches in base order; each keeps the place in the epoch
   of the base batch its first sample came from. A stream's last partial batch
   is completed with its unplanned samples, so every remaining sample is
   trained once and batches stay full and of one shape. When the stream has
   too few of those (its epoch takes every sample it keeps), no batch of only
   its samples can hold that tail without training one of them twice: the
   tail is *carried* (not trained in this epoch; reported).
5. Proportions changed (every dataset weighted by a proportion): each
   dataset's share of the current plan's epoch counts what it already
   trained; it gets the rest of its share from its streams' rests, then from
   their unplanned samples, never a sample twice (:func:`_allocate`). Its
   batches are spread evenly over the rest of the epoch; a stream's rest
   beyond what it gets is not trained in this epoch. The report gives, per
   dataset, the share requested against the share realised over the epoch.
6. A checkpoint during the continued epoch records the base fingerprint, each
   stream's consumed prefixes and trained count, and the start the rest was
   cut from with the batches done (:meth:`Continued.state`): a resume onto the
   same space cuts the same rest and skips what was done (exact, on any world
   size an elastic resume allows); one onto a changed space cuts a new rest
   from where each stream stands.

The next epoch is planned on the current space as usual.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
import logging
import math
import types
from collections.abc import Sequence
from typing import Any

import numpy as np
from streaming import StreamingDataset

from prx_data.core.streaming_compat import World, generate_work
from prx_data.stream import planner
from prx_data.stream.holdout import merge_skips
from prx_data.stream.resume import ResumeMismatch, describe_changes, plan_digest
from prx_data.stream.sampling import vectorised_sampling
from prx_data.stream.spec import BucketSource, DatasetSpec

log = logging.getLogger(__name__)

#: The loader state's key for a continued epoch: base fingerprint, epoch and positions.
CONTINUE_KEY = "prx_continue"
#: The loader state's key for where each dataset's lists stood in their log (:func:`lists_at`).
LISTS_AT_KEY = "prx_lists_at"


def _without_lists(fp: dict[str, Any]) -> dict[str, Any]:
    out = {k: v for k, v in fp.items() if k not in ("plan", "epoch_size")}
    out["datasets"] = [
        {k: v for k, v in d.items() if k != "skip_lists"} for d in fp.get("datasets", [])
    ]
    return out


def weights_changed(base: dict[str, Any], now: dict[str, Any]) -> bool:
    """Whether the datasets' proportions differ, every dataset weighted by a proportion on both
    sides (the only weight change a continued epoch takes: :func:`_allocate`)."""
    a, b = base.get("datasets", []), now.get("datasets", [])
    if [d["root"] for d in a] != [d["root"] for d in b]:
        return False
    if any(d.get("proportion") is None for d in (*a, *b)):
        return False
    return [d["proportion"] for d in a] != [d["proportion"] for d in b]


def _without_weights(fp: dict[str, Any]) -> dict[str, Any]:
    out = dict(fp)
    out["datasets"] = [{k: v for k, v in d.items() if k != "proportion"} for d in fp["datasets"]]
    return out


def refusals(base: dict[str, Any], now: dict[str, Any]) -> tuple[list[str], dict[str, set[str]]]:
    """What keeps ``now`` from continuing an epoch planned on ``base`` (empty: it can), and per
    dataset root the base's lists whose content changed since (their earlier content must be
    rebuilt from the lists' log: :func:`list_at`).

    Only skip lists added, or changed in place, since the base may differ, and the datasets'
    proportions (each dataset weighted by one on both sides); a list in force in the base must
    still be in force.
    """
    a, b = _without_lists(base), _without_lists(now)
    if weights_changed(base, now):
        a, b = _without_weights(a), _without_weights(b)
    out = describe_changes(a, b)
    changed: dict[str, set[str]] = {}
    new = {d["root"]: d for d in now.get("datasets", [])}
    for d in base.get("datasets", []):
        lists = (new.get(d["root"]) or {}).get("skip_lists", {})
        for name, entry in sorted((d.get("skip_lists") or {}).items()):
            if name not in lists:
                out.append(
                    f"{d['root']}: skip list {name!r} no longer applied ({entry['samples']} "
                    "samples would come back)"
                )
            elif lists[name] != entry:
                changed.setdefault(d["root"], set()).add(name)
    return out, changed


def lists_at(root: str) -> dict[str, Any] | None:
    """Where an export's lists are materialised in their log (``_lists/registry``): enough to
    rebuild any of them as it was (:func:`list_at`). None: no log state (a foreign tree, a
    tree with sidecars no log knows)."""
    from prx_data.skips.export_state import STATE_FORMAT, read_state

    try:
        st = read_state(root)
    except Exception:  # an unreadable state: the resume refuses to rebuild from it
        return None
    if st is None or st.format != STATE_FORMAT or st.dirty:
        return None
    return {"position": int(st.position), "local": int(st.local), "log_id": st.log_id}


def list_at(
    root: str, name: str, at: dict[str, Any], src: Sequence[BucketSource]
) -> tuple[dict[str, dict[str, np.ndarray]], tuple[int, str]]:
    """List ``name`` as the log held it at ``at`` (:func:`lists_at`), bound to ``src``'s
    shards: per bucket its indices per shard, and (samples, digest) as the fingerprint
    records a list, so the caller checks it against the checkpoint's."""
    from prx_data.skips import export_state as es
    from prx_data.skips.bind import bind
    from prx_data.skips.log import REGISTRY, state
    from prx_data.skips.which import resolve
    from prx_data.stream.resume import per_bucket_digest
    from prx_data.stream.spec import shard_digest

    reg = resolve(root, strict=False)  # whatever log it is, the digest decides
    entries, _ = es.export_entries(root, reg, [name], upto=at["position"] if reg else None)
    if len(entries):
        keep = np.asarray(entries["kind"].to_numpy(zero_copy_only=False)) == REGISTRY
        keep |= np.asarray(entries["seq"].to_numpy(zero_copy_only=False)) <= at["local"]
        entries = entries.filter(keep)
    ids = state(entries).get(name)
    positions = bind(root, {name: ids["id"].combine_chunks()})[name].positions if ids else {}
    per: dict[str, dict[str, np.ndarray]] = {}
    for (bucket, shard), idx in positions.items():
        per.setdefault(bucket, {})[shard] = np.asarray(idx, np.uint32)
    digests = []
    for b in src:
        one = per.get(b.bucket, {})
        n, digest = shard_digest(one, b.shards)
        if n:
            digests.append((b.bucket, (n, digest)))
    return per, per_bucket_digest(digests)


def unplanned(seq: np.ndarray, first: int, count: int, key: tuple[int, ...]) -> np.ndarray:
    """One stream's base samples that its epoch never planned, as base ids, in an order
    fixed by ``key`` (seed, epoch, stream).

    ``seq``: the stream's whole base sequence (base ids ``first .. first + count``). A
    bucket whose epoch takes fewer samples than it holds leaves some out each epoch:
    they complete a short last batch, or give a dataset whose share grew more samples.
    The order holds every one of them, skipped now or not, so what a run consumed is a
    prefix of it (one number per stream in the checkpoint) on every resume and world size.
    """
    planned = np.zeros(count, bool)
    planned[seq - first] = True
    out = first + np.flatnonzero(~planned)
    return out[np.random.default_rng(list(key)).permutation(len(out))]


def space_digest(fp: dict[str, Any]) -> str:
    """Digest of a whole fingerprint: the space a continued epoch's rest was cut on."""
    return hashlib.sha1(json.dumps(fp, sort_keys=True).encode()).hexdigest()[:16]


@dataclasses.dataclass
class Continued:
    """The rest of one epoch: full global batches of current sample ids, in order.

    The rest is cut from ``start`` (per base stream: how far its base sequence and its order
    of unplanned samples were consumed, and how many of its samples were trained) on the
    space ``space``; the first ``skip`` batches were trained before this run.
    """

    epoch: int
    base: dict[str, Any]
    #: Per dataset: where its lists stood in their log at the base (:func:`lists_at`).
    base_at: list[dict[str, Any] | None] | None
    global_batch: int
    #: (m, global batch) current sample ids, and per batch its base stream, the end of its
    #: samples in that stream's base sequence and in its order of unplanned samples.
    batches: np.ndarray
    stream_of: np.ndarray
    end_of: np.ndarray
    free_of: np.ndarray
    start: dict[str, list[int]]
    space: str
    skip: int
    report: dict[str, Any]

    def after(self, samples: int) -> dict[str, list[int]]:
        """Per base stream: positions, unplanned samples consumed and samples trained once
        ``samples`` of this run's batches were trained."""
        done = min(self.skip + samples // self.global_batch, len(self.batches))
        out = {k: list(v) for k, v in self.start.items()}
        streams = self.stream_of[:done]
        for key, ends in (("positions", self.end_of[:done]), ("free", self.free_of[:done])):
            best = np.full(len(out[key]), -1, np.int64)
            np.maximum.at(best, streams, ends)
            out[key] = [max(int(a), int(b)) for a, b in zip(out[key], best, strict=True)]
        n = np.bincount(streams, minlength=len(out["trained"])) * self.global_batch
        out["trained"] = [int(a + b) for a, b in zip(out["trained"], n, strict=True)]
        return out

    def positions_after(self, samples: int) -> list[int]:
        """Each base stream's position once ``samples`` of this run's batches were trained."""
        return self.after(samples)["positions"]

    def state(self, samples: int) -> dict[str, Any]:
        """The loader state's :data:`CONTINUE_KEY` once ``samples`` of this run were trained:
        where each stream stands (a resume onto another space cuts the rest from there), and
        the start this rest was cut from with the batches done (a resume onto the same space
        cuts it again from there, so it resumes exactly)."""
        done = min(self.skip + samples // self.global_batch, len(self.batches))
        return {
            "epoch": self.epoch,
            "base": self.base,
            "base_at": self.base_at,
            **self.after(samples),
            "anchor": {"space": self.space, "done": done, **self.start},
        }

    def work(self, world: Any, device_batch: int) -> np.ndarray:
        """Streaming's work array (nodes, ranks, workers, batches, device batch) for ``world``."""
        per = world.num_nodes * world.ranks_per_node * world.workers_per_rank * device_batch
        flat = self.batches[self.skip :].reshape(-1)
        pad = (-len(flat)) % per
        if pad:
            flat = np.concatenate([flat, np.full(pad, -1, np.int64)])
        g = device_batch * world.num_nodes * world.ranks_per_node
        rows = flat.reshape(-1, g)
        return rows.reshape(
            -1, world.workers_per_rank, world.num_nodes, world.ranks_per_node, device_batch
        ).transpose(2, 3, 1, 0, 4)


def build(
    ds: StreamingDataset,
    specs: Sequence[DatasetSpec],
    sources: Sequence[Sequence[BucketSource]],
    plan_spec: planner.PlanSpec,
    plan: planner.Plan,
    *,
    epoch: int,
    base: dict[str, Any],
    state: dict[str, Any] | None,
    sample_in_epoch: int,
    base_at: Sequence[dict[str, Any] | None] | None = None,
) -> Continued:
    """The rest of ``epoch`` as planned on ``base``, less what the current lists skip, with
    the current proportions when they changed (:func:`_allocate`).

    ``state``: a continued epoch's checkpoint (:meth:`Continued.state`); None: the
    first ``sample_in_epoch`` samples of the base order were trained. ``base_at``:
    per dataset, where its lists stood in their log at the base (:func:`lists_at`),
    to rebuild a list changed in place since.
    """
    why, changed = refusals(base, ds.fingerprint)
    earlier: dict[str, dict[str, dict[str, dict[str, np.ndarray]]]] = {}
    recorded = {d["root"]: d.get("skip_lists") or {} for d in base.get("datasets", [])}
    for di, spec in enumerate(specs):
        for name in sorted(changed.get(spec.root, ())):
            at = base_at[di] if base_at is not None and di < len(base_at) else None
            got = None
            if at is not None:
                per, (n, digest) = list_at(spec.root, name, at, sources[di])
                want = recorded[spec.root][name]
                if (n, digest) == (want["samples"], want["digest"]):
                    got = per
            if got is None:
                why.append(
                    f"{spec.root}: skip list {name!r} changed in place and its content at the "
                    "checkpoint cannot be rebuilt from its log (no log position recorded, or "
                    "the log no longer holds it)"
                )
            else:
                earlier.setdefault(spec.root, {})[name] = got
    if plan.batching_method != "per_stream" or plan.replication not in (None, 1):
        why.append(
            f"continuing after a change needs batching_method='per_stream' and no replication "
            f"(this run: {plan.batching_method}, replication {plan.replication})"
        )
    if why:
        raise ResumeMismatch(
            "on_change='continue' cannot continue this epoch: " + "; ".join(why) + ". "
            "Use on_change='restart_epoch', or restore the checkpoint's lists and settings"
        )
    # 1. The base space: the base's lists and weights, and the hold-out's side, per bucket.
    weights = {d["root"]: d for d in base["datasets"]}
    names = {d["root"]: set(d.get("skip_lists") or {}) for d in base["datasets"]}
    base_skips: list[list[dict[str, np.ndarray]]] = []
    counts = []
    for spec, src in zip(specs, sources, strict=True):
        keep = names.get(spec.root, set())
        per_bucket = []
        for b in src:
            sk: dict[str, np.ndarray] = dict(b.held_side)
            then = earlier.get(spec.root, {})
            for name in sorted(keep):
                one = then[name].get(b.bucket, {}) if name in then else b.per_list.get(name, {})
                sk = merge_skips(sk, one)
            per_bucket.append(sk)
        base_skips.append(per_bucket)
        counts.append(
            planner.DatasetCount(
                spec.label,
                [
                    planner.BucketCount(b.bucket, b.samples, sum(len(v) for v in sk.values()))
                    for b, sk in zip(src, per_bucket, strict=True)
                ],
                weights[spec.root].get("proportion"),
                weights[spec.root].get("repeat"),
                weights[spec.root].get("choose"),
            )
        )
    base_plan = planner.plan_buckets(
        counts, plan_spec, world_size=plan.world_size, num_nodes=plan.num_nodes
    )
    if plan_digest(base_plan) != base.get("plan") or base_plan.epoch_size != base["epoch_size"]:
        raise ResumeMismatch(
            "on_change='continue' cannot continue this epoch: its plan cannot be made again "
            "from the checkpoint's lists with this run's settings (epoch_size or another plan "
            "setting changed?); use on_change='restart_epoch' or the checkpoint's settings"
        )
    # 2. Base shards per stream, and each base sample's id in the current space (-1: skipped).
    now_stream = {(di, bucket): i for i, (di, bucket, _shape) in enumerate(ds.stream_info)}
    decisions = base_plan.decisions()
    samples_per_shard: list[int] = []
    shards_per_stream: list[int] = []
    chooses: list[int] = []
    dataset_of: list[int] = []
    table: list[np.ndarray] = []
    for di, src in enumerate(sources):
        for b, sk in zip(src, base_skips[di], strict=True):
            bp = decisions[(di, b.bucket)]
            if bp.excluded or bp.choose == 0:
                continue
            si = now_stream.get((di, b.bucket))
            now_shards = {}
            if si is not None:
                first = int(ds.shard_offset_per_stream[si])
                for j in range(first, first + int(ds.shards_per_stream[si])):
                    now_shards[ds.shards[j].raw_data.basename] = j
            n_shards = 0
            for shard in b.shards:
                skipped = np.asarray(sk.get(shard.basename, ()), np.int64)
                stored = np.setdiff1d(np.arange(shard.samples, dtype=np.int64), skipped)
                if not len(stored):
                    continue
                n_shards += 1
                samples_per_shard.append(len(stored))
                j = now_shards.get(shard.basename)
                ids = np.full(len(stored), -1, np.int64)
                if j is not None:
                    now_sk = np.asarray(b.skips.get(shard.basename, ()), np.int64)
                    live = ~np.isin(stored, now_sk)
                    k = stored[live] - np.searchsorted(now_sk, stored[live])
                    ids[live] = int(ds.sample_offset_per_shard[j]) + k
                elif si is None and len(np.setdiff1d(stored, b.skips.get(shard.basename, ()))):
                    raise ResumeMismatch(
                        f"on_change='continue' cannot continue this epoch: bucket {b.bucket} "
                        "is left out of the current plan but still has samples to train; use "
                        "on_change='restart_epoch'"
                    )
                table.append(ids)
            shards_per_stream.append(n_shards)
            chooses.append(int(bp.choose))
            dataset_of.append(di)
    new_id = np.concatenate(table) if table else np.zeros(0, np.int64)
    sps = np.asarray(samples_per_shard, np.int64)
    shard_off = np.concatenate([[0], np.cumsum(shards_per_stream)[:-1]]).astype(np.int64)
    shadow = types.SimpleNamespace(
        num_canonical_nodes=plan.num_canonical_nodes,
        batch_size=plan.device_batch_size,
        partition_algo=ds.partition_algo,
        initial_physical_nodes=ds.initial_physical_nodes,
        shuffle=ds.shuffle,
        shuffle_algo=ds.shuffle_algo,
        shuffle_seed=ds.shuffle_seed,
        shuffle_block_size=ds.shuffle_block_size or plan.shuffle_block_size,
        epoch_seed_change=ds.epoch_seed_change,
        sampling_method=ds.sampling_method,
        sampling_granularity=ds.sampling_granularity,
        num_streams=len(chooses),
        shard_offset_per_stream=shard_off,
        shards_per_stream=np.asarray(shards_per_stream, np.int64),
        samples_per_shard=sps,
        sample_offset_per_shard=np.cumsum(sps) - sps,
        streams=[
            types.SimpleNamespace(choose=c, proportion=c / max(1, sum(chooses))) for c in chooses
        ],
    )
    resample = functools.partial(StreamingDataset.resample_streams, shadow)

    def resample_streams(epoch: int, stream_id: int | None = None):
        with vectorised_sampling():
            return resample(epoch, stream_id)

    shadow.resample_streams = resample_streams
    ranks = plan.world_size // plan.num_nodes
    world = World(plan.num_nodes, ranks, max(1, plan.num_workers), 0)
    g = plan.global_batch_size
    work = generate_work("per_stream", shadow, world, epoch, 0)
    rows = work.transpose(3, 2, 0, 1, 4).reshape(-1, g)
    rows = rows[rows.min(axis=1) >= 0]  # streaming pads with whole rows of -1 at the end
    # A global batch holds the same samples on any world size, but in rank order: sorted, the
    # base sequences (and every position in them) are the same on every world size.
    rows = np.sort(rows, axis=1)
    sample_off = np.cumsum(sps) - sps
    stream_first_sample = sample_off[shard_off] if len(shard_off) else shard_off
    stream_of_row = np.searchsorted(stream_first_sample, rows[:, 0], side="right") - 1
    streams = len(chooses)
    # Each stream's rows in order, grouped once (not one pass over every row per stream).
    by_stream = np.argsort(stream_of_row, kind="stable")
    bounds = np.searchsorted(stream_of_row[by_stream], np.arange(streams + 1))
    space = space_digest(ds.fingerprint)
    anchor = (state or {}).get("anchor")
    skip = 0
    if anchor is not None and anchor.get("space") == space:
        start = {k: list(anchor[k]) for k in ("positions", "free", "trained")}
        skip = int(anchor["done"])  # the same space: the same cut, resumed exactly
    elif state is not None:
        pos = list(state["positions"])
        start = {
            "positions": pos,
            "free": list(state.get("free") or [0] * len(pos)),
            "trained": list(state.get("trained") or pos),
        }
    else:
        done = sample_in_epoch // g
        pos = (g * np.bincount(stream_of_row[:done], minlength=streams)).tolist()
        start = {"positions": pos, "free": [0] * streams, "trained": list(pos)}
    if any(len(v) != streams for v in start.values()):
        raise ResumeMismatch(
            "on_change='continue': the checkpoint's positions do not match its plan "
            f"({len(start['positions'])} streams, {streams} planned); use "
            "on_change='restart_epoch'"
        )
    # 3. Each stream's rest (less what is skipped now) and its unplanned samples.
    seed = int(ds.shuffle_seed) if ds.shuffle_seed is not None else 0
    rest, free, seqs, mines = [], [], [], []
    left_out = 0
    for s in range(streams):
        mine = by_stream[bounds[s] : bounds[s + 1]]
        seq = rows[mine].reshape(-1)
        p0 = start["positions"][s]
        ids = new_id[seq[p0:]]
        live = ids >= 0
        left_out += int(np.count_nonzero(~live))
        rest.append((ids[live], np.arange(p0, len(seq))[live]))
        first = int(sample_off[shard_off[s]]) if shards_per_stream[s] else 0
        count = int(sps[shard_off[s] : shard_off[s] + shards_per_stream[s]].sum())
        order = unplanned(seq, first, count, (seed, epoch, s))[start["free"][s] :]
        fid = new_id[order]
        keep = fid >= 0
        free.append((fid[keep], start["free"][s] + np.flatnonzero(keep)))
        seqs.append(len(seq))
        mines.append(mine)
    # 4. How many global batches each stream gets.
    reweigh = weights_changed(base, ds.fingerprint)
    if reweigh:
        take, mix = _allocate(plan, dataset_of, start["trained"], rest, free, g)
    else:
        take, mix = [], None
        for (r, _), (f, _) in zip(rest, free, strict=True):
            n, short = divmod(len(r), g)
            take.append(n + (1 if short and len(r) + len(f) >= (n + 1) * g else 0))
    # 5. Cut: each stream's batches in its order (rest, then unplanned samples), placed where
    # its first sample was planned, or spread evenly over the rest when the weights changed.
    out_b, out_key, out_s, out_end, out_free = [], [], [], [], []
    filled = carried = dropped = 0
    for s in range(streams):
        (r, rpos), (f, fpos), q = rest[s], free[s], take[s]
        used_free = max(0, q * g - len(r))
        filled += used_free
        if not reweigh:
            carried += max(0, len(r) - q * g)
        else:
            dropped += max(0, len(r) - q * g)
        if not q:
            continue
        ids = np.concatenate([r, f[:used_free]])[: q * g]
        last = np.arange(1, q + 1) * g - 1  # each batch's last sample
        in_rest = last < len(r)
        end = np.full(q, seqs[s], np.int64)
        end[in_rest] = rpos[last[in_rest]] + 1
        if reweigh or len(r) <= q * g:
            end[-1] = seqs[s]  # the stream is over for this epoch (else a carried tail is left)
        fend = np.full(q, -1, np.int64)
        fend[~in_rest] = fpos[last[~in_rest] - len(r)] + 1
        if reweigh:
            key = (np.arange(q) + 0.5) / q
        else:
            key = mines[s][rpos[np.arange(q) * g] // g].astype(np.float64)
        out_b.append(ids.reshape(q, g))
        out_key.append(key)
        out_s.append(np.full(q, s, np.int64))
        out_end.append(end)
        out_free.append(fend)
    if out_b:
        keys, st = np.concatenate(out_key), np.concatenate(out_s)
        order = np.lexsort((st, keys))
        batches = np.concatenate(out_b)[order]
        stream_of = st[order]
        end_of = np.concatenate(out_end)[order]
        free_of = np.concatenate(out_free)[order]
    else:
        batches = np.zeros((0, g), np.int64)
        stream_of = end_of = free_of = np.zeros(0, np.int64)
    report = {
        "epoch": epoch,
        "trained": int(sum(start["trained"])) + skip * g,
        "left_out": left_out,
        "remaining": (len(batches) - skip) * g,
        "filled": filled,
        "carried": carried,
    }
    if mix is not None:
        report["dropped"] = dropped
        report["mix"] = mix
        log.warning(
            "continuing epoch %s with new proportions (samples already trained count toward "
            "each dataset's share): %s",
            epoch,
            "; ".join(
                f"{m['dataset']} requested {m['requested']:.3f}, realised {m['realised']:.3f}"
                for m in mix
            ),
        )
    at = list(base_at) if base_at is not None else None
    return Continued(
        epoch, base, at, g, batches, stream_of, end_of, free_of, start, space, skip, report
    )


def _allocate(
    plan: planner.Plan,
    dataset_of: Sequence[int],
    trained: Sequence[int],
    rest: Sequence[tuple[np.ndarray, np.ndarray]],
    free: Sequence[tuple[np.ndarray, np.ndarray]],
    g: int,
) -> tuple[list[int], list[dict[str, Any]]]:
    """Global batches per base stream for the rest of an epoch whose proportions changed.

    The epoch is the current plan's size; each dataset's share of it is the current
    proportion, and what it already trained counts toward it: a dataset gets the
    rest of its share (none when it is already past it; the others' shares are scaled
    to fill the epoch). A dataset draws from its buckets' rests first, then from their
    samples this epoch never planned, never a sample twice: one with too few samples
    left gets what it has, and the report says so (requested against realised). Inside
    a dataset, batches go to its buckets by what each has left (:func:`_capped_split`).
    """
    n_data = len(plan.mix)
    total = plan.epoch_size
    requested = [m.requested for m in plan.mix]
    done = [0] * n_data
    for s, t in enumerate(trained):
        done[dataset_of[s]] += int(t)
    want = [max(0.0, p * total - t) for p, t in zip(requested, done, strict=True)]
    left = max(0, total - sum(done)) // g
    scale = left * g / sum(want) if sum(want) else 0.0
    batches = planner.largest_remainder(left, [w * scale / g for w in want])
    take = [0] * len(dataset_of)
    for d in range(n_data):
        mine = [s for s in range(len(dataset_of)) if dataset_of[s] == d]
        have = [len(rest[s][0]) + len(free[s][0]) for s in mine]
        for s, a in zip(mine, _capped_split(batches[d], have, g), strict=True):
            take[s] = a
    grand = sum(done) + g * sum(take)
    mix = []
    for d in range(n_data):
        got = done[d] + g * sum(t for s, t in enumerate(take) if dataset_of[s] == d)
        mix.append(
            {
                "dataset": plan.datasets[d],
                "requested": requested[d],
                "realised": got / grand if grand else 0.0,
                "trained_before": done[d],
                "samples": got,
            }
        )
    return take, mix


def _capped_split(n: int, have: Sequence[int], g: int) -> list[int]:
    """At most ``n`` global batches over streams holding ``have`` samples, by largest
    remainder in proportion to ``have``, none past a stream's whole batches."""
    cap = [h // g for h in have]
    n = min(n, sum(cap))
    total = sum(have)
    quota = [n * h / total if total else 0.0 for h in have]
    alloc = [min(math.floor(q), c) for q, c in zip(quota, cap, strict=True)]
    left = n - sum(alloc)
    while left > 0:  # each pass gives one batch to each stream with room, most owed first
        room = sorted((a - q, i) for i, (a, q) in enumerate(zip(alloc, quota, strict=True)))
        for _, i in room:
            if left and alloc[i] < cap[i]:
                alloc[i] += 1
                left -= 1
    return alloc
