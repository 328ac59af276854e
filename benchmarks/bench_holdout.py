#!/usr/bin/env python
"""Hold-out cost per rank: hashing every id on every rank vs once per node into a cache.

Fabricates one bucket's ``ids.parquet`` manifests (``--per-part`` ids per
part, one shard each) and its index at each size, then times, per rank:

* ``per_id``: the per-id Python loop every rank ran before (kept here as the
  reference, and checked to give the same set);
* ``leader``: the node leader computing the set (vectorised per manifest) and
  writing it to ``<local>/holdout/``;
* ``rank``: every other rank, and every later run, reading the cached set.

Prints seconds and microseconds per id per size, and the growth exponent
between sizes. Usage: ``python benchmarks/bench_holdout.py [--sizes 100000 1000000]``.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import os
import sys
import tempfile
import time

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from prx_data.export import layout, naming  # noqa: E402
from prx_data.stream import holdout as ho  # noqa: E402

BUCKET = "512/1.000"


def fabricate(root: str, n: int, per_part: int) -> list[layout.ShardInfo]:
    shards = []
    bdir = os.path.join(root, *BUCKET.split("/"))
    for start in range(0, n, per_part):
        k = min(per_part, n - start)
        part = naming.part_name(0, start)
        name = f"{part}/shard.00000.mds"
        os.makedirs(os.path.join(bdir, part), exist_ok=True)
        t = pa.table(
            {
                "shard": pa.array([name] * k, pa.string()),
                "index": pa.array(np.arange(k, dtype=np.int32)),
                "id": pa.array([f"ds/{BUCKET}/{start + i:010d}" for i in range(k)], pa.string()),
            }
        )
        pq.write_table(t, os.path.join(bdir, part, "ids.parquet"))
        shards.append(layout.ShardInfo(name, 1, k, {}))
    with open(os.path.join(bdir, naming.INDEX_NAME), "w") as f:
        json.dump({"shards": [s.basename for s in shards], "version": 2}, f)
    return shards


def per_id(hold: ho.Holdout, root: str, shards) -> dict[str, np.ndarray]:
    """What every rank ran before: read every manifest, hash and group one id at a time."""
    table = layout.read_manifests(root, [BUCKET])
    key = hold.salt.encode()[:64]
    mask = [
        int.from_bytes(hashlib.blake2b(i.encode(), digest_size=8, key=key).digest(), "little")
        / float(1 << 64)
        < hold.fraction
        for i in table["id"].to_pylist()
    ]
    out: dict[str, list[int]] = {}
    for shard, index, d in zip(
        table["shard"].to_pylist(), table["index"].to_pylist(), mask, strict=True
    ):
        if d:
            out.setdefault(shard, []).append(int(index))
    return {k: np.unique(np.asarray(v, np.int64)) for k, v in out.items()}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--sizes", type=int, nargs="+", default=[100_000, 300_000, 1_000_000])
    p.add_argument("--per-part", type=int, default=1000)
    p.add_argument("--fraction", type=float, default=0.01)
    args = p.parse_args()
    hold = ho.Holdout(args.fraction, "bench", "train")
    rows = []
    with tempfile.TemporaryDirectory() as work:
        for n in args.sizes:
            root = os.path.join(work, f"tree-{n}")
            cache = os.path.join(work, f"cache-{n}")
            shards = fabricate(root, n, args.per_part)
            t = time.perf_counter()
            want = per_id(hold, root, shards)
            before = time.perf_counter() - t
            t = time.perf_counter()
            lead = ho.holdout_skips(hold, root, root, {BUCKET: shards}, cache, is_leader=True)
            leader = time.perf_counter() - t
            t = time.perf_counter()
            other = ho.holdout_skips(hold, root, root, {BUCKET: shards}, cache, is_leader=False)
            rank = time.perf_counter() - t
            for got in (lead, other):
                side = got[BUCKET][1]
                assert side.keys() == want.keys()
                assert all(np.array_equal(side[k], want[k]) for k in want)
            rows.append((n, before, leader, rank))
            print(
                f"n={n:>9,}  per_id {before:7.2f} s ({before / n * 1e6:.2f} us/id)  "
                f"leader {leader:7.2f} s ({leader / n * 1e6:.2f} us/id)  "
                f"other ranks / later runs {rank:7.3f} s ({rank / n * 1e6:.3f} us/id)",
                flush=True,
            )
    for (n0, *a), (n1, *b) in zip(rows, rows[1:], strict=False):
        exps = [math.log(y / x) / math.log(n1 / n0) for x, y in zip(a, b, strict=True)]
        print(
            f"exponent {n0:,} -> {n1:,}: per_id {exps[0]:.2f}, leader {exps[1]:.2f}, "
            f"other ranks {exps[2]:.2f}"
        )


if __name__ == "__main__":
    main()
