"""Benchmark: small jobs never start Ray, and end within 1.5x their work on driver threads.

Target (issue #33): on a 12-row table every job, run as a user runs it (a fresh
``prx-data JOB`` process with the default ``--engine auto``), ends without
starting Ray, in at most 1.5x the time of the same job with ``--engine local``
(its work on driver threads, the anchor measured in the same run). Each job
gets a fresh copy of the table, so every run does the same work.

Per job it prints the wall time of the whole process and of the job's
``main`` inside it (process start-up and imports are the difference), for
``auto`` and ``local`` and, with ``--with-ray``, ``--engine ray`` for contrast;
and whether Ray was started. Rounds alternate the engines; each keeps its
fastest round, so a busy machine disturbs both alike.

    python benchmarks/bench_startup.py                  # 12 rows, 2 rounds
    python benchmarks/bench_startup.py --with-ray --json benchmarks/results/startup.json
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time

from prx_data.core.runtime import RunOptions

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

#: One process: run the job's main, time it, say whether Ray was started (JSON on the last line).
_RUNNER = """
import json, sys, time
from prx_data.cli import JOBS
t = time.perf_counter()
rc = JOBS[sys.argv[1]].main(sys.argv[2:])
main_s = time.perf_counter() - t
ray = sys.modules.get("ray")
started = bool(ray is not None and ray.is_initialized())
print(json.dumps({"rc": rc, "main_s": main_s, "ray_started": started}))
"""


def _jobs(table: str, work: str) -> dict[str, list[str]]:
    """The jobs that need no model or network, with their arguments on ``table``."""
    return {
        "ingest": [os.path.join(work, "images"), "--table", os.path.join(work, "ing.lance")]
        + ["--mode", "create"],
        "quality": ["--table", table],
        "dedup": ["--table", table, "--report", ""],
        "classify": ["--table", table, "--rules-only", "--source-column", "caption"],
        "write_mds": ["--table", table, "--out", os.path.join(work, "mds"), "--tiers", "256"],
        "semdedup": ["--table", table, "--embedding-column", "pixel_descriptor"]
        + ["--cluster-size", "4"],
    }


def _run(job: str, args: list[str], engine: str, env: dict) -> dict:
    argv = [sys.executable, "-c", _RUNNER, job, *args, "--engine", engine, "--no-progress"]
    t = time.perf_counter()
    r = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=600)
    wall = time.perf_counter() - t
    if r.returncode != 0 or not r.stdout.strip():
        raise SystemExit(f"{job} --engine {engine} failed:\n{r.stdout[-2000:]}\n{r.stderr[-2000:]}")
    out = json.loads(r.stdout.strip().splitlines()[-1])
    out["process_s"] = wall
    return out


def _make_table(work: str, rows: int) -> str:
    sys.path.insert(0, ROOT)
    from prx_data.pipelines.ingest import ingest

    from prx_data.columns import descriptors
    from prx_data.core.sample_data import make_sample_collection

    folder = os.path.join(work, "images")
    sizes = ((320, 240), (240, 320), (300, 300), (400, 225), (225, 400), (360, 270))
    make_sample_collection(folder, sizes=sizes, repeats=max(1, rows // len(sizes)))
    table = os.path.join(work, "base.lance")
    ingest([folder], table, mode="create", progress=False, engine="local")
    descriptors.compute_descriptors(
        table,
        run=RunOptions(progress=False, engine="local"),
    )  # for semdedup
    return table


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rows", type=int, default=12, help="table rows (default: %(default)s)")
    p.add_argument("--rounds", type=int, default=2, help="rounds per engine (default: 2)")
    p.add_argument("--with-ray", action="store_true", help="also time --engine ray")
    p.add_argument("--only", default=None, help="comma-separated jobs (default: all)")
    p.add_argument("--json", default=None, help="write the figures here")
    args = p.parse_args(argv)

    work = tempfile.mkdtemp(prefix="bench_startup_")
    env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_ADDRESS")}
    env.update(PYTHONPATH=ROOT, TMPDIR=work)  # no `ray start` record of this host is seen
    engines = ["auto", "local"] + (["ray"] if args.with_ray else [])
    results: dict[str, dict] = {}
    try:
        base = _make_table(work, args.rows)
        table = os.path.join(work, "t.lance")
        jobs = _jobs(table, work)
        if args.only:
            jobs = {k: v for k, v in jobs.items() if k in args.only.split(",")}
        print(f"{args.rows} rows; fastest of {args.rounds} rounds; seconds")
        print(
            f"{'job':<10} {'auto main':>9} {'local main':>10} {'ratio':>6} "
            f"{'auto proc':>9} {'local proc':>10} {'ray main':>8} {'Ray started (auto)':>19}"
        )
        for job, jargs in jobs.items():
            best: dict[str, dict] = {}
            for _ in range(args.rounds):
                for engine in engines:
                    shutil.rmtree(table, ignore_errors=True)
                    for name in ("mds", "ing.lance"):
                        shutil.rmtree(os.path.join(work, name), ignore_errors=True)
                    shutil.copytree(base, table)
                    r = _run(job, jargs, engine, env)
                    if engine not in best or r["main_s"] < best[engine]["main_s"]:
                        best[engine] = r
            auto, local = best["auto"], best["local"]
            ratio = auto["main_s"] / local["main_s"] if local["main_s"] else float("inf")
            ray_s = f"{best['ray']['main_s']:8.2f}" if "ray" in best else f"{'-':>8}"
            print(
                f"{job:<10} {auto['main_s']:9.2f} {local['main_s']:10.2f} {ratio:6.2f} "
                f"{auto['process_s']:9.2f} {local['process_s']:10.2f} {ray_s} "
                f"{str(auto['ray_started']):>19}"
            )
            results[job] = {**best, "ratio": ratio, "ok": ratio <= 1.5 and not auto["ray_started"]}
    finally:
        shutil.rmtree(work, ignore_errors=True)
    ok = all(r["ok"] for r in results.values())
    print("target (no Ray, <= 1.5x local):", "met" if ok else "NOT met")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"rows": args.rows, "rounds": args.rounds, "jobs": results}, f, indent=2)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
