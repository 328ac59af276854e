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
  limit      at 512 from 512-tier shards, in the same rounds: the loader, a
             plain StreamingDataset + Pillow decode + HWC->CHW tensor (what a
             user writes), and decoding the same JPEG bytes alone (Pillow's
             ``load()``, and libjpeg-turbo through torchvision); target: the
             loader at >= 0.8x the decode-only rate

Real photos: ``apt-get download lomiri-wallpapers-16.04 && dpkg-deb -x *.deb x``
then ``python benchmarks/bench_loader_decode.py --photos x/usr/share/backgrounds``.
"""

from __future__ import annotations

import argparse
import gc
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
    """An export tree holding ``photos`` (x reps) at ``tier``, in the exporter's layout.

    One part per bucket (the exporter's part names and ``ids.parquet``
    manifests), then the exporter's own ``finalize`` merges the buckets and
    writes ``report.json``, so the loader takes it as a finished export.
    """
    from prx_data.core import storage
    from prx_data.export import durable, naming, safety
    from prx_data.export.merge import finalize
    from prx_data.export.spec import ExportConfig, UnitResult

    part = naming.part_name(0, 0)
    writers: dict[str, MDSWriter] = {}
    ids: dict[str, list[str]] = {}
    for r in range(reps):
        for i, data in enumerate(photos):
            info = imaging.probe(data)
            w, h = nearest_shape(info.width, info.height, DEFAULT_SPEC.shapes(tier))
            prep = imaging.prepare(data, w, h)
            b = bucket_name(tier, w, h)
            if b not in writers:
                writers[b] = MDSWriter(
                    out=os.path.join(root, b, part),
                    columns=dict(MDS_COLUMNS),
                    hashes=["sha1", "xxh64"],
                )
            sid = f"{tier}/{r}/{i}"
            writers[b].write(
                {
                    "image": prep.data,
                    "id": sid,
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
            ids.setdefault(b, []).append(sid)
    for w in writers.values():
        w.finish()
    result = UnitResult(part=part)
    for b, bids in ids.items():
        durable.write_manifest(os.path.join(root, b), part, bids)
        result.buckets[b] = len(bids)
    result.written = result.rows = sum(result.buckets.values())
    safety.write_export_marker(root)
    storage.write_bytes_atomic(naming.marker_path(root, part), result.to_json().encode())
    cfg = ExportConfig(table="(bench_loader_decode)", out=root, caption_columns=())
    finalize(cfg, {part: result}, 0.0)
    return result.written


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
    gc.collect()  # releases the dataset's shared memory (others' may be in use)
    return n / dt


def plain_pass(root: str) -> float:
    """Samples/s: a plain StreamingDataset over the buckets + Pillow decode + CHW tensor."""
    import torch
    from streaming import Stream, StreamingDataset

    dirs = sorted(
        os.path.dirname(p) for p in glob.glob(os.path.join(root, "*", "*", "*", "index.json"))
    )
    ds = StreamingDataset(
        streams=[Stream(local=d) for d in dirs], batch_size=1, shuffle=False, replication=None
    )
    t0 = time.perf_counter()
    for i in range(ds.num_samples):
        im = Image.open(io.BytesIO(ds[i]["image"])).convert("RGB")
        t = torch.from_numpy(np.asarray(im)).permute(2, 0, 1).contiguous()
        assert t.shape[0] == 3
    dt = time.perf_counter() - t0
    n = ds.num_samples
    del ds
    gc.collect()  # releases the dataset's shared memory (others' may be in use)
    return n / dt


def shard_images(root: str) -> list[bytes]:
    """The encoded images of an export, read straight from its shards."""
    from streaming.base.format import reader_from_json

    out = []
    for index in sorted(glob.glob(os.path.join(root, "*", "*", "*", "index.json"))):
        d = os.path.dirname(index)
        with open(index) as f:
            shards = json.load(f)["shards"]
        for info in shards:
            r = reader_from_json(d, None, info)
            out.extend(r.get_item(j)["image"] for j in range(r.samples))
    return out


def decode_only(datas: list[bytes], how: str) -> float:
    """Samples/s decoding the bytes alone: Pillow's ``load()`` or torchvision's libjpeg-turbo."""
    import torch
    import torchvision.io as tio

    t0 = time.perf_counter()
    for d in datas:
        if how == "pillow":
            Image.open(io.BytesIO(d)).load()
        else:
            tio.decode_jpeg(torch.frombuffer(bytearray(d), dtype=torch.uint8))
    return len(datas) / (time.perf_counter() - t0)


def psnr(a: np.ndarray, b: np.ndarray) -> float:
    mse = float(np.mean((a.astype(np.float64) - b.astype(np.float64)) ** 2))
    return float("inf") if mse == 0 else 10 * np.log10(255.0**2 / mse)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--photos", required=True, help="folder of real JPEG photos (see module doc)")
    p.add_argument("--reps", type=int, default=2, help="copies of each photo per export")
    p.add_argument("--rounds", type=int, default=3, help="interleaved timing rounds")
    p.add_argument(
        "--tiers", default="512,2048,4096", help="source tiers to export (512 is always one)"
    )
    p.add_argument("--json", help="also write the figures to this JSON file")
    args = p.parse_args()
    paths = sorted(glob.glob(os.path.join(args.photos, "*.jp*g")))
    if not paths:
        print(f"no JPEGs under {args.photos}", file=sys.stderr)
        return 2
    photos = [open(p, "rb").read() for p in paths]
    import torch

    torch.set_num_threads(1)  # as in a DataLoader worker
    tiers = tuple(sorted({512, *(int(t) for t in args.tiers.split(","))}))
    work = tempfile.mkdtemp(prefix="bench-loader-decode-")
    roots = {}
    for tier in tiers:
        roots[tier] = os.path.join(work, str(tier))
        n = write_export(roots[tier], photos, tier, args.reps)
        print(f"export tier {tier}: {n} samples", flush=True)

    from prx_data.train.data import EncodedBucketedDataset

    new_decode = stream_dataset._decode
    rates: dict[str, list[float]] = {}
    datas512 = shard_images(roots[512])
    for _ in range(args.rounds):
        rates.setdefault("limit/loader", []).append(one_pass(roots[512]))
        rates.setdefault("limit/plain+PIL", []).append(plain_pass(roots[512]))
        rates.setdefault("limit/decode:pillow", []).append(decode_only(datas512, "pillow"))
        rates.setdefault("limit/decode:turbo", []).append(decode_only(datas512, "torchvision"))
        for tier in tiers:
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
    # Ratios per round (same machine load), then the median.
    limit = {
        f"loader/{k}": statistics.median(
            a / b for a, b in zip(rates["limit/loader"], rates[k], strict=True)
        )
        for k in ("limit/plain+PIL", "limit/decode:pillow", "limit/decode:turbo")
    }
    print(f"\nat 512 from 512-tier shards ({len(datas512)} samples, one process):")
    for k in ("limit/loader", "limit/plain+PIL", "limit/decode:pillow", "limit/decode:turbo"):
        print(f"  {k[6:]:>16} {med[k]:8.1f} samples/s")
    for k, v in limit.items():
        print(f"  {k.replace('limit/', ''):>28} {v:5.2f}x")
    base = med["512/draft"]
    print(f"\n{'source tier':>12} {'decode':>6} {'samples/s':>10} {'vs 512':>7}")
    for k, v in med.items():
        if k.startswith("limit/"):
            continue
        tier, name = k.split("/")
        print(f"{tier:>12} {name:>6} {v:10.1f} {v / base:7.2f}x")

    # Fidelity: draft path against a full decode + the same cover-resize.
    scores = []
    for tier in (t for t in tiers if t > 512):
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
    if scores:
        print(
            f"\nPSNR draft vs full decode (higher-tier sources, {len(scores)} images): "
            f"min {min(scores):.1f} dB, median {statistics.median(scores):.1f} dB"
        )
    out = {
        "rates": med,
        "ratio_vs_512": {k: v / base for k, v in med.items() if not k.startswith("limit/")},
        "limit_ratios": limit,
        "psnr_min": min(scores, default=None),
        "psnr_median": statistics.median(scores) if scores else None,
        "rounds": rates,
    }
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
