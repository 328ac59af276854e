"""Attached columns on CPU: the attach job's time and bytes, and the loader with 0, 1, 3 columns.

  attach   ``run_attach`` of a caption column (``cap2``, ~50-byte strings) from a Lance
           table with a BTREE on ``id`` (as ingest builds it) onto a sample export of
           N samples: wall seconds, and the bytes of the Arrow files written over the
           bytes of the values they hold (Arrow buffers: offsets, data, validity).
           Two more columns (``score`` float64, ``label`` string) are attached for the
           loader part. A second run (nothing to do) is timed too.
  loader   one process serving every sample with ``get_item`` (images left encoded:
           ``EncodedBucketedDataset``, so the figure is the loader's own cost, not JPEG
           decoding), with 0, 1 (``cap2``) and 3 attached columns as ``extra_columns``,
           from the local export and from the same export on moto ``s3://`` (a fresh
           cache each time: shard and column downloads included). Each configuration
           runs twice, interleaved; the fastest run is kept (a shared machine).

The export's images are one tiny JPEG per bucket shape (the column path never reads
them), so 10^5 samples build in seconds.

    python benchmarks/bench_attach.py [--samples 100000] [--json OUT.json] [--attach-only]
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import json
import os
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from unittest import mock

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

BUCKETS = ("512/1.000", "512/0.500")
#: Runs of each loader configuration (interleaved; the fastest is reported).
REPEATS = 2


def _make_export(root: str, samples: int):
    from prx_data.export import sample

    real = sample._jpeg
    one = functools.lru_cache(maxsize=None)(lambda w, h: real(8, 8, (1, 2, 3)))
    with mock.patch.object(sample, "_jpeg", lambda w, h, colour: one(w, h)):
        per = samples // len(BUCKETS)
        return sample.make_sample_export(
            root, dict.fromkeys(BUCKETS, per), samples_per_part=16384, samples_per_shard=4096
        )


def _make_table(uri: str, ids: list[str]) -> None:
    import lance
    import pyarrow as pa

    t = pa.table(
        {
            "id": ids,
            "cap2": [f"a new, longer caption written for sample {i}" for i in ids],
            "score": [float(k % 1000) / 1000 for k in range(len(ids))],
            "label": [("photo", "drawing", "text")[k % 3] for k in range(len(ids))],
        }
    )
    ds = lance.write_dataset(t, uri, mode="overwrite")
    ds.create_scalar_index("id", "BTREE", replace=True)


def _attach(root: str, table: str, columns: tuple[str, ...]) -> dict:
    from prx_data.pipelines.attach import AttachConfig, run_attach

    t0 = time.perf_counter()
    r = run_attach(AttachConfig(out=root, table=table, columns=columns))
    return {
        "seconds": round(time.perf_counter() - t0, 3),
        "shards": r.shards,
        "written_shards": r.written_shards,
        "bytes_written": r.bytes_written,
        "column_bytes": r.column_bytes,
        "bytes_ratio": round(r.bytes_written / r.column_bytes, 3) if r.column_bytes else None,
    }


def _serve(spec, columns: tuple[str, ...]) -> dict:
    from prx_data.train.data import EncodedBucketedDataset
    from tests.exportkit import one_rank

    with one_rank():
        t0 = time.perf_counter()
        ds = EncodedBucketedDataset(
            spec, tier=512, batch_size=8, shuffle=False, num_workers=1, extra_columns=columns
        )
        start = time.perf_counter() - t0
        try:
            t0 = time.perf_counter()
            n = ds.num_samples
            for i in range(n):
                item = ds.get_item(i)
            wall = time.perf_counter() - t0
            assert all(c in item for c in columns)
        finally:
            del ds
    return {"samples": n, "start_s": round(start, 3), "samples_per_s": round(n / wall, 1)}


def _best(run, sets: dict, repeats: int = REPEATS) -> dict:
    """Each configuration ``repeats`` times, interleaved (0, 1, 3, 0, 1, 3, ...), its
    fastest run kept: the machine is shared, so the slow runs measure the neighbours."""
    runs: dict[str, list[dict]] = {k: [] for k in sets}
    for _ in range(repeats):
        for k in sets:
            runs[k].append(run(k))
    return {
        k: {
            **max(v, key=lambda r: r["samples_per_s"]),
            "runs_samples_per_s": [r["samples_per_s"] for r in v],
        }
        for k, v in runs.items()
    }


def _moto():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = subprocess.Popen(
        [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    url = f"http://127.0.0.1:{port}"
    for _ in range(100):
        try:
            socket.create_connection(("127.0.0.1", port), timeout=0.2).close()
            return proc, url
        except OSError:
            time.sleep(0.1)
    proc.kill()
    raise RuntimeError("moto did not start")


@contextlib.contextmanager
def moto_bucket(bucket: str = "bench"):
    """A moto S3 server on 127.0.0.1 with ``bucket`` made, this process's S3 settings
    pointing at it; stopped on leaving. Yields the endpoint's URL."""
    proc, url = _moto()
    try:
        os.environ["S3_ENDPOINT_URL"] = url
        os.environ.setdefault("AWS_ACCESS_KEY_ID", "testing")
        os.environ.setdefault("AWS_SECRET_ACCESS_KEY", "testing")
        os.environ.setdefault("AWS_DEFAULT_REGION", "us-east-1")
        import boto3

        boto3.client("s3", endpoint_url=url).create_bucket(Bucket=bucket)
        yield url
    finally:
        proc.kill()
        proc.wait()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--samples", type=int, default=100_000)
    ap.add_argument("--json", default=None)
    ap.add_argument("--attach-only", action="store_true", help="skip the loader part")
    args = ap.parse_args()
    from prx_data.stream.spec import DatasetSpec
    from tests.exportkit import upload_tree

    out: dict = {"samples": args.samples, "cpus": os.cpu_count()}
    with tempfile.TemporaryDirectory(prefix="bench-attach-") as tmp:
        root = os.path.join(tmp, "ex")
        t0 = time.perf_counter()
        ex = _make_export(root, args.samples)
        out["export_build_s"] = round(time.perf_counter() - t0, 1)
        table = os.path.join(tmp, "t.lance")
        _make_table(table, sorted(ex.all_ids()))
        out["attach_caption"] = _attach(root, table, ("cap2",))
        out["attach_again"] = _attach(root, table, ("cap2",))
        out["attach_two_more"] = _attach(root, table, ("score", "label"))
        print(json.dumps(out, indent=1), flush=True)
        if args.attach_only:
            if args.json:
                Path(args.json).write_text(json.dumps(out, indent=1) + "\n")
            return
        sets = {"0": (), "1": ("cap2",), "3": ("cap2", "score", "label")}
        out["loader_local"] = _best(lambda k: _serve(DatasetSpec(root), sets[k]), sets)
        print(json.dumps(out["loader_local"], indent=1), flush=True)
        with moto_bucket("bench"):
            t0 = time.perf_counter()
            upload_tree(root, "s3://bench/ex")
            out["upload_s"] = round(time.perf_counter() - t0, 1)
            caches = iter(range(100))

            def remote(k: str) -> dict:  # a fresh cache each run: downloads included
                cache = os.path.join(tmp, f"cache{next(caches)}")
                return _serve(DatasetSpec("s3://bench/ex", local=cache), sets[k])

            out["loader_s3"] = _best(remote, sets)
    print(json.dumps(out, indent=1))
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=1) + "\n")


if __name__ == "__main__":
    main()
