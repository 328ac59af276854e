"""python -m prx_data.demo: the whole export path on a small embedded sample.

Makes a photo-like sample collection (several sizes, aspect ratios, formats
and caption sidecars, plus a few broken files), ingests it into a local
Lance table and exports bucketed MDS (on threads of this process at the default
size: small work never starts Ray), then prints the report.
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


#: Where the demo's URL list points: a loopback server over its sample folder (README).
URL_PORT = 8765


def _write_url_list(workdir: str, src: str, n: int = 4) -> str:
    """A LAION-style parquet (url, caption) of a few sample images, served from loopback.

    ``python -m http.server 8765 -b 127.0.0.1 -d <workdir>/src`` serves them, so the
    download job can be tried offline (``--allow-private 127.0.0.1:8765``).
    """
    import pyarrow as pa
    import pyarrow.parquet as pq

    names = sorted(f for f in os.listdir(src) if f.startswith("img_") and f.endswith(".jpg"))[:n]
    urls = [f"http://127.0.0.1:{URL_PORT}/{name}" for name in names]
    captions = [f"sample {name}" for name in names]
    path = os.path.join(workdir, "urls.parquet")
    pq.write_table(pa.table({"url": urls, "caption": captions}), path)
    return path


def _write_plain_mds(workdir: str, src: str, n: int = 4) -> str:
    """A small MDS tree as another writer makes it (``<tier>/<ratio>/``), for ``adopt``."""
    from streaming import MDSWriter

    root = os.path.join(workdir, "plain-mds")
    if os.path.exists(root):
        shutil.rmtree(root)
    names = sorted(f for f in os.listdir(src) if f.startswith("img_") and f.endswith(".jpg"))[:n]
    out = os.path.join(root, "512", "1.000")
    with MDSWriter(out=out, columns={"image": "bytes", "caption": "str"}) as w:
        for name in names:
            with open(os.path.join(src, name), "rb") as f:
                w.write({"image": f.read(), "caption": f"sample {name}"})
    return root


def _write_optout_ids(workdir: str, export: str, n: int = 2) -> str:
    """A file of row ids, as a rights holder's opt-out request becomes, for ``optout``:
    ids the export holds, so the opt-out visibly leaves samples out."""
    from prx_data.export.layout import read_manifests

    ids = sorted(set(read_manifests(export)["id"].to_pylist()))[:n]
    path = os.path.join(workdir, "optout.txt")
    with open(path, "w", encoding="utf-8") as f:
        f.write("# one row id per line; blank lines and '#' comments are ignored\n")
        f.writelines(f"{i}\n" for i in ids)
    return path


def demo_columns() -> set[str]:
    """The columns the demo's ingest writes (the table's own and the folder reader's)."""
    from prx_data.core import schema as S
    from prx_data.ingest import folder

    return set(S.TABLE_SCHEMA.names) | {f.name for f in folder.EXTRA_FIELDS}


def check_table_is_the_demos(table: str) -> None:
    """Refuse to replace a table holding columns the demo did not write: the README's job rows
    add them (captions, labels, scores, downloads), and a rerun would re-ingest over them."""
    from prx_data.core.errors import NotFound, UsageError
    from prx_data.table.lance_ops import open_table

    if not os.path.exists(table):
        return
    try:
        names = open_table(table).schema.names
    except NotFound:
        raise UsageError(
            f"{table} exists and is not a Lance table the demo wrote; pass --force to replace "
            "it, or --workdir elsewhere"
        ) from None
    added = sorted(set(names) - demo_columns())
    if added:
        shown = ", ".join(added[:8]) + (f" and {len(added) - 8} more" if len(added) > 8 else "")
        raise UsageError(
            f"{table} has columns the demo did not write ({shown}): rerunning would replace the "
            "table and lose them; pass --force to replace it, or --workdir elsewhere"
        )


