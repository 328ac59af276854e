"""``python -m prx_data.skips``: argument parsing over :mod:`prx_data.skips.ops` and
:mod:`prx_data.skips.rewrite`; one function per subcommand (:data:`COMMANDS`)."""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable, Sequence
from dataclasses import asdict

from prx_data.core import storage
from prx_data.core.errors import PrxDataError
from prx_data.core.runtime import ENGINES
from prx_data.export import layout
from prx_data.skips import sidecar as skiplist
from prx_data.skips.bind import ids_at
from prx_data.skips.export_state import read_state, read_store
from prx_data.skips.log import Provenance
from prx_data.skips.ops import lists_text, sync, update_list
from prx_data.skips.sidecar import read_ids_file, read_indices_file
from prx_data.skips.which import require_export
from prx_data.table.lance_ops import query_ids

#: ``prx_data.skips.rewrite.DEFAULT_THRESHOLD``, repeated here so that list commands do not
#: import streaming (seconds of start-up) for a default they never use.
DEFAULT_THRESHOLD = 0.10


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m prx_data.skips",
        description="Named skip lists stored as sidecars next to MDS shards (local, s3:// or "
        "gs:// exports), recorded in the corpus ledger. List commands run in this process; "
        "rewrite copies its packs on threads of this process when small, else on Ray (a "
        "private local Ray, or --ray-address).",
    )
    sub = p.add_subparsers(dest="cmd", required=True)

    a = sub.add_parser("add", help="add samples to a named list (merged with what it holds)")
    a.add_argument("root", help="export root (local directory or s3://bucket/prefix)")
    a.add_argument("name", help="list name: [a-z0-9._-], e.g. dedup, nsfw, optout-2026-11")
    src = a.add_mutually_exclusive_group(required=True)
    src.add_argument(
        "--indices", metavar="FILE", help="text file of '<bucket> <shard> <index>' lines"
    )
    src.add_argument(
        "--ids", metavar="FILE", help="text file of row ids (the Lance 'id'), one per line"
    )
    src.add_argument("--table", metavar="URI", help="Lance table to query; needs --where")
    a.add_argument(
        "--where", metavar="SQL", help='Lance filter selecting the rows to skip, e.g. "nsfw > 0.8"'
    )
    _registry_args(a)

    ls = sub.add_parser(
        "list",
        help="list the skip lists and the buckets they touch; checks every sidecar and reports "
        "orphan and unparseable ones (exit status 1)",
    )
    ls.add_argument("root", help="export root")
    ls.add_argument("--tier", type=int, action="append", help="only this tier (repeatable)")
    ls.add_argument(
        "--no-check",
        action="store_true",
        help="do not read the sidecars (faster on large remote exports): orphans are still "
        "reported, unparseable sidecars are not",
    )

    st = sub.add_parser(
        "stats",
        help="per list and per bucket: samples, skipped, percent; orphan and unparseable "
        "sidecars are reported and left out (exit status 1)",
    )
    st.add_argument("root", help="export root")
    st.add_argument(
        "--name", action="append", help="only this list (repeatable); '*' rows are the union"
    )
    st.add_argument("--tier", type=int, action="append", help="only this tier (repeatable)")
    st.add_argument("--json", action="store_true", help="print JSON instead of a table")

    rm = sub.add_parser(
        "remove",
        help="remove a list (or only --ids from it) from the export and from the table's "
        "registry, so later exports stop leaving those samples out",
    )
    rm.add_argument("root", help="export root")
    rm.add_argument("name", help="list name")
    rm.add_argument("--ids", metavar="FILE", help="remove only these row ids (one per line)")
    rm.add_argument(
        "--table", metavar="URI", help="the table whose registry to change (always wins)"
    )
    _registry_args(rm)

    sy = sub.add_parser(
        "sync",
        help="make the export's lists the state of the log (its table's registry and its "
        "own export-only entries): idempotent; a list the log emptied leaves every form "
        "(store and sidecars)",
    )
    sy.add_argument("root", help="export root")
    sy.add_argument(
        "--table",
        metavar="URI",
        help="the table whose folder's ledger to read (needed when the export's table moved "
        "or the export names none)",
    )
    _ledger_arg(sy)
    sy.add_argument(
        "--drop-lists",
        metavar="NAME",
        action="append",
        default=[],
        help="leave this list of the export behind when its ids cannot be recovered",
    )

    ix = sub.add_parser(
        "index",
        help="(re)build the export's id index (_ids.lance: id -> bucket, shard, index) from its "
        "manifests; exports written before it existed, or changed since, need it for fast "
        "id lookups (add --ids, opt-out, dedup)",
    )
    ix.add_argument("root", help="export root")
    ix.add_argument(
        "--check", action="store_true", help="only say whether the index is current (exit 1 if not)"
    )

    rw = sub.add_parser(
        "rewrite", help="write a new export without the skipped samples and without lists"
    )
    rw.add_argument("root", help="export root to read")
    rw.add_argument("out", help="new export root (must not hold an export)")
    rw.add_argument(
        "--name", action="append", help="apply only this list (repeatable); default: all"
    )
    rw.add_argument(
        "--threshold",
        type=float,
        default=DEFAULT_THRESHOLD,
        help="refuse unless at least this share is skipped (default %(default)s)",
    )
    rw.add_argument("--force", action="store_true", help="rewrite even below the threshold")
    rw.add_argument(
        "--purge-optouts",
        action="store_true",
        help="apply exactly the ledger's opt-out lists, whatever share they skip (no "
        "threshold): the opted-out images leave the shards; reports the bytes removed",
    )
    rw.add_argument("--no-verify", action="store_true", help="skip the sample-by-sample comparison")
    rw.add_argument(
        "--compact",
        metavar="SIZE",
        nargs="?",
        const="64M",
        help="also pack each bucket's consecutive small parts (e.g. of appends) into parts of "
        "about SIZE (default 64M, Mosaic's recommended shard size), copying encoded samples; "
        "no threshold applies",
    )
    rw.add_argument(
        "--fold-columns",
        action="store_true",
        help="write the export's precomputed latents (as img_latent: VAE moments, ndarray) and "
        "every attached column (under its own name) into real MDS columns of the new shards, "
        "for plain streaming readers such as Photoroom PRX's StreamingProcessedDataset; the "
        "images are copied as they are, the new export has no _latents/ or _columns/; no "
        "threshold applies",
    )
    rw.add_argument(
        "--max-local-bytes",
        metavar="SIZE",
        help="local disk the rewrite may stage at once, e.g. 8G or 500M (default: "
        "$PRX_REWRITE_DISK, else 8G); each pack stages a shard at a time within it",
    )
    rw.add_argument(
        "--resume",
        action="store_true",
        help="finish an interrupted rewrite into OUT (same source, lists and options): packs "
        "already written are kept",
    )
    rw.add_argument(
        "--engine",
        default="auto",
        choices=ENGINES,
        help="where the packs run: auto = threads of this process for a small export and no "
        "cluster named, else Ray; local = threads; ray = Ray (default: %(default)s)",
    )
    rw.add_argument(
        "--ray-address", metavar="HOST:PORT", help="Ray cluster to join (default: $RAY_ADDRESS)"
    )
    rw.add_argument(
        "--num-cpus", type=int, help="CPUs of the threads or of a private local Ray (default: all)"
    )
    rw.add_argument(
        "--work-dir", metavar="DIR", help="where to stage shards (default: the temp directory)"
    )
    rw.add_argument(
        "--table",
        metavar="URI",
        help="record the old export's own (export-only) entries in this table's folder's "
        "ledger; without --table or --ledger they stay the new export's own, and nothing read "
        "from the old export is written into a ledger",
    )
    _ledger_arg(rw)
    rw.add_argument(
        "--drop-lists",
        metavar="NAME",
        action="append",
        default=[],
        help="do not carry this list to the new export (only needed, and only allowed, for a "
        "list whose ids cannot be recovered; every other list is always carried)",
    )
    lg = sub.add_parser(
        "ledger",
        help="the corpus ledger: show it, adopt an earlier version's per-table registry into "
        "it, or give a copied ledger its own identity",
    )
    lg.add_argument(
        "action",
        choices=("show", "adopt", "fork"),
        help="show: its lists and opt-out keys; adopt: import a registry of an earlier version "
        "(once); fork: give a copy its own identity",
    )
    lg.add_argument(
        "uri", help="show/fork: the ledger; adopt: the registry (<table>.lists.lance) to adopt"
    )
    lg.add_argument("--ledger", metavar="URI", help="adopt: the ledger to adopt into")
    lg.add_argument("--table", metavar="URI", help="adopt: the table whose folder's ledger")
    return p


