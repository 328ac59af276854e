"""Continue an interrupted epoch after skip lists grew: ``on_change="continue"``.

Streaming derives an epoch's whole order from per-shard sample counts, so an
epoch planned on one sample space has no "rest" on another. This module keeps
the epoch's order as it was planned on the checkpoint's space (the *base*
space) and leaves out what the lists now remove:

1. The base space is rebuilt from the lists the checkpoint's fingerprint names
   (each must still be in force with the same content digest; the hold-out
   must be the same), and its plan is made again and checked against the
   fingerprint's plan digest, so the order rebuilt is the order trained.
2. Streaming's own ``per_stream`` work generation runs on the base space; its
   global batches, in the order they are consumed, give each stream's base
   sequence (each batch's ids sorted: its order within the batch is the ranks'
   order, which depends on the world size). A base sample id is mapped to its shard and stored index, then to
   the current space's id, or to -1 when a list now skips it.
3. What was trained is a prefix of each stream's base sequence (``positions``,
   one int per stream: O(streams), nothing per sample). The rest of each
   stream, less the samples now skipped, is cut into full global batches in
   base order; each keeps the place in the epoch of the base batch its first
   sample came from. A stream's last partial batch (under one global batch) is
   completed with samples of the same stream that this epoch never planned (a
   bucket whose epoch takes fewer samples than it holds; :func:`unplanned`), so
   every remaining sample is trained once and batches stay full and of one
   shape. When the stream has too few of those (its epoch takes every sample it
   holds), no batch of only its samples can hold that tail without training one
   of them twice: the tail is *carried*, i.e. trained in the next epoch, which
   holds every sample of such a bucket.
4. A checkpoint during the continued epoch records the base fingerprint and
   the positions reached, so a later resume (with or without a further change,
   on any world size an elastic resume allows) continues from there.

The next epoch is planned on the current space as usual.
"""

from __future__ import annotations

import dataclasses
import functools
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


def refusals(base: dict[str, Any], now: dict[str, Any]) -> tuple[list[str], dict[str, set[str]]]:
    """What keeps ``now`` from continuing an epoch planned on ``base`` (empty: it can), and per
    dataset root the base's lists whose content changed since (their earlier content must be
    rebuilt from the lists' log: :func:`list_at`).

    Only skip lists added, or changed in place, since the base may differ; a list in force in
    the base must still be in force.
    """
    out = describe_changes(_without_lists(base), _without_lists(now))
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


def unplanned(
    new_id: np.ndarray, seq: np.ndarray, first: int, count: int, k: int, key: tuple[int, ...]
) -> np.ndarray:
    """``k`` current ids of one stream's samples that its epoch never planned, or none.

    ``seq``: the stream's whole base sequence (base ids ``first .. first + count``);
    ``new_id``: each base id's current id (-1: skipped now). A bucket whose epoch
    takes fewer samples than it holds leaves some out each epoch; those (still in the
    space) are drawn in an order fixed by ``key`` (seed, epoch, stream), so every
    resume of the epoch, on any world size, draws the same ones. Empty when fewer
    than ``k`` exist: the short batch cannot be completed within the epoch.
    """
    planned = np.zeros(count, bool)
    planned[seq - first] = True
    free = np.flatnonzero(~planned & (new_id[first : first + count] >= 0))
    if len(free) < k:
        return np.zeros(0, np.int64)
    pick = np.random.default_rng(list(key)).permutation(len(free))[:k]
    return new_id[first + free[np.sort(pick)]]


