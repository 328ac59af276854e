"""``python -m prx_data.semdedup``: argument parsing over :mod:`prx_data.pipelines.semdedup`."""

from __future__ import annotations

import argparse
import sys

from prx_data.cli.reporting import finish_run, print_error
from prx_data.core.errors import PrxDataError
from prx_data.core.runtime import add_run_args, run_options_from_args
from prx_data.pipelines.semdedup import SemDedupConfig
from prx_data.skips.semdedup import (
    DEFAULT_REPORT_THRESHOLDS,
    DEFAULT_SKIP_NAME,
    DEFAULT_THRESHOLD,
)
from prx_data.table.search import CLIP_IMAGE_COLUMN


def _floats(value: str) -> tuple[float, ...]:
    try:
        return tuple(float(v) for v in value.split(",") if v.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected comma-separated numbers, got {value!r}"
        ) from None


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m prx_data.semdedup",
        description="Semantic dedup (SemDeDup): k-means over the images' embeddings, then "
        "within each cluster every image whose cosine to a larger member reaches the threshold "
        "is a near duplicate (the same photo re-encoded, cropped, colour-shifted, or the same "
        "concept shot again). The largest member (width x height) is kept. Prints the share "
        "removed at several thresholds; with --export, writes the removed rows to a skip list "
        "there (shards untouched; a rerun replaces the list).",
    )
    p.add_argument("--table", required=True, help="Lance table URI")
    p.add_argument(
        "--export",
        default=None,
        help="export made from the table (write_mds --out): only its rows take part, and the "
        "near duplicates go to the skip list --name there. Without it: a report only.",
    )
    p.add_argument(
        "--embedding-column",
        default=CLIP_IMAGE_COLUMN,
        help="fixed-size vector column (default: %(default)s, from `python -m prx_data.score "
        "clip`; pixel_descriptor also works for near-identical copies)",
    )
    p.add_argument(
        "--threshold",
        type=float,
        default=DEFAULT_THRESHOLD,
        help="cosine at or above which an image is a duplicate of a larger one "
        "(default: %(default)s; see the report's table before lowering it)",
    )
    p.add_argument(
        "--report-thresholds",
        type=_floats,
        default=DEFAULT_REPORT_THRESHOLDS,
        help="comma-separated thresholds to report the share removed at (default: %(default)s)",
    )
    p.add_argument(
        "--cluster-size",
        type=int,
        default=1000,
        help="mean rows per k-means cluster: larger finds more pairs, costs more "
        "(default: %(default)s)",
    )
    p.add_argument(
        "--train-rows",
        type=int,
        default=262_144,
        help="rows k-means is trained on, a seeded sample (default: %(default)s)",
    )
    p.add_argument(
        "--iters", type=int, default=20, help="k-means iterations (default: %(default)s)"
    )
    p.add_argument("--seed", type=int, default=0, help="sampling and k-means seed (default: 0)")
    p.add_argument(
        "--name",
        dest="skip_name",
        default=DEFAULT_SKIP_NAME,
        help="skip-list name on the export (default: %(default)s)",
    )
    p.add_argument(
        "--spill-dir",
        default=None,
        help="where the ray engine spills assignments; must be shared by all nodes "
        "(default: a local temporary directory)",
    )
    p.add_argument(
        "--no-columns",
        dest="store_columns",
        action="store_false",
        help="do not store semdedup_cluster / semdedup_cosine in the table",
    )
    add_run_args(p)
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    from prx_data.pipelines.semdedup import run_semdedup

    try:
        opts = run_options_from_args(args)
        cfg = SemDedupConfig(
            table=args.table,
            export=args.export,
            embedding_column=args.embedding_column,
            threshold=args.threshold,
            report_thresholds=args.report_thresholds,
            cluster_size=args.cluster_size,
            train_rows=args.train_rows,
            iters=args.iters,
            seed=args.seed,
            skip_name=args.skip_name,
            **opts.job_fields(),
            spill_dir=args.spill_dir,
            store_columns=args.store_columns,
        )
        report = run_semdedup(cfg)
    except PrxDataError as e:
        print_error(e)
        return 2
    return finish_run(report, opts)


if __name__ == "__main__":
    sys.exit(main())