def _ledger_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--ledger",
        metavar="URI",
        help="the corpus ledger (default: the one the export follows; $PRX_LEDGER; else "
        "_prx_ledger.lance beside --table); must be the ledger the export recorded",
    )


def _registry_args(p: argparse.ArgumentParser) -> None:
    _ledger_arg(p)
    p.add_argument(
        "--reason", default="", help="free text kept with every id (why it was added/removed)"
    )
    p.add_argument(
        "--export-only",
        action="store_true",
        help="change only this export, not the corpus ledger (later exports will not see the "
        "change, until --overwrite or rewrite carries it there)",
    )


def _refuse_plain_tree(root: str) -> None:
    from prx_data.export.adopt import refuse_plain_tree

    refuse_plain_tree(root)


def _add(args: argparse.Namespace) -> list:
    if args.table and not args.where:
        raise SystemExit("--table needs --where")
    if args.where and not args.table:
        raise SystemExit("--where needs --table")
    if args.indices:
        ids = ids_at(args.root, read_indices_file(args.indices))
    elif args.ids:
        ids = read_ids_file(args.ids)
    else:
        ids = query_ids(args.table, args.where)
    r = update_list(
        args.root,
        args.name,
        ids,
        Provenance("skips add", args.reason),
        table=args.table,
        ledger=args.ledger,
        export_only=args.export_only,
    )
    print(
        f"{r.name}: {r.samples_listed} samples in {r.shards_written} shard sidecars; "
        f"{r.ids_in_list} ids in the list"
        + (
            f"; {r.ids_not_in_export} ids not found in the export (kept in the list)"
            if r.ids_not_in_export
            else ""
        )
        + (f"; recorded in {r.registry}" if r.registry else "; this export only")
    )
    if r.warning:
        print(r.warning, file=sys.stderr)
    return []


