"""Captioning pipeline throughput: overhead with a zero-cost backend, and tiny-model CPU speed.

Measures, in one run:

1. ``anchor``: the same per-row work done in one plain Python loop in the
   driver (fit each image to the pixel budget, check the output, write the
   columns back with one ``update_column`` per column at the end), no Ray.
2. ``pipeline``: ``prx_data.pipelines.caption.run_caption`` over the same table with
   :class:`ZeroCostBackend`, i.e. everything except the model: Lance read,
   decode + downsize, the actor pool, output checks, the per-fragment
   write-back of the column runner.
   The goal is >= 500 rows/s on 2 cores, so the pipeline never limits
   8 GPUs x 20 img/s.
3. ``transformers``: the CPU transformers backend with a tiny random Qwen2-VL
   built from config (tests/tinymodels.py), images/s at a fixed token budget.

Ratios are against the anchor of the same run. Usage::

    python benchmarks/bench_caption.py --rows 4000 --tiny-rows 32
"""

from __future__ import annotations

import argparse
import io
import json
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

from prx_data.columns import checks  # noqa: E402
from prx_data.columns.backends import (  # noqa: E402
    Backend,
    BackendSpec,
    Generation,
    GenerationConfig,
)
from prx_data.columns.images import DEFAULT_MAX_PIXELS, fit_image  # noqa: E402


class ZeroCostBackend(Backend):
    """Benchmark-only stand-in for a model: answers instantly with a fixed sentence.

    It exists to measure the pipeline around the model; it is not a backend.
    """

    name = "zero-cost"

    def prepare(self, requests):
        return len(requests)

    def generate(self, prepared):
        return prepared

    def decode(self, raw):
        return [Generation("A fixed benchmark sentence about the image.", "stop")] * raw


def make_table(uri: str, rows: int, size: tuple[int, int], seed: int = 0) -> None:
    """Noisy JPEGs (so they do not compress to nothing), ~1 fragment per 1000 rows."""
    rng = np.random.default_rng(seed)
    base = [
        Image.fromarray(rng.integers(0, 255, (size[1], size[0], 3), dtype=np.uint8))
        for _ in range(16)
    ]
    blobs = []
    for im in base:
        buf = io.BytesIO()
        im.save(buf, "JPEG", quality=85)
        blobs.append(buf.getvalue())
    images = [blobs[i % len(blobs)] for i in range(rows)]
    tbl = pa.table(
        {
            "id": [f"bench/{i:07d}" for i in range(rows)],
            "image": pa.array(images, pa.large_binary()),
            "caption": pa.array([None] * rows, pa.string()),
        }
    )
    lance.write_dataset(tbl, uri, max_rows_per_file=1000)


def anchor(uri: str, column: str, max_pixels: int) -> float:
    """The same work in one plain loop (no Ray): rows/s."""
    from prx_data.table.lance_ops import update_column

    done: list[pa.Table] = []
    ds = lance.dataset(uri)
    n = 0
    t0 = time.perf_counter()
    for batch in ds.to_batches(columns=["id", "image"], batch_size=256):
        caps, sts = [], []
        for data in batch["image"].to_pylist():
            fit_image(data, max_pixels)
            st, cap = checks.check("A fixed benchmark sentence about the image.", "stop")
            caps.append(cap)
            sts.append(st)
        done.append(
            pa.table(
                {
                    "id": batch["id"],
                    column: pa.array(caps, pa.string()),
                    f"{column}_status": pa.array(sts, pa.string()),
                }
            )
        )
        n += batch.num_rows
    values = pa.concat_tables(done)
    for col in (column, f"{column}_status"):
        update_column(uri, col, values.select(["id", col]))
    return n / (time.perf_counter() - t0)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument(
        "--rows", type=int, default=6000, help="rows per overhead run (default: %(default)s)"
    )
    p.add_argument(
        "--sizes",
        default="64x48,384x288",
        help="comma-separated JPEG sizes WxH; the smallest isolates pipeline overhead, larger ones "
        "add real decode/re-encode cost (default: %(default)s)",
    )
    p.add_argument("--max-pixels", type=int, default=DEFAULT_MAX_PIXELS, help="pixel budget")
    p.add_argument("--batch-size", type=int, default=256, help="rows per backend call")
    p.add_argument(
        "--num-cpus", type=int, default=2, help="CPUs for the local Ray (default: %(default)s)"
    )
    p.add_argument(
        "--tiny-rows", type=int, default=32, help="rows for the tiny-model run (0 = skip)"
    )
    p.add_argument("--tiny-tokens", type=int, default=16, help="max new tokens for the tiny model")
    p.add_argument("--json", default=None, help="also write the results to this file")
    args = p.parse_args(argv)

    from prx_data.pipelines.caption import CaptionConfig, run_caption

    from prx_data.core.runtime import ensure_ray

    ensure_ray(num_cpus=args.num_cpus, object_store_memory=512 * 2**20)
    results: dict = {"rows": args.rows, "num_cpus": args.num_cpus, "runs": {}}
    with tempfile.TemporaryDirectory() as tmp:
        for size in args.sizes.split(","):
            w, h = (int(x) for x in size.split("x"))
            uri = f"{tmp}/bench-{size}.lance"
            make_table(uri, args.rows, (w, h))
            run: dict = {"anchor_rows_per_s": anchor(uri, "cap_anchor", args.max_pixels)}
            spec = BackendSpec(ZeroCostBackend, "none", batch_size=args.batch_size, num_cpus=1)
            cfg = CaptionConfig(
                table=uri,
                backend="zero-cost",
                model="none",
                max_pixels=args.max_pixels,
                run=RunOptions(progress=False),
            )
            report = run_caption(cfg, spec=spec)
            assert report.rows == args.rows and report.counts == {"ok": args.rows}, report.summary()
            run["pipeline_rows_per_s"] = report.rows_per_s
            run["pipeline_steady_rows_per_s"] = report.steady_rows_per_s
            run["pipeline_first_result_s"] = report.first_result_s
            run["steady_vs_anchor"] = report.steady_rows_per_s / run["anchor_rows_per_s"]
            results["runs"][size] = run

        if args.tiny_rows:
            from prx_data.core.tinymodels import build_tiny_vlm

            model = str(build_tiny_vlm(Path(tmp) / "tiny-vlm"))
            tiny_uri = f"{tmp}/tiny.lance"
            make_table(tiny_uri, args.tiny_rows, (384, 288), seed=1)
            cfg = CaptionConfig(
                table=tiny_uri,
                backend="transformers",
                model=model,
                generation=GenerationConfig(max_tokens=args.tiny_tokens),
                backend_options={"device": "cpu"},
                batch_size=8,
                run=RunOptions(progress=False),
            )
            rep = run_caption(cfg)
            results["tiny_transformers"] = {
                "rows_per_s": rep.rows_per_s,
                "steady_rows_per_s": rep.steady_rows_per_s,
                "first_result_s": rep.first_result_s,
                "max_tokens": args.tiny_tokens,
                "counts": rep.counts,
            }

    print(json.dumps(results, indent=2))
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
