"""``python -m prx_data.adopt ROOT``: make an MDS tree another writer made usable with skip lists."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from prx_data.core.errors import PrxDataError


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m prx_data.adopt",
        description="Write id manifests, shard hashes and a report for an MDS bucket tree not "
        "written by prx_data.write_mds (<tier>/<ratio>/index.json, or <ratio>/index.json with "
        "--tier), so skip lists, opt-outs and verify work on it. Shards and index.json files "
        "are not touched; everything goes to ROOT/_prx/.",
    )
    p.add_argument("root", help="the tree's root (local, s3:// or gs://)")
    p.add_argument(
        "--tier",
        type=int,
        default=None,
        help="the tier of a tree with one folder per aspect ratio (e.g. 1024)",
    )
    p.add_argument(
        "--id-column",
        default=None,
        help="a 'str' column holding each sample's id (default: 'id' when every shard has one; "
        "'' or no such column: synthetic ids <bucket>/<shard>:<index>)",
    )
    return p


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    from prx_data.export.adopt import adopt_tree, report_text

    try:
        res = adopt_tree(args.root, tier=args.tier, id_column=args.id_column)
    except PrxDataError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(report_text(res), end="")
    return 0


if __name__ == "__main__":
    sys.exit(main())