def _list(args: argparse.Namespace) -> list:
    lists = skiplist.list_skip_lists(args.root, args.tier)
    stored = {n: len(t) for n, t in read_store(args.root).items()}
    state = read_state(args.root)
    source = state.lists if state is not None else {}
    if not lists and not stored:
        print("no skip lists")
    for name in sorted(set(lists) | set(stored)):
        ids = (
            f"{stored[name]} ids" + (f" (from {source[name]})" if source.get(name) else "")
            if name in stored
            else "no ids in _lists/ (sidecars only: any list update records them)"
        )
        where = ", ".join(f"{b} ({n} shards)" for b, n in lists.get(name, {}).items())
        print(f"{name}: {where or 'no sample in this export'}; {ids}")
    problems = skiplist.sidecar_problems(args.root, args.tier, read=not args.no_check)
    for pr in problems:
        print(pr.text())
    return problems


def _stats(args: argparse.Namespace) -> list:
    problems: list = []
    stats = skiplist.skip_stats(args.root, args.name, args.tier, problems=problems)
    if args.json:
        body = {
            k: [asdict(r) | {"percent": round(r.percent, 4)} for r in v] for k, v in stats.items()
        }
        if problems:  # list names start with [a-z0-9], so this key cannot clash
            body["_problems"] = [asdict(pr) for pr in problems]
        from prx_data.skips.ops import optouts_present

        body["_optouts_present"] = optouts_present(args.root)
        print(json.dumps(body, indent=1))
    else:
        print(f"{'list':<20} {'bucket':<12} {'samples':>10} {'skipped':>9} {'%':>7}")
        for name, rows in stats.items():
            for r in rows:
                print(f"{name:<20} {r.bucket:<12} {r.samples:>10} {r.skipped:>9} {r.percent:>7.2f}")
        for pr in problems:
            print(pr.text())
        _print_present(args.root)
    return problems


def _print_present(root: str) -> None:
    """How many opted-out samples the shards still hold (hidden by sidecars), and the purge."""
    from prx_data.skips.ops import optouts_present

    present = optouts_present(root)
    if present is None:
        print("opted-out samples still in the shards: unknown (the export's ledger is not found)")
        return
    n = sum(present.values())
    per = ", ".join(f"{k}: {v}" for k, v in present.items() if v)
    print(
        f"opted-out samples still in the shards (hidden by sidecars): {n}"
        + (f" ({per})" if per else "")
    )
    if n:
        print(f"purge them: python -m prx_data.skips rewrite {root} NEW_ROOT --purge-optouts")


def _remove(args: argparse.Namespace) -> list:
    prov = Provenance("skips remove", args.reason)
    ids = read_ids_file(args.ids) if args.ids else None
    r = update_list(
        args.root,
        args.name,
        ids,
        prov,
        mode="remove",
        table=args.table,
        ledger=args.ledger,
        export_only=args.export_only,
    )
    print(
        f"{args.name}: "
        + (f"removed {r.ids_requested} ids" if ids is not None else "removed the list")
        + (f" (in {r.registry})" if r.registry else " (this export only)")
        + f"; {r.ids_in_list} ids left"
    )
    return []


def _sync(args: argparse.Namespace) -> list:
    done = sync(args.root, args.table, ledger=args.ledger, drop=args.drop_lists)
    st = read_state(args.root)
    print(
        f"{args.root}: {len(done)} lists"
        + (f" at ledger position {st.position} ({st.ledger})" if st and st.ledger_id else "")
    )
    for line in lists_text(done):
        print(line)
    return []


