"""``python -m prx_data.table``: argument parsing over :mod:`prx_data.table.lance_ops`."""

from __future__ import annotations

import argparse
import json
import sys

from prx_data.table.lance_ops import (
    DEFAULT_TARGET_ROWS_PER_FRAGMENT,
    compact,
    format_stats,
    table_stats,
)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m prx_data.table",
        description="Fragment hygiene for a Lance table: show fragment stats, or compact small "
        "fragments into larger ones (many small fragments make every scan and query slow).",
    )
    sub = p.add_subparsers(dest="cmd", required=True)
    ps = sub.add_parser("stats", help="print rows, fragment count and fragment sizes")
    ps.add_argument("uri", help="Lance table URI (local path or s3://...)")
    ps.add_argument(
        "--json", action="store_true", help="print the stats as JSON instead of a table"
    )
    pc_ = sub.add_parser("compact", help="merge small fragments into large ones")
    pc_.add_argument("uri", help="Lance table URI (local path or s3://...)")
    pc_.add_argument(
        "--target-rows",
        type=int,
        default=DEFAULT_TARGET_ROWS_PER_FRAGMENT,
        help="rows per fragment to aim for (default: %(default)s)",
    )
    pc_.add_argument(
        "--cleanup",
        action="store_true",
        help="afterwards delete the files of older table versions (frees space, ends time travel)",
    )
    args = p.parse_args(argv)
    if args.cmd == "stats":
        stats = table_stats(args.uri)
        print(json.dumps(stats, indent=2, default=str) if args.json else format_stats(stats))
    else:
        result = compact(args.uri, args.target_rows, cleanup=args.cleanup)
        print(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
