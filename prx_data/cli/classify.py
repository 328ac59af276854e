"""``python -m prx_data.classify``: label captions visual / text / nsfw.

Thin over :func:`prx_data.pipelines.classify.run_classify`, which a notebook can
call directly with a :class:`prx_data.pipelines.classify.ClassifyConfig`.
"""

from __future__ import annotations

import argparse
import sys

from prx_data.cli._column_args import column_job_parser, run_column_job
from prx_data.pipelines.classify import ClassifyConfig, run_classify


def build_parser() -> argparse.ArgumentParser:
    return column_job_parser(
        "python -m prx_data.classify",
        (
            "Label each row of a Lance table from its caption alone: a text-only language model "
            "answers 'would you look at this image, or read it?' with visual, text or nsfw. "
            "Answers that name no single label become 'unknown' and are counted. A rule-based "
            "pre-filter (keywords/regex in prx_data/columns/prompts_txt/classify_rules.txt) labels clear "
            "cases first, or alone with --rules-only. Only rows with a caption and no label are "
            "processed, so reruns resume; failures keep their reason in COLUMN_error. Turn "
            "labels into skip lists with `python -m prx_data.skips` and a query such as \"label IN ('text','nsfw')\". "
            "Small work runs on threads of this process; larger work, or a run given a cluster, "
            "on Ray."
        ),
        ClassifyConfig,
        max_tokens=8,
    )


def main(argv: list[str] | None = None) -> int:
    return run_column_job(build_parser().parse_args(argv), ClassifyConfig, run_classify)


if __name__ == "__main__":
    sys.exit(main())
