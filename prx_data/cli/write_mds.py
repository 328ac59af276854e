"""python -m prx_data.write_mds: Lance table -> resolution/aspect-ratio bucketed MDS."""

from __future__ import annotations

import argparse
import sys

from prx_data.cli.reporting import (
    add_report_args,
    finish,
    finish_run,
    report_options_from_args,
    warnings_once,
)
from prx_data.core.buckets import check_tiers
from prx_data.core.errors import PrxDataError
from prx_data.core.flags import add_flags, from_args
from prx_data.core.runtime import add_run_args, run_options_from_args
from prx_data.export.spec import ExportConfig
from prx_data.pipelines.write_mds import DRIVER_UNIT_ROWS, ListChanges, run_export

EPILOG = """\
output layout:
  OUT/<tier>/<w/h>/index.json      one Mosaic Streaming dataset per bucket (e.g. 1024/1.000)
  OUT/<tier>/<w/h>/<part>/...      shards + ids.parquet (row ids, for skip lists)
  OUT/report.json, report.txt      written last: the export is complete
  OUT/dropped.parquet              id, reason, detail of every dropped or failed row
  OUT/.prx-export.lock             held while a run writes (a lease object on s3://)

skip lists: every list in the log next to the table (<table>.lists.lance, written by
skips add, optout and dedup) is applied to every export by row id; --overwrite carries
the old export's export-only changes into it; --drop-list NAME undoes a trial list
(see docs/STREAMING.md, Skip lists: one log per table).

refusals: --tiers outside 512,1024,2048,4096 (the trainer's bucket spec), a missing
--table and an --out that cannot be used are refused before Ray starts or the table is read.

safety: --overwrite and --resume only touch a tree the exporter marked as its own
(OUT/_progress/export.marker) that holds nothing but tiers, buckets and parts;
anything else is refused with a list of what was found. One run at a time per OUT.
Check an export with: python -m prx_data.verify OUT [--deep]

bucketing: an image goes to the largest tier T with (3T/4)^2 <= its pixels (never
upscaled more than 4/3), then to the nearest of 13 patch-aligned shapes in log
aspect ratio (0.5 to 2.0). Smaller images are dropped as too_small, more extreme
ones as aspect_ratio; every drop and failure is counted by reason in the report.

examples:
  python -m prx_data.write_mds --table data/photos.lance --out exports/photos
  python -m prx_data.write_mds --table s3://bkt/t.lance --out s3://bkt/mds --compression zstd
  RAY_ADDRESS=auto python -m prx_data.write_mds --table ... --out ...   # on a cluster
  python -m prx_data.write_mds --table ... --out OUT --driver-rows 0  # Ray even for a tiny table
  python -m prx_data.write_mds --table ... --out OUT --resume        # finish a killed run
  python -m prx_data.write_mds --table ... --out OUT --append        # add the table's new rows
  python -m prx_data.write_mds --table ... --out OUT --append --resume  # finish a killed append
"""


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m prx_data.write_mds",
        description="Bucket every image of a Lance table by resolution tier and aspect ratio, "
        "resize (Lanczos, centre crop) and write Mosaic Data Shards, as a Ray Data job "
        "(a table of at most --driver-rows rows: on threads of this process).",
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_flags(p, ExportConfig)
    g = p.add_mutually_exclusive_group()
    g.add_argument(
        "--overwrite",
        action="store_true",
        help="Replace an existing export at --out (only one this exporter wrote, holding "
        "nothing else).",
    )
    g.add_argument(
        "--resume",
        action="store_true",
        help="Finish an interrupted export at --out with the same options (with --append: "
        "an interrupted append).",
    )
    p.add_argument(
        "--drop-lists",
        metavar="NAME",
        action="append",
        default=[],
        help="With --overwrite: leave this skip list of the old export behind when its ids "
        "cannot be recovered (the run refuses otherwise, naming it). Every other list is kept: "
        "each export applies every list of the table's registry.",
    )
    p.add_argument(
        "--drop-list",
        metavar="NAME",
        action="append",
        default=[],
        help="Remove this list from the table's registry before exporting (undo a trial list: "
        "this export and every later one stop leaving its samples out; other exports lose it "
        "at their next 'skips sync'). Repeatable.",
    )
    p.add_argument(
        "--driver-rows",
        type=int,
        default=DRIVER_UNIT_ROWS,
        metavar="N",
        help="With --engine auto: a table of at most N rows (default: %(default)s) is "
        "exported on threads of this process, without starting Ray; same units and bytes. "
        "Never when a cluster is given (--ray-address, $RAY_ADDRESS). 0: always Ray.",
    )
    p.add_argument(
        "--latents",
        metavar="VAE",
        default=None,
        help="Then store every shard's VAE latents beside it (python -m prx_data.latents OUT "
        "--vae VAE, its defaults: float16, every tier; that job's own flags choose others), so "
        "a latent-space run with vae.source: precomputed never runs the encoder.",
    )
    add_run_args(p)
    add_report_args(p)
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        opts = report_options_from_args(args)
        run = run_options_from_args(args)
    except PrxDataError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    cfg = from_args(ExportConfig, args)
    try:
        check_tiers(cfg.tiers)  # the command line has no bucket spec of its own
        if cfg.append and (args.drop_lists or args.drop_list):
            raise PrxDataError("--drop-lists and --drop-list do not apply to --append")
        with warnings_once(set()) as reported:  # the report lists its warnings: once
            if cfg.append:
                from prx_data.pipelines.append import run_append

                report = run_append(
                    cfg,
                    run,
                    resume=args.resume,
                    overwrite=args.overwrite,
                    driver_rows=args.driver_rows,
                )
            else:
                report = run_export(
                    cfg,
                    run,
                    overwrite=args.overwrite,
                    resume=args.resume,
                    lists=ListChanges(
                        may_drop_lists=args.drop_lists, unregister_lists=args.drop_list
                    ),
                    driver_rows=args.driver_rows,
                )
            reported.update(report.warnings)
    except PrxDataError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    status = finish_run(report, opts, footer=f"\nreport: {report.report_path}")
    if status or not args.latents:
        return status
    from prx_data.pipelines.latents import LatentsConfig, run_latents

    try:
        latents = run_latents(LatentsConfig(out=cfg.out, vae=args.latents, run=run))
    except PrxDataError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print()
    return finish(latents, max_error_rate=opts.max_error_rate)


if __name__ == "__main__":
    sys.exit(main())
