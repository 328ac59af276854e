"""``python -m prx_data.caption``: re-caption a Lance table with a vision-language model.

Thin over :func:`prx_data.pipelines.caption.run_caption`, which a notebook can call
directly with a :class:`prx_data.pipelines.caption.CaptionConfig`.
"""

from __future__ import annotations

import argparse
import sys

from prx_data.cli._column_args import column_job_parser, run_column_job
from prx_data.pipelines.caption import CaptionConfig, run_caption


def build_parser() -> argparse.ArgumentParser:
    return column_job_parser(
        "python -m prx_data.caption",
        (
            "Caption the rows of a Lance table that lack COLUMN with a vision-language model, as a "
            "streaming Ray Data job. Each image is decoded and downsized to the model's pixel "
            "budget, captioned, checked (empty, looping and truncated generations are flagged, "
            "never stored as captions) and written back once per fragment: COLUMN holds the caption, "
            "COLUMN_status one of ok|empty|looping|truncated|error and COLUMN_error why a row is "
            "not ok (e.g. 'image: empty_file', 'image: not_an_image', 'image: truncated'). "
            "Rerunning fills only the rows still missing, so a killed run can simply be restarted. "
            "With --schema FILE (a JSON schema) the job writes structured attributes instead: a "
            "struct column typed from the schema (default column: attributes), generation guided "
            "by the schema (vllm: guided decoding; openai: response_format json_schema), every "
            "output validated on every backend; outputs that are not JSON or fail the schema get "
            "status 'invalid' with the reason in COLUMN_error and are not stored."
        ),
        CaptionConfig,
        max_tokens=512,
    )


def main(argv: list[str] | None = None) -> int:
    return run_column_job(build_parser().parse_args(argv), CaptionConfig, run_caption)


if __name__ == "__main__":
    sys.exit(main())
