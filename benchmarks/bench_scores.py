"""Score jobs and semantic dedup at scale.

1. **Score-job overhead** (:mod:`prx_data.pipelines.score` through the column
   runner): ``--rows`` rows of tiny images over fragments of
   ``--rows-per-fragment``.
   - ``aesthetic``: the real aesthetic job over a stored 16-d embedding with a
     tiny linear head: the model costs nothing, so this is the runner's
     per-row overhead (read, step, write back, checkpoint, commit);
   - ``watermark``: the real classifier job with a ~20 k-parameter ViT on
     32x32 inputs: adds decode and preprocessing (target for both:
     >= 500 rows/s/core).
   Reported: seconds and rows/s/core (cores = ``--cpus``).
2. **Semantic dedup** (:func:`prx_data.skips.semdedup.find_semantic_duplicates`)
   on ``--embeddings`` synthetic 64-d embeddings (clustered, with 2 % planted
   near duplicates) held in memory; then on a ``--subset`` drawn the same way
   (k = 100) the clustered result against brute force (one cluster: every
   pair compared):
   the share of brute-force removals the clustered run also finds (recall)
   and the share it finds that brute force does not (0 by construction).
3. **The semantic dedup job** (:func:`prx_data.pipelines.semdedup.run_semdedup`) for
   each of ``--job-embeddings`` (comma-separated sizes) over a Lance table of
   those embeddings (``--rows-per-fragment`` rows per fragment), with
   ``engine=local`` and ``engine=ray``, each in a fresh subprocess: seconds,
   the driver's peak Python allocations (tracemalloc), peak Arrow pool bytes
   and peak RSS (Ray workers not counted), the 1-minute load average after,
   and whether both engines removed the same ids.

Usage::

    python benchmarks/bench_scores.py --rows 100000 --embeddings 1000000 --subset 10000
    python benchmarks/bench_scores.py --skip-jobs --embeddings 0 --job-embeddings 100000,1000000
"""

from __future__ import annotations

import argparse
import io
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import lance
import numpy as np
import pyarrow as pa
from PIL import Image

from prx_data.core.runtime import RunOptions

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from prx_data.columns import scores as SC  # noqa: E402
from prx_data.core import schema as S  # noqa: E402
from prx_data.core.runtime import ensure_ray  # noqa: E402
from prx_data.pipelines import score as SJ  # noqa: E402
from prx_data.skips import semdedup as SD  # noqa: E402


def tiny_jpeg(i: int) -> bytes:
    b = io.BytesIO()
    Image.new("RGB", (24, 24), (i % 256, (7 * i) % 256, (13 * i) % 256)).save(b, "JPEG")
    return b.getvalue()


def make_table(uri: str, rows: int, per_fragment: int, dim: int = 16) -> None:
    rng = np.random.default_rng(0)
    images = [tiny_jpeg(i) for i in range(256)]
    emb = rng.standard_normal((rows, dim)).astype(np.float32)
    t = pa.table(
        {
            S.ID: pa.array([f"b/{i:09d}" for i in range(rows)]),
            S.IMAGE: pa.array([images[i % 256] for i in range(rows)], pa.binary()),
            S.WIDTH: pa.array(np.full(rows, 24, np.int32)),
            S.HEIGHT: pa.array(np.full(rows, 24, np.int32)),
            SC.CLIP_IMAGE_COLUMN: pa.FixedSizeListArray.from_arrays(pa.array(emb.ravel()), dim),
        }
    )
    lance.write_dataset(t, uri, max_rows_per_file=per_fragment)


