"""The export step per source-size band and target tier, against anchors that do only what
their tools do, and against the sum of its own parts.

Corpus (built on first use under ``build/step_bands``, git-ignored): every RGB JPEG of
2-18.5 MP in four Debian packages, whole and byte-for-byte (``apt-get download``, as
``photo_corpus.py``): lomiri-wallpapers-16.04 and -20.04 (camera photos),
mate-backgrounds (photos and a few renders) and ukui-wallpapers (photos). The 2-4 MP
band has only 5 such originals, so it also holds one derived image per original of
8-18.5 MP: the whole photo Lanczos-downscaled to 3 MP and re-encoded at q92 (what a
web copy of a camera photo is); every row of the results says how many of its images
are originals. ``--no-derived`` leaves them out.

Every image goes to every target tier it can serve under the project's bucket rule
(``assign_bucket`` with that one tier: an upscale of at most 4/3), in its nearest
bucket shape. Cells are (band, tier): 2-4, 4-8 and 8-18.5 MP x 512, 1024, 2048, 4096.

Contenders, each timed on exactly what it does (bytes in, q92 JPEG bytes out):

  img2dataset   its resizer's defaults: ``cv2.imdecode`` (BGR), ``cv2.resize`` to cover
                (INTER_AREA to shrink, INTER_LANCZOS4 to enlarge), integer centre crop,
                ``cv2.imencode`` q92. No colour conversion: the loop has none.
  vips          ``pyvips.Image.thumbnail_buffer(crop="centre")`` + ``jpegsave_buffer(Q=92)``
                with libvips' defaults (4:4:4 chroma at Q >= 90).
  pillow        ``Image.open``, full decode, ``resize(LANCZOS, box=cover box)``, ``save`` q92.
  step          ``imaging.prepare_with(DEFAULT_CODEC, ...)``: what ``write_mds`` runs.
  step before   the default path as of commit a30d6f6 (kept below): RGB decode, libvips
                reduce, Pillow encode; enlargements through Pillow's Lanczos.

The parts of the step, each measured alone on inputs prepared outside the timed region,
each at its best (the fastest library for that image): the decode to the step's draft
scale (OpenCV ``IMREAD_REDUCED_*``, libvips ``jpegload shrink``, Pillow ``draft``), the
step's resample (libvips Lanczos3 reduce or OpenCV bicubic enlarge over the exact box),
the q92 encode of the target (OpenCV, Pillow, libvips with 4:2:0).

Speed: CPU seconds of this process (``time.process_time``) on one core (the process pins
itself, like ``taskset``); every item goes through every contender and part in turn,
the order rotating from item to item; per round each cell's img/s, and ratios taken
within the round; reported: medians over rounds. Fidelity, outside the timed region:
PSNR of the decoded output against a float Lanczos resample of the full decode over the
exact cover box (min / median per cell). "Equal worst-case fidelity": the step's worst
image must score at least the worst of the anchor it is compared with.

  python benchmarks/bench_step_bands.py --quick     # about 5 minutes on a quiet core
  python benchmarks/bench_step_bands.py             # 3 rounds, every image
"""

from __future__ import annotations

import argparse
import hashlib
import io
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time

os.environ.setdefault("VIPS_CONCURRENCY", "1")

import cv2  # noqa: E402
import numpy as np  # noqa: E402
import pyvips  # noqa: E402
from PIL import Image  # noqa: E402

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

import photo_corpus  # noqa: E402  (benchmarks/ is this script's own folder)
from bench_export import reference  # noqa: E402  (full decode, float Lanczos over the box)

from prx_data.core import heap, imaging  # noqa: E402
from prx_data.core.buckets import BucketSpec, assign_bucket  # noqa: E402

