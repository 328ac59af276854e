"""Download benchmark: prx-data's download job against img2dataset 1.47 on one URL list.

A loopback server (its own process, 127.0.0.1 only) serves N URLs of real
photos (``benchmarks/photo_corpus.py``: Debian wallpaper JPEGs and WebPs,
downscaled once to LAION-like sizes, repeated under distinct URLs) with
injected latency and a few percent of failures, fixed per URL:

- ``404``: permanent, must not be retried;
- ``500``: always, transient, retried and still failing;
- ``503once``: the first request fails, the retry succeeds;
- ``stall``: headers and half a body, then silence (a timeout).

Both tools get the same URLs (under a per-tool path prefix, so the
``503once`` state is fresh for each), CPUs, threads per process, timeout and
retries. img2dataset 1.47 is installed into a throwaway venv under
``--work`` on first use (``pip install img2dataset==1.47.0``) and runs with
``--resize_mode no`` (original bytes, as prx-data keeps them) into
WebDataset shards. prx-data ingests the URL list as a LAION-style parquet
(not timed) and downloads it into the table on Ray with ``--num-cpus``
(Ray started before the clock; its start-up is printed separately).

Reported per tool: wall seconds, images, success rate, images/s and
images/s per core, the failure accounting (every URL ok or failed with a
reason, checked against the injected faults for prx-data), requests the
server saw, and for prx-data the bytes written to the table against the
bytes downloaded.

Usage (short smoke run; the figures in docs/LANCE.md use --urls 2000):
  python benchmarks/bench_download.py --urls 300
  python benchmarks/bench_download.py --urls 2000 --cpus 2 --threads 32
"""

from __future__ import annotations

import argparse
import glob
import io
import json
import multiprocessing as mp
import os
import random
import shutil
import subprocess
import sys
import threading
import time

from prx_data.core.runtime import RunOptions

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

FAULTS = ("404", "500", "503once", "stall")


# --- the corpus ------------------------------------------------------------------------


