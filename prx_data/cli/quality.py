"""``python -m prx_data.quality``: argument parsing over :mod:`prx_data.pipelines.quality`."""

from __future__ import annotations

import argparse
import sys

from prx_data.cli.reporting import finish_run, print_error
from prx_data.core import quality
from prx_data.core.errors import PrxDataError
from prx_data.core.runtime import add_run_args, run_options_from_args


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m prx_data.quality",
        description="Measure every image's information content (std, grey-level entropy and "
        f"the share of its most common colour), after flattening alpha on white as the export "
        f"does, into the struct column {quality.COLUMN!r}. Resumable: only rows without a "
        "value are measured. Blank images (such as transparent overlays that export as pure "
        "white) then show in stats and the explorer and can go to a 'blank' skip list.",
    )
    p.add_argument("--table", required=True, help="Lance table URI")
    p.add_argument(
        "--chunk-rows",
        type=int,
        default=2048,
        help="rows measured per write to the table (default: %(default)s)",
    )
    add_run_args(p)
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    from prx_data.pipelines.quality import QualityConfig, run_quality

    try:
        opts = run_options_from_args(args)
        report = run_quality(
            QualityConfig(table=args.table, chunk_rows=args.chunk_rows, **opts.job_fields())
        )
    except PrxDataError as e:
        print_error(e)
        return 2
    return finish_run(report, opts)


if __name__ == "__main__":
    sys.exit(main())