PACKAGES = (
    "lomiri-wallpapers-16.04",
    "lomiri-wallpapers-20.04",
    "mate-backgrounds",
    "ukui-wallpapers",
)
DEFAULT_OUT = os.path.join(REPO, "build", "step_bands")
BANDS = ((2.0, 4.0, "2-4 MP"), (4.0, 8.0, "4-8 MP"), (8.0, 18.5, "8-18 MP"))
TIERS = (512, 1024, 2048, 4096)
ANCHORS = ("img2dataset", "vips", "pillow")
#: "worker": the step in a process started as write_mds's workers are (``core.heap``), timed
#: in a child process pinned to the same core (the setting is process-wide and one-way).
WORKER = "worker"
CONTENDERS = (*ANCHORS, "step", "step before", WORKER)
PARTS = ("decode", "resample", "encode")
DERIVED_MP = 3.0

cv2.setNumThreads(1)
pyvips.cache_set_max(0)


# --- corpus ------------------------------------------------------------------------


def build_corpus(out: str, derived: bool = True) -> list[dict]:
    """Unpack the packages' RGB JPEGs of 2-18.5 MP into ``out`` (and the derived 3 MP
    copies); returns the manifest rows."""
    manifest = os.path.join(out, "manifest.jsonl")
    if os.path.exists(manifest):
        with open(manifest) as f:
            rows = [json.loads(line) for line in f]
        return [r for r in rows if derived or not r["derived"]]
    debs = photo_corpus.fetch_debs(os.path.join(out, "debs"), PACKAGES)
    img_dir = os.path.join(out, "images")
    os.makedirs(img_dir, exist_ok=True)
    rows = []
    with tempfile.TemporaryDirectory(prefix="step_bands_") as tmp:
        for pkg, deb in zip(PACKAGES, debs, strict=True):
            for p in photo_corpus.extract_images(deb, os.path.join(tmp, pkg)):
                if not p.lower().endswith((".jpg", ".jpeg")):
                    continue
                with open(p, "rb") as f:
                    data = f.read()
                im = Image.open(io.BytesIO(data))
                mp = im.size[0] * im.size[1] / 1e6
                if im.mode != "RGB" or not 2.0 <= mp <= 18.5:
                    continue
                name = f"{pkg}__{os.path.basename(p)}"
                with open(os.path.join(img_dir, name), "wb") as f:
                    f.write(data)
                rows.append(_row(name, pkg, data, derived=False))
                if mp >= 8.0:
                    s = (DERIVED_MP * 1e6 / (im.size[0] * im.size[1])) ** 0.5
                    small = im.convert("RGB").resize(
                        (round(im.size[0] * s), round(im.size[1] * s)), Image.Resampling.LANCZOS
                    )
                    buf = io.BytesIO()
                    prog = bool(im.info.get("progressive"))
                    small.save(buf, "JPEG", quality=92, progressive=prog)
                    dname = f"{os.path.splitext(name)[0]}~3mp.jpg"
                    with open(os.path.join(img_dir, dname), "wb") as f:
                        f.write(buf.getvalue())
                    rows.append(_row(dname, pkg, buf.getvalue(), derived=True))
    rows.sort(key=lambda r: r["name"])
    with open(manifest, "w") as f:
        for r in rows:
            f.write(json.dumps(r, sort_keys=True) + "\n")
    return [r for r in rows if derived or not r["derived"]]


def _row(name: str, pkg: str, data: bytes, derived: bool) -> dict:
    im = Image.open(io.BytesIO(data))
    return {
        "name": name,
        "package": pkg,
        "width": im.size[0],
        "height": im.size[1],
        "progressive": bool(im.info.get("progressive")),
        "derived": derived,
        "bytes": len(data),
        "sha256": hashlib.sha256(data).hexdigest(),
    }


def band_of(w: int, h: int) -> str | None:
    mp = w * h / 1e6
    return next((name for lo, hi, name in BANDS if lo <= mp < hi), None)


def work_items(out: str, rows: list[dict], tiers: tuple[int, ...]) -> list[dict]:
    """One item per (image, tier it can serve): its bucket shape and cell."""
    items = []
    for r in rows:
        with open(os.path.join(out, "images", r["name"]), "rb") as f:
            data = f.read()
        size = (r["width"], r["height"])
        band = band_of(*size)
        for t in tiers:
            b = assign_bucket(*size, BucketSpec(tiers=(t,))).bucket
            if b is None or b.tier != t or band is None:
                continue
            items.append(
                {
                    "name": r["name"],
                    "derived": r["derived"],
                    "data": data,
                    "size": size,
                    "bw": b.width,
                    "bh": b.height,
                    "cell": (band, t),
                }
            )
    return items


