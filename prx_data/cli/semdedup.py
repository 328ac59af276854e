"""``python -m prx_data.semdedup``: argument parsing over :mod:`prx_data.pipelines.semdedup`."""

from __future__ import annotations

import argparse
import sys

from prx_data.cli.reporting import add_report_args, run_job
from prx_data.core.flags import add_flags
from prx_data.pipelines.semdedup import SemDedupConfig


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m prx_data.semdedup",
        description="Semantic dedup (SemDeDup): k-means over the images' embeddings, then "
        "within each cluster every image whose cosine to a larger member reaches the threshold "
        "is a near duplicate (the same photo re-encoded, cropped, colour-shifted, or the same "
        "concept shot again). The largest member (width x height) is kept. Prints the share "
        "removed at several thresholds; with --export, writes the removed rows to a skip list "
        "there (shards untouched; a rerun replaces the list). Small work runs in this process; "
        "larger work, or a run given a cluster, on Ray.",
    )
    add_flags(p, SemDedupConfig)
    add_report_args(p)
    return p


def main(argv: list[str] | None = None) -> int:
    from prx_data.pipelines.semdedup import run_semdedup

    return run_job(build_parser().parse_args(argv), SemDedupConfig, run_semdedup)


if __name__ == "__main__":
    sys.exit(main())
