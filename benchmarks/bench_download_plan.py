"""Driver memory and time of the download's duplicate planning on fabricated URL tables.

Nothing is fetched: a table of ``--rows`` URL rows (10 % repeated URLs, a
tenth of the rows already ``ok``) is planned with
:func:`prx_data.pipelines.download.plan_duplicates` in a fresh process per setting,
once in memory and once spilled by URL hash, and each run reports its peak
resident memory (sampled) above the process's level before planning.

    python benchmarks/bench_download_plan.py --rows 250000 1000000 --out results.json
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def make_table(uri: str, rows: int) -> None:
    import lance
    import numpy as np
    import pyarrow as pa

    from prx_data.core import schema as S

    rng = np.random.default_rng(0)
    ids = np.arange(rows)
    src = np.where(rng.random(rows) < 0.1, rng.integers(0, max(1, rows // 10), rows), ids)
    urls = pa.array([f"https://img{i % 97}.example.com/photos/{i:012d}.jpg" for i in src.tolist()])
    status = pa.array(np.where(ids % 10 == 0, "ok", None).tolist(), pa.string())
    cols = {
        S.ID: pa.array([f"laion/{i}" for i in ids.tolist()]),
        S.IMAGE: pa.nulls(rows, pa.large_binary()),
        S.WIDTH: pa.nulls(rows, pa.int32()),
        S.HEIGHT: pa.nulls(rows, pa.int32()),
        S.FORMAT: pa.nulls(rows, pa.string()),
        S.SOURCE: pa.array(["laion"] * rows),
        S.CAPTION: pa.nulls(rows, pa.string()),
        S.PROBE_ERROR: pa.array(["missing_image"] * rows),
    }
    table = pa.table(cols, schema=S.TABLE_SCHEMA)
    table = table.append_column("url", urls).append_column("download_status", status)
    lance.write_dataset(table, uri, mode="create", max_rows_per_file=1 << 18)


def _rss_mb() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def measure(uri: str, partition_rows: int) -> dict:
    """Run in a child: peak RSS (MB, sampled every 5 ms) above the level before planning.

    ``partition_rows`` 0 measures the pending-row selection instead: the per-fragment
    pending counts and the work units the download job plans from them.
    """
    import threading
    import time

    import lance
    import prx_data.pipelines.download as D

    from prx_data.columns import runner as R

    ds = lance.dataset(uri)
    where = D.pending_filter("url")
    ds.count_rows(where)  # warm the manifest and Lance's caches outside the measurement
    before = _rss_mb()
    peak = [before]
    stop = threading.Event()

    def sample() -> None:
        while not stop.wait(0.005):
            peak[0] = max(peak[0], _rss_mb())

    t = threading.Thread(target=sample, daemon=True)
    t.start()
    t0 = time.perf_counter()
    if partition_rows:
        found = len(D.plan_duplicates(ds, "url", where, partition_rows=partition_rows))
    else:
        units, _ = R.plan_units(R.pending_counts(ds, where), None, D.DownloadConfig.rows_per_unit)
        found = len(units)
    seconds = time.perf_counter() - t0
    stop.set()
    t.join()
    return {
        "peak_mb": round(max(peak[0], _rss_mb()) - before, 1),
        "seconds": round(seconds, 2),
        ("duplicates" if partition_rows else "units"): int(found),
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rows", type=int, nargs="+", default=[250_000, 1_000_000])
    p.add_argument(
        "--partition-rows",
        type=int,
        default=1 << 17,
        help="rows planned in memory at once by the spilled plan",
    )
    p.add_argument("--out", default=None)
    p.add_argument("--child", nargs=2, metavar=("URI", "PARTITION_ROWS"), help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child:
        print(json.dumps(measure(args.child[0], int(args.child[1]))))
        return
    env = {**os.environ, "PYTHONPATH": ROOT}
    results = []
    with tempfile.TemporaryDirectory() as tmp:
        for rows in args.rows:
            uri = f"{tmp}/t{rows}.lance"
            make_table(uri, rows)
            modes = (("in_memory", 1 << 40), ("spilled", args.partition_rows), ("pending", 0))
            for mode, part in modes:
                out = subprocess.run(
                    [sys.executable, __file__, "--child", uri, str(part)],
                    env=env,
                    capture_output=True,
                    text=True,
                    check=True,
                ).stdout
                r = {"rows": rows, "mode": mode, "partition_rows": part, **json.loads(out)}
                print(json.dumps(r), flush=True)
                results.append(r)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(results, f, indent=2)


if __name__ == "__main__":
    main()
