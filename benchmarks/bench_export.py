"""Export throughput against two anchors, in one run on the same photo-like images.

  floor        plain loop: Pillow draft(>= 1.5x) + Lanczos cover-crop + JPEG q92
  img2dataset  plain loop: OpenCV full decode + Lanczos4 + imencode q92
  write_mds    the real job (Lance -> Ray Data -> MDS) on 1 and on 2 Ray CPUs,
               and on 1 CPU with --codec vips (libvips thumbnail)

Targets: write_mds(1 CPU) >= 0.9x floor, >= 1.8x img2dataset; 2 CPUs >= 1.8x 1 CPU.
Run on an otherwise idle machine:  python benchmarks/bench_export.py --images 48
"""

from __future__ import annotations

import argparse
import io
import json
import math
import os
import shutil
import sys
import tempfile
import time

import cv2
import numpy as np
from PIL import Image

from prx_data.core.buckets import BucketSpec, assign_bucket
from prx_data.core.sample_data import photo_like

SIZES = [
    (2000, 1500),
    (3000, 2000),
    (4000, 3000),
    (1600, 1200),
    (2400, 1600),
    (3264, 2448),
    (1500, 2250),
]


def make_images(n: int) -> list[bytes]:
    out = []
    for i in range(n):
        w, h = SIZES[i % len(SIZES)]
        buf = io.BytesIO()
        photo_like(w, h, 1000 + i)[0].save(buf, "JPEG", quality=95)
        out.append(buf.getvalue())
    return out


def floor_loop(images: list[bytes], spec: BucketSpec) -> float:
    t0 = time.perf_counter()
    for data in images:
        im = Image.open(io.BytesIO(data))
        w, h = im.size
        b = assign_bucket(w, h, spec).bucket
        scale = max(b.width / w, b.height / h)
        im.draft("RGB", (math.ceil(w * scale * 1.5), math.ceil(h * scale * 1.5)))
        im = im.convert("RGB")
        cw, ch = b.width / scale, b.height / scale
        box = ((w - cw) / 2, (h - ch) / 2, (w + cw) / 2, (h + ch) / 2)
        sx, sy = im.size[0] / w, im.size[1] / h
        box = (
            max(0, box[0] * sx),
            max(0, box[1] * sy),
            min(im.size[0], box[2] * sx),
            min(im.size[1], box[3] * sy),
        )
        out = im.resize((b.width, b.height), Image.Resampling.LANCZOS, box=box)
        buf = io.BytesIO()
        out.save(buf, "JPEG", quality=92)
    return len(images) / (time.perf_counter() - t0)


def img2dataset_loop(images: list[bytes], spec: BucketSpec) -> float:
    cv2.setNumThreads(1)
    t0 = time.perf_counter()
    for data in images:
        arr = cv2.imdecode(np.frombuffer(data, np.uint8), cv2.IMREAD_COLOR)
        h, w = arr.shape[:2]
        b = assign_bucket(w, h, spec).bucket
        scale = max(b.width / w, b.height / h)
        rw, rh = max(b.width, round(w * scale)), max(b.height, round(h * scale))
        res = cv2.resize(arr, (rw, rh), interpolation=cv2.INTER_LANCZOS4)
        x0, y0 = (rw - b.width) // 2, (rh - b.height) // 2
        crop = res[y0 : y0 + b.height, x0 : x0 + b.width]
        ok, _ = cv2.imencode(".jpg", crop, [cv2.IMWRITE_JPEG_QUALITY, 92])
        assert ok
    return len(images) / (time.perf_counter() - t0)


def export_rate(
    table: str,
    workdir: str,
    num_cpus: int,
    tiers: tuple[int, ...],
    rows_per_task: int,
    codec: str = "pillow",
) -> dict:
    import ray

    from pipelines.write_mds import run_export
    from prx_data.core.runtime import ensure_ray
    from prx_data.export.unit import ExportConfig

    if ray.is_initialized():
        ray.shutdown()
    ensure_ray(num_cpus=num_cpus)
    # Warm-up: start the worker processes and import the codec stack once.
    run_export(
        ExportConfig(
            table=table,
            out=os.path.join(workdir, f"warm{num_cpus}{codec}"),
            tiers=tiers,
            codec=codec,
            rows_per_task=rows_per_task,
            filter="id < 'img/0002'",
        ),
        progress=False,
    )
    out = os.path.join(workdir, f"out{num_cpus}{codec}")
    t0 = time.perf_counter()
    report = run_export(
        ExportConfig(table=table, out=out, tiers=tiers, rows_per_task=rows_per_task, codec=codec),
        progress=False,
    )
    wall = time.perf_counter() - t0
    ray.shutdown()
    return {
        "cpus": num_cpus,
        "samples": report.samples_written,
        "seconds": wall,
        "img_per_s": report.samples_written / wall,
    }


def main() -> None:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument(
        "--images", type=int, default=48, help="Photo-like 2-12 MP JPEGs to generate (default 48)."
    )
    p.add_argument(
        "--tiers", default="512,1024", help="Tiers (default 512,1024: every image lands in 1024)."
    )
    p.add_argument("--rows-per-task", type=int, default=4)
    p.add_argument("--json", default=None, help="Also write the results to this JSON file.")
    args = p.parse_args()
    tiers = tuple(int(t) for t in args.tiers.split(","))
    spec = BucketSpec(tiers=tiers)
    workdir = tempfile.mkdtemp(prefix="bench_export_")
    try:
        images = make_images(args.images)
        sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
        from tests.tablekit import make_table

        table = os.path.join(workdir, "t.lance")
        make_table(
            table,
            [(f"img/{i:04d}", d, f"image {i}") for i, d in enumerate(images)],
            max_rows_per_file=16,
        )
        floor = floor_loop(images, spec)
        i2d = img2dataset_loop(images, spec)
        one = export_rate(table, workdir, 1, tiers, args.rows_per_task)
        two = export_rate(table, workdir, 2, tiers, args.rows_per_task)
        vips = export_rate(table, workdir, 1, tiers, args.rows_per_task, codec="vips")
        res = {
            "images": args.images,
            "floor_img_per_s": round(floor, 2),
            "img2dataset_img_per_s": round(i2d, 2),
            "write_mds_1cpu_img_per_s": round(one["img_per_s"], 2),
            "write_mds_2cpu_img_per_s": round(two["img_per_s"], 2),
            "ratio_vs_floor": round(one["img_per_s"] / floor, 3),
            "ratio_vs_img2dataset": round(one["img_per_s"] / i2d, 3),
            "scaling_1_to_2": round(two["img_per_s"] / one["img_per_s"], 3),
            "write_mds_vips_1cpu_img_per_s": round(vips["img_per_s"], 2),
            "vips_ratio_vs_floor": round(vips["img_per_s"] / floor, 3),
            "vips_ratio_vs_img2dataset": round(vips["img_per_s"] / i2d, 3),
        }
        print(json.dumps(res, indent=2))
        if args.json:
            with open(args.json, "w") as f:
                json.dump(res, f, indent=2)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)


if __name__ == "__main__":
    main()
