"""``skips rewrite`` of a fabricated export: the re-shard stage against the previous rewrite.

Fabricates an export with :func:`prx_data.export.sample.make_sample_export`
(solid-colour JPEGs in the exporter's layout: parts, manifests, merged
indexes, report), skips every ``--every``-th sample with a list, then times
in one run, each in a fresh process:

- ``old``: the previous rewrite (its module as of ``--old-rev``, read with
  ``git show`` and imported from a temporary file): every sample read, decoded
  and re-encoded on the driver through its own ``MDSWriter`` subclass;
- ``driver``: the re-shard stage on driver threads (``--engine local``);
- ``ray1`` / ``ray2``: the stage on a private local Ray of 1 and 2 CPUs (Ray
  is started before the clock starts; its start is printed apart).

Every run verifies sample by sample (the default) unless ``--no-verify``;
each output's content digest must equal the old rewrite's. Prints seconds,
samples/s and the ratio to ``old``, and writes them as JSON with ``--json``.

    python benchmarks/bench_rewrite.py --samples 100000 --work /tmp/bench-rewrite
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

BUCKETS = ("512/1.000", "512/0.500")


def fabricate(root: str, samples: int, per_part: int, per_shard: int, every: int) -> None:
    from prx_data.export.sample import make_sample_export
    from tests.exportkit import skip_samples

    per_bucket = samples // len(BUCKETS)
    ex = make_sample_export(
        root,
        {b: per_bucket for b in BUCKETS},
        samples_per_part=per_part,
        samples_per_shard=per_shard,
    )
    ids = [i for b in BUCKETS for k, i in enumerate(ex.ids[b]) if k % every == 0]
    skip_samples(root, "dedup", ids=ids)


def old_module(rev: str):
    text = subprocess.run(
        ["git", "show", f"{rev}:prx_data/skips/rewrite.py"],
        cwd=ROOT,
        check=True,
        capture_output=True,
        text=True,
    ).stdout
    path = os.path.join(tempfile.mkdtemp(prefix="old-rewrite-"), "old_rewrite.py")
    with open(path, "w") as f:
        f.write(text)
    spec = importlib.util.spec_from_file_location("old_rewrite", path)
    mod = importlib.util.module_from_spec(spec)
    sys.modules["old_rewrite"] = mod  # dataclasses look their module up
    spec.loader.exec_module(mod)
    return mod


def run_one(mode: str, src: str, out: str, verify: bool, rev: str) -> dict:
    """One rewrite in this process: {seconds, samples, ray_start}."""
    ray_start = 0.0
    kw: dict = {"force": True, "verify": verify}
    if mode == "old":
        fn = old_module(rev).rewrite_export
    else:
        from prx_data.skips.rewrite import rewrite_export as fn

        kw["progress"] = False
        if mode == "driver":
            kw["engine"] = "local"
        else:
            from prx_data.core.runtime import ensure_ray

            kw.update(engine="ray", num_cpus=int(mode[-1]))
            t = time.perf_counter()
            ensure_ray(None, kw["num_cpus"])
            ray_start = time.perf_counter() - t
    t = time.perf_counter()
    r = fn(src, out, **kw)
    seconds = time.perf_counter() - t
    from prx_data.export import layout

    return {
        "seconds": seconds,
        "samples": r.samples_out,
        "ray_start": ray_start,
        "digest": layout.content_digest(out),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--samples", type=int, default=100_000)
    ap.add_argument("--per-part", type=int, default=5000)
    ap.add_argument("--per-shard", type=int, default=1000)
    ap.add_argument("--every", type=int, default=5, help="skip every N-th sample (default 5)")
    ap.add_argument("--modes", default="old,driver,ray1,ray2")
    ap.add_argument("--old-rev", default="f97d2a3", help="git revision of the old rewrite")
    ap.add_argument("--no-verify", action="store_true")
    ap.add_argument("--work", default=None)
    ap.add_argument("--json", default=None)
    ap.add_argument("--run", nargs=3, metavar=("MODE", "SRC", "OUT"), help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.run:
        mode, src, out = args.run
        print(json.dumps(run_one(mode, src, out, not args.no_verify, args.old_rev)))
        return
    work = tempfile.mkdtemp(prefix="bench-rewrite-", dir=args.work)
    src = os.path.join(work, "src")
    t = time.perf_counter()
    fabricate(src, args.samples, args.per_part, args.per_shard, args.every)
    print(f"fabricated {args.samples:,} samples in {time.perf_counter() - t:.0f} s", flush=True)
    results = {}
    for mode in args.modes.split(","):
        out = os.path.join(work, f"out-{mode}")
        cmd = [sys.executable, __file__, "--run", mode, src, out, "--old-rev", args.old_rev]
        cmd += ["--no-verify"] if args.no_verify else []
        proc = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT)
        if proc.returncode:
            sys.exit(f"{mode} failed:\n{proc.stderr[-3000:]}")
        results[mode] = json.loads(proc.stdout.strip().splitlines()[-1])
        shutil.rmtree(out, ignore_errors=True)
        r = results[mode]
        print(f"{mode:<7}{r['seconds']:8.1f} s  {r['samples'] / r['seconds']:9,.0f} samples/s"
              f"  (ray start {r['ray_start']:.1f} s)", flush=True)  # fmt: skip
    digests = {r["digest"] for r in results.values()}
    base = results.get("old")
    print(f"\nsame bytes in every output: {len(digests) == 1}")
    if base:
        for mode, r in results.items():
            print(f"{mode:<7}x{base['seconds'] / r['seconds']:.2f} faster than old")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "results": results}, f, indent=2)
    shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
