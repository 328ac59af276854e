"""``python -m prx_data.dedup``: argument parsing over :mod:`prx_data.pipelines.dedup`."""

from __future__ import annotations

import argparse
import sys

from prx_data.cli.reporting import add_report_args, run_job
from prx_data.core.flags import add_flags
from prx_data.pipelines.dedup import DedupConfig, run_dedup
from prx_data.skips.dedup import default_report


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m prx_data.dedup",
        description="Find duplicate images in a Lance table by perceptual hash (pHash), keep the "
        "highest-resolution copy of each cluster, write a dup_of column and (with --export) a "
        "skip list on an export so the loader leaves the copies out without rewriting shards. "
        "Small work runs on threads of this process; larger work, or a run given a cluster, "
        "on Ray.",
    )
    add_flags(p, DedupConfig)
    add_report_args(p)
    return p


def main(argv: list[str] | None = None) -> int:
    from prx_data.table.lance_ops import lance_storage_options

    args = build_parser().parse_args(argv)
    return run_job(
        args,
        DedupConfig,
        run_dedup,
        footer=lambda cfg: f"report: {cfg.report}" if cfg.report else None,
        report=default_report(args.table) if args.report is None else (args.report or None),
        storage_options=lance_storage_options(args.table),
    )


if __name__ == "__main__":
    sys.exit(main())