@dataclasses.dataclass
class Continued:
    """The rest of one epoch: full global batches of current sample ids, in order."""

    epoch: int
    base: dict[str, Any]
    #: Per dataset: where its lists stood in their log at the base (:func:`lists_at`).
    base_at: list[dict[str, Any] | None] | None
    global_batch: int
    #: (m, global batch) current sample ids, and per batch its base stream and the end of
    #: its samples in that stream's base sequence.
    batches: np.ndarray
    stream_of: np.ndarray
    end_of: np.ndarray
    #: Per base stream: how far its base sequence was trained when this run started.
    positions: list[int]
    report: dict[str, Any]

    def positions_after(self, samples: int) -> list[int]:
        """Each base stream's position once ``samples`` of this run's batches were trained."""
        done = min(samples // self.global_batch, len(self.batches))
        out = list(self.positions)
        for s, end in zip(self.stream_of[:done].tolist(), self.end_of[:done].tolist(), strict=True):
            out[s] = max(out[s], int(end))
        return out

    def work(self, world: Any, device_batch: int) -> np.ndarray:
        """Streaming's work array (nodes, ranks, workers, batches, device batch) for ``world``."""
        per = world.num_nodes * world.ranks_per_node * world.workers_per_rank * device_batch
        flat = self.batches.reshape(-1)
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
    positions: list[int] | None,
    sample_in_epoch: int,
    base_at: Sequence[dict[str, Any] | None] | None = None,
) -> Continued:
    """The rest of ``epoch`` as planned on ``base``, less what the current lists skip.

    ``positions``: each base stream's trained prefix (a checkpoint of a
    continued epoch); None: the first ``sample_in_epoch`` samples of the base
    order were trained. ``base_at``: per dataset, where its lists stood in their
    log at the base (:func:`lists_at`), to rebuild a list changed in place since.
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
    # 1. The base space: the base's lists and the hold-out's side, per bucket.
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
                spec.proportion,
                spec.repeat,
                spec.choose,
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
    if positions is None:
        done = sample_in_epoch // g
        positions = [
            int(g * np.count_nonzero(stream_of_row[:done] == s)) for s in range(len(chooses))
        ]
    if len(positions) != len(chooses):
        raise ResumeMismatch(
            "on_change='continue': the checkpoint's positions do not match its plan "
            f"({len(positions)} streams, {len(chooses)} planned); use on_change='restart_epoch'"
        )
    # 3. The rest of each stream, less what is skipped now, in full global batches; a short
    # last batch is completed with the stream's samples this epoch never planned (fill).
    seed = int(ds.shuffle_seed) if ds.shuffle_seed is not None else 0
    out_b, out_key, out_s, out_end = [], [], [], []
    left_out = carried = remaining = filled = 0
    for s in range(len(chooses)):
        mine = np.flatnonzero(stream_of_row == s)
        seq = rows[mine].reshape(-1)
        pos = np.arange(positions[s], len(seq))
        ids = new_id[seq[positions[s] :]]
        live = ids >= 0
        left_out += int(np.count_nonzero(~live))
        ids, pos = ids[live], pos[live]
        n, short = divmod(len(ids), g)
        extra = np.zeros(0, np.int64)
        if short:
            first = int(sample_off[shard_off[s]]) if shards_per_stream[s] else 0
            count = int(sps[shard_off[s] : shard_off[s] + shards_per_stream[s]].sum())
            extra = unplanned(new_id, seq, first, count, g - short, (seed, epoch, s))
        if len(extra):
            ids = np.concatenate([ids, extra])
            filled += len(extra)
            n += 1
        else:
            carried += short
        remaining += n * g
        if not n:
            continue
        out_b.append(ids[: n * g].reshape(n, g))
        out_key.append(mine[pos[: n * g : g] // g])
        out_s.append(np.full(n, s, np.int64))
        end = pos[g - 1 : n * g : g] + 1
        if len(extra):  # the completed batch ends the stream
            end = np.concatenate([pos[g - 1 :: g][: n - 1] + 1, [len(seq)]])
        out_end.append(end)
    if out_b:
        order = np.argsort(np.concatenate(out_key), kind="stable")
        batches = np.concatenate(out_b)[order]
        stream_of = np.concatenate(out_s)[order]
        end_of = np.concatenate(out_end)[order]
    else:
        batches = np.zeros((0, g), np.int64)
        stream_of = end_of = np.zeros(0, np.int64)
    trained = sum(positions)
    report = {
        "epoch": epoch,
        "trained": int(trained),
        "left_out": left_out,
        "remaining": remaining,
        "filled": filled,
        "carried": carried,
    }
    at = list(base_at) if base_at is not None else None
    return Continued(epoch, base, at, g, batches, stream_of, end_of, list(positions), report)
