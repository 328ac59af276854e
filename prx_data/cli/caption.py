"""``python -m prx_data.caption``: re-caption a Lance table with a vision-language model.

Thin over :func:`prx_data.pipelines.caption.run_caption`, which a notebook can call
directly with a :class:`prx_data.pipelines.caption.CaptionConfig`.
"""

from __future__ import annotations

import argparse
import sys

from prx_data.cli._column_args import (
    add_backend_args,
    backend_options_from_args,
    generation_from_args,
    redo_args,
    run_column_job,
)
from prx_data.columns import checks
from prx_data.columns.images import DEFAULT_MAX_PIXELS


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m prx_data.caption",
        description=(
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
    )
    p.add_argument("--table", required=True, help="Lance table URI (local path or s3://...)")
    p.add_argument(
        "--column",
        default=None,
        help="column to write the captions to; its status goes to COLUMN_status "
        "(default: caption_vlm, or attributes with --schema)",
    )
    p.add_argument(
        "--schema",
        default=None,
        metavar="FILE",
        help="JSON schema of structured attributes to ask for (an object schema; e.g. "
        "configs/attributes.schema.json, or 'attributes' for that example as shipped in the "
        "package). Supported: type object/array/string/boolean/"
        "integer/number, properties, required, enum, items, additionalProperties, bounds",
    )
    p.add_argument(
        "--prompt-file",
        default=None,
        help="text file with the instruction (default: the packaged prx_data/columns/prompts_txt/caption.txt, "
        "one dense, visually grounded paragraph of ~100-200 words; with --schema: attributes.txt, "
        "whose {schema} is replaced by the schema)",
    )
    p.add_argument(
        "--max-pixels",
        type=int,
        default=DEFAULT_MAX_PIXELS,
        help="downsize images to at most this many pixels before sending them "
        "(default: %(default)s = 1280 patches of 28x28, Qwen-VL's usual budget)",
    )
    p.add_argument(
        "--limit", type=int, default=None, help="caption at most this many rows (a trial run)"
    )
    redo = p.add_mutually_exclusive_group()
    redo.add_argument(
        "--redo",
        default="",
        help=f"comma-separated statuses to caption again, from {','.join(checks.STATUSES[:-1])}, "
        "in addition to the rows never captioned (default: none; rows that already have a "
        "caption are never redone). Use --only to leave the never-captioned rows alone",
    )
    redo.add_argument(
        "--only",
        default="",
        help="comma-separated statuses to caption again, and nothing else: e.g. --only looping "
        "retries the looping rows without captioning rows that were never captioned",
    )
    add_backend_args(
        p,
        max_tokens=512,
        batch_size_help="rows per backend call (default: vllm 256, openai 4 x concurrency, transformers 16)",
    )
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    from prx_data.pipelines.caption import CaptionConfig, run_caption

    return run_column_job(
        args,
        lambda run: CaptionConfig(
            table=args.table,
            backend=args.backend,
            model=args.model,
            column=args.column or ("attributes" if args.schema else "caption_vlm"),
            schema_file=args.schema,
            prompt_file=args.prompt_file,
            max_pixels=args.max_pixels,
            limit=args.limit,
            generation=generation_from_args(args),
            backend_options=backend_options_from_args(args),
            replicas=args.replicas,
            batch_size=args.batch_size,
            redo=redo_args(args)[0],
            only=redo_args(args)[1],
            commit_every=args.commit_every,
            **run,
        ),
        run_caption,
    )


if __name__ == "__main__":
    sys.exit(main())