# --- contenders ------------------------------------------------------------------------


def img2dataset(data: bytes, bw: int, bh: int, size: tuple[int, int]) -> bytes:
    """img2dataset's resizer (center_crop to the bucket shape), without any extra work."""
    arr = cv2.imdecode(np.frombuffer(data, np.uint8), cv2.IMREAD_COLOR)
    h, w = arr.shape[:2]
    scale = max(bw / w, bh / h)
    rw, rh = max(bw, round(w * scale)), max(bh, round(h * scale))
    interp = cv2.INTER_AREA if scale < 1 else cv2.INTER_LANCZOS4
    res = cv2.resize(arr, (rw, rh), interpolation=interp)
    x0, y0 = (rw - bw) // 2, (rh - bh) // 2
    ok, enc = cv2.imencode(".jpg", res[y0 : y0 + bh, x0 : x0 + bw], [cv2.IMWRITE_JPEG_QUALITY, 92])
    assert ok
    return enc.tobytes()


def vips_thumbnail(data: bytes, bw: int, bh: int, size: tuple[int, int]) -> bytes:
    return pyvips.Image.thumbnail_buffer(data, bw, height=bh, crop="centre").jpegsave_buffer(Q=92)


def pillow_plain(data: bytes, bw: int, bh: int, size: tuple[int, int]) -> bytes:
    im = Image.open(io.BytesIO(data))
    if im.mode != "RGB":
        im = im.convert("RGB")
    out = im.resize((bw, bh), Image.Resampling.LANCZOS, box=imaging.cover_box(*im.size, bw, bh))
    buf = io.BytesIO()
    out.save(buf, "JPEG", quality=92)
    return buf.getvalue()


def step(data: bytes, bw: int, bh: int, size: tuple[int, int]) -> bytes:
    return imaging.prepare_with(imaging.DEFAULT_CODEC, data, bw, bh, src_size=size).data


def step_before(data: bytes, bw: int, bh: int, size: tuple[int, int]) -> bytes:
    """The default path as of commit a30d6f6 (``prepare_reduce`` then)."""
    spec = imaging.EncodeSpec()
    draft_to = imaging.draft_size(*size, bw, bh, spec.draft_margin)
    if max(bw / size[0], bh / size[1]) > 1.0:
        return imaging.prepare(data, bw, bh, size, spec).data
    arr, k = imaging.decode_scaled_array(data, draft_to=draft_to)
    full, k = imaging._decoded_frame((arr.shape[1], arr.shape[0]), size, k)
    _, scaled = imaging.scaled_box((arr.shape[1], arr.shape[0]), full, bw, bh, k)
    out = imaging.reduce_exact(arr, scaled, bw, bh)
    if out is None:
        res = Image.fromarray(arr).resize((bw, bh), Image.Resampling.LANCZOS, box=scaled)
    else:
        res = Image.fromarray(out)
    return spec.encode(res)


FUNCS = {
    "img2dataset": img2dataset,
    "vips": vips_thumbnail,
    "pillow": pillow_plain,
    "step": step,
    "step before": step_before,
}


# --- the step's parts, each alone ------------------------------------------------------


def prepare_parts(item: dict) -> dict:
    """Inputs for the parts (outside the timed region): the step's draft scale, its decoded
    (BGR) array, its box on that array and its output."""
    data, size, bw, bh = item["data"], item["size"], item["bw"], item["bh"]
    draft_to = imaging.draft_size(*size, bw, bh)
    im, k = imaging._decode_scaled(data, draft_to, as_array=True, bgr=True)
    arr = im if isinstance(im, np.ndarray) else np.asarray(im)[..., ::-1].copy()
    full, k2 = imaging._decoded_frame((arr.shape[1], arr.shape[0]), size, k)
    _, scaled = imaging.scaled_box((arr.shape[1], arr.shape[0]), full, bw, bh, k2)
    out = imaging.reduce_exact(arr, scaled, bw, bh)
    enlarge = out is None
    if enlarge:  # a view into OpenCV's output: the encoders get the same contiguous pixels
        out = np.ascontiguousarray(imaging.enlarge_exact(arr, scaled, bw, bh))
    return {"k": k, "arr": arr, "box": scaled, "out": out, "enlarge": enlarge}