def _index(args: argparse.Namespace) -> int | list:
    from prx_data.export import idindex

    if args.check:
        index, why = idindex.open_index(args.root)
        print(f"{args.root}: id index current ({index.rows} rows)" if index else why)
        return 0 if index else 1
    info = idindex.write_id_index(args.root)
    print(f"{info.uri}: {info.rows} rows from {info.buckets} buckets")
    return []


def _rewrite(args: argparse.Namespace) -> int | list:
    from prx_data.skips.rewrite import RewriteRefused, rewrite_export

    names, force = args.name, args.force
    if args.purge_optouts:
        from prx_data.skips.which import resolve

        led = resolve(args.root, args.table, ledger=args.ledger)
        t = led.optout_entries() if led is not None else None
        names = sorted(set(t["list"].to_pylist())) if t is not None and len(t) else []
        if not names:
            print(f"{args.root}: no opt-out list to purge")
            return []
        force = True
    before = sum(storage.file_sizes(args.root).values()) if args.purge_optouts else 0
    try:
        r = rewrite_export(
            args.root,
            args.out,
            names=names,
            threshold=args.threshold,
            force=force,
            verify=not args.no_verify,
            drop_lists=args.drop_lists,
            table=args.table,
            ledger=args.ledger,
            max_local=args.max_local_bytes,
            work_dir=args.work_dir,
            resume=args.resume,
            engine=args.engine,
            ray_address=args.ray_address,
            num_cpus=args.num_cpus,
            compact=args.compact,
            fold_columns=args.fold_columns,
        )
    except RewriteRefused as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(
        f"wrote {r.samples_out} of {r.samples_in} samples ({r.skipped} skipped) in "
        f"{r.buckets} buckets to {r.out}" + (", verified" if r.verified else "")
    )
    for line in lists_text(r.lists_carried):
        print(line.replace("  ", "  carried ", 1))
    if r.parts and r.parts[0] != r.parts[1]:
        print(f"packed {r.parts[0]} parts into {r.parts[1]}")
    if r.buckets_dropped:
        print(f"left out (every sample skipped): {', '.join(r.buckets_dropped)}")
    if r.warnings:
        print(f"{sum(r.warnings.values())} streaming warnings, see the report")
    if args.purge_optouts:
        after = sum(storage.file_sizes(r.out).values())
        print(f"purged opt-out lists {', '.join(names)}: {before - after:,} bytes fewer")
    print(f"report: {r.out}/report.json")
    return []


def _ledger(args: argparse.Namespace) -> int | list:
    from prx_data.skips.ledger import Ledger
    from prx_data.skips.place import ledger_uri

    if args.action == "fork":
        new = Ledger(args.uri).fork()
        print(f"{args.uri}: now ledger {new}; exports that followed the original refuse it")
        return []
    if args.action == "adopt":
        led = (
            Ledger.for_table(args.table, args.ledger)
            if args.table
            else Ledger(ledger_uri(None, args.ledger))
        )
        n = led.adopt(args.uri)
        print(
            f"{args.uri}: adopted into {led.uri} ({n} ids)"
            if n is not None
            else f"{args.uri}: nothing to adopt (no registry there, or adopted before)"
        )
        return []
    led = Ledger(args.uri)
    head, _ = led.position()
    if not head:
        print(f"{args.uri}: no ledger there")
        return 1
    lists = led.state()
    keys = led.optout_keys()
    print(f"{led.uri}: ledger {led.identity}, position {head}, {len(lists)} lists")
    for name, t in lists.items():
        print(f"  {name}: {len(t)} ids")
    print(
        f"  opt-out keys applied by every export: {len(keys.id)} ids, {len(keys.sha256)} "
        f"source digests, {len(keys.phash)} pHashes"
    )
    return []


#: One function per subcommand: each returns the sidecar problems it found (exit 1 when
#: any), or an exit status of its own.
COMMANDS: dict[str, Callable[[argparse.Namespace], int | list]] = {
    "add": _add,
    "list": _list,
    "stats": _stats,
    "remove": _remove,
    "sync": _sync,
    "index": _index,
    "rewrite": _rewrite,
    "ledger": _ledger,
}
#: Subcommands that change the export: refused on a tree another writer made.
WRITES = ("add", "remove", "sync", "rewrite")


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        if hasattr(args, "root"):
            require_export(args.root)  # a typo creates nothing and says so
            args.root = layout.tree(args.root)  # an adopted flat tree: its layout, once
        if args.cmd in WRITES:
            _refuse_plain_tree(args.root)
        problems = COMMANDS[args.cmd](args)
    except PrxDataError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if isinstance(problems, int):
        return problems
    if problems:
        print(
            f"{len(problems)} sidecar problem(s): orphan files are never applied and unparseable "
            "ones make the loader refuse their list; rebuild them with 'add' or delete them",
            file=sys.stderr,
        )
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
