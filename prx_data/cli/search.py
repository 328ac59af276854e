"""``python -m prx_data.search``: argument parsing over :mod:`prx_data.table.search`."""

from __future__ import annotations

import argparse
import sys
from collections import Counter

from prx_data.cli.reporting import print_error
from prx_data.columns import descriptors
from prx_data.core.errors import PrxDataError
from prx_data.table import lance_ops as T
from prx_data.table.search import build_indexes, filter_sql, hybrid_search, similar, text_search


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m prx_data.search",
        description="Query a Lance image table from the shell: caption full-text search, "
        "similar images, or both fused (RRF). Optionally build the indexes first.",
    )
    p.add_argument("--table", required=True, help="Lance table URI")
    p.add_argument("query", nargs="?", default="", help="words to look for in the captions")
    p.add_argument("--similar", metavar="ID", help="list the images most similar to this row id")
    p.add_argument(
        "--hybrid", action="store_true", help="fuse text and vector results (needs a query)"
    )
    p.add_argument("--k", type=int, default=20, help="results to show (default: %(default)s)")
    p.add_argument("--tier", default=None, help="only this tier (e.g. 1024, or too_small)")
    p.add_argument("--aspect", default=None, help="only this aspect bucket (e.g. 1.000)")
    p.add_argument(
        "--descriptors",
        action="store_true",
        help="first compute missing pixel descriptors (resumable; writes a column)",
    )
    p.add_argument(
        "--build-indexes",
        action="store_true",
        help="first build/refresh the full-text, id and vector indexes",
    )
    return p


def main(argv: list[str] | None = None) -> int:
    p = build_parser()
    args = p.parse_args(argv)
    try:
        return _run(p, args)
    except PrxDataError as e:
        print_error(e)
        return 2


def _run(p: argparse.ArgumentParser, args: argparse.Namespace) -> int:
    if args.descriptors:
        failed: Counter = Counter()
        descriptors.compute_descriptors(args.table, errors=failed)
        if failed:
            print(
                f"{sum(failed.values()):,} rows without a descriptor, by reason (see the "
                "pixel_descriptor_error column): "
                + ", ".join(f"{k} {v:,}" for k, v in failed.most_common()),
                file=sys.stderr,
            )
    if args.build_indexes:
        print("indexes:", build_indexes(args.table))
    where = filter_sql(tier=args.tier, aspect=args.aspect)
    ds = T.open_table(args.table)
    if args.similar:
        res = similar(ds, args.similar, k=args.k, filter=where)
    elif args.hybrid:
        res = hybrid_search(ds, args.query, k=args.k, filter=where)
    elif args.query:
        res = text_search(ds, args.query, k=args.k, filter=where)
    else:
        p.error("give a query, --similar ID, or --hybrid with a query")
    for row in res.to_pylist():
        print("  ".join(f"{k}={v}" for k, v in row.items()))
    return 0


if __name__ == "__main__":
    import sys

    sys.exit(main())