def load_photos(photos: str, max_side: int, n_fallback: int = 32) -> tuple[list[bytes], str]:
    """Real photos downscaled to ``max_side`` (JPEG q90), or synthetic ones if there are none."""
    from PIL import Image

    paths = sorted(
        p
        for p in glob.glob(os.path.join(photos, "**", "*"), recursive=True)
        if p.lower().endswith((".jpg", ".jpeg", ".webp", ".png"))
    )
    out = []
    for p in paths:
        with Image.open(p) as im:
            im = im.convert("RGB")
            im.thumbnail((max_side, max_side), Image.Resampling.LANCZOS)
            buf = io.BytesIO()
            im.save(buf, "JPEG", quality=90)
            out.append(buf.getvalue())
    if out:
        return out, f"{len(out)} real photos from {photos}"
    from prx_data.core.sample_data import photo_like

    for i in range(n_fallback):
        im, _ = photo_like(max_side, max_side * 3 // 4, i)
        buf = io.BytesIO()
        im.save(buf, "JPEG", quality=90)
        out.append(buf.getvalue())
    return out, f"{len(out)} synthetic photo-like images (no corpus at {photos})"


def unique_body(body: bytes, i: int) -> bytes:
    """The JPEG with a comment segment naming URL ``i``: distinct bytes per URL, same pixels.

    Without it the table would hold each photo many times and Lance's encodings could
    store the repeats compactly, which real URL lists do not allow.
    """
    text = f"url {i}".encode()
    return body[:2] + b"\xff\xfe" + (len(text) + 2).to_bytes(2, "big") + text + body[2:]


def plan_faults(n: int, fail_pct: float, seed: int) -> dict[int, str]:
    rng = random.Random(seed)
    k = round(n * fail_pct / 100)
    picked = rng.sample(range(n), k)
    return {i: FAULTS[j % len(FAULTS)] for j, i in enumerate(picked)}


# --- the server (own process) ------------------------------------------------------------


def serve(bodies: list[bytes], faults: dict[int, str], latency: tuple[float, float], q) -> None:
    from collections import Counter
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    hits: Counter = Counter()
    lock = threading.Lock()
    rng = random.Random(1)

    class H(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, *a):
            pass

        def handle(self):
            try:
                super().handle()
            except (BrokenPipeError, ConnectionResetError):
                pass

        def reply(self, status, body=b"", ctype="image/jpeg"):
            self.send_response(status)
            self.send_header("Content-Type", ctype)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def do_GET(self):
            if self.path.startswith("/_stats/"):
                prefix = self.path[len("/_stats/") :]
                with lock:
                    n = sum(v for k, v in hits.items() if k.startswith(f"/{prefix}/"))
                return self.reply(200, json.dumps({"requests": n}).encode(), "application/json")
            with lock:
                hits[self.path] += 1
                hit = hits[self.path]
                delay = rng.uniform(*latency)
            time.sleep(delay)
            try:
                i = int(self.path.rsplit("/", 1)[1].split(".")[0])
            except ValueError:
                return self.reply(404, b"?", "text/plain")
            fault = faults.get(i)
            body = unique_body(bodies[i % len(bodies)], i)
            ctype = "image/jpeg"
            if fault == "404":
                return self.reply(404, b"gone", "text/plain")
            if fault == "500" or (fault == "503once" and hit == 1):
                return self.reply(500 if fault == "500" else 503, b"busy", "text/plain")
            if fault == "stall":
                self.send_response(200)
                self.send_header("Content-Type", ctype)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body[: len(body) // 2])
                self.wfile.flush()
                time.sleep(30)
                return
            self.reply(200, body, ctype)

    httpd = ThreadingHTTPServer(("127.0.0.1", 0), H)
    httpd.daemon_threads = True
    httpd.request_queue_size = 1024
    q.put(httpd.server_address[1])
    httpd.serve_forever()


def requests_seen(port: int, prefix: str) -> int:
    import urllib.request

    with urllib.request.urlopen(f"http://127.0.0.1:{port}/_stats/{prefix}", timeout=10) as r:
        return json.loads(r.read())["requests"]


def write_urls(path: str, port: int, prefix: str, n: int) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    urls = [f"http://127.0.0.1:{port}/{prefix}/{i}.jpg" for i in range(n)]
    pq.write_table(
        pa.table(
            {
                "url": urls,
                "TEXT": [f"photo {i}" for i in range(n)],
                "key": [f"{i:07d}" for i in range(n)],
            }
        ),
        path,
    )


# --- the two tools -----------------------------------------------------------------------


def du(path: str) -> int:
    return sum(os.path.getsize(os.path.join(d, f)) for d, _, files in os.walk(path) for f in files)


def run_prx(args, port: int, work: str, faults: dict[int, str]) -> dict:
    import ray
    from prx_data.pipelines.download import DownloadConfig, run_download
    from prx_data.pipelines.ingest import ingest

    from prx_data.core.runtime import ensure_ray
    from prx_data.download import fetch as F

    src = os.path.join(work, "urls_prx.parquet")
    write_urls(src, port, "a", args.urls)
    table = os.path.join(work, "prx.lance")
    shutil.rmtree(table, ignore_errors=True)
    t = time.perf_counter()
    ensure_ray(num_cpus=args.cpus)
    ray_start = time.perf_counter() - t
    ingest([src], table, progress=False)
    before = du(os.path.join(table, "data"))
    cfg = DownloadConfig(
        table,
        fetch=F.FetchConfig(
            allow=(f"127.0.0.1:{port}",),
            threads=args.threads,
            # The one loopback host stands in for the many hosts of a real list: the
            # per-host limit (held across the run's tasks) is both tools' whole concurrency.
            per_host=args.threads * args.cpus,
            total_timeout=args.timeout,
            read_timeout=args.timeout,
            connect_timeout=args.timeout,
            retries=args.retries,
            backoff=args.backoff,
        ),
        run=RunOptions(engine="ray", num_cpus=args.cpus, progress=False),
    )
    t = time.perf_counter()
    report = run_download(cfg)
    wall = time.perf_counter() - t
    ray.shutdown()
    written_disk = du(os.path.join(table, "data")) - before
    # Accounting: every injected fault must be failed with the matching reason.
    import lance

    rows = lance.dataset(table).to_table(columns=["id", "download_status", "download_error"])
    want = {"404": "http_404", "500": "http_500", "stall": "timeout"}
    mismatched = 0
    for row_id, st, err in zip(*(rows[c].to_pylist() for c in rows.column_names), strict=True):
        fault = faults.get(int(row_id.rsplit("/", 1)[1]))
        expect_ok = fault in (None, "503once")
        if expect_ok != (st == "ok") or (not expect_ok and err != want[fault]):
            mismatched += 1
    print(report.text())
    return {
        "tool": "prx-data",
        "wall_s": wall,
        "ray_start_s": ray_start,
        "ok": report.fetched_ok,
        "total": report.rows,
        "failures": dict(report.reasons),
        "accounted": report.fetched_ok + sum(report.failures.values()) == report.rows,
        "mismatched_vs_injected": mismatched,
        "requests": requests_seen(port, "a"),
        "bytes_downloaded": report.bytes_downloaded,
        "image_bytes": report.image_bytes,
        "bytes_written": report.bytes_written,
        "bytes_written_disk": written_disk,
    }


def img2dataset_bin(work: str) -> str:
    venv = os.path.join(work, "img2dataset-venv")
    exe = os.path.join(venv, "bin", "img2dataset")
    if not os.path.exists(exe):
        print("installing img2dataset 1.47.0 into a throwaway venv ...", flush=True)
        subprocess.run([sys.executable, "-m", "venv", venv], check=True)
        subprocess.run(
            [os.path.join(venv, "bin", "pip"), "install", "-q", "img2dataset==1.47.0"], check=True
        )
    return exe


def run_img2dataset(args, port: int, work: str) -> dict:
    exe = img2dataset_bin(work)
    src = os.path.join(work, "urls_i2d.parquet")
    write_urls(src, port, "b", args.urls)
    out = os.path.join(work, "i2d_out")
    shutil.rmtree(out, ignore_errors=True)
    cmd = [
        exe,
        f"--url_list={src}",
        "--input_format=parquet",
        "--url_col=url",
        "--caption_col=TEXT",
        "--output_format=webdataset",
        f"--output_folder={out}",
        f"--processes_count={args.cpus}",
        f"--thread_count={args.threads}",
        "--resize_mode=no",
        f"--timeout={args.timeout}",
        f"--retries={args.retries}",
        # Shards are img2dataset's unit of parallelism: at least 4 per process.
        f"--number_sample_per_shard={max(50, args.urls // (4 * args.cpus))}",
        "--enable_wandb=False",
        "--distributor=multiprocessing",
    ]
    t = time.perf_counter()
    r = subprocess.run(cmd, capture_output=True, text=True)
    wall = time.perf_counter() - t
    if r.returncode != 0:
        print(r.stderr[-3000:])
        raise SystemExit("img2dataset failed")
    stats = [json.load(open(p)) for p in glob.glob(os.path.join(out, "*_stats.json"))]
    total = sum(s["count"] for s in stats)
    ok = sum(s["successes"] for s in stats)
    failures: dict[str, int] = {}
    for s in stats:
        for k, v in s.get("status_dict", {}).items():
            if k != "success":
                failures[k] = failures.get(k, 0) + v
    return {
        "tool": "img2dataset 1.47",
        "wall_s": wall,
        "ok": ok,
        "total": total,
        "failures": failures,
        "accounted": ok + sum(failures.values()) == total == args.urls,
        "requests": requests_seen(port, "b"),
        "bytes_written_disk": du(out),
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--urls", type=int, default=2000, help="URLs in the list (default: 2000)")
    p.add_argument("--photos", default=os.path.join(REPO, "build", "photo_corpus", "images"))
    p.add_argument("--max-side", type=int, default=768, help="served photos' longest side")
    p.add_argument("--latency-ms", default="20,80", help="injected latency range per request")
    p.add_argument("--fail-pct", type=float, default=4.0, help="URLs with an injected fault")
    p.add_argument("--cpus", type=int, default=2, help="CPUs (processes) for each tool")
    p.add_argument("--threads", type=int, default=32, help="threads per process")
    p.add_argument("--timeout", type=float, default=3.0, help="seconds per request")
    p.add_argument("--retries", type=int, default=1, help="retries per URL")
    p.add_argument("--backoff", type=float, default=0.2, help="prx-data's first retry wait")
    p.add_argument("--only", choices=("prx", "img2dataset"), default=None)
    p.add_argument("--work", default=os.path.join(REPO, "build", "bench_download"))
    p.add_argument("--json", default=None, help="write the results here")
    args = p.parse_args(argv)
    os.makedirs(args.work, exist_ok=True)
    bodies, what = load_photos(args.photos, args.max_side)
    faults = plan_faults(args.urls, args.fail_pct, seed=0)
    lo, hi = (float(x) / 1000 for x in args.latency_ms.split(","))
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    server = ctx.Process(target=serve, args=(bodies, faults, (lo, hi), q), daemon=True)
    server.start()
    port = q.get(timeout=60)
    mean_kb = sum(map(len, bodies)) / len(bodies) / 1024
    print(
        f"{args.urls:,} URLs over {what} (mean {mean_kb:.0f} KiB), latency {args.latency_ms} ms, "
        f"{len(faults)} faults ({args.fail_pct}%), {args.cpus} CPUs x {args.threads} threads, "
        f"timeout {args.timeout} s, {args.retries} retries; server on 127.0.0.1:{port}",
        flush=True,
    )
    results = []
    try:
        if args.only in (None, "img2dataset"):
            results.append(run_img2dataset(args, port, args.work))
        if args.only in (None, "prx"):
            results.append(run_prx(args, port, args.work, faults))
    finally:
        server.terminate()
    print(
        f"\n{'tool':<18}{'wall s':>8}{'ok':>7}{'success':>9}{'img/s':>9}{'img/s/core':>12}"
        f"{'requests':>10}  accounted  failures"
    )
    for r in results:
        r["images_per_s"] = r["ok"] / r["wall_s"]
        if "ray_start_s" in r:
            r["images_per_s_with_ray_start"] = r["ok"] / (r["wall_s"] + r["ray_start_s"])
        r["images_per_s_per_core"] = r["images_per_s"] / args.cpus
        r["success_rate"] = r["ok"] / max(1, r["total"])
        print(
            f"{r['tool']:<18}{r['wall_s']:>8.1f}{r['ok']:>7}{r['success_rate']:>9.1%}"
            f"{r['images_per_s']:>9.1f}{r['images_per_s_per_core']:>12.1f}{r['requests']:>10}"
            f"  {str(r['accounted']):<9}  {r['failures']}"
        )
    for r in results:
        if "bytes_written" in r:
            print(
                f"prx-data: downloaded {r['bytes_downloaded'] / 1e6:.1f} MB, kept "
                f"{r['image_bytes'] / 1e6:.1f} MB of images, wrote {r['bytes_written'] / 1e6:.1f} "
                f"MB of data files ({r['bytes_written_disk'] / 1e6:.1f} MB on disk); "
                f"{r['mismatched_vs_injected']} rows differ from the injected faults; "
                f"Ray start-up {r['ray_start_s']:.1f} s (not in wall; with it "
                f"{r['images_per_s_with_ray_start']:.1f} img/s)"
            )
    if len(results) == 2:
        print(
            f"prx-data / img2dataset images/s: {results[1]['images_per_s'] / results[0]['images_per_s']:.2f}x"
        )
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "results": results}, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
