"""``python -m prx_data.score``: argument parsing over :mod:`prx_data.pipelines.score`."""

from __future__ import annotations

import argparse
import sys

from prx_data.cli.reporting import add_report_args, run_job
from prx_data.core.flags import add_flags
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
        "the columns in `skips add --where` and `write_mds --filter`. Small work runs on threads "
        "of this process; larger work, or a run given a cluster, on Ray.",
    )
    add_flags(p, ScoreConfig)
    add_report_args(p)
    return p


def main(argv: list[str] | None = None) -> int:
    from prx_data.pipelines.score import run_score

    return run_job(build_parser().parse_args(argv), ScoreConfig, run_score)


if __name__ == "__main__":
    sys.exit(main())
