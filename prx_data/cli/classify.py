"""``python -m prx_data.classify``: label captions visual / text / nsfw.

Thin over :func:`prx_data.pipelines.classify.run_classify`, which a notebook can
call directly with a :class:`prx_data.pipelines.classify.ClassifyConfig`.
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
from prx_data.columns.backends import GenerationConfig


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m prx_data.classify",
        description=(
            "Label each row of a Lance table from its caption alone: a text-only language model "
            "answers 'would you look at this image, or read it?' with visual, text or nsfw. "
            "Answers that name no single label become 'unknown' and are counted. A rule-based "
            "pre-filter (keywords/regex in prx_data/columns/prompts_txt/classify_rules.txt) labels clear "
            "cases first, or alone with --rules-only. Only rows with a caption and no label are "
            "processed, so reruns resume; failures keep their reason in COLUMN_error. Turn "
            "labels into skip lists with `python -m prx_data.skips` and a query such as \"label IN ('text','nsfw')\"."
        ),
    )
    p.add_argument("--table", required=True, help="Lance table URI (local path or s3://...)")
    p.add_argument(
        "--column", default="label", help="column to write the labels to (default: %(default)s)"
    )
    p.add_argument(
        "--source-column",
        default="caption_vlm",
        help="caption column the model reads (default: %(default)s)",
    )
    p.add_argument(
        "--prompt-file",
        default=None,
        help="prompt template with a {caption} placeholder "
        "(default: the packaged prx_data/columns/prompts_txt/classify.txt)",
    )
    p.add_argument(
        "--rules-file",
        default=None,
        help="rules file, one '<label>: <regex>' per line "
        "(default: the packaged prx_data/columns/prompts_txt/classify_rules.txt)",
    )
    mode = p.add_mutually_exclusive_group()
    mode.add_argument(
        "--rules-only",
        action="store_true",
        help="label with the rules alone, no model: unmatched rows become 'visual'",
    )
    mode.add_argument("--no-rules", action="store_true", help="send every caption to the model")
    p.add_argument(
        "--limit", type=int, default=None, help="label at most this many rows (a trial run)"
    )
    redo = p.add_mutually_exclusive_group()
    redo.add_argument(
        "--redo",
        default="",
        help="comma-separated labels to compute again, e.g. 'unknown', in addition to the rows "
        "without a label (default: none)",
    )
    redo.add_argument(
        "--only",
        default="",
        help="comma-separated labels to compute again, and nothing else: e.g. --only unknown "
        "leaves rows that were never labelled alone",
    )
    add_backend_args(
        p,
        max_tokens=GenerationConfig(max_tokens=8).max_tokens,
        batch_size_help="rows per backend call (default: vllm 256, openai 4 x concurrency, transformers 16)",
        required=False,
    )
    return p


def main(argv: list[str] | None = None) -> int:
    p = build_parser()
    args = p.parse_args(argv)
    if not args.rules_only and not (args.backend and args.model):
        p.error("--backend and --model are required unless --rules-only is given")
    from prx_data.pipelines.classify import ClassifyConfig, run_classify

    return run_column_job(
        args,
        lambda run: ClassifyConfig(
            table=args.table,
            backend=args.backend,
            model=args.model,
            column=args.column,
            source_column=args.source_column,
            prompt_file=args.prompt_file,
            rules_file=args.rules_file,
            rules_only=args.rules_only,
            use_rules=not args.no_rules,
            limit=args.limit,
            generation=generation_from_args(args),
            backend_options=backend_options_from_args(args) if args.backend else {},
            replicas=args.replicas,
            batch_size=args.batch_size,
            redo=redo_args(args)[0],
            only=redo_args(args)[1],
            commit_every=args.commit_every,
            **run,
        ),
        run_classify,
    )


if __name__ == "__main__":
    sys.exit(main())
