"""python -m prx_data.demo: the whole export path on a small embedded sample.

Makes a photo-like sample collection (several sizes, aspect ratios, formats
and caption sidecars, plus a few broken files), ingests it into a local
Lance table with Ray Data, exports bucketed MDS and prints the report.
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys

from prx_data.core.sample_data import make_sample_collection


def _add_broken_files(folder: str) -> None:
    """A few files every real collection has, to show how they are counted."""
    from PIL import Image

    with open(os.path.join(folder, "broken_zero_bytes.jpg"), "wb"):
        pass
    with open(os.path.join(folder, "img_0000.jpg"), "rb") as f:
        data = f.read()
    with open(os.path.join(folder, "broken_truncated.jpg"), "wb") as f:
        f.write(data[: len(data) // 3])
    with open(os.path.join(folder, "broken_truncated.txt"), "w") as f:
        f.write("a photo cut short by a failed download")
    Image.new("RGB", (64, 64), (128, 128, 128)).save(os.path.join(folder, "tiny_thumbnail.png"))
    Image.new("RGB", (2400, 300), (90, 140, 200)).save(os.path.join(folder, "banner_8to1.jpg"))


def run_demo(workdir: str, repeats: int = 2, num_cpus: int | None = None) -> dict:
    from prx_data.export.unit import ExportConfig
    from prx_data.pipelines.ingest import ingest
    from prx_data.pipelines.write_mds import run_export

    src = os.path.join(workdir, "src")
    table = os.path.join(workdir, "table.lance")
    out = os.path.join(workdir, "export")
    if os.path.exists(src):
        shutil.rmtree(src)
    items = make_sample_collection(src, repeats=repeats)
    _add_broken_files(src)
    print(f"sample collection: {len(items)} images + 4 awkward files in {src}")
    ingest_report = ingest([f"demo={src}"], table, mode="overwrite", num_cpus=num_cpus)
    print(ingest_report.format())
    report = run_export(
        ExportConfig(table=table, out=out, rows_per_task=8),
        overwrite=os.path.exists(out),
        num_cpus=num_cpus,
    )
    from prx_data.train.text_encoder import save_tiny_t5
    from prx_data.train.vae import save_tiny_autoencoder

    encoder = save_tiny_t5(os.path.join(workdir, "tiny-t5"))
    print(f"\ntiny random-weight T5 text encoder for the offline smoke run: {encoder}")
    vae = save_tiny_autoencoder(os.path.join(workdir, "tiny-vae"))
    print(f"tiny random-weight AutoencoderKL for the latent smoke run: {vae}")
    from prx_data.train.metrics import save_tiny_metric_models

    tiny = save_tiny_metric_models(workdir)
    print(f"tiny random-weight FID/CLIP/DINOv2 models for its metrics: {', '.join(tiny.values())}")
    print()
    print(report.table_text())
    print(f"\nreport: {os.path.join(out, 'report.json')}")
    print(
        "\nnext:\n"
        f"  python -m prx_data.stats --table {table} --out {workdir}/stats\n"
        f"  python -m prx_data.explore --table {table} --build-indexes\n"
        f"  python -m prx_data.skips stats {out}\n"
        "  python -m prx_data.train configs/train/smoke_cpu.yaml\n"
        "  python -m prx_data.train configs/train/smoke_latent_cpu.yaml"
    )
    return report.to_dict()


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m prx_data.demo",
        description="Make a small sample collection, ingest it into Lance and export bucketed MDS "
        "with local Ray; prints the export report.",
    )
    p.add_argument(
        "--workdir",
        default="demo_out",
        help="Where the sample, table and export go (default: ./demo_out; replaced on rerun).",
    )
    p.add_argument(
        "--repeats",
        type=int,
        default=2,
        help="Copies of the 16-size sample grid to generate (default: 2, i.e. 32 images).",
    )
    p.add_argument("--num-cpus", type=int, default=None, help="CPUs for local Ray (default: all).")
    return p


def main(argv: list[str] | None = None) -> int:
    p = build_parser()
    args = p.parse_args(argv)
    run_demo(args.workdir, args.repeats, args.num_cpus)
    return 0


if __name__ == "__main__":
    sys.exit(main())
