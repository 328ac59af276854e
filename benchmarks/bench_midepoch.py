"""on_change="continue" at scale: resume time, loader state size, samples trained twice.

For each size (fabricated exports: one real shard hard-linked under one merged
index, as bench_stream's resume figure), a checkpoint at 60 % of the epoch, then a
1 % skip list added:

  resume_s        building the loader, load_state_dict and the first batch, with
                  on_change="continue", against the same with no change (the anchor:
                  an ordinary resume at the same position on the new space)
  load_s          load_state_dict alone (continue rebuilds and re-cuts the epoch)
  state_bytes     the loader state as JSON: an ordinary checkpoint and one written
                  during the continued epoch
  trained_twice   samples trained before the checkpoint and again after it, under
                  restart_epoch and under continue (counted from the orders, not run)
  not_trained     samples of the interrupted epoch still in the space that continue
                  trains neither before nor after the checkpoint (its carried tail)

Run:  python benchmarks/bench_midepoch.py [--sizes 100000,1000000] [--per-shard 100]
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import shutil
import sys
import tempfile
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from streaming.base.util import clean_stale_shared_memory  # noqa: E402

from benchmarks.bench_stream import BUCKET, make_export, skip_fraction  # noqa: E402
from prx_data.skips.reader import SkipMDSReader  # noqa: E402
from prx_data.stream import midepoch  # noqa: E402
from prx_data.stream.dataset import BucketedDataset, DatasetSpec  # noqa: E402

BATCH = 32
#: Samples per fabricated shard (``--per-shard``): 10^7 samples in 100-sample shards would be
#: 10^5 shard folders and skip sidecars to fabricate.
PER_SHARD = 100


def big_export(work: str, shards: int, per_shard: int) -> str:
    """One real shard hard-linked ``shards`` times under one merged index (parts ``f0-<i>``)."""
    seed_root = os.path.join(work, "seed")
    make_export(seed_root, {BUCKET: per_shard}, samples_per_part=per_shard, hashes=())
    (part,) = [
        d
        for d in os.listdir(os.path.join(seed_root, BUCKET))
        if d.startswith("u") or d.startswith("f")
    ]
    src_dir = os.path.join(seed_root, BUCKET, part)
    with open(os.path.join(src_dir, "index.json")) as f:
        entry = json.load(f)["shards"][0]
    bdir = os.path.join(work, "big", BUCKET)
    entries = []
    for i in range(shards):
        name = f"f0-{i * per_shard}"
        os.makedirs(os.path.join(bdir, name))
        os.link(
            os.path.join(src_dir, "shard.00000.mds"), os.path.join(bdir, name, "shard.00000.mds")
        )
        e = json.loads(json.dumps(entry))
        e["raw_data"]["basename"] = f"{name}/shard.00000.mds"
        entries.append(e)
    with open(os.path.join(bdir, "index.json"), "w") as f:
        json.dump({"version": 2, "shards": entries}, f)
    return os.path.join(work, "big")


def make(root: str, **kw) -> BucketedDataset:
    clean_stale_shared_memory()
    return BucketedDataset(
        DatasetSpec(root, allow_incomplete=True),
        tier=512,
        batch_size=BATCH,
        num_canonical_nodes=1,
        small_buckets="drop",
        **kw,
    )


def first_batch(ds: BucketedDataset) -> None:
    it = iter(ds)
    for _ in range(BATCH):
        next(it)
    ds._iterator.exit()  # stop streaming's prefetch threads before the export is deleted
    ds._executor.shutdown(wait=True)
    del it


def keys(ds: BucketedDataset, ids: np.ndarray) -> np.ndarray:
    """Each sample id as (shard file, stored index), one int64: comparable across spaces."""
    shard = np.searchsorted(ds.sample_offset_per_shard, ids, side="right") - 1
    k = ids - ds.sample_offset_per_shard[shard]
    out = np.empty(len(ids), np.int64)
    order = np.argsort(shard, kind="stable")  # one pass per shard over its own ids only
    uniq, starts = np.unique(shard[order], return_index=True)
    ends = np.append(starts[1:], len(order))
    for s, a, z in zip(uniq.tolist(), starts.tolist(), ends.tolist(), strict=True):
        m = order[a:z]
        r = ds.shards[s]
        stored = k[m]
        if isinstance(r, SkipMDSReader):
            stored = stored + np.searchsorted(r._shift_keys, stored, side="right")
        part = int(r.raw_data.basename.split("/")[0].split("-")[1]) // PER_SHARD
        out[m] = part * PER_SHARD + stored
    return out


def planned(ds: BucketedDataset) -> np.ndarray:
    """The whole epoch's global batches on ``ds``'s own space (no change: nothing left out)."""
    specs, sources = ds._space
    c = midepoch.build(
        ds, specs, sources, ds.spec, ds.plan,
        epoch=0, base=ds.fingerprint, state=None, sample_in_epoch=0, base_at=ds.lists_at,
    )  # fmt: skip
    return c.batches


def one_size(work: str, n: int, rounds: int = 3) -> dict:
    root = big_export(work, n // PER_SHARD, PER_SHARD)
    base = make(root)
    epoch = base.plan.epoch_size
    g = base.plan.global_batch_size
    at = int(0.6 * epoch) // g * g
    state = {**base.state_dict(at, True), "epoch": 0}  # as written during epoch 0
    order = planned(base)
    trained = keys(base, order[: at // g].reshape(-1))
    whole = keys(base, order.reshape(-1))
    del base
    gc.collect()
    skip_fraction(root, "optout", 0.01)

    out: dict = {"samples": n, "epoch": epoch, "checkpoint_at": at}
    plain = make(root)
    plain_state = {**plain.state_dict(at, True), "epoch": 0}
    new_epoch = keys(plain, planned(plain).reshape(-1))
    space = keys(plain, np.arange(int(plain.samples_per_shard.sum()), dtype=np.int64))
    del plain
    runs = {"continue": [], "plain": [], "load": []}
    for r in range(rounds):
        for kind in ("continue", "plain") if r % 2 else ("plain", "continue"):
            t = time.perf_counter()
            ds = make(root, on_change="continue")
            t1 = time.perf_counter()
            ds.load_state_dict(state if kind == "continue" else plain_state)
            t2 = time.perf_counter()
            first_batch(ds)
            runs[kind].append(time.perf_counter() - t)
            if kind == "continue":
                runs["load"].append(t2 - t1)
                cont = ds._continued
                after = keys(ds, cont.batches.reshape(-1))
                out["state_bytes_continued"] = len(json.dumps(ds.state_dict(g * 10, False)))
                for k in ("left_out", "remaining", "filled", "carried"):
                    out[k] = cont.report[k]
            del ds
            gc.collect()
    out["resume_s_continue"] = min(runs["continue"])
    out["resume_s_plain"] = min(runs["plain"])
    out["ratio"] = out["resume_s_continue"] / out["resume_s_plain"]
    out["load_state_dict_s_continue"] = min(runs["load"])
    out["state_bytes_plain"] = len(json.dumps(state))
    out["trained_twice_restart_epoch"] = int(np.isin(new_epoch, trained).sum())
    out["trained_twice_continue"] = int(np.isin(after, trained).sum())
    rest = np.setdiff1d(np.intersect1d(whole, space), trained)
    out["not_trained_continue"] = int(len(np.setdiff1d(rest, after)))
    shutil.rmtree(root)
    shutil.rmtree(os.path.join(work, "seed"), ignore_errors=True)
    return out


def main() -> None:
    global PER_SHARD
    ap = argparse.ArgumentParser()
    ap.add_argument("--sizes", default="100000,1000000")
    ap.add_argument("--work", default=None)
    ap.add_argument("--per-shard", type=int, default=PER_SHARD)
    ap.add_argument("--rounds", type=int, default=3, help="timed resumes of each kind (best of)")
    args = ap.parse_args()
    PER_SHARD = args.per_shard
    for n in map(int, args.sizes.split(",")):
        work = tempfile.mkdtemp(prefix="prx-midepoch-", dir=args.work)
        try:
            print(
                json.dumps({**one_size(work, n, args.rounds), "per_shard": PER_SHARD}), flush=True
            )
        finally:
            shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
