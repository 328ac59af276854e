"""``python -m prx_data.score``: argument parsing over :mod:`prx_data.pipelines.score`."""

from __future__ import annotations

import argparse
import sys

from prx_data.cli.reporting import finish_run, print_error
from prx_data.columns.scores import CLIP_IMAGE_COLUMN, SCORERS
from prx_data.core.errors import PrxDataError
from prx_data.core.runtime import add_run_args, run_options_from_args
from prx_data.pipelines.score import ScoreConfig


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m prx_data.score",
        description="Score images from their pixels into table columns, as a resumable column "
        "job (image data files are never rewritten; a killed run continues). "
        "clip: L2-normalised image and caption embeddings (<prefix>_image_embedding is the "
        "explorer's vector column) and <prefix>_score, their cosine; aesthetic: a linear/MLP "
        "head (LAION aesthetic predictor, .safetensors or a torch state dict) over the CLIP "
        "image embedding, so run clip first; watermark, nsfw: an image-classification model, "
        "with <prefix>_label and one <prefix>_p_<class> probability column per class. Rows "
        "that cannot be scored get a reason in <prefix>_error and are retried next run. Use "
        "the columns in `skips add --where` and `write_mds --filter`.",
    )
    p.add_argument("scorer", choices=SCORERS, help="what to compute")
    p.add_argument("--table", required=True, help="Lance table URI")
    p.add_argument(
        "--model",
        required=True,
        help="Hugging Face model name or local path (aesthetic: the head's weights file; "
        "set HF_HUB_OFFLINE=1 to use only local files)",
    )
    p.add_argument("--prefix", default=None, help="column prefix (default: the scorer's name)")
    p.add_argument(
        "--embedding-column",
        default=CLIP_IMAGE_COLUMN,
        help="aesthetic: the CLIP image embedding column it reads (default: %(default)s)",
    )
    p.add_argument(
        "--caption-column", default="caption", help="clip: the text (default: %(default)s)"
    )
    p.add_argument(
        "--device",
        default="auto",
        help="cpu, cuda or cuda:N; cuda gives each replica one GPU (default: auto)",
    )
    p.add_argument("--replicas", type=int, default=1, help="model actors (default: %(default)s)")
    p.add_argument(
        "--batch-size", type=int, default=64, help="rows per model call (default: %(default)s)"
    )
    p.add_argument("--limit", type=int, default=None, help="score at most this many rows")
    p.add_argument(
        "--commit-every", type=int, default=16, help="fragments per commit (default: %(default)s)"
    )
    add_run_args(p)
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    from prx_data.pipelines.score import run_score

    try:
        opts = run_options_from_args(args)
        cfg = ScoreConfig(
            table=args.table,
            scorer=args.scorer,
            model=args.model,
            prefix=args.prefix,
            embedding_column=args.embedding_column,
            caption_column=args.caption_column,
            device=args.device,
            replicas=args.replicas,
            batch_size=args.batch_size,
            limit=args.limit,
            commit_every=args.commit_every,
            **opts.job_fields(),
        )
        report = run_score(cfg)
    except PrxDataError as e:
        print_error(e)
        return 2
    return finish_run(report, opts)


if __name__ == "__main__":
    sys.exit(main())
