"""``python -m prx_data.table``: argument parsing over :mod:`prx_data.table.lance_ops`."""

from __future__ import annotations

import argparse
import json
import sys

from prx_data.core.errors import PrxDataError
from prx_data.table.lance_ops import (
    DEFAULT_TARGET_ROWS_PER_FRAGMENT,
    compact,
    format_stats,
    lance_storage_options,
    open_table,
    table_stats,
)
from prx_data.table.pins import describe, list_tags, unpin


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m prx_data.table",
        description="Fragment hygiene for a Lance table: show fragment stats, or compact small "
        "fragments into larger ones (many small fragments make every scan and query slow). "
        "Versions that a paused export or a running column job reads are tagged and survive "
        "--cleanup; `tags` lists them and `untag` removes stale ones.",
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
        help="afterwards delete the files of older table versions (frees space, ends time "
        "travel); tagged versions (paused exports, running column jobs) are kept",
    )
    pt = sub.add_parser(
        "tags",
        help="list the table's tags: the versions pinned by paused exports (prx-export-*) "
        "and running or killed column jobs (prx-col-*)",
    )
    pt.add_argument("uri", help="Lance table URI (local path or s3://...)")
    pt.add_argument("--json", action="store_true", help="print the tags as JSON")
    pu = sub.add_parser(
        "untag",
        help="remove tags (stale pins of jobs that will not be resumed); a paused export "
        "whose tag is removed cannot --resume after the next --cleanup",
    )
    pu.add_argument("uri", help="Lance table URI (local path or s3://...)")
    pu.add_argument("names", nargs="+", metavar="NAME", help="tag names, as `tags` lists them")
    ph = sub.add_parser(
        "sha256",
        help="fill the sha256 column of rows ingested before it was recorded, so opt-outs find "
        "byte-identical copies in this table (resumable; only the new column is written)",
    )
    ph.add_argument("uri", help="Lance table URI (local path or s3://...)")
    return p


def main(argv: list[str] | None = None) -> int:
    p = build_parser()
    args = p.parse_args(argv)
    opts = lance_storage_options(args.uri)
    try:
        if args.cmd == "stats":
            stats = table_stats(args.uri, opts)
            print(json.dumps(stats, indent=2, default=str) if args.json else format_stats(stats))
        elif args.cmd == "compact":
            result = compact(args.uri, args.target_rows, cleanup=args.cleanup, storage_options=opts)
            print(json.dumps(result, indent=2))
            _note_kept(args.uri, result.get("kept_tags") or {}, opts)
        elif args.cmd == "sha256":
            from prx_data.pipelines.content_keys import Sha256Config, run_sha256

            rep = run_sha256(Sha256Config(args.uri, storage_options=opts))
            print(
                f"sha256: {rep.rows:,} of {rep.pending:,} pending rows hashed "
                f"(table version {rep.table_version} -> {rep.final_version})"
                if rep.pending
                else f"sha256: every stored image of {args.uri} already has one; nothing to do"
            )
        elif args.cmd == "tags":
            tags = list_tags(open_table(args.uri, opts))
            if args.json:
                print(json.dumps(tags, indent=2, default=str))
            else:
                print("\n".join(describe(t) for t in tags) or f"{args.uri} has no tags")
        else:
            ds = open_table(args.uri, opts)
            known = {t["name"] for t in list_tags(ds)}
            unknown = [n for n in args.names if n not in known]
            if unknown:
                print(
                    f"error: {args.uri} has no tag {', '.join(unknown)} (it has: "
                    f"{', '.join(sorted(known)) or 'none'}); nothing was removed",
                    file=sys.stderr,
                )
                return 2
            for name in args.names:
                unpin(ds, name)
                print(f"removed tag {name}")
    except PrxDataError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


def _note_kept(uri: str, kept: dict[str, int], opts: dict | None) -> None:
    """Say which tags held versions back, and how to drop the stale ones."""
    if not kept:
        return
    tags = [t for t in list_tags(open_table(uri, opts)) if t["name"] in kept]
    print(
        f"kept {len(kept)} tagged version(s), in use by a job or left by one that was stopped:",
        file=sys.stderr,
    )
    for t in tags:
        print(f"  {describe(t)}", file=sys.stderr)
    print(
        f"a finished job removes its own tag; remove a stale one with "
        f"`python -m prx_data.table untag {uri} NAME`",
        file=sys.stderr,
    )


if __name__ == "__main__":
    sys.exit(main())
