"""``python -m prx_data.stats``: argument parsing over :mod:`prx_data.table.resolution`."""

from __future__ import annotations

import argparse
import sys

from prx_data.core.buckets import DEFAULT_SPEC, BucketSpec
from prx_data.core.errors import PrxDataError
from prx_data.table import lance_ops as T
from prx_data.table.resolution import (
    STATS_NAME,
    format_report,
    numeric_columns,
    parse_marks,
    run,
)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m prx_data.stats",
        description="Resolution, aspect-ratio and tier distribution of a Lance table, with the "
        "rows an export would drop (too small, aspect ratio outside the range, unreadable), "
        "fragment count with rows and bytes per fragment, and, once python -m prx_data.quality "
        "has run, the image-quality distribution with the count of low-information (blank) "
        "images, and the distribution of every numeric column found in the schema (every float "
        "column and struct field: clip_score, aesthetic_score, watermark/nsfw class "
        "probabilities from python -m prx_data.score, image_quality.std/entropy/flat, numeric "
        "attributes), with chosen thresholds marked (--mark). Writes PNG plots and stats.json, "
        "prints a table.",
    )
    p.add_argument("--table", required=True, help="Lance table URI")
    p.add_argument("--out", required=True, help="folder for the PNG plots and stats.json")
    p.add_argument(
        "--tiers",
        default=",".join(str(t) for t in DEFAULT_SPEC.tiers),
        help="comma-separated training tiers, as for the export (default: %(default)s)",
    )
    p.add_argument(
        "--mark",
        action="append",
        default=[],
        metavar="COLUMN=VALUE",
        help="draw a threshold on COLUMN's plot with the share of rows at or above it and "
        "below it (also in stats.json and the printed table); repeatable; COLUMN may omit "
        "_score (e.g. --mark aesthetic=5.0 --mark clip_score=0.25 --mark watermark_p_watermark=0.5)",
    )
    return p


def main(argv: list[str] | None = None) -> int:
    p = build_parser()
    args = p.parse_args(argv)
    spec = BucketSpec(tiers=tuple(int(t) for t in args.tiers.split(",")))
    try:
        marks = parse_marks(args.mark, numeric_columns(T.open_table(args.table).schema))
        report = run(args.table, args.out, spec, marks)
    except PrxDataError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(format_report(report))
    print(f"\nplots and {STATS_NAME} in {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