def bench_score_jobs(args, root: Path) -> dict:
    from prx_data.core.tinymodels import build_tiny_aesthetic_head, build_tiny_image_classifier

    head = str(build_tiny_aesthetic_head(root / "head.safetensors"))
    clf = str(build_tiny_image_classifier(root / "clf"))
    out = {}
    for scorer, model in (("aesthetic", head), ("watermark", clf)):
        if scorer not in args.scorers.split(","):
            continue
        uri = str(root / f"{scorer}.lance")
        make_table(uri, args.rows, args.rows_per_fragment)
        cfg = SJ.ScoreConfig(
            uri,
            scorer,
            model,
            run=RunOptions(engine=args.engine, progress=False, num_cpus=args.cpus),
            device="cpu",
            batch_size=256,
            commit_every=64,
        )
        t0 = time.perf_counter()
        rep = SJ.run_score(cfg)
        s = time.perf_counter() - t0
        assert rep.rows == args.rows and not rep.failed, rep.text()
        out[scorer] = {
            "rows": rep.rows,
            "seconds": round(s, 2),
            "rows_per_s_per_core": round(rep.rows / s / args.cpus, 1),
        }
        print(scorer, out[scorer], flush=True)
    return out


def clustered_embeddings(n: int, dim: int = 64, seed: int = 0) -> np.ndarray:
    rng = np.random.default_rng(seed)
    centres = rng.standard_normal((max(1, n // 500), dim))
    x = centres[rng.integers(0, len(centres), n)] + 0.6 * rng.standard_normal((n, dim))
    dup = rng.choice(n, n // 50, replace=False)
    src = rng.integers(0, n, len(dup))
    x[dup] = x[src] + 0.02 * rng.standard_normal((len(dup), dim))
    return SD.normalise(x)


def bench_semdedup(args) -> dict:
    x = clustered_embeddings(args.embeddings)
    n = len(x)
    area = np.random.default_rng(1).integers(1, 10**6, n)
    ids = pa.array([f"e{i:09d}" for i in range(n)])
    t0 = time.perf_counter()
    dups = SD.find_semantic_duplicates(lambda r: x[r], n, area, ids, cluster_size=1000)
    full_s = time.perf_counter() - t0
    # The reference: a subset drawn the same way (its own 2 % planted pairs), clustered
    # into 100 clusters as the full run is (k = 1000 there), against all pairs compared.
    m = min(args.subset, n)
    xs, a_s, i_s = clustered_embeddings(m, seed=2), area[:m], ids.slice(0, m)
    t0 = time.perf_counter()
    clus = SD.find_semantic_duplicates(lambda r: xs[r], m, a_s, i_s, cluster_size=max(1, m // 100))
    sub_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    brute = SD.find_semantic_duplicates(lambda r: xs[r], m, a_s, i_s, cluster_size=10**12)
    brute_s = time.perf_counter() - t0
    out = {"embeddings": n, "seconds": round(full_s, 2), "subset": m}
    for t in (0.9, 0.95):
        b = set(np.flatnonzero(brute.removed(t)).tolist())
        c = set(np.flatnonzero(clus.removed(t)).tolist())
        out[f"t={t}"] = {
            "removed_full": int(dups.removed(t).sum()),
            "brute_removed": len(b),
            "clustered_removed": len(c),
            "recall": round(len(b & c) / len(b), 4) if b else 1.0,
            "extra": len(c - b),
        }
    out["subset_seconds"] = {"clustered": round(sub_s, 2), "brute": round(brute_s, 2)}
    print("semdedup", json.dumps(out), flush=True)
    return out


def engine_run(uri: str, engine: str, cpus: int, iters: int, out: str) -> None:
    """One job run in this (fresh) process; figures and removed ids to ``out``."""
    import tracemalloc

    from prx_data.pipelines.semdedup import SemDedupConfig, run_semdedup

    if engine == "ray":
        ensure_ray(num_cpus=cpus)
    tracemalloc.start()
    t0 = time.perf_counter()
    rep = run_semdedup(SemDedupConfig(uri, run=RunOptions(engine=engine), iters=iters))
    seconds = time.perf_counter() - t0
    _, peak = tracemalloc.get_traced_memory()
    t = lance.dataset(uri).to_table(columns=[S.ID, "semdedup_cosine"])
    removed = pa.compute.greater_equal(t["semdedup_cosine"], rep.threshold).fill_null(False)
    res = {
        "seconds": round(seconds, 2),
        "tracemalloc_peak_mb": round(peak / 2**20, 1),
        "arrow_peak_mb": round(pa.default_memory_pool().max_memory() / 2**20, 1),
        "peak_rss_mb": _peak_rss_mb(),
        "loadavg_1m": round(os.getloadavg()[0], 2),
        "removed": rep.removed,
        "clusters": rep.clusters,
        "removed_ids": sorted(t[S.ID].filter(removed).to_pylist()),
    }
    Path(out).write_text(json.dumps(res))


def _peak_rss_mb() -> float:
    """This process's peak RSS (``VmHWM``: unlike ``ru_maxrss`` it does not carry the parent's)."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return round(int(line.split()[1]) / 1024, 1)
    return float("nan")


def bench_semdedup_job(args, root: Path) -> dict:
    out: dict = {}
    for n in (int(v) for v in args.job_embeddings.split(",") if v.strip()):
        x = clustered_embeddings(n)
        uri = str(root / f"emb{n}.lance")
        area = np.random.default_rng(1).integers(1, 1000, n)
        t = pa.table(
            {
                S.ID: pa.array([f"e{i:09d}" for i in range(n)]),
                S.WIDTH: pa.array(area.astype(np.int32)),
                S.HEIGHT: pa.array(np.ones(n, np.int32)),
                SC.CLIP_IMAGE_COLUMN: pa.FixedSizeListArray.from_arrays(
                    pa.array(x.astype(np.float32).ravel()), x.shape[1]
                ),
            }
        )
        lance.write_dataset(t, uri, max_rows_per_file=args.rows_per_fragment)
        del x, t
        row: dict = {}
        for engine in ("local", "ray"):
            res_path = root / f"res-{n}-{engine}.json"
            here = str(Path(__file__).parent)
            code = (
                f"import sys; sys.path.insert(0, {here!r}); import bench_scores as B; "
                f"B.engine_run({uri!r}, {engine!r}, {args.cpus}, {args.iters}, {str(res_path)!r})"
            )
            subprocess.run([sys.executable, "-c", code], check=True)
            row[engine] = json.loads(res_path.read_text())
        same = row["local"].pop("removed_ids") == row["ray"].pop("removed_ids")
        row["same_removed_ids"] = same
        out[str(n)] = row
        print("semdedup job", n, json.dumps(row), flush=True)
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--rows", type=int, default=100_000, help="rows of each score job")
    p.add_argument("--rows-per-fragment", type=int, default=10_000, help="rows per fragment")
    p.add_argument("--engine", choices=("ray", "local"), default="ray", help="runner engine")
    p.add_argument("--cpus", type=int, default=2, help="CPUs for Ray (and the per-core figure)")
    p.add_argument("--embeddings", type=int, default=1_000_000, help="semantic dedup size")
    p.add_argument("--subset", type=int, default=10_000, help="brute-force comparison size")
    p.add_argument(
        "--scorers", default="aesthetic,watermark", help="score jobs to run (comma-separated)"
    )
    p.add_argument("--skip-jobs", action="store_true", help="only the semantic dedup part")
    p.add_argument(
        "--job-embeddings",
        default="",
        help="comma-separated table sizes for the semdedup job, local vs ray (default: none)",
    )
    p.add_argument("--iters", type=int, default=20, help="k-means iterations of the job runs")
    p.add_argument("--json", default=None, help="write the figures to this file")
    args = p.parse_args(argv)
    res: dict = {}
    with tempfile.TemporaryDirectory() as d:
        if not args.skip_jobs:
            if args.engine == "ray":
                ensure_ray(num_cpus=args.cpus)
            res["score_jobs"] = bench_score_jobs(args, Path(d))
        if args.embeddings:
            res["semdedup"] = bench_semdedup(args)
        if args.job_embeddings:
            res["semdedup_job"] = bench_semdedup_job(args, Path(d))
    if args.json:
        Path(args.json).write_text(json.dumps(res, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
