"""``python -m prx_data.quality``: argument parsing over :mod:`prx_data.pipelines.quality`."""

from __future__ import annotations

import argparse
import sys

from prx_data.cli.reporting import add_report_args, run_job
from prx_data.core import quality
from prx_data.core.flags import add_flags
from prx_data.pipelines.quality import QualityConfig


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m prx_data.quality",
        description="Measure every image's information content (std, grey-level entropy and "
        f"the share of its most common colour), after flattening alpha on white as the export "
        f"does, into the struct column {quality.COLUMN!r}. Resumable: only rows without a "
        "value are measured. Blank images (such as transparent overlays that export as pure "
        "white) then show in stats and the explorer and can go to a 'blank' skip list. Small "
        "work runs on threads of this process; larger work, or a run given a cluster, on Ray.",
    )
    add_flags(p, QualityConfig)
    add_report_args(p)
    return p


def main(argv: list[str] | None = None) -> int:
    from prx_data.pipelines.quality import run_quality

    return run_job(build_parser().parse_args(argv), QualityConfig, run_quality)


if __name__ == "__main__":
    sys.exit(main())
