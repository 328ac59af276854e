"""python -m prx_data.write_mds: Lance table -> resolution/aspect-ratio bucketed MDS."""

from __future__ import annotations

import argparse
import sys

from prx_data.cli.reporting import finish_run
from prx_data.core.buckets import DEFAULT_TIERS
from prx_data.core.errors import PrxDataError
from prx_data.core.imaging import CODECS, DEFAULT_CODEC, DRAFT_MARGIN
from prx_data.core.runtime import add_run_args, run_options_from_args
from prx_data.export.unit import DEFAULT_HASHES, ExportConfig
from prx_data.pipelines.write_mds import DRIVER_UNIT_ROWS, run_export

EPILOG = """\
output layout:
  OUT/<tier>/<w/h>/index.json      one Mosaic Streaming dataset per bucket (e.g. 1024/1.000)
  OUT/<tier>/<w/h>/<part>/...      shards + ids.parquet (row ids, for skip lists)
  OUT/report.json, report.txt      written last: the export is complete
  OUT/dropped.parquet              id, reason, detail of every dropped or failed row
  OUT/.prx-export.lock             held while a run writes (a lease object on s3://)

skip lists: every list in the log next to the table (<table>.lists.lance, written by
skips add, optout and dedup) is applied to every export by row id; --overwrite carries
the old export's export-only changes into it; --drop-list NAME undoes a trial list
(see docs/STREAMING.md, Skip lists: one log per table).

safety: --overwrite and --resume only touch a tree the exporter marked as its own
(OUT/_progress/export.marker) that holds nothing but tiers, buckets and parts;
anything else is refused with a list of what was found. One run at a time per OUT.
Check an export with: python -m prx_data.verify OUT [--deep]

bucketing: an image goes to the largest tier T with (3T/4)^2 <= its pixels (never
upscaled more than 4/3), then to the nearest of 13 patch-aligned shapes in log
aspect ratio (0.5 to 2.0). Smaller images are dropped as too_small, more extreme
ones as aspect_ratio; every drop and failure is counted by reason in the report.

examples:
  python -m prx_data.write_mds --table data/photos.lance --out exports/photos
  python -m prx_data.write_mds --table s3://bkt/t.lance --out s3://bkt/mds --compression zstd
  RAY_ADDRESS=auto python -m prx_data.write_mds --table ... --out ...   # on a cluster
  python -m prx_data.write_mds --table ... --out OUT --driver-rows 0  # Ray even for a tiny table
  python -m prx_data.write_mds --table ... --out OUT --resume        # finish a killed run
"""


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m prx_data.write_mds",
        description="Bucket every image of a Lance table by resolution tier and aspect ratio, "
        "resize (Lanczos, centre crop) and write Mosaic Data Shards, as a Ray Data job "
        "(a table of at most --driver-rows rows: on threads of this process).",
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--table", required=True, help="Lance table URI (local path or s3://...).")
    p.add_argument(
        "--out", required=True, help="Output root: local directory or s3:// / gs:// URI."
    )
    p.add_argument(
        "--tiers",
        type=lambda s: tuple(int(x) for x in s.split(",")),
        default=DEFAULT_TIERS,
        help="Comma-separated resolution tiers (default: %(default)s as 512,1024,2048,4096).",
    )
    p.add_argument(
        "--caption-columns",
        type=lambda s: tuple(x for x in s.split(",") if x),
        default=None,
        help="Comma-separated caption columns to carry (default: every caption* column).",
    )
    p.add_argument(
        "--keep-columns",
        type=lambda s: tuple(x.strip() for x in s.split(",") if x.strip()),
        default=(),
        metavar="A,B,...",
        help="Comma-separated table columns to copy into every sample with their types "
        "(similarity, punsafe, aesthetic, url...): floats as float64 (null: NaN); integers, "
        "booleans, strings and lists of numbers or strings as json. A training config's "
        "data.extra_columns (or BucketedDataset(extra_columns=...)) hands them to the batches.",
    )
    p.add_argument(
        "--format",
        dest="image_format",
        choices=["jpeg", "png"],
        default="jpeg",
        help="Sample encoding: JPEG (default) or lossless PNG for artifact-sensitive data.",
    )
    p.add_argument("--quality", type=int, default=92, help="JPEG quality (default: 92).")
    p.add_argument(
        "--subsampling",
        type=int,
        choices=[-1, 0, 1, 2],
        default=-1,
        help="JPEG chroma subsampling: -1 Pillow default (4:2:0), 0 = 4:4:4, 1 = 4:2:2, 2 = 4:2:0.",
    )
    p.add_argument(
        "--codec",
        choices=list(CODECS),
        default=DEFAULT_CODEC,
        help="Resize/encode path. vips-reduce (default): JPEG draft to >= 1.5x the target, "
        "libvips' SIMD Lanczos3 over the exact crop box, Pillow encode; pillow: the same with "
        "Pillow's Lanczos (slower, same fidelity); vips: libvips thumbnail (crops on whole "
        "pixels).",
    )
    p.add_argument(
        "--resample",
        choices=["lanczos", "bicubic", "hamming", "bilinear", "box"],
        default="lanczos",
        help="Resampling filter (default: lanczos). The others are Pillow's, faster "
        "and softer; hamming beats an img2dataset-style OpenCV loop on speed and fidelity "
        "(measured frontier in docs/ARCHITECTURE.md, Codecs).",
    )
    p.add_argument(
        "--no-draft",
        dest="use_draft",
        action="store_false",
        help="Always decode at full size (default: JPEG DCT-domain downscale to >= 1.5x the target).",
    )
    p.add_argument(
        "--draft-margin",
        type=float,
        default=DRAFT_MARGIN,
        help="Decode/reduce to no less than this multiple of the bucket before the Lanczos pass "
        f"(default: {DRAFT_MARGIN}). 1.0 loses 2-3 dB on the most detailed photos; it is "
        "about 1.3x faster with --codec pillow, and no faster with the default codec "
        "(measured frontier in docs/ARCHITECTURE.md, Codecs).",
    )
    p.add_argument(
        "--compression",
        default=None,
        help="MDS shard compression, e.g. zstd, zstd:7, br (default: none; JPEG does not compress).",
    )
    p.add_argument(
        "--hashes",
        type=lambda s: tuple(x for x in s.split(",") if x),
        default=DEFAULT_HASHES,
        help="Comma-separated shard hashes to record in each index; skip lists bind to them and "
        "`verify --deep` checks them (default: xxh64; pass '' for none).",
    )
    p.add_argument(
        "--size-limit",
        type=int,
        default=1 << 26,
        help="Maximum shard size in bytes before a new shard starts (default: 64 MiB).",
    )
    p.add_argument(
        "--shard-size",
        type=int,
        default=1 << 26,
        help="Target bytes of a bucket's shards: once the work units are done, each bucket's "
        "parts are packed into shards of about this size, copying the encoded samples "
        "(default: 64 MiB, Mosaic's recommended 50-100 MB; 0 keeps one small part per unit "
        "and bucket).",
    )
    p.add_argument(
        "--rows-per-task",
        type=int,
        default=1000,
        help="Most rows per work unit (a row range of one Lance fragment). Smaller = finer "
        "progress and resume, larger = fewer, bigger shards (default: 1000).",
    )
    p.add_argument(
        "--min-units",
        type=int,
        default=None,
        help="Plan at least this many work units, so that small tables use every core "
        "(default: 8 per CPU of the Ray cluster, recorded so that --resume plans the same "
        "units; give a number for an export whose parts do not depend on the cluster).",
    )
    p.add_argument(
        "--filter",
        default=None,
        help="Lance SQL filter; rows that fail it are counted as 'filtered' (e.g. \"label = 'visual'\").",
    )
    p.add_argument(
        "--max-caption-chars",
        type=int,
        default=20000,
        help="Longer captions are truncated and counted (default: 20000).",
    )
    g = p.add_mutually_exclusive_group()
    g.add_argument(
        "--overwrite",
        action="store_true",
        help="Replace an existing export at --out (only one this exporter wrote, holding "
        "nothing else).",
    )
    g.add_argument(
        "--resume",
        action="store_true",
        help="Finish an interrupted export at --out with the same options.",
    )
    p.add_argument(
        "--drop-lists",
        metavar="NAME",
        action="append",
        default=[],
        help="With --overwrite: leave this skip list of the old export behind when its ids "
        "cannot be recovered (the run refuses otherwise, naming it). Every other list is kept: "
        "each export applies every list of the table's registry.",
    )
    p.add_argument(
        "--drop-list",
        metavar="NAME",
        action="append",
        default=[],
        help="Remove this list from the table's registry before exporting (undo a trial list: "
        "this export and every later one stop leaving its samples out; other exports lose it "
        "at their next 'skips sync'). Repeatable.",
    )
    p.add_argument(
        "--driver-rows",
        type=int,
        default=DRIVER_UNIT_ROWS,
        metavar="N",
        help="With --engine auto: a table of at most N rows (default: %(default)s) is "
        "exported on threads of this process, without starting Ray; same units and bytes. "
        "Never when a cluster is given (--ray-address, $RAY_ADDRESS). 0: always Ray.",
    )
    add_run_args(p)
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        opts = run_options_from_args(args)
    except PrxDataError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    cfg = ExportConfig(
        table=args.table,
        out=args.out,
        tiers=args.tiers,
        caption_columns=args.caption_columns,
        image_format=args.image_format,
        quality=args.quality,
        subsampling=args.subsampling,
        use_draft=args.use_draft,
        draft_margin=args.draft_margin,
        codec=args.codec,
        resample=args.resample,
        compression=args.compression,
        hashes=args.hashes,
        size_limit=args.size_limit,
        shard_size=args.shard_size,
        rows_per_task=args.rows_per_task,
        min_units=args.min_units,
        filter=args.filter,
        max_caption_chars=args.max_caption_chars,
        keep_columns=args.keep_columns,
    )
    try:
        report = run_export(
            cfg,
            overwrite=args.overwrite,
            resume=args.resume,
            **opts.job_fields(),
            drop_lists=tuple(args.drop_lists),
            drop_list=tuple(args.drop_list),
            driver_rows=args.driver_rows,
        )
    except PrxDataError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return finish_run(report, opts, footer=f"\nreport: {report.report_path}")


if __name__ == "__main__":
    sys.exit(main())
