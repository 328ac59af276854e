"""Benchmark: per-job throughput on the one runner against an older commit, same run.

Target (issue #33): on 10^5 rows every job's throughput on the runner is at
least its old figure. Measured for ``ingest`` (a folder of small JPEGs into a
new table) and one column job (``quality``: decode every image, write
``image_quality``), each run as a user runs it: a fresh ``prx-data JOB``
process with the default ``--engine auto``. The old code runs from a
``git worktree`` of ``--old`` (default b69f4ad, before ingest and semdedup
moved onto the runner); both trees run on the same inputs, in alternating
rounds, and each keeps its fastest round, so a busy machine disturbs both
alike. The ratio new/old of rows per second is the figure (>= 1: no slower).

Both trees run with ``RAY_AUTH_MODE=disabled``: the old tree cannot start a
local Ray with token auth on a host without ``~/.ray/auth_token``.

    python benchmarks/bench_runner.py                       # 10^5 rows, 1 round
    python benchmarks/bench_runner.py --rows 20000 --rounds 2 --json out.json
"""

from __future__ import annotations

import argparse
import io
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

#: One process: run the job's main, time it, say whether it used Ray (JSON on the last line).
_RUNNER = """
import json, sys, time
from prx_data.cli import JOBS
t = time.perf_counter()
rc = JOBS[sys.argv[1]].main(sys.argv[2:])
main_s = time.perf_counter() - t
print(json.dumps({"rc": rc, "main_s": main_s, "ray_used": "ray" in sys.modules}))
"""


def _images(folder: str, rows: int) -> None:
    """``rows`` small JPEGs (16 distinct images of 48-108 px, written under distinct names)."""
    from PIL import Image

    os.makedirs(folder, exist_ok=True)
    blobs = []
    for i in range(16):
        img = Image.new("RGB", (48 + 4 * i, 64 - 2 * i), (16 * i, 255 - 16 * i, 90))
        buf = io.BytesIO()
        img.save(buf, "JPEG", quality=85)
        blobs.append(buf.getvalue())
    per_dir = 10_000
    for i in range(rows):
        d = os.path.join(folder, f"d{i // per_dir:03d}")
        if i % per_dir == 0:
            os.makedirs(d, exist_ok=True)
        with open(os.path.join(d, f"{i:07d}.jpg"), "wb") as f:
            f.write(blobs[i % 16])


def _run(tree: str, job: str, args: list[str], env: dict) -> dict:
    argv = [sys.executable, "-c", _RUNNER, job, *args, "--no-progress"]
    t = time.perf_counter()
    r = subprocess.run(
        argv, env={**env, "PYTHONPATH": tree}, cwd=tree, capture_output=True, text=True, timeout=900
    )
    wall = time.perf_counter() - t
    if not r.stdout.strip():
        raise SystemExit(f"{job} in {tree} failed:\n{r.stdout[-2000:]}\n{r.stderr[-2000:]}")
    out = json.loads(r.stdout.strip().splitlines()[-1])
    if out["rc"] != 0:
        raise SystemExit(f"{job} in {tree} exited {out['rc']}:\n{r.stderr[-2000:]}")
    out["process_s"] = wall
    return out


def _commit(tree: str) -> str:
    return subprocess.run(
        ["git", "-C", tree, "rev-parse", "--short", "HEAD"], capture_output=True, text=True
    ).stdout.strip()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rows", type=int, default=100_000, help="rows (default: %(default)s)")
    p.add_argument("--rounds", type=int, default=1, help="rounds per tree (default: 1)")
    p.add_argument("--old", default="b69f4ad", help="the old commit (default: %(default)s)")
    p.add_argument("--only", default=None, help="comma-separated jobs (default: ingest,quality)")
    p.add_argument("--json", default=None, help="write the figures here")
    args = p.parse_args(argv)

    work = tempfile.mkdtemp(prefix="bench_runner_")
    old = os.path.join(work, "old-tree")
    subprocess.run(
        ["git", "-C", ROOT, "worktree", "add", "--detach", old, args.old],
        check=True,
        capture_output=True,
    )
    env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_ADDRESS")}
    env.update(TMPDIR=work, RAY_AUTH_MODE="disabled")  # no `ray start` record is seen
    trees = {"old": old, "new": ROOT}
    jobs = ["ingest", "quality"] if not args.only else args.only.split(",")
    results: dict[str, dict] = {}
    try:
        folder = os.path.join(work, "images")
        t = time.perf_counter()
        _images(folder, args.rows)
        base = os.path.join(work, "base.lance")
        _run(ROOT, "ingest", [folder, "--table", base, "--engine", "local"], env)
        print(f"{args.rows:,} rows ready in {time.perf_counter() - t:.0f} s")
        table = os.path.join(work, "t.lance")
        argsets = {
            "ingest": [folder, "--table", table, "--mode", "create"],
            "quality": ["--table", table],
        }
        print(f"{args.rows:,} rows; fastest of {args.rounds} round(s); --engine auto")
        print(
            f"{'job':<8} {'old s':>8} {'new s':>8} {'old rows/s':>11} {'new rows/s':>11} "
            f"{'new/old':>8} {'Ray used (old, new)':>20}"
        )
        for job in jobs:
            best: dict[str, dict] = {}
            for _ in range(args.rounds):
                for name, tree in trees.items():
                    shutil.rmtree(table, ignore_errors=True)
                    if job != "ingest":
                        shutil.copytree(base, table)
                    r = _run(tree, job, argsets[job], env)
                    if name not in best or r["main_s"] < best[name]["main_s"]:
                        best[name] = r
            o, n = best["old"], best["new"]
            ratio = o["main_s"] / n["main_s"]
            print(
                f"{job:<8} {o['main_s']:8.1f} {n['main_s']:8.1f} {args.rows / o['main_s']:11,.0f} "
                f"{args.rows / n['main_s']:11,.0f} {ratio:8.2f} "
                f"{str(o['ray_used']) + ', ' + str(n['ray_used']):>20}"
            )
            results[job] = {**best, "ratio_new_over_old_throughput": ratio}
    finally:
        subprocess.run(["git", "-C", ROOT, "worktree", "remove", "--force", old], check=False)
        shutil.rmtree(work, ignore_errors=True)
    ok = all(r["ratio_new_over_old_throughput"] >= 1.0 for r in results.values())
    print(f"old {args.old}, new {_commit(ROOT)}; target (new >= old):", "met" if ok else "NOT met")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(
                {"rows": args.rows, "rounds": args.rounds, "old": args.old, "jobs": results},
                f,
                indent=2,
            )
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
