"""Export throughput and fidelity on real photos, every ratio measured in one run.

Corpus: ``benchmarks/photo_corpus.py`` (Debian wallpaper packages: JPEG
photos and WebP wallpapers, 2-24 MP, 320 images with distinct crops, flips and
re-encodes). It is built on first use under ``build/photo_corpus``.

Four parts (``--only step,frontier,pipeline,startup``; all by default):

  step      the per-image step of ``write_mds`` (``imaging.prepare_with``, bytes
            in memory, one core) against three anchors: an img2dataset-style
            loop with img2dataset's own defaults (OpenCV full decode, INTER_AREA
            to shrink, INTER_LANCZOS4 to enlarge, cover to the bucket shape,
            integer centre crop, ``imencode`` q92), libvips ``thumbnail``
            (``--codec vips``) and the plain Pillow loop (full decode, Lanczos);
            and ``--codec pillow``. Target: step >= 1.0x the fastest anchor at
            equal or better worst-case fidelity.
  frontier  speed and fidelity of the resize/encode paths the project could
            use (draft + libvips' Lanczos3 reduce over the exact box, the
            default; Pillow draft + Lanczos; other Pillow filters with the same
            exact crop box, larger/smaller draft margins, libvips ``thumbnail``).
  pipeline  ``write_mds`` end to end (Lance -> Ray Data -> MDS) on 1 and on 2
            Ray CPUs against the plain loop of its own per-image step. Each export
            runs twice on its Ray: the second (warm: the same worker processes)
            gives the ratios; the first (cold: workers starting and importing the
            export stack, a fixed cost per job, see ``startup``) is reported too.
            Targets: 1 CPU >= 0.9x the loop; 2 CPUs >= 1.8x 1 CPU.
  startup   a job's fixed cost: ``python -m prx_data.write_mds`` of a 4-photo
            table against a bare Ray Data job of the same size (``ray.init``
            plus a 4-row map), each a fresh process on the same CPUs, rounds
            interleaved. Target: <= 1.3x. Such a table runs on driver threads
            (``--driver-rows``); the same export forced onto Ray
            (``--driver-rows 0``, what a larger table or a cluster gets) is
            timed alongside.

Speed: every image goes through every contender in turn (the order rotates
from image to image), so the load swings of a shared machine hit all of them
alike; each ratio is taken within a round and the median over rounds is
reported, with every round's figures. The per-image loops are timed in CPU seconds of this
process (``time.process_time``: a shared machine's other jobs do not count)
and in wall seconds; the pipeline in wall seconds (it spans processes).

Fidelity: PSNR (RGB, 8-bit peak) of each path's decoded output against a
float reference: Pillow full decode, then Lanczos in 32-bit float per channel
over the exact cover-crop box. Reported as min and median over the images,
and over the "detailed" quarter (highest mean absolute Laplacian of the
reference), after the q92 encode and (where the path exposes its pixels)
before it. A path that crops on whole pixels after rounding the resize
(img2dataset, libvips ``thumbnail``) is shifted by a fraction of a pixel and
pays for it in PSNR; the project's paths keep the crop box exact.

  python benchmarks/bench_export.py                         # everything, 320 images, tiers 512,1024
  python benchmarks/bench_export.py --only step --rounds 5
  python benchmarks/bench_export.py --json artifacts/bench_export.json
"""

from __future__ import annotations

import argparse
import io
import json
import os
import platform
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Callable

import cv2
import numpy as np
from PIL import Image

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

import photo_corpus  # noqa: E402  (benchmarks/ is this script's own folder)

from prx_data.core import imaging  # noqa: E402
from prx_data.core.buckets import BucketSpec, assign_bucket  # noqa: E402

Path = Callable[[bytes, int, int, tuple[int, int]], tuple[bytes, "np.ndarray | None"]]


# --- the contenders ----------------------------------------------------------------


