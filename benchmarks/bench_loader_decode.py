"""Loader decode when training at 512 from higher tiers: samples/s per worker, as ratios.

Three exports of the same real photos, one per source tier (512, 2048, 4096),
each written with the export's own ``prepare`` (Lanczos cover-resize, q92).
A ``BucketedDataset`` at tier 512 (``include_higher_tiers``) reads each one
in one process (one loader worker) and yields 512-tier tensors. Reported:

  rate       samples/s per worker for each source tier, with the loader's
             decode (JPEG draft to >= 1.5x the target, then Lanczos) and
             with a full decode + Lanczos (the previous loader), rounds
             interleaved so machine load drifts cancel
  ratio      rate(2048 or 4096 source) / rate(512 source); target >= 0.5
  bytes      the loader rate with data.decode=device (no decode in the loader:
             the step decodes each batch on the GPU with nvJPEG)
  psnr       draft path vs full decode, per image (min / median dB)

Real photos: ``apt-get download lomiri-wallpapers-16.04 && dpkg-deb -x *.deb x``
then ``python benchmarks/bench_loader_decode.py --photos x/usr/share/backgrounds``.
"""

from __future__ import annotations

import argparse
import glob
import io
import json
import os
import statistics
import sys
import tempfile
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from PIL import Image  # noqa: E402
from streaming import MDSWriter  # noqa: E402
from streaming.base.util import clean_stale_shared_memory  # noqa: E402

from prx_data.core import imaging  # noqa: E402
from prx_data.core.buckets import DEFAULT_SPEC, bucket_name, nearest_shape  # noqa: E402
from prx_data.core.schema import MDS_COLUMNS  # noqa: E402
from prx_data.stream import dataset as stream_dataset  # noqa: E402
from prx_data.stream.dataset import BucketedDataset  # noqa: E402

TIERS = (512, 2048, 4096)


def full_decode(data: bytes, shape: tuple[int, int]):
    """The loader's previous decode: full-size decode, then Lanczos to the shape."""
    import torch

    im = Image.open(io.BytesIO(data))
    im = im.convert("RGB") if im.mode != "RGB" else im
    if im.size != shape:
        im = im.resize(shape, Image.Resampling.LANCZOS)
    return torch.from_numpy(np.asarray(im, dtype=np.uint8).copy()).permute(2, 0, 1).contiguous()


def write_export(root: str, photos: list[bytes], tier: int, reps: int) -> int:
    """One export tree holding ``photos`` (x reps) at ``tier``, in the bucket layout."""
    writers: dict[str, MDSWriter] = {}
    n = 0
    for r in range(reps):
        for i, data in enumerate(photos):
            info = imaging.probe(data)
            w, h = nearest_shape(info.width, info.height, DEFAULT_SPEC.shapes(tier))
            prep = imaging.prepare(data, w, h)
            b = bucket_name(tier, w, h)
            if b not in writers:
                writers[b] = MDSWriter(out=os.path.join(root, b), columns=dict(MDS_COLUMNS))
            writers[b].write(
                {
                    "image": prep.data,
                    "id": f"{tier}/{r}/{i}",
                    "width": info.width,
                    "height": info.height,
                    "crop_left": prep.crop_box[0],
                    "crop_top": prep.crop_box[1],
                    "crop_right": prep.crop_box[2],
                    "crop_bottom": prep.crop_box[3],
                    "tier": tier,
                    "bucket": b,
                }
            )
            n += 1
    for w in writers.values():
        w.finish()
    return n


def one_pass(root: str, cls: type = BucketedDataset) -> float:
    """Samples/s for one pass over the export through BucketedDataset.get_item."""
    ds = cls(
        root,
        tier=512,
        batch_size=1,
        include_higher_tiers=True,
        shuffle=False,
        small_buckets="drop",
        caption_columns=(),
    )
    t0 = time.perf_counter()
    for i in range(ds.num_samples):
        item = ds[i]
        assert len(item["image"])
    dt = time.perf_counter() - t0
    n = ds.num_samples
    del ds
    clean_stale_shared_memory()
    return n / dt


def psnr(a: np.ndarray, b: np.ndarray) -> float:
    mse = float(np.mean((a.astype(np.float64) - b.astype(np.float64)) ** 2))
    return float("inf") if mse == 0 else 10 * np.log10(255.0**2 / mse)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--photos", required=True, help="folder of real JPEG photos (see module doc)")
    p.add_argument("--reps", type=int, default=2, help="copies of each photo per export")
    p.add_argument("--rounds", type=int, default=3, help="interleaved timing rounds")
    p.add_argument("--json", help="also write the figures to this JSON file")
    args = p.parse_args()
    paths = sorted(glob.glob(os.path.join(args.photos, "*.jp*g")))
    if not paths:
        print(f"no JPEGs under {args.photos}", file=sys.stderr)
        return 2
    photos = [open(p, "rb").read() for p in paths]
    work = tempfile.mkdtemp(prefix="bench-loader-decode-")
    roots = {}
    for tier in TIERS:
        roots[tier] = os.path.join(work, str(tier))
        n = write_export(roots[tier], photos, tier, args.reps)
        print(f"export tier {tier}: {n} samples", flush=True)

    from prx_data.train.data import EncodedBucketedDataset

    new_decode = stream_dataset._decode
    rates: dict[str, list[float]] = {}
    for _ in range(args.rounds):
        for tier in TIERS:
            # data.decode=device: the loader passes the bytes on; the GPU decodes the batch.
            rates.setdefault(f"{tier}/bytes", []).append(
                one_pass(roots[tier], EncodedBucketedDataset)
            )
            for name, fn in (("draft", new_decode), ("full", full_decode)):
                if tier == 512 and name == "full":
                    continue  # same path: the 512 source is already the target shape
                stream_dataset._decode = fn
                try:
                    rates.setdefault(f"{tier}/{name}", []).append(one_pass(roots[tier]))
                finally:
                    stream_dataset._decode = new_decode
    med = {k: statistics.median(v) for k, v in rates.items()}
    base = med["512/draft"]
    print(f"\n{'source tier':>12} {'decode':>6} {'samples/s':>10} {'vs 512':>7}")
    for k, v in med.items():
        tier, name = k.split("/")
        print(f"{tier:>12} {name:>6} {v:10.1f} {v / base:7.2f}x")

    # Fidelity: draft path against a full decode + the same cover-resize.
    scores = []
    for tier in (2048, 4096):
        for data in photos:
            info = imaging.probe(data)
            w, h = nearest_shape(info.width, info.height, DEFAULT_SPEC.shapes(tier))
            src = imaging.prepare(data, w, h).data
            from prx_data.core.buckets import parse_bucket_name, same_ratio_shape

            shape = same_ratio_shape(parse_bucket_name(bucket_name(tier, w, h)), 512)
            fast = stream_dataset._decode(src, shape).permute(1, 2, 0).numpy()
            ref_im = imaging.decode(src)
            ref, _ = imaging.cover_resize(ref_im, *shape)
            scores.append(psnr(fast, np.asarray(ref)))
    print(
        f"\nPSNR draft vs full decode (2048/4096 sources, {len(scores)} images): "
        f"min {min(scores):.1f} dB, median {statistics.median(scores):.1f} dB"
    )
    out = {
        "rates": med,
        "ratio_vs_512": {k: v / base for k, v in med.items()},
        "psnr_min": min(scores),
        "psnr_median": statistics.median(scores),
        "rounds": rates,
    }
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
