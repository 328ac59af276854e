"""``python -m prx_data.optout``: argument parsing over :mod:`prx_data.skips.optout`."""

from __future__ import annotations

import argparse
import sys

from prx_data.cli.reporting import finish
from prx_data.skips.optout import add_optout, read_id_file, resolve_source_ids


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m prx_data.optout",
        description="Leave opted-out samples out of an export: adds their (bucket, shard, index) "
        "positions to a named skip list in every bucket and tier, found through the export's "
        "id manifests. Nothing is rewritten; running the same request again changes nothing.",
    )
    p.add_argument(
        "--export", required=True, help="Export root (python -m prx_data.write_mds --out)."
    )
    p.add_argument(
        "--name",
        required=True,
        help="Skip-list name, e.g. optout-2026-11 ([a-z0-9._-], at most 64 characters). An "
        "existing list of that name is extended, never shrunk.",
    )
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument(
        "--ids",
        metavar="FILE",
        help="Row ids (the Lance 'id' column, '<source>/<key>'): a text file with one per line "
        "(# comments allowed) or a .parquet file with an 'id' column.",
    )
    src.add_argument(
        "--where",
        metavar="SQL",
        help="Lance SQL filter over --table selecting the rows to leave out, e.g. "
        "\"source = 'shop' AND caption LIKE '%%logo%%'\".",
    )
    src.add_argument(
        "--source-ids",
        metavar="FILE",
        help="Item keys as the source names them (the part after '<source>/' in row ids), one "
        "per line or a .parquet 'id' column. Needs --source or --table.",
    )
    p.add_argument(
        "--table", help="Lance table the export was made from (for --where and --source-ids)."
    )
    p.add_argument(
        "--ledger",
        metavar="URI",
        help="The corpus ledger to record the opt-out in (default: the one the export follows; "
        "$PRX_LEDGER; else _prx_ledger.lance beside --table). Every later export of any table "
        "of the corpus leaves the ids, and copies of their images, out while it writes.",
    )
    p.add_argument(
        "--allow-unmatched",
        action="store_true",
        help="Record the ids even when none of them is in the export or in a table of the "
        "corpus (ids not ingested yet); without it such a request fails and records nothing.",
    )
    p.add_argument(
        "--source", help="Source name that --source-ids belong to (row id = '<source>/<key>')."
    )
    p.add_argument(
        "--reason", default="", help="Free text kept with every id (e.g. the request's ticket)."
    )
    p.add_argument(
        "--export-only",
        action="store_true",
        help="Change only this export. Default: also record the ids in the corpus ledger, so "
        "no later export of any table of the corpus writes them.",
    )
    p.add_argument("--report", default=None, help="Also write the report as JSON to this path.")
    p.add_argument(
        "--unmatched",
        metavar="FILE",
        default=None,
        help="Where to list every requested id or key that matched nothing, one per line "
        "(written only when there are some). Default: next to --report as "
        "<report>.unmatched.txt, else ./<name>.unmatched.txt.",
    )
    return p


def main(argv: list[str] | None = None) -> int:
    from prx_data.table.lance_ops import lance_storage_options, query_ids

    p = build_parser()
    args = p.parse_args(argv)
    keys = None
    if args.ids:
        ids = read_id_file(args.ids)
    elif args.where:
        if not args.table:
            p.error("--where needs --table")
        ids = query_ids(args.table, args.where)
    else:
        if not (args.source or args.table):
            p.error("--source-ids needs --source NAME or --table URI")
        ids = []
        keys = resolve_source_ids(
            read_id_file(args.source_ids),
            source=args.source,
            table=args.table,
            storage_options=lance_storage_options(args.table) if args.table else None,
        )
    from prx_data.core import storage
    from prx_data.core.errors import PrxDataError
    from prx_data.export import layout
    from prx_data.export.adopt import refuse_plain_tree
    from prx_data.skips.which import require_export

    try:
        require_export(args.export)  # a typo creates nothing and says so
        refuse_plain_tree(args.export)
        args.export = layout.tree(args.export)  # an adopted flat tree: its layout, once
        report = add_optout(
            args.export,
            args.name,
            ids,
            keys=keys,
            reason=args.reason,
            table=args.table,
            ledger=args.ledger,
            export_only=args.export_only,
            allow_unmatched=args.allow_unmatched,
        )
    except PrxDataError as e:  # ListError, a tree not adopted, an unsafe index
        print(f"error: {e}", file=sys.stderr)
        return 2
    if report.not_matched:
        path = args.unmatched or (
            f"{args.report.removesuffix('.json')}.unmatched.txt"
            if args.report
            else f"{args.name}.unmatched.txt"
        )
        storage.write_bytes_atomic(path, "".join(k + "\n" for k in report.not_matched).encode())
        report.not_matched_file = path
    return finish(report, report_json=args.report)


if __name__ == "__main__":
    sys.exit(main())
