"""Ingest throughput (folder and parquet) against a plain loop, and fragment count at scale.

In one run, on the same synthetic photo-like JPEGs with captions:

- ``anchor_folder``: one Python process reads every file and its caption,
  probes the header (:func:`prx_data.core.imaging.probe`), and writes the same
  table with one ``lance.write_dataset``;
- ``ray_folder``: ``prx_data.cli.ingest.ingest`` on the folder (Ray Data,
  ``--cpus`` local CPUs; Ray started before the clock so start-up is not
  counted);
- ``anchor_parquet`` / ``ray_parquet``: the same with the images stored as
  bytes in a parquet file;
- ``ray_fixed_cost_s``: a warm 1-row ingest (planning, ledger actor, Ray
  Data start-up, commit), and ``*_marginal_rows_s`` = rows / (time - fixed);
- ``fragments``: a default ingest of ``--fragment-rows`` small rows
  (parquet, tiny images) and the fragment count it leaves (target: <= ~20
  for 1M rows).

Ratios are rows/s of the job over rows/s of the anchor in the same run::

    python benchmarks/bench_ingest.py --images 2000 --cpus 2 --fragment-rows 1000000
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
import pyarrow.parquet as pq
from PIL import Image

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from prx_data.pipelines.ingest import ingest  # noqa: E402

from prx_data.core import schema as S  # noqa: E402
from prx_data.core.imaging import (
    ImageError,
    probe,  # noqa: E402
)
from prx_data.core.runtime import ensure_ray  # noqa: E402


def photo_like(rng: np.random.Generator, w: int, h: int) -> bytes:
    """Smooth gradients plus noise: JPEG sizes close to real photos of that size."""
    y, x = np.mgrid[0:h, 0:w].astype(np.float32)
    base = np.stack(
        [
            128 + 100 * np.sin(x / rng.uniform(20, 80) + rng.uniform(0, 6)),
            128 + 100 * np.cos(y / rng.uniform(20, 80) + rng.uniform(0, 6)),
            128 + 60 * np.sin((x + y) / rng.uniform(30, 90)),
        ],
        axis=-1,
    )
    px = np.clip(base + rng.normal(0, 18, base.shape), 0, 255).astype(np.uint8)
    buf = io.BytesIO()
    Image.fromarray(px).save(buf, "JPEG", quality=88)
    return buf.getvalue()


def make_sources(root: Path, n: int, seed: int = 0) -> tuple[Path, Path, float]:
    rng = np.random.default_rng(seed)
    folder = root / "photos"
    folder.mkdir(parents=True, exist_ok=True)
    images, captions = [], []
    for i in range(n):
        w, h = int(rng.integers(320, 1024)), int(rng.integers(320, 1024))
        data = photo_like(rng, w, h)
        cap = f"synthetic photo {i} of {w} by {h} pixels"
        (folder / f"{i:06d}.jpg").write_bytes(data)
        (folder / f"{i:06d}.txt").write_text(cap)
        images.append(data)
        captions.append(cap)
    pq_path = root / "photos.parquet"
    pq.write_table(
        pa.table({"key": [f"{i:06d}" for i in range(n)], "image": images, "caption": captions}),
        pq_path,
        row_group_size=256,
    )
    return folder, pq_path, float(np.mean([len(b) for b in images]))


def _write(rows: dict[str, list], uri: str) -> None:
    lance.write_dataset(pa.table(rows, schema=S.TABLE_SCHEMA), uri, mode="overwrite")


def _row(rows: dict[str, list], source: str, key: str, data: bytes, caption: str | None) -> None:
    try:
        info = probe(data)
        w, h, fmt, err = info.width, info.height, info.format, None
    except ImageError as e:
        w = h = fmt = None
        err = e.reason
    for name, v in zip(
        S.TABLE_SCHEMA.names,
        (f"{source}/{key}", data, w, h, fmt, source, caption, err),
        strict=True,
    ):
        rows[name].append(v)


def anchor_folder(folder: Path, uri: str) -> int:
    rows: dict[str, list] = {n: [] for n in S.TABLE_SCHEMA.names}
    for p in sorted(folder.glob("*.jpg")):
        txt = p.with_suffix(".txt")
        caption = txt.read_text() if txt.exists() else None
        _row(rows, "photos", p.stem, p.read_bytes(), caption)
    _write(rows, uri)
    return len(rows["id"])


def anchor_parquet(path: Path, uri: str) -> int:
    rows: dict[str, list] = {n: [] for n in S.TABLE_SCHEMA.names}
    pf = pq.ParquetFile(path)
    for rg in range(pf.num_row_groups):
        t = pf.read_row_group(rg)
        for key, data, cap in zip(
            t["key"].to_pylist(), t["image"].to_pylist(), t["caption"].to_pylist(), strict=True
        ):
            _row(rows, "photos", key, data, cap)
    _write(rows, uri)
    return len(rows["id"])


def timed(fn, *args) -> tuple[int, float]:
    t0 = time.perf_counter()
    n = fn(*args)
    return n, time.perf_counter() - t0


def fragments_at_scale(root: Path, rows: int) -> dict:
    """A default ingest of ``rows`` small rows (tiny JPEGs): how many fragments?"""
    tiny = []
    rng = np.random.default_rng(1)
    for _ in range(64):
        buf = io.BytesIO()
        Image.fromarray(rng.integers(0, 255, (16, 16, 3), dtype=np.uint8)).save(buf, "JPEG")
        tiny.append(buf.getvalue())
    path = root / "many.parquet"
    with pq.ParquetWriter(
        path, pa.schema([("key", pa.string()), ("image", pa.binary()), ("caption", pa.string())])
    ) as w:
        for start in range(0, rows, 100_000):
            n = min(100_000, rows - start)
            w.write_table(
                pa.table(
                    {
                        "key": [f"{i:08d}" for i in range(start, start + n)],
                        "image": [tiny[i % 64] for i in range(n)],
                        "caption": [f"row {i}" for i in range(start, start + n)],
                    }
                ),
                row_group_size=8192,
            )
    uri = str(root / "many.lance")
    t0 = time.perf_counter()
    report = ingest([str(path)], uri, mode="overwrite", progress=False)
    secs = time.perf_counter() - t0
    ds = lance.dataset(uri)
    return {
        "rows": ds.count_rows(),
        "fragments": len(ds.get_fragments()),
        "rows_per_fragment_target": report.rows_per_fragment,
        "seconds": round(secs, 1),
        "rows_per_s": round(ds.count_rows() / secs, 1),
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument(
        "--images", type=int, default=2000, help="synthetic photos (default: %(default)s)"
    )
    p.add_argument("--cpus", type=int, default=2, help="local Ray CPUs (default: %(default)s)")
    p.add_argument(
        "--fragment-rows",
        type=int,
        default=0,
        help="also ingest this many small rows and count fragments (0: skip; 1000000 for the target)",
    )
    p.add_argument("--dir", default=None, help="work folder (default: a temp folder)")
    args = p.parse_args(argv)

    root = Path(args.dir or tempfile.mkdtemp(prefix="bench_ingest_"))
    folder, pq_path, mean_bytes = make_sources(root, args.images)
    ensure_ray(num_cpus=args.cpus)
    # Warm-up (not timed): Ray starts its worker processes and imports on first use.
    warm = root / "warm"
    warm.mkdir(exist_ok=True)
    (warm / "w.jpg").write_bytes(photo_like(np.random.default_rng(5), 64, 64))
    ingest([str(warm)], str(root / "warm.lance"), mode="overwrite", progress=False)
    # Fixed cost of one job (plan, ledger actor, Ray Data start, commit): a 1-row ingest.
    t0 = time.perf_counter()
    ingest([str(warm)], str(root / "warm.lance"), mode="overwrite", progress=False)
    fixed = time.perf_counter() - t0
    out: dict = {
        "images": args.images,
        "mean_image_kb": round(mean_bytes / 1024, 1),
        "cpus": args.cpus,
        "ray_fixed_cost_s": round(fixed, 2),
    }

    n, t = timed(anchor_folder, folder, str(root / "anchor_folder.lance"))
    out["anchor_folder_rows_s"] = round(n / t, 1)
    n, t = timed(anchor_parquet, pq_path, str(root / "anchor_parquet.lance"))
    out["anchor_parquet_rows_s"] = round(n / t, 1)
    for name, src in (("folder", folder), ("parquet", pq_path)):
        uri = str(root / f"ray_{name}.lance")
        t0 = time.perf_counter()
        rep = ingest([f"photos={src}"], uri, mode="overwrite", progress=False)
        t = time.perf_counter() - t0
        assert rep.rows_written == args.images, rep.format()
        out[f"ray_{name}_rows_s"] = round(rep.rows_written / t, 1)
        out[f"ray_{name}_vs_anchor"] = round(
            (rep.rows_written / t) / out[f"anchor_{name}_rows_s"], 2
        )
        out[f"ray_{name}_fragments"] = len(lance.dataset(uri).get_fragments())
        # Rows/s once the fixed cost is paid: what larger ingests approach.
        out[f"ray_{name}_marginal_rows_s"] = round(rep.rows_written / max(t - fixed, 1e-3), 1)
    if args.fragment_rows:
        out["fragments_at_scale"] = fragments_at_scale(root, args.fragment_rows)
    print(json.dumps(out, indent=2))
    if not args.dir:
        import shutil

        shutil.rmtree(root, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
