"""``python -m prx_data.stats``: argument parsing over :mod:`prx_data.table.resolution`."""

from __future__ import annotations

import argparse
import sys

from prx_data.core.buckets import DEFAULT_SPEC, BucketSpec
from prx_data.table.resolution import STATS_NAME, format_report, run


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m prx_data.stats",
        description="Resolution, aspect-ratio and tier distribution of a Lance table, with the "
        "rows an export would drop (too small, aspect ratio outside the range, unreadable), "
        "fragment count with rows and bytes per fragment, and, once python -m prx_data.quality "
        "has run, the image-quality distribution with the count of low-information (blank) "
        "images, and the distribution of every score column (*_score, *_p_<class>: python -m "
        "prx_data.score). Writes PNG plots and stats.json, prints a table.",
    )
    p.add_argument("--table", required=True, help="Lance table URI")
    p.add_argument("--out", required=True, help="folder for the PNG plots and stats.json")
    p.add_argument(
        "--tiers",
        default=",".join(str(t) for t in DEFAULT_SPEC.tiers),
        help="comma-separated training tiers, as for the export (default: %(default)s)",
    )
    return p


def main(argv: list[str] | None = None) -> int:
    p = build_parser()
    args = p.parse_args(argv)
    spec = BucketSpec(tiers=tuple(int(t) for t in args.tiers.split(",")))
    report = run(args.table, args.out, spec)
    print(format_report(report))
    print(f"\nplots and {STATS_NAME} in {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
