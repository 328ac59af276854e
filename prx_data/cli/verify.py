"""``python -m prx_data.verify``: argument parsing over :mod:`prx_data.export.verify`."""

from __future__ import annotations

import argparse
import json
import sys

from prx_data.core import storage
from prx_data.core.errors import PrxDataError
from prx_data.export import naming
from prx_data.export.layout import ShardInfo
from prx_data.export.verify import verify_export

EPILOG = """\
checks (every problem is listed with its path; exit status 1 if there is any):
  report.json exists; its unit count matches the _progress markers
  every bucket's index.json holds the samples report.json counts for it
  every shard path in an index stays inside its bucket (<part>/shard.NNNNN.mds)
  every shard exists with the size its index records (--deep: and its hashes)
  every part's ids.parquet has as many rows per shard as the index
  nothing sits in a bucket that its index does not account for
  every skip-list sidecar parses, names the shard and list of its file name, and
  is bound to its shard's size, sample count and hashes in the index

examples:
  python -m prx_data.verify exports/photos
  python -m prx_data.verify s3://bkt/mds --deep --json
"""


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m prx_data.verify",
        description="Check an export written by python -m prx_data.write_mds: report, progress "
        "markers, bucket indexes, shards, id manifests and skip-list sidecars against each other.",
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("export", help="Export root (the --out of write_mds): local path or s3:// URI.")
    p.add_argument(
        "--deep",
        action="store_true",
        help="Also read every shard and compare its hashes with the index (reads the whole "
        "export; catches same-size byte changes).",
    )
    p.add_argument(
        "--json", action="store_true", help="Print the result as JSON instead of text lines."
    )
    p.add_argument(
        "--no-progress", dest="progress", action="store_false", help="Hide the progress bar."
    )
    return p


def check_sidecar(path: str, data: bytes, shard: ShardInfo, name: str) -> list[str]:
    """Problems of one sidecar: unparseable, named for another list or shard, or unbound."""
    from prx_data.skips.sidecar import SkipList, SkipListError

    try:
        parsed = SkipList.from_bytes(data, path)
    except SkipListError as e:
        return [str(e).removeprefix(f"{path}: ")]
    problems = []
    if parsed.name != name:
        problems.append(
            f"header names list {parsed.name!r} but the file is named for {name!r} "
            "(a renamed sidecar is never applied as another list)"
        )
    if parsed.shard.basename != shard.basename:
        problems.append(f"header names shard {parsed.shard.basename!r}, not {shard.basename!r}")
    if shard.hashes and not parsed.shard.hashes:
        problems.append("not bound to its shard's content hash (rebuild the list)")
    try:
        SkipList.from_bytes(data, path, expected=shard)
    except SkipListError as e:
        problems.append(str(e).removeprefix(f"{path}: "))
    return problems


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    from prx_data.export import adopt

    try:
        storage.check_store(args.export)  # before any read names another cause
        if adopt.read_record(args.export) is not None:  # an MDS tree another writer made
            return _verify_adopted(args.export, args.deep)
        if storage.exists(args.export) and adopt.is_plain_tree(args.export):
            raise adopt.ForeignTreeError(
                f"{args.export}: not an export of prx_data.write_mds (no "
                f"{naming.MARKER_NAME}) nor an adopted tree; to use an MDS tree another writer "
                f"made, run python -m prx_data.adopt {args.export} once"
            )
    except PrxDataError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    try:
        res = verify_export(
            args.export, deep=args.deep, check_sidecar=check_sidecar, progress=args.progress
        )
    except PrxDataError as e:  # a store that stops answering, an export that is not one
        print(f"error: {e}", file=sys.stderr)
        return 2
    if args.json:
        print(
            json.dumps(
                {
                    "export": res.root,
                    "ok": res.ok,
                    "buckets": res.buckets,
                    "shards": res.shards,
                    "sidecars": res.sidecars,
                    "rehashed": res.rehashed,
                    "attached_columns": res.columns,
                    "problems": [{"path": p.path, "problem": p.message} for p in res.problems],
                },
                indent=2,
            )
        )
    else:
        for p in res.problems:
            print(p)
        _print_optouts(res.root)
        deep = f", {res.rehashed} rehashed" if args.deep else ""
        verdict = "ok" if res.ok else f"{len(res.problems)} problem(s)"
        cols = f", attached columns {', '.join(res.columns)}" if res.columns else ""
        print(
            f"{res.root}: {res.buckets} buckets, {res.shards} shards{deep}, "
            f"{res.sidecars} sidecars{cols}: {verdict}",
            file=sys.stderr,
        )
    return 0 if res.ok else 1


def _print_optouts(root: str) -> None:
    """Opted-out samples the shards still hold: not a problem (sidecars hide them), a fact a
    compliance check needs."""
    from prx_data.skips.ops import optouts_present

    try:
        present = optouts_present(root)
    except PrxDataError as e:
        print(f"opted-out samples still in the shards: unknown ({e})", file=sys.stderr)
        return
    if present:
        n = sum(present.values())
        print(
            f"{root}: {n} opted-out samples still in the shards, hidden by sidecars"
            + (
                f"; purge: python -m prx_data.skips rewrite {root} NEW_ROOT --purge-optouts"
                if n
                else ""
            ),
            file=sys.stderr,
        )


def _verify_adopted(root: str, deep: bool) -> int:
    from prx_data.export.adopt import verify_adopted

    problems, buckets, shards = verify_adopted(root, deep=deep)
    for p in problems:
        print(p)
    verdict = "ok" if not problems else f"{len(problems)} problem(s)"
    rehashed = f", {shards} rehashed" if deep else ""
    print(
        f"{root} (adopted): {buckets} buckets, {shards} shards{rehashed}: {verdict}",
        file=sys.stderr,
    )
    return 0 if not problems else 1


if __name__ == "__main__":
    sys.exit(main())
