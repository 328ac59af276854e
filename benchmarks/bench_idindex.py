"""An opt-out against exports of growing size: through the id index vs every manifest.

Fabricates only what binding ids to shards reads: per bucket a merged
``index.json`` (one shard per part) and each part's ``ids.parquet`` manifest
(no shard files). For each size, each in a fresh process:

  build      ``write_id_index`` (what finalize / rewrite / pack add)
  bind_*     binding the opt-out's ids to shards alone (``skips.bind``), before / after
  before     ``add_optout`` of ``--ids`` ids on the tree without its index (every manifest)
  after      the same opt-out through the index (sidecar writes and statistics included)
  in / scan  the two lookup strategies of ``IdIndex.lookup`` alone, for the opt-out's ids
             and for 10 % of the rows (which one the chooser would pick is printed)

with the seconds, the peak resident memory the operation added (``ru_maxrss``
of a child process over its baseline after imports) and the traced Python peak
(``tracemalloc``), then the growth exponent ``log(t2/t1) / log(n2/n1)`` of each.

    python benchmarks/bench_idindex.py --sizes 1e5 1e6
"""

from __future__ import annotations

import argparse
import json
import math
import os
import resource
import shutil
import subprocess
import sys
import tempfile
import time
import tracemalloc

BUCKETS = [f"512/{r}" for r in ("0.500", "0.750", "1.000", "1.333", "2.000")]


def _sid(i: int) -> str:
    return f"src/{i:010d}"


def fabricate(root: str, n: int, per_part: int) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    from prx_data.core.schema import MDS_COLUMNS
    from prx_data.export import naming, safety

    names, encs = list(MDS_COLUMNS), list(MDS_COLUMNS.values())
    per_bucket = n // len(BUCKETS)
    k = 0
    for b in BUCKETS:
        bdir = os.path.join(root, *b.split("/"))
        shards = []
        for start in range(0, per_bucket, per_part):
            m = min(per_part, per_bucket - start)
            part = naming.part_name(0, k)
            os.makedirs(os.path.join(bdir, part))
            base = f"{part}/shard.00000.mds"
            ids = pa.array([_sid(k + j) for j in range(m)], pa.string())
            t = pa.table(
                {
                    "shard": pa.array([base] * m, pa.string()),
                    "index": pa.array(range(m), pa.int32()),
                    "id": ids,
                }
            )
            pq.write_table(t, os.path.join(bdir, part, "ids.parquet"), compression="zstd")
            shards.append(
                {
                    "column_encodings": encs,
                    "column_names": names,
                    "column_sizes": [None] * len(names),
                    "compression": None,
                    "format": "mds",
                    "hashes": [],
                    "raw_data": {"basename": base, "bytes": 1000 * m, "hashes": {}},
                    "samples": m,
                    "size_limit": 1 << 26,
                    "version": 2,
                    "zip_data": None,
                }
            )
            k += m
        with open(os.path.join(bdir, "index.json"), "w") as f:
            json.dump({"version": 2, "shards": shards}, f, sort_keys=True)
    safety.write_export_marker(root)