def run_demo(
    workdir: str, repeats: int = 2, num_cpus: int | None = None, force: bool = False
) -> dict:
    from prx_data.core.runtime import RunOptions
    from prx_data.export.spec import ExportConfig
    from prx_data.pipelines.ingest import ingest
    from prx_data.pipelines.write_mds import run_export

    src = os.path.join(workdir, "src")
    table = os.path.join(workdir, "table.lance")
    out = os.path.join(workdir, "export")
    if not force:
        check_table_is_the_demos(table)  # before anything of the workdir is replaced
    if os.path.exists(src):
        shutil.rmtree(src)
    items = make_sample_collection(src, repeats=repeats)
    _add_broken_files(src)
    print(f"sample collection: {len(items)} images + 4 awkward files in {src}")
    ingest_report = ingest([f"demo={src}"], table, mode="overwrite", num_cpus=num_cpus)
    print(ingest_report.format())
    report = run_export(
        ExportConfig(table=table, out=out, rows_per_task=8),
        RunOptions(num_cpus=num_cpus),
        overwrite=os.path.exists(out),
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
    from prx_data.core.tinymodels import save_demo_models

    jobs = save_demo_models(workdir)
    urls = _write_url_list(workdir, src)
    print(f"a URL list for the download job (served by python -m http.server): {urls}")
    plain = _write_plain_mds(workdir, src)
    print(f"an MDS tree another writer made, for the adopt job: {plain}")
    optout = _write_optout_ids(workdir, out)
    print(f"row ids to opt out, for the optout job: {optout}")
    print(
        "tiny random-weight models for the column jobs (offline, CPU; outputs are noise): "
        + ", ".join(f"{k} {v}" for k, v in jobs.items())
    )
    print()
    print(report.table_text())
    print(f"\nreport: {os.path.join(out, 'report.json')}")
    print("\nnext:\n" + "".join(f"  {c}\n" for c in next_steps(workdir, table, out)), end="")
    print("(README.md, 'Every job': one offline command per job)")
    return report.to_dict()


def next_steps(workdir: str, table: str, out: str) -> list[str]:
    """The commands the demo suggests next: rows of the README's job table, spelled for
    ``workdir`` (tests/test_readme_jobs.py checks that the default's are in the table)."""
    return [
        f"python -m prx_data.stats --table {table} --out {workdir}/stats",
        f"python -m prx_data.skips stats {out}",
        f"python -m prx_data.caption --table {table} --backend transformers "
        f"--model {workdir}/tiny-vlm --max-tokens 16 --limit 8",
        f"python -m prx_data.score clip --table {table} --model {workdir}/tiny-clip --engine local",
        "python -m prx_data.train configs/train/smoke_cpu.yaml",
        "composer -n 2 -m prx_data.train configs/train/smoke_latent_cpu.yaml",
    ]


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m prx_data.demo",
        description="Make a small sample collection, ingest it into Lance and export bucketed MDS; "
        "prints the export report. At the default size both run on threads of this process; a "
        "larger --repeats can make a table large enough to start a local Ray.",
    )
    p.add_argument(
        "--workdir",
        default="demo_out",
        help="Where the sample, table and export go (default: ./demo_out; replaced on rerun, "
        "unless the table has columns the demo did not write: see --force).",
    )
    p.add_argument(
        "--repeats",
        type=int,
        default=2,
        help="Copies of the 16-size sample grid to generate (default: 2, i.e. 32 images).",
    )
    p.add_argument(
        "--num-cpus",
        type=int,
        default=None,
        help="CPUs for the work, on threads or a local Ray (default: all).",
    )
    p.add_argument(
        "--force",
        action="store_true",
        help="Replace the workdir's table even when it has columns the demo did not write "
        "(captions, labels, scores the other jobs added); without it such a rerun is refused.",
    )
    return p


def main(argv: list[str] | None = None) -> int:
    from prx_data.core.errors import PrxDataError

    p = build_parser()
    args = p.parse_args(argv)
    try:
        run_demo(args.workdir, args.repeats, args.num_cpus, force=args.force)
    except PrxDataError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