def img2dataset_style(data: bytes, bw: int, bh: int, size: tuple[int, int]):
    """img2dataset's resizer defaults: full decode, INTER_AREA down / LANCZOS4 up, integer crop."""
    arr = cv2.imdecode(np.frombuffer(data, np.uint8), cv2.IMREAD_COLOR)
    h, w = arr.shape[:2]
    scale = max(bw / w, bh / h)
    rw, rh = max(bw, round(w * scale)), max(bh, round(h * scale))
    interp = cv2.INTER_AREA if scale < 1 else cv2.INTER_LANCZOS4
    res = cv2.resize(arr, (rw, rh), interpolation=interp)
    x0, y0 = (rw - bw) // 2, (rh - bh) // 2
    crop = res[y0 : y0 + bh, x0 : x0 + bw]
    ok, enc = cv2.imencode(".jpg", crop, [cv2.IMWRITE_JPEG_QUALITY, 92])
    assert ok
    return enc.tobytes(), cv2.cvtColor(crop, cv2.COLOR_BGR2RGB)


def step(data: bytes, bw: int, bh: int, size: tuple[int, int]):
    """What write_mds runs per image (default codec and settings)."""
    return imaging.prepare_with(imaging.DEFAULT_CODEC, data, bw, bh, src_size=size).data, None


def reduce_path(margin: float = imaging.DRAFT_MARGIN) -> Path:
    """``--codec vips-reduce`` at a draft margin: draft, libvips Lanczos3 over the exact box."""

    def run(data: bytes, bw: int, bh: int, size: tuple[int, int]):
        kw = {"src_size": size, "draft_margin": margin}
        return imaging.prepare_with("vips-reduce", data, bw, bh, **kw).data, None

    return run


def pillow_path(resample: str = "lanczos", margin: float = imaging.DRAFT_MARGIN) -> Path:
    """The default path with another filter or draft margin; returns its pixels too."""

    def run(data: bytes, bw: int, bh: int, size: tuple[int, int]):
        im, k = imaging.decode_scaled(data, draft_to=imaging.draft_size(*size, bw, bh, margin))
        out, _ = imaging.cover_resize(
            im, bw, bh, full_size=size, reducing_gap=margin, resample=resample, shrink=k
        )
        return imaging.encode(out), np.asarray(out)

    return run


def pillow_before(data: bytes, bw: int, bh: int, size: tuple[int, int]):
    """The path before this change: Pillow's WebP decoder, no whole-factor reduce, box
    mapped by the drafted size."""
    im = imaging.open_image(data)
    if im.format == "JPEG":
        im.draft("RGB", imaging.draft_size(*size, bw, bh))
    im.load()
    im = imaging._to_rgb(im)
    out, _ = imaging.cover_resize(im, bw, bh, full_size=size)
    return imaging.encode(out), np.asarray(out)


def vips(data: bytes, bw: int, bh: int, size: tuple[int, int]):
    return imaging.prepare_with("vips", data, bw, bh, src_size=size).data, None


