"""``python -m prx_data.dedup``: argument parsing over :mod:`prx_data.pipelines.dedup`."""

from __future__ import annotations

import argparse
import sys

from prx_data.cli.reporting import finish_run
from prx_data.core.buckets import DEFAULT_TIERS
from prx_data.core.errors import PrxDataError
from prx_data.core.runtime import add_run_args, run_options_from_args
from prx_data.pipelines.dedup import DedupConfig, run_dedup
from prx_data.skips.dedup import (
    DEFAULT_REPORT,
    DEFAULT_SKIP_NAME,
    MAX_RADIUS,
)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m prx_data.dedup",
        description="Find duplicate images in a Lance table by perceptual hash (pHash), keep the "
        "highest-resolution copy of each cluster, write a dup_of column and (with --export) a "
        "skip list on an export so the loader leaves the copies out without rewriting shards.",
    )
    p.add_argument("--table", required=True, help="Lance table URI (local path or s3://...).")
    p.add_argument(
        "--export",
        default=None,
        help="Export root made from this table (python -m prx_data.write_mds --out). The named "
        "skip list there is replaced with the duplicates found now.",
    )
    p.add_argument(
        "--radius",
        type=int,
        default=0,
        help="Largest Hamming distance between hashes that counts as a duplicate (default 0: "
        "identical hashes). 1-4 catch more re-encoded/resized copies; larger radii also "
        f"merge different images and get slow on big tables. At most {MAX_RADIUS}.",
    )
    p.add_argument(
        "--tiers",
        type=lambda v: tuple(int(x) for x in v.split(",") if x),
        default=DEFAULT_TIERS,
        help="Comma-separated tiers used, without --export, to name the bucket each row would "
        "get in the report (default: %(default)s, the exporter's default).",
    )
    p.add_argument(
        "--name",
        dest="skip_name",
        default=DEFAULT_SKIP_NAME,
        help="Skip-list name on the export (default: %(default)s).",
    )
    p.add_argument(
        "--report",
        default=DEFAULT_REPORT,
        help="Where to write the JSON report (default: %(default)s; '' for none). Keep it "
        "outside the export tree.",
    )
    p.add_argument(
        "--no-column",
        dest="write_column",
        action="store_false",
        help="Do not write the dup_of column into the table (report and skip list only).",
    )
    p.add_argument(
        "--no-compute",
        dest="compute",
        action="store_false",
        help="Use the phash column as it is; do not hash rows that lack it.",
    )
    p.add_argument(
        "--exact",
        action="store_true",
        help="Hash from a full Pillow decode, bit-identical to imagehash.phash (several "
        "times slower than the default reduced JPEG decode).",
    )
    p.add_argument(
        "--batch-size", type=int, default=256, help="Rows per hashing batch (default: %(default)s)."
    )
    add_run_args(p)
    return p


def main(argv: list[str] | None = None) -> int:
    from prx_data.table.lance_ops import lance_storage_options

    args = build_parser().parse_args(argv)
    try:
        opts = run_options_from_args(args)
    except PrxDataError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    cfg = DedupConfig(
        table=args.table,
        export=args.export,
        radius=args.radius,
        skip_name=args.skip_name,
        tiers=args.tiers,
        report=args.report or None,
        write_column=args.write_column,
        compute=args.compute,
        exact=args.exact,
        batch_size=args.batch_size,
        **opts.job_fields(),
        storage_options=lance_storage_options(args.table),
    )
    try:
        report = run_dedup(cfg)
    except PrxDataError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    footer = f"report: {cfg.report}" if cfg.report else None
    return finish_run(report, opts, footer=footer)


if __name__ == "__main__":
    sys.exit(main())
