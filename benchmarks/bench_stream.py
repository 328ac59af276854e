"""Streaming with skip lists: three figures, each a ratio against an anchor in the same run.

  skip10    loader throughput with 10% of samples skipped vs no skip lists
            (two copies of one export, both loaders pulled in alternating
            chunks; plus the same ratio per get_item without the loader's
            threads, and the cost of the index mapping); target >= 0.95x
  resume    time to first batch resuming at sample 1,000,000 vs at sample 0
            (a 1.2M-sample index over hard-linked copies of one shard, with a
            10% skip list on every shard); target <= 1.2x. Nothing is read to skip.
  sidecars  validating and loading skip lists for 100,000 shards (seconds)
  plan      planning 1,000 buckets over 3 datasets (seconds; target < 1 s)
  mix       loader throughput of a 0.7/0.3 BucketedDataset (dataset-level allocation)
            vs plain streaming (one Stream per bucket with streaming's own
            proportions) over the same shards, the same decode in both,
            pulled in alternating chunks; target >= 0.95x

Run on an otherwise idle machine:  python benchmarks/bench_stream.py
Smaller:                           python benchmarks/bench_stream.py --quick
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

from prx_data.export import layout
from prx_data.export.sample import make_sample_export as make_export  # noqa: E402
from prx_data.skips import sidecar as skiplist  # noqa: E402
from prx_data.stream.dataset import (
    BucketedDataset,
    DatasetSpec,  # noqa: E402
)
from tests.exportkit import skip_samples  # noqa: E402  (the sidecar writer: a fabricated tree)

BUCKET = "512/1.000"


def skip_fraction(root: str, name: str, fraction: float, seed: int = 0) -> int:
    rng = np.random.default_rng(seed)
    skips = {}
    for s in layout.read_index(root, BUCKET):
        k = int(round(s.samples * fraction))
        skips[(BUCKET, s.basename)] = np.sort(rng.choice(s.samples, k, replace=False))
    return skip_samples(root, name, skips).samples_listed


def bench_skip10(work: str, samples: int, rounds: int, chunk: int = 50) -> dict:
    """Both loaders alive at once over two copies of one export, pulled in alternating chunks.

    Interleaving cancels drift in machine load, which dominates on a shared box.
    """
    a = os.path.join(work, "skip10-a")
    make_export(a, {BUCKET: samples}, samples_per_part=samples, samples_per_shard=200, hashes=())
    b = os.path.join(work, "skip10-b")
    shutil.copytree(a, b)
    skip_fraction(b, "ten", 0.10)
    clean_stale_shared_memory()
    kw = dict(tier=512, batch_size=16, shuffle=True, small_buckets="drop")
    base = BucketedDataset(DatasetSpec(a, skip_lists=[]), **kw)
    skip = BucketedDataset(DatasetSpec(b, skip_lists=["ten"]), **kw)
    t_base = t_skip = 0.0
    n_base = n_skip = 0
    for _ in range(rounds):
        its = [iter(base), iter(skip)]
        live = [True, True]
        turn = 0
        while any(live):
            turn += 1
            for k in (0, 1) if turn % 2 else (1, 0):  # alternate who goes first
                it = its[k]
                if not live[k]:
                    continue
                t = time.perf_counter()
                got = sum(1 for _ in zip(range(chunk), it, strict=False))
                dt = time.perf_counter() - t
                live[k] = got == chunk
                if k == 0:
                    t_base, n_base = t_base + dt, n_base + got
                else:
                    t_skip, n_skip = t_skip + dt, n_skip + got
    # Per sample without the loader's threads: fetch + decode through the same get_item.
    g_base = g_skip = 0.0
    for i in range(min(base.num_samples, skip.num_samples)):
        t = time.perf_counter()
        base.get_item(i)
        g_base += time.perf_counter() - t
        t = time.perf_counter()
        skip.get_item(i)
        g_skip += time.perf_counter() - t
    del base, skip
    gc.collect()
    # The per-sample cost of the kept -> stored mapping itself, for scale.
    from streaming.base.format.mds.reader import MDSReader

    from prx_data.skips.reader import SkipMDSReader

    shard = MDSReader.__new__(MDSReader)
    shard.samples = 2000
    r = SkipMDSReader.wrap(shard, np.arange(0, 2000, 10))
    t = time.perf_counter()
    for i in range(100_000):
        r.stored_index(i % 1800)
    map_us = (time.perf_counter() - t) * 10
    return {
        "samples_per_s_no_skips": n_base / t_base,
        "samples_per_s_10pct_skipped": n_skip / t_skip,
        "ratio": (n_skip / t_skip) / (n_base / t_base),
        "samples_streamed": [n_base, n_skip],
        "mapping_us_per_sample": map_us,
        "get_item_ratio": g_base / g_skip,
    }


def big_export(work: str, shards: int, per_shard: int) -> str:
    """One real shard hard-linked ``shards`` times under one merged index."""
    seed_root = os.path.join(work, "seed")
    make_export(seed_root, {BUCKET: per_shard}, samples_per_part=per_shard, hashes=())
    # The seed's one part, whatever the export named it (parts are named by content).
    seed_index = json.load(open(os.path.join(seed_root, BUCKET, "index.json")))
    entry = seed_index["shards"][0]
    seed_shard = os.path.join(seed_root, BUCKET, entry["raw_data"]["basename"])
    root = os.path.join(work, "big")
    bdir = os.path.join(root, BUCKET)
    entries = []
    for i in range(shards):
        part = f"f0-{i * per_shard}"
        os.makedirs(os.path.join(bdir, part))
        os.link(seed_shard, os.path.join(bdir, part, "shard.00000.mds"))
        e = json.loads(json.dumps(entry))
        e["raw_data"]["basename"] = f"{part}/shard.00000.mds"
        entries.append(e)
    with open(os.path.join(bdir, "index.json"), "w") as f:
        json.dump({"version": 2, "shards": entries}, f)
    return root


def time_to_first_batch(root: str, sample_in_epoch: int, batch: int) -> float:
    clean_stale_shared_memory()
    t = time.perf_counter()
    ds = BucketedDataset(
        DatasetSpec(root),
        tier=512,
        batch_size=batch,
        num_canonical_nodes=1,
        shuffle=True,
        small_buckets="drop",
    )
    if sample_in_epoch:
        ds.load_state_dict(
            {
                "epoch": 0,
                "sample_in_epoch": sample_in_epoch,
                "num_canonical_nodes": 1,
                "shuffle_seed": 9176,
                "initial_physical_nodes": 1,
            }
        )
    it = iter(ds)
    for _ in range(batch):
        next(it)
    dt = time.perf_counter() - t
    del it, ds
    gc.collect()
    return dt


def bench_resume(work: str, shards: int, per_shard: int, at: int, rounds: int) -> dict:
    root = big_export(work, shards, per_shard)
    t = time.perf_counter()
    skip_fraction(root, "ten", 0.10)
    add_s = time.perf_counter() - t
    zero, far = [], []
    for r in range(2 * rounds + 1):  # alternate which goes first; keep the best of each
        pair = [(zero, 0), (far, at)]
        for acc, start in pair if r % 2 else pair[::-1]:
            acc.append(time_to_first_batch(root, start, 32))
    return {
        "samples": shards * per_shard,
        "kept": int(shards * per_shard * 0.9),
        "resume_at": at,
        "first_batch_s_at_0": min(zero),
        "first_batch_s_at_resume": min(far),
        "ratio": min(far) / min(zero),
        "add_10pct_list_s": add_s,
    }


def bench_sidecars(work: str, shards: int) -> dict:
    root = os.path.join(work, "sidecars")
    bdir = os.path.join(root, BUCKET)
    os.makedirs(bdir)
    infos = [layout.ShardInfo(f"f0-{i}/shard.00000.mds", 1 << 26, 1000, {}) for i in range(shards)]
    with open(os.path.join(bdir, "index.json"), "w") as f:
        json.dump(
            {
                "version": 2,
                "shards": [
                    {
                        "raw_data": {"basename": s.basename, "bytes": s.bytes, "hashes": {}},
                        "samples": s.samples,
                    }
                    for s in infos
                ],
            },
            f,
        )
    rng = np.random.default_rng(0)
    for s in infos:
        os.makedirs(os.path.join(bdir, os.path.dirname(s.basename)), exist_ok=True)
        idx = np.sort(rng.choice(s.samples, 100, replace=False)).astype(np.uint32)
        with open(os.path.join(bdir, f"{s.basename}.dedup.skip"), "wb") as f:
            f.write(skiplist.SkipList("dedup", s, idx).to_bytes())
    os.system("sync")
    t = time.perf_counter()
    shards_read = layout.read_index(root, BUCKET)
    loaded = skiplist.load_skips(root, BUCKET, shards_read)
    dt = time.perf_counter() - t
    return {
        "shards": shards,
        "load_validate_s": dt,
        "skipped": int(sum(len(v) for v in loaded.values())),
    }


def bench_plan(buckets: int = 1000, datasets: int = 3, rounds: int = 5) -> dict:
    """Plan ``buckets`` skewed buckets over ``datasets`` datasets mixed by proportion."""
    from prx_data.stream.planner import BucketCount, DatasetCount, plan_buckets

    rng = np.random.default_rng(0)
    counts = []
    for d in range(datasets):
        n = buckets // datasets + (d < buckets % datasets)
        sizes = (rng.pareto(1.2, n) * 2000 + 5).astype(int)
        counts.append(
            DatasetCount(
                f"d{d}",
                [
                    BucketCount(f"{512 * (1 + i // 13)}/{i:04d}", int(x))
                    for i, x in enumerate(sizes)
                ],
                proportion=float(d + 1),
            )
        )
    times = []
    for _ in range(rounds):
        t = time.perf_counter()
        plan = plan_buckets(
            counts, device_batch_size=128, world_size=8, num_workers=8, small_buckets="drop"
        )
        times.append(time.perf_counter() - t)
    want = [(d + 1) / sum(range(1, datasets + 1)) for d in range(datasets)]
    return {
        "buckets": sum(len(c.buckets) for c in counts),
        "samples": sum(c.kept for c in counts),
        "plan_s_best": min(times),
        "plan_s_median": sorted(times)[len(times) // 2],
        "max_share_error": max(
            abs(m.realised(plan.epoch_size) - w) for m, w in zip(plan.mix, want, strict=True)
        ),
    }


def bench_mix(work: str, samples: int, rounds: int, chunk: int = 50) -> dict:
    """BucketedDataset (planned mix) vs plain StreamingDataset streams over the same shards."""
    from streaming import Stream, StreamingDataset

    from prx_data.core.buckets import parse_bucket_name, same_ratio_shape
    from prx_data.stream.dataset import _decode

    shapes = {"512/1.000": 0.6, "512/0.500": 0.4}
    a = make_export(
        os.path.join(work, "mix-a"),
        {b: int(samples * 0.6 * f) for b, f in shapes.items()},
        name="a",
        samples_per_part=samples,
        samples_per_shard=200,
        hashes=(),
    ).root
    b = make_export(
        os.path.join(work, "mix-b"),
        {b: int(samples * 0.4 * f) for b, f in shapes.items()},
        name="b",
        samples_per_part=samples,
        samples_per_shard=200,
        hashes=(),
    ).root
    clean_stale_shared_memory()
    batch = 16
    mixed = BucketedDataset(
        [
            DatasetSpec(a, proportion=0.7, skip_lists=[]),
            DatasetSpec(b, proportion=0.3, skip_lists=[]),
        ],
        tier=512,
        batch_size=batch,
        small_buckets="drop",
    )
    streams = []
    for root, weight in ((a, 0.7), (b, 0.3)):
        kept = {bk: int(samples * (0.6 if root == a else 0.4) * f) for bk, f in shapes.items()}
        for bk, n in kept.items():
            streams.append(
                Stream(local=os.path.join(root, bk), proportion=weight * n / sum(kept.values()))
            )
    plain = StreamingDataset(
        streams=streams, batch_size=batch, batching_method="per_stream", shuffle=True
    )

    def plain_items(ds):
        for raw in ds:
            shape = same_ratio_shape(parse_bucket_name(raw["bucket"]), 512)
            yield _decode(raw["image"], shape)

    t_mix = t_plain = 0.0
    n_mix = n_plain = 0
    for _ in range(rounds):
        its = [iter(mixed), plain_items(plain)]
        live = [True, True]
        turn = 0
        while any(live):
            turn += 1
            for k in (0, 1) if turn % 2 else (1, 0):
                if not live[k]:
                    continue
                t = time.perf_counter()
                got = sum(1 for _ in zip(range(chunk), its[k], strict=False))
                dt = time.perf_counter() - t
                live[k] = got == chunk
                if k == 0:
                    t_mix, n_mix = t_mix + dt, n_mix + got
                else:
                    t_plain, n_plain = t_plain + dt, n_plain + got
    share = {m.name[-5:]: round(m.realised(mixed.plan.epoch_size), 4) for m in mixed.plan.mix}
    del mixed, plain
    gc.collect()
    clean_stale_shared_memory()
    return {
        "samples_per_s_planned_mix": n_mix / t_mix,
        "samples_per_s_plain_streaming": n_plain / t_plain,
        "ratio": (n_mix / t_mix) / (n_plain / t_plain),
        "samples_streamed": [n_mix, n_plain],
        "planned_shares": share,
    }


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument(
        "--quick", action="store_true", help="small sizes (a smoke run, not the figures)"
    )
    ap.add_argument(
        "--samples", type=int, default=2000, help="export size for the skip10 throughput run"
    )
    ap.add_argument(
        "--rounds", type=int, default=3, help="alternating rounds per measurement (best kept)"
    )
    ap.add_argument("--resume-at", type=int, default=1_000_000, help="sample_in_epoch to resume at")
    ap.add_argument(
        "--sidecar-shards", type=int, default=100_000, help="shards with a sidecar to load"
    )
    ap.add_argument(
        "--only",
        action="append",
        choices=("skip10", "resume", "sidecars", "plan", "mix"),
        help="run only these",
    )
    ap.add_argument("--work", default=None, help="scratch directory (default: a temp dir, removed)")
    args = ap.parse_args()
    if args.quick:
        args.samples, args.rounds, args.resume_at, args.sidecar_shards = 600, 1, 20_000, 2_000
    per_shard = 2000
    shards = int(args.resume_at / 0.9 / per_shard) + 2
    work = args.work or tempfile.mkdtemp(prefix="bench-stream-")
    try:
        benches = {
            "skip10": lambda: bench_skip10(work, args.samples, args.rounds),
            "resume": lambda: bench_resume(work, shards, per_shard, args.resume_at, args.rounds),
            "sidecars": lambda: bench_sidecars(work, args.sidecar_shards),
            "plan": lambda: bench_plan(),
            "mix": lambda: bench_mix(work, args.samples, args.rounds),
        }
        out = {k: f() for k, f in benches.items() if not args.only or k in args.only}
    finally:
        if args.work is None:
            shutil.rmtree(work, ignore_errors=True)
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