_REDUCED = {1: 0, 2: cv2.IMREAD_REDUCED_COLOR_2, 4: cv2.IMREAD_REDUCED_COLOR_4}
_REDUCED[8] = cv2.IMREAD_REDUCED_COLOR_8


def part_fns(item: dict, p: dict) -> dict[str, dict]:
    """Per part, the ways to do it (the fastest counts)."""
    data, bw, bh, k = item["data"], item["bw"], item["bh"], p["k"]
    buf = np.frombuffer(data, np.uint8)
    flags = (_REDUCED[k] or cv2.IMREAD_COLOR) | cv2.IMREAD_IGNORE_ORIENTATION
    arr, out, box = p["arr"], p["out"], p["box"]

    def pil_decode():
        im = Image.open(io.BytesIO(data))
        im.draft("RGB", (im.size[0] // k, im.size[1] // k))
        im.load()

    def vips_decode():
        pyvips.Image.jpegload_buffer(data, shrink=k, access="sequential").write_to_memory()

    def resample():
        if p["enlarge"]:
            imaging.enlarge_exact(arr, box, bw, bh)
        else:
            imaging.reduce_exact(arr, box, bw, bh)

    def cv_encode():
        cv2.imencode(".jpg", out, [cv2.IMWRITE_JPEG_QUALITY, 92])

    def pil_encode():
        imaging.encode(Image.fromarray(out))

    def vips_encode():
        v = pyvips.Image.new_from_memory(out.data, bw, bh, 3, "uchar")
        v.jpegsave_buffer(Q=92, subsample_mode="on")

    return {
        "decode": {
            "opencv": lambda: cv2.imdecode(buf, flags),
            "pillow": pil_decode,
            "libvips": vips_decode,
        },
        "resample": {"step's": resample},
        "encode": {"opencv": cv_encode, "pillow": pil_encode, "libvips": vips_encode},
    }


# --- fidelity --------------------------------------------------------------------------


def psnr(ref: np.ndarray, enc: bytes) -> float:
    out = np.asarray(Image.open(io.BytesIO(enc)).convert("RGB"), np.float64)
    mse = float(np.mean((ref.astype(np.float64) - out) ** 2))
    return 99.0 if mse == 0 else 10 * float(np.log10(255.0**2 / mse))


# --- the race --------------------------------------------------------------------------


class Worker:
    """The step in a child process with the export worker's heap settings, one call per
    request on the same core; it answers its CPU time and the sha256 of its output."""

    def __init__(self, corpus: str, cpu: int):
        cmd = [sys.executable, os.path.abspath(__file__), "--worker", "--corpus", corpus]
        self.proc = subprocess.Popen(
            [*cmd, "--cpu", str(cpu)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            env={**os.environ, **heap.WORKER_ENV},  # as write_mds starts its Ray workers
        )

    def __call__(self, it: dict) -> tuple[float, str]:
        req = {"name": it["name"], "bw": it["bw"], "bh": it["bh"], "size": list(it["size"])}
        self.proc.stdin.write(json.dumps(req) + "\n")
        self.proc.stdin.flush()
        ans = json.loads(self.proc.stdout.readline())
        return ans["cpu_s"], ans["sha256"]

    def close(self) -> None:
        self.proc.stdin.close()
        self.proc.wait()


def serve_worker(corpus: str) -> int:
    """The child side of :class:`Worker` (started with the export workers' environment)."""
    if any(os.environ.get(k) != v for k, v in heap.WORKER_ENV.items()):
        raise SystemExit("the worker was not started with prx_data.core.heap.WORKER_ENV")
    cache: dict[str, bytes] = {}
    for line in sys.stdin:
        req = json.loads(line)
        if req["name"] not in cache:
            with open(os.path.join(corpus, "images", req["name"]), "rb") as f:
                cache[req["name"]] = f.read()
        c0 = time.process_time()
        out = step(cache[req["name"]], req["bw"], req["bh"], tuple(req["size"]))
        dt = time.process_time() - c0
        print(json.dumps({"cpu_s": dt, "sha256": hashlib.sha256(out).hexdigest()}), flush=True)
    return 0


def race(items: list[dict], rounds: int, worker: Worker) -> tuple[list[dict], dict]:
    """Interleaved rounds: per round, per cell, CPU seconds of each contender and part."""
    parts = [part_fns(it, prepare_parts(it)) for it in items]
    names = list(CONTENDERS)
    for it in items[:2]:  # warm-up: imports, codec tables
        for n in names[:-1]:
            FUNCS[n](it["data"], it["bw"], it["bh"], it["size"])
        worker(it)
    per_round = []
    for r in range(rounds):
        t: dict = {}
        for i, (it, pf) in enumerate(zip(items, parts, strict=True)):
            cell = t.setdefault(it["cell"], {"n": 0, **{n: 0.0 for n in (*names, "parts")}})
            cell["n"] += 1
            k = (i + r) % len(names)
            for n in names[k:] + names[:k]:
                if n == WORKER:
                    cell[n] += worker(it)[0]
                    continue
                c0 = time.process_time()
                FUNCS[n](it["data"], it["bw"], it["bh"], it["size"])
                cell[n] += time.process_time() - c0
            for part in PARTS:
                best = None
                for lib, fn in pf[part].items():
                    c0 = time.process_time()
                    fn()
                    dt = time.process_time() - c0
                    cell[f"{part}:{lib}"] = cell.get(f"{part}:{lib}", 0.0) + dt
                    best = dt if best is None else min(best, dt)
                cell[f"{part}"] = cell.get(part, 0.0) + best
                cell["parts"] += best
        per_round.append(t)
        print(
            f"round {r + 1}/{rounds}: "
            + "; ".join(
                f"{c[0]} {c[1]}: step {v['step'] / v['n'] * 1e3:.0f} ms, "
                f"i2d {v['img2dataset'] / v['n'] * 1e3:.0f} ms"
                for c, v in sorted(t.items())
            ),
            file=sys.stderr,
        )
    same = 0
    for it in items:  # the worker writes the step's bytes (checked after timing: every
        # contender is warmed on the same two items only)
        want = hashlib.sha256(step(it["data"], it["bw"], it["bh"], it["size"])).hexdigest()
        same += worker(it)[1] == want
    if same != len(items):
        raise SystemExit(f"the worker's step wrote other bytes for {len(items) - same} items")
    return per_round, {"prepared": len(parts), "worker bytes = step bytes": same}


def fidelity(items: list[dict]) -> dict:
    scores: dict = {}
    for it in items:
        ref = reference(it["data"], it["bw"], it["bh"], it["size"])
        for n in CONTENDERS[:-1]:  # the worker's bytes are the step's (checked in race)
            enc = FUNCS[n](it["data"], it["bw"], it["bh"], it["size"])
            scores.setdefault(it["cell"], {}).setdefault(n, []).append((psnr(ref, enc), it["name"]))
    return scores


def summarise(items, per_round, scores) -> list[dict]:
    cells = sorted({it["cell"] for it in items}, key=lambda c: (BANDS_ORDER[c[0]], c[1]))
    out = []
    for cell in cells:
        its = [it for it in items if it["cell"] == cell]
        rounds = [pr[cell] for pr in per_round]
        n = rounds[0]["n"]
        row = {
            "band": cell[0],
            "tier": cell[1],
            "images": n,
            "originals": sum(not it["derived"] for it in its),
            "enlarged": sum(
                max(it["bw"] / it["size"][0], it["bh"] / it["size"][1]) > 1 for it in its
            ),
            "ms": {},
            "psnr": {},
        }
        for key in rounds[0]:
            if key == "n":
                continue
            row["ms"][key] = round(statistics.median(r[key] / n * 1e3 for r in rounds), 2)
        for who in ("step", "step before", WORKER):
            ratios = {}
            for a in ANCHORS:
                ratios[a] = [r[a] / r[who] for r in rounds]
            fastest = min(ANCHORS, key=lambda a: row["ms"][a])
            row[f"{who} vs fastest anchor"] = {
                "anchor": fastest,
                "ratio": round(statistics.median(ratios[fastest]), 3),
                "per_round": [round(x, 3) for x in ratios[fastest]],
            }
            row[f"{who} vs anchors"] = {
                a: round(statistics.median(v), 3) for a, v in ratios.items()
            }
        for who in ("step", WORKER):
            sp = [r[who] / r["parts"] for r in rounds]
            row[f"{who} / sum of parts"] = round(statistics.median(sp), 3)
            row[f"{who} / sum of parts per round"] = [round(x, 3) for x in sp]
        if cell in scores:
            for who, vals in scores[cell].items():
                ps = [v for v, _ in vals]
                worst = min(vals)
                row["psnr"][who] = {
                    "min": round(worst[0], 2),
                    "median": round(statistics.median(ps), 2),
                    "worst": worst[1],
                    "n": len(ps),
                }
        out.append(row)
    return out


BANDS_ORDER = {name: i for i, (_, _, name) in enumerate(BANDS)}


def markdown(res: dict) -> str:
    lines = [
        "# The export step per size band and tier (`benchmarks/bench_step_bands.py`)",
        "",
        f"Run {res['date']} on {res['machine']}, pinned to CPU {res['cpu']}; "
        f"load average at start `{res['loadavg_start']}`, at end `{res['loadavg_end']}`; "
        f"{res['rounds']} interleaved rounds, medians; command `{res['command']}`.",
        "",
        f"Corpus: {res['corpus']}",
        "",
        "Speed is CPU ms per image (one core). Ratios are the anchor's time over the "
        "step's, per round (> 1: the step is faster), median over rounds; 'fastest' is the "
        "anchor with the least median time in that cell. PSNR (dB) is min / median against "
        "a float Lanczos resample of the full decode over the exact box, after the q92 "
        "encode, computed outside the timed region.",
        "",
        "## Step against the anchors, before and after",
        "",
        "'step' runs in this process (glibc's default heap); 'worker' is the same step, "
        "writing the same bytes, in a child process set up as `write_mds`'s workers are "
        "(`prx_data.core.heap`: large buffers kept in the heap between images). 'worker' is "
        "what an export runs.",
        "",
        "| band | tier | imgs (orig) | up | img2dataset ms | vips ms | pillow ms "
        "| before ms | step ms | worker ms | before vs fastest | step vs fastest "
        "| **worker vs fastest** | PSNR min: i2d / vips / pillow / before / step |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in res["cells"]:
        ms, ps = r["ms"], r["psnr"]
        f, fb = r["step vs fastest anchor"], r["step before vs fastest anchor"]
        fw = r[f"{WORKER} vs fastest anchor"]

        def p(who, ps=ps):
            return f"{ps[who]['min']:.1f}" if who in ps else "-"

        lines.append(
            f"| {r['band']} | {r['tier']} | {r['images']} ({r['originals']}) | {r['enlarged']} "
            f"| {ms['img2dataset']:.1f} | {ms['vips']:.1f} | {ms['pillow']:.1f} "
            f"| {ms['step before']:.1f} | {ms['step']:.1f} | {ms[WORKER]:.1f} "
            f"| {fb['ratio']:.2f}x ({fb['anchor']}) | {f['ratio']:.2f}x "
            f"| **{fw['ratio']:.2f}x** ({fw['anchor']}; "
            f"{', '.join(f'{x:.2f}' for x in fw['per_round'])}) "
            f"| {p('img2dataset')} / {p('vips')} / {p('pillow')} / {p('step before')} "
            f"/ **{p('step')}** |"
        )
    lines += [
        "",
        "PSNR median per cell (i2d / vips / pillow / before / step):",
        "",
        "| band | tier | PSNR median | step's worst image |",
        "|---|---|---|---|",
    ]
    for r in res["cells"]:
        ps = r["psnr"]
        if not ps:
            continue
        med = " / ".join(f"{ps[w]['median']:.1f}" for w in CONTENDERS[:-1])
        lines.append(f"| {r['band']} | {r['tier']} | {med} | {ps['step']['worst']} |")
    lines += [
        "",
        "## Step against the sum of its parts",
        "",
        "Each part alone, at its best per image (the fastest library), on inputs "
        "prepared outside the timed region; CPU ms per image.",
        "",
        "| band | tier | decode (opencv / pillow / libvips) | resample | encode "
        "(opencv / pillow / libvips) | sum of best | step | worker | step / sum "
        "| **worker / sum** |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in res["cells"]:
        ms = r["ms"]
        lines.append(
            f"| {r['band']} | {r['tier']} "
            f"| {ms['decode']:.1f} ({ms['decode:opencv']:.1f} / {ms['decode:pillow']:.1f} / "
            f"{ms['decode:libvips']:.1f}) | {ms['resample']:.1f} "
            f"| {ms['encode']:.1f} ({ms['encode:opencv']:.1f} / {ms['encode:pillow']:.1f} / "
            f"{ms['encode:libvips']:.1f}) | {ms['parts']:.1f} | {ms['step']:.1f} "
            f"| {ms[WORKER]:.1f} | {r['step / sum of parts']:.2f}x "
            f"| **{r[f'{WORKER} / sum of parts']:.2f}x** |"
        )
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--quick", action="store_true", help="2 rounds, every other image")
    ap.add_argument("--rounds", type=int, default=None, help="default 3 (2 with --quick)")
    ap.add_argument("--tiers", default=",".join(map(str, TIERS)))
    ap.add_argument("--no-derived", action="store_true", help="originals only")
    ap.add_argument("--corpus", default=DEFAULT_OUT)
    ap.add_argument("--limit", type=int, default=None, help="first N images (a smoke run)")
    ap.add_argument("--cpu", type=int, default=None, help="core to pin to (default: the last)")
    ap.add_argument("--json", default=os.path.join(REPO, "benchmarks/results/export-bands.json"))
    ap.add_argument("--md", default=os.path.join(REPO, "benchmarks/results/export-bands.md"))
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    cpu = args.cpu if args.cpu is not None else max(os.sched_getaffinity(0))
    os.sched_setaffinity(0, {cpu})
    if args.worker:
        return serve_worker(args.corpus)
    with open("/proc/loadavg") as f:
        load0 = f.read().strip()
    rows = build_corpus(args.corpus, derived=not args.no_derived)
    if args.quick:
        rows = rows[::2]
    rows = rows[: args.limit]
    rounds = args.rounds or (2 if args.quick else 3)
    tiers = tuple(int(t) for t in args.tiers.split(","))
    items = work_items(args.corpus, rows, tiers)
    n_orig = sum(not r["derived"] for r in rows)
    pk = sorted({r["package"] for r in rows})
    corpus = (
        f"{len(rows)} RGB JPEGs ({n_orig} whole originals, byte-for-byte, from {', '.join(pk)}; "
        f"{len(rows) - n_orig} derived: an 8-18 MP original downscaled whole to "
        f"{DERIVED_MP:g} MP, q92), {len(items)} (image, tier) items; "
        f"{sum(r['progressive'] for r in rows)} progressive."
    )
    print(corpus, file=sys.stderr)
    t0 = time.time()
    worker = Worker(args.corpus, cpu)
    try:
        per_round, checks = race(items, rounds, worker)
    finally:
        worker.close()
    scores = fidelity(items)
    with open("/proc/loadavg") as f:
        load1 = f.read().strip()
    res = {
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "machine": f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores",
        "cpu": cpu,
        "loadavg_start": load0,
        "loadavg_end": load1,
        "rounds": rounds,
        "command": "python benchmarks/bench_step_bands.py" + (" --quick" if args.quick else ""),
        "corpus": corpus,
        "seconds": round(time.time() - t0, 1),
        "checks": checks,
        "images": [{k: v for k, v in r.items()} for r in rows],
        "cells": summarise(items, per_round, scores),
    }
    with open(args.json, "w") as f:
        json.dump(res, f, indent=1)
    md = markdown(res)
    with open(args.md, "w") as f:
        f.write(md)
    print(md)
    return 0


if __name__ == "__main__":
    sys.exit(main())