def draft_cv2(margin: float = imaging.DRAFT_MARGIN) -> Path:
    """Draft decode, OpenCV INTER_AREA by the whole factor that keeps >= margin x the target,
    then an exact sub-pixel cover crop with one INTER_LANCZOS4 warp (no antialias)."""

    def run(data: bytes, bw: int, bh: int, size: tuple[int, int]):
        im, k = imaging.decode_scaled(data, draft_to=imaging.draft_size(*size, bw, bh, margin))
        arr = np.asarray(im)
        box = imaging.cover_box(*size, bw, bh)
        f = 1.0 / k if k else arr.shape[1] / size[0]
        r = max(
            1,
            int(min((box[2] - box[0]) * f / (bw * margin), (box[3] - box[1]) * f / (bh * margin))),
        )
        if r > 1:
            h0, w0 = arr.shape[0] - arr.shape[0] % r, arr.shape[1] - arr.shape[1] % r
            arr = cv2.resize(arr[:h0, :w0], (w0 // r, h0 // r), interpolation=cv2.INTER_AREA)
            f /= r
        sx = (box[2] - box[0]) * f / bw
        sy = (box[3] - box[1]) * f / bh
        m = np.array(
            [[sx, 0, box[0] * f + 0.5 * sx - 0.5], [0, sy, box[1] * f + 0.5 * sy - 0.5]], np.float64
        )
        out = cv2.warpAffine(
            arr,
            m,
            (bw, bh),
            flags=cv2.INTER_LANCZOS4 | cv2.WARP_INVERSE_MAP,
            borderMode=cv2.BORDER_REFLECT_101,
        )
        return imaging.encode(Image.fromarray(out)), out

    return run


def step_before(data: bytes, bw: int, bh: int, size: tuple[int, int]):
    """The default before ``vips-reduce``: ``--codec pillow`` (Pillow's Lanczos)."""
    return imaging.prepare_with("pillow", data, bw, bh, src_size=size).data, None


def pillow_full(data: bytes, bw: int, bh: int, size: tuple[int, int]):
    """Pillow full decode (no draft) and Lanczos over the exact box: the plain Pillow loop."""
    return imaging.prepare_with("pillow", data, bw, bh, src_size=size, use_draft=False).data, None


#: The default against the three anchors (img2dataset's loop, libvips ``thumbnail``, the plain
#: Pillow loop) and ``--codec pillow``.
STEP = {
    "img2dataset": img2dataset_style,
    "step": step,
    "vips thumbnail": vips,
    "pillow full decode": pillow_full,
    "pillow (before)": step_before,
}
FRONTIER = {
    "img2dataset (OpenCV full decode, INTER_AREA, integer crop)": img2dataset_style,
    "Pillow draft 1.5x + Lanczos (before)": pillow_before,
    "draft 1.5x + libvips Lanczos3 reduce, exact box (default, --codec vips-reduce)": (
        reduce_path()
    ),
    "same, draft 1.25x": reduce_path(1.25),
    "same, draft 1.0x": reduce_path(1.0),
    "Pillow draft 1.5x + reduce + Lanczos, libwebp RGB (--codec pillow)": pillow_path("lanczos"),
    "same, draft/reduce 1.25x + Lanczos": pillow_path("lanczos", 1.25),
    "same, draft/reduce 1.0x + Lanczos": pillow_path("lanczos", 1.0),
    "same, Bicubic": pillow_path("bicubic"),
    "same, Hamming": pillow_path("hamming"),
    "same, Bilinear": pillow_path("bilinear"),
    "same, Box (area)": pillow_path("box"),
    "libvips thumbnail (--codec vips)": vips,
    "draft 1.5x + OpenCV area + exact Lanczos4 warp": draft_cv2(),
}


# --- corpus and fidelity -------------------------------------------------------------


def load_items(
    corpus: str, n: int, spec: BucketSpec, jpeg_min_mp: float | None = None
) -> tuple[list, list]:
    """(id, bytes, caption) rows for the table, and the bucketable ones with their shape;
    ``jpeg_min_mp``: JPEGs of at least that many megapixels only."""
    if not os.path.exists(os.path.join(corpus, "manifest.jsonl")):
        print(f"building the photo corpus in {corpus} ...", file=sys.stderr)
        photo_corpus.build(corpus, images=max(n, 320))
    rows = photo_corpus.load(corpus)
    if jpeg_min_mp is not None:
        rows = [
            r
            for r in rows
            if (i := imaging.probe(r[1])).format == "jpeg"
            and i.width * i.height >= jpeg_min_mp * 1e6
        ]
    rows = rows[:n]
    work = []
    for rid, data, _ in rows:
        info = imaging.probe(data)
        b = assign_bucket(info.width, info.height, spec).bucket
        if b is not None:
            work.append((rid, data, b.width, b.height, (info.width, info.height)))
    return rows, work


def reference(data: bytes, bw: int, bh: int, size: tuple[int, int]) -> np.ndarray:
    im = imaging.decode(data)
    box = imaging.cover_box(*size, bw, bh)
    chans = [
        np.asarray(c.convert("F").resize((bw, bh), Image.Resampling.LANCZOS, box=box))
        for c in im.split()
    ]
    return np.stack(chans, -1)


def psnr(ref: np.ndarray, out: np.ndarray) -> float:
    mse = float(np.mean((ref.astype(np.float64) - out.astype(np.float64)) ** 2))
    return 99.0 if mse == 0 else 10 * np.log10(255.0**2 / mse)


def detail(ref: np.ndarray) -> float:
    y = ref @ np.array([0.299, 0.587, 0.114], np.float32)
    lap = 4 * y[1:-1, 1:-1] - y[:-2, 1:-1] - y[2:, 1:-1] - y[1:-1, :-2] - y[1:-1, 2:]
    return float(np.abs(lap).mean())


def fidelity(paths: dict[str, Path], work: list, every: int) -> dict:
    """PSNR of each path against the float Lanczos reference, over every ``every``-th image."""
    sample = work[::every]
    scores: dict[str, list[tuple[float, float | None]]] = {k: [] for k in paths}
    details = []
    names = [rid for rid, *_ in sample]
    for _, data, bw, bh, size in sample:
        ref = reference(data, bw, bh, size)
        details.append(detail(ref))
        for name, fn in paths.items():
            enc, pix = fn(data, bw, bh, size)
            dec = np.asarray(Image.open(io.BytesIO(enc)).convert("RGB"))
            scores[name].append((psnr(ref, dec), None if pix is None else psnr(ref, pix)))
    cut = sorted(details)[len(details) * 3 // 4] if details else 0.0
    detailed = [i for i, d in enumerate(details) if d >= cut]
    out = {}
    for name, vals in scores.items():
        after = [v[0] for v in vals]
        before = [v[1] for v in vals if v[1] is not None]
        row = {
            "psnr_min": round(min(after), 2),
            "psnr_median": round(statistics.median(after), 2),
            "detailed_psnr_min": round(min(after[i] for i in detailed), 2),
            "detailed_psnr_median": round(statistics.median(after[i] for i in detailed), 2),
            "worst": names[min(range(len(after)), key=after.__getitem__)],
        }
        if before:
            row["before_encode_psnr_min"] = round(min(before), 2)
            row["before_encode_psnr_median"] = round(statistics.median(before), 2)
        out[name] = row
    return {"images": len(sample), "detailed_images": len(detailed), "paths": out}


# --- speed ---------------------------------------------------------------------------


def time_loop(fn: Path, work: list) -> tuple[float, float]:
    c0, w0 = time.process_time(), time.perf_counter()
    for _, data, bw, bh, size in work:
        fn(data, bw, bh, size)
    return time.process_time() - c0, time.perf_counter() - w0


def race(paths: dict[str, Path], work: list, rounds: int, anchor: str) -> dict:
    """Per-image interleaving: each image goes through every path in turn (the order
    rotates), so a shared machine's load swings hit all paths alike. Per round:
    img/s per path (CPU and wall) and ratios to ``anchor``; reported: medians."""
    names = list(paths)
    for name in names:  # warm-up: imports, codec tables, page cache
        for _, data, bw, bh, size in work[:2]:
            paths[name](data, bw, bh, size)
    per_round = []
    for r in range(rounds):
        cpu = dict.fromkeys(names, 0.0)
        wall = dict.fromkeys(names, 0.0)
        for i, (_, data, bw, bh, size) in enumerate(work):
            k = (i + r) % len(names)
            for name in names[k:] + names[:k]:
                c0, w0 = time.process_time(), time.perf_counter()
                paths[name](data, bw, bh, size)
                cpu[name] += time.process_time() - c0
                wall[name] += time.perf_counter() - w0
        res = {
            n: {"cpu_img_s": len(work) / cpu[n], "wall_img_s": len(work) / wall[n]} for n in names
        }
        per_round.append(res)
        print(
            f"  round {r + 1}: "
            + ", ".join(f"{n} {res[n]['cpu_img_s']:.2f} img/cpu-s" for n in names),
            file=sys.stderr,
        )
    out = {}
    for name in names:
        cpu_r = [pr[name]["cpu_img_s"] for pr in per_round]
        wall_r = [pr[name]["wall_img_s"] for pr in per_round]
        ratio_cpu = [pr[name]["cpu_img_s"] / pr[anchor]["cpu_img_s"] for pr in per_round]
        ratio_wall = [pr[name]["wall_img_s"] / pr[anchor]["wall_img_s"] for pr in per_round]
        out[name] = {
            "cpu_img_per_s": round(statistics.median(cpu_r), 2),
            "wall_img_per_s": round(statistics.median(wall_r), 2),
            f"ratio_cpu_vs_{anchor}": round(statistics.median(ratio_cpu), 3),
            f"ratio_wall_vs_{anchor}": round(statistics.median(ratio_wall), 3),
            "ratio_cpu_per_round": [round(x, 3) for x in ratio_cpu],
            "ratio_wall_per_round": [round(x, 3) for x in ratio_wall],
        }
    return {"images": len(work), "rounds": rounds, "anchor": anchor, "paths": out}


# --- the pipeline ----------------------------------------------------------------------


def export_once(table: str, workdir: str, tag: str, tiers: tuple[int, ...], **cfg) -> dict:
    from prx_data.pipelines.write_mds import run_export

    from prx_data.core.runtime import RunOptions
    from prx_data.export.spec import ExportConfig

    out = os.path.join(workdir, f"out-{tag}")
    t0 = time.perf_counter()
    report = run_export(
        ExportConfig(table=table, out=out, tiers=tiers, **cfg), RunOptions(progress=False)
    )
    wall = time.perf_counter() - t0
    shutil.rmtree(out, ignore_errors=True)
    return {"samples": report.samples_written, "units": report.units, "seconds": wall}


def pipeline(table: str, workdir: str, work: list, tiers: tuple[int, ...], rounds: int) -> dict:
    """``write_mds`` of ``table`` on a fresh 1- and 2-CPU Ray, twice each: the first export
    (cold: its Ray workers start and import the export stack) and the second (warm: the
    same workers, the steady state of a long export), against the plain per-image loop."""
    import ray

    from prx_data.core.runtime import ensure_ray

    spec_loop = STEP["step"]
    per_round = []
    for r in range(rounds):
        res = {}
        order = ["loop", 1, 2] if r % 2 == 0 else [2, 1, "loop"]
        for who in order:
            if who == "loop":
                cpu, wall = time_loop(spec_loop, work)
                res["loop"] = {"img_s": len(work) / wall, "cpu_img_s": len(work) / cpu}
                continue
            if ray.is_initialized():
                ray.shutdown()
            ensure_ray(num_cpus=who)
            cold = export_once(table, workdir, f"{who}cpu-cold-{r}", tiers)
            e = export_once(table, workdir, f"{who}cpu-{r}", tiers)
            res[f"{who}cpu"] = {
                "img_s": e["samples"] / e["seconds"],
                "cold_img_s": cold["samples"] / cold["seconds"],
                "cold_seconds": cold["seconds"],
                **e,
            }
        ray.shutdown()
        per_round.append(res)
        print(
            f"  round {r + 1}: loop {res['loop']['img_s']:.2f} img/s, "
            f"1 cpu {res['1cpu']['img_s']:.2f} (cold {res['1cpu']['cold_img_s']:.2f}, "
            f"{res['1cpu']['units']} units), 2 cpu {res['2cpu']['img_s']:.2f} "
            f"(cold {res['2cpu']['cold_img_s']:.2f}, {res['2cpu']['units']} units)",
            file=sys.stderr,
        )

    def med(f) -> float:
        return round(statistics.median(f(pr) for pr in per_round), 3)

    def ratios(f) -> list[float]:
        return [round(f(pr), 3) for pr in per_round]

    return {
        "images": len(work),
        "rounds": rounds,
        "loop_img_per_s": med(lambda pr: pr["loop"]["img_s"]),
        "write_mds_1cpu_img_per_s": med(lambda pr: pr["1cpu"]["img_s"]),
        "write_mds_2cpu_img_per_s": med(lambda pr: pr["2cpu"]["img_s"]),
        "ratio_1cpu_vs_loop": med(lambda pr: pr["1cpu"]["img_s"] / pr["loop"]["img_s"]),
        "ratio_2cpu_vs_1cpu": med(lambda pr: pr["2cpu"]["img_s"] / pr["1cpu"]["img_s"]),
        "cold_ratio_1cpu_vs_loop": med(lambda pr: pr["1cpu"]["cold_img_s"] / pr["loop"]["img_s"]),
        "cold_ratio_2cpu_vs_1cpu": med(
            lambda pr: pr["2cpu"]["cold_img_s"] / pr["1cpu"]["cold_img_s"]
        ),
        "ratio_1cpu_vs_loop_per_round": ratios(
            lambda pr: pr["1cpu"]["img_s"] / pr["loop"]["img_s"]
        ),
        "ratio_2cpu_vs_1cpu_per_round": ratios(
            lambda pr: pr["2cpu"]["img_s"] / pr["1cpu"]["img_s"]
        ),
        "cold_seconds": {k: med(lambda pr, k=k: pr[k]["cold_seconds"]) for k in ("1cpu", "2cpu")},
        "warm_seconds": {k: med(lambda pr, k=k: pr[k]["seconds"]) for k in ("1cpu", "2cpu")},
        "units": {k: per_round[0][k]["units"] for k in ("1cpu", "2cpu")},
    }


_BARE_JOB = """
import sys, ray, ray.data
ray.init(num_cpus=int(sys.argv[1]), include_dashboard=False, logging_level="WARNING")
ctx = ray.data.DataContext.get_current()
ctx.enable_progress_bars = False
rows = ray.data.from_items([{"i": i} for i in range(4)], override_num_blocks=4)
assert len(rows.map(lambda r: {"o": r["i"] * 2}).take_all()) == 4
"""


def startup(rows: list, workdir: str, rounds: int, num_cpus: int = 2) -> dict:
    """Wall seconds of a 4-photo ``write_mds`` (as it runs, and forced onto Ray) and of a
    bare 4-row Ray Data job, fresh processes, the order rotating from round to round."""
    import subprocess

    from tests.tablekit import make_table

    table = os.path.join(workdir, "four.lance")
    make_table(table, rows[:4])
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join(filter(None, (REPO, os.environ.get("PYTHONPATH")))),
    }
    export = [
        *(sys.executable, "-m", "prx_data.write_mds", "--table", table),
        *("--num-cpus", str(num_cpus), "--no-progress", "--overwrite", "--out"),
    ]
    cmds = {
        "bare": [sys.executable, "-c", _BARE_JOB, str(num_cpus)],
        "write_mds": [*export, os.path.join(workdir, "four-out")],
        "write_mds_ray": [*export, os.path.join(workdir, "four-out-ray"), "--driver-rows", "0"],
    }
    names = list(cmds)
    env.pop("RAY_ADDRESS", None)  # each job starts its own Ray (or none), as a first run does
    per_round = []
    for r in range(rounds):
        res = {}
        for who in names[r % 3 :] + names[: r % 3]:
            t0 = time.perf_counter()
            subprocess.run(cmds[who], env=env, check=True, capture_output=True)
            res[who] = time.perf_counter() - t0
        res["loadavg"] = os.getloadavg()
        per_round.append(res)
        print(
            f"  round {r + 1}: bare Ray Data job {res['bare']:.1f} s, "
            f"write_mds of 4 photos {res['write_mds']:.1f} s "
            f"({res['write_mds'] / res['bare']:.2f}x), on Ray {res['write_mds_ray']:.1f} s "
            f"({res['write_mds_ray'] / res['bare']:.2f}x), load {res['loadavg'][0]:.1f}",
            file=sys.stderr,
        )
    ratios = [pr["write_mds"] / pr["bare"] for pr in per_round]
    ray_ratios = [pr["write_mds_ray"] / pr["bare"] for pr in per_round]
    return {
        "num_cpus": num_cpus,
        "bare_s": round(statistics.median(pr["bare"] for pr in per_round), 2),
        "write_mds_s": round(statistics.median(pr["write_mds"] for pr in per_round), 2),
        "write_mds_ray_s": round(statistics.median(pr["write_mds_ray"] for pr in per_round), 2),
        "ratio": round(statistics.median(ratios), 3),
        "ratio_per_round": [round(x, 3) for x in ratios],
        "ratio_ray": round(statistics.median(ray_ratios), 3),
        "ratio_ray_per_round": [round(x, 3) for x in ray_ratios],
        "rounds": per_round,
    }


def machine() -> dict:
    try:
        load = os.getloadavg()
    except OSError:
        load = None
    return {
        "cpus": os.cpu_count(),
        "processor": platform.processor() or platform.machine(),
        "loadavg_at_start": load,
        "pillow": Image.__version__,
        "opencv": cv2.__version__,
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--corpus", default=photo_corpus.DEFAULT_OUT, help="Photo corpus folder.")
    p.add_argument("--images", type=int, default=320, help="Images to use (default 320).")
    p.add_argument(
        "--tiers", default="512,1024", help="Export tiers (default 512,1024: most land in 1024)."
    )
    p.add_argument("--only", default="step,frontier,pipeline,startup", help="Parts to run.")
    p.add_argument(
        "--jpeg-min-mp",
        type=float,
        default=None,
        help="Large-JPEG corpus: only JPEGs of at least this many megapixels (e.g. 2).",
    )
    p.add_argument("--rounds", type=int, default=3, help="Interleaved rounds (default 3).")
    p.add_argument(
        "--frontier-rounds", type=int, default=1, help="Rounds for the frontier (default 1)."
    )
    p.add_argument(
        "--fidelity-every",
        type=int,
        default=4,
        help="PSNR on every k-th image (default 4; the reference is a slow float resample).",
    )
    p.add_argument("--json", default=None, help="Also write the results to this JSON file.")
    args = p.parse_args(argv)
    cv2.setNumThreads(1)
    tiers = tuple(int(t) for t in args.tiers.split(","))
    spec = BucketSpec(tiers=tiers)
    parts = set(args.only.split(","))
    rows, work = load_items(args.corpus, args.images, spec, args.jpeg_min_mp)
    res: dict = {
        "machine": machine(),
        "corpus": {"rows": len(rows), "bucketable": len(work), "tiers": list(tiers)},
    }
    print(json.dumps(res), file=sys.stderr)
    if "step" in parts:
        print("step vs img2dataset-style loop ...", file=sys.stderr)
        res["step"] = race(STEP, work, args.rounds, anchor="img2dataset")
        res["step"]["fidelity"] = fidelity(STEP, work, args.fidelity_every)
        print(json.dumps(res["step"], indent=1), file=sys.stderr)
    if "frontier" in parts:
        print("frontier ...", file=sys.stderr)
        anchor = next(iter(FRONTIER))
        res["frontier"] = race(FRONTIER, work, args.frontier_rounds, anchor=anchor)
        res["frontier"]["fidelity"] = fidelity(FRONTIER, work, args.fidelity_every)
        print(json.dumps(res["frontier"], indent=1), file=sys.stderr)
    if "pipeline" in parts:
        print("write_mds pipeline ...", file=sys.stderr)
        from tests.tablekit import make_table

        workdir = tempfile.mkdtemp(prefix="bench_export_")
        try:
            table = os.path.join(workdir, "t.lance")
            make_table(table, rows, max_rows_per_file=1024)
            res["pipeline"] = pipeline(table, workdir, work, tiers, args.rounds)
        finally:
            shutil.rmtree(workdir, ignore_errors=True)
        print(json.dumps(res["pipeline"], indent=1), file=sys.stderr)
    if "startup" in parts:
        print("start-up: 4-photo write_mds vs a bare Ray Data job ...", file=sys.stderr)
        workdir = tempfile.mkdtemp(prefix="bench_export_")
        try:
            res["startup"] = startup(rows, workdir, args.rounds)
        finally:
            shutil.rmtree(workdir, ignore_errors=True)
        print(json.dumps(res["startup"], indent=1), file=sys.stderr)
    res["machine"]["loadavg_at_end"] = os.getloadavg()
    print(json.dumps(res, indent=2))
    if args.json:
        os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
        with open(args.json, "w") as f:
            json.dump(res, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