def _rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def _cpu_s() -> float:
    """CPU seconds of this process, all threads (steadier than wall time on a busy machine)."""
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def child(root: str, op: str, n: int, n_ids: int) -> dict:
    """One measured operation in this (fresh) process."""
    import lance  # noqa: F401 (imports are not what is measured)
    import numpy as np
    import pyarrow as pa

    import prx_data.core.streaming_compat  # noqa: F401
    from prx_data.export import idindex
    from prx_data.skips import optout

    rng = np.random.default_rng(0)
    total = (n // len(BUCKETS)) * len(BUCKETS)
    base = _rss_mb()
    tracemalloc.start()
    c0 = _cpu_s()
    t0 = time.perf_counter()
    extra: dict = {}
    if op == "build":
        extra["rows"] = idindex.write_id_index(root).rows
    elif op.startswith("bind_"):  # the lookup alone: ids -> (bucket, shard) positions
        from prx_data.skips.bind import bind

        ids = [_sid(int(i)) for i in rng.choice(total, n_ids, replace=False)] + ["gone/1"]
        b = bind(root, {"optout": pa.array(ids)}, want_missing=["optout"])["optout"]
        extra.update(samples=b.samples, missing=len(b.missing))
    elif op in ("before", "after"):
        ids = [_sid(int(i)) for i in rng.choice(total, n_ids, replace=False)] + ["gone/1"]
        r = optout.add_optout(root, "optout", ids, export_only=True)
        extra.update(samples=r.samples_in_list, missing=r.ids_not_in_export)
    else:  # in / scan, for n_ids ids and for 10 % of the rows
        index, why = idindex.open_index(root)
        assert index is not None, why
        q = n_ids if op.endswith("small") else total // 10
        ids = pa.array([_sid(int(i)) for i in rng.choice(total, q, replace=False)])
        c0 = _cpu_s()
        t0 = time.perf_counter()
        # lookup() scans when len(chunk) * SCAN_RATIO > rows: 0 never scans, a huge one always.
        idindex.SCAN_RATIO = 0 if op.startswith("in") else 1 << 62
        extra["rows"] = sum(len(t) for t in index.lookup(ids))
        extra["ids"] = q
    seconds = time.perf_counter() - t0
    cpu = _cpu_s() - c0
    _, peak = tracemalloc.get_traced_memory()
    return {
        "seconds": round(seconds, 3),
        "cpu_s": round(cpu, 3),
        "rss_mb": round(_rss_mb() - base, 1),
        "traced_mb": round(peak / 2**20, 1),
        **extra,
    }


def run_child(root: str, op: str, n: int, n_ids: int) -> dict:
    out = subprocess.run(
        [sys.executable, __file__, "--child", root, op, str(n), str(n_ids)],
        check=True,
        capture_output=True,
        text=True,
    )
    return json.loads(out.stdout.strip().splitlines()[-1])


def _clear_lists(root: str) -> None:
    import glob

    shutil.rmtree(os.path.join(root, "_lists"), ignore_errors=True)
    for p in glob.glob(os.path.join(root, "*", "*", "*", "*.skip")):
        os.remove(p)


def exponent(n1: int, t1: float, n2: int, t2: float) -> float:
    if t1 <= 0 or t2 <= 0:
        return float("nan")
    return math.log(t2 / t1) / math.log(n2 / n1)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--sizes", nargs="+", type=float, default=[1e5, 1e6])
    ap.add_argument("--ids", type=int, default=1000, help="ids per opt-out")
    ap.add_argument("--per-part", type=int, default=400, help="manifest rows per part")
    ap.add_argument("--child", nargs=4, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        root, op, n, k = args.child
        print(json.dumps(child(root, op, int(n), int(k))))
        return
    sizes = [int(s) for s in args.sizes]
    ops = ["build", "bind_before", "bind_after", "before", "after"]
    ops += ["in_small", "scan_small", "in_10pct", "scan_10pct"]
    runs: dict[int, dict] = {}
    for n in sizes:
        work = tempfile.mkdtemp(prefix="bench-idindex-")
        try:
            root = os.path.join(work, "ex")
            t = time.perf_counter()
            fabricate(root, n, args.per_part)
            print(f"n={n:,}: fabricated in {time.perf_counter() - t:.1f} s", flush=True)
            res = {"bind_before": run_child(root, "bind_before", n, args.ids)}
            res["before"] = run_child(root, "before", n, args.ids)
            _clear_lists(root)  # the same opt-out again, from scratch
            res["build"] = run_child(root, "build", n, args.ids)
            res["bind_after"] = run_child(root, "bind_after", n, args.ids)
            for op in ops[4:]:
                if op == "after":
                    _clear_lists(root)
                res[op] = run_child(root, op, n, args.ids)
            runs[n] = res
            for op in ops:
                print(f"  {op:<11}{json.dumps(res[op])}", flush=True)
        finally:
            shutil.rmtree(work, ignore_errors=True)
    hdr = "".join(f"{f'{n:,} s':>13}{'cpu s':>8}{'rss MB':>8}" for n in sizes)
    print(f"\n{'op':<12}{hdr}  exp(s) exp(cpu)")
    for op in ops:
        row = f"{op:<12}"
        for n in sizes:
            r = runs[n][op]
            row += f"{r['seconds']:>13.3f}{r['cpu_s']:>8.2f}{r['rss_mb']:>8.1f}"
        if len(sizes) > 1:
            a, b = runs[sizes[0]][op], runs[sizes[-1]][op]
            e_s = exponent(sizes[0], a["seconds"], sizes[-1], b["seconds"])
            e_c = exponent(sizes[0], a["cpu_s"], sizes[-1], b["cpu_s"])
            row += f"  {e_s:6.2f} {e_c:6.2f}"
        print(row)


if __name__ == "__main__":
    main()
