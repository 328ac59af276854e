"""``python -m prx_data.ingest SOURCE... --table URI``: load image-text sources into Lance.

Thin CLI over :func:`prx_data.pipelines.ingest.ingest`; the job is
:mod:`prx_data.pipelines.ingest`. Sources: image folders (captions from same-stem
``.txt``/``.json``), parquet (image bytes or paths, HF exports, LAION-style
metadata), URL lists (txt, csv, tsv, JSON lines), WebDataset tars, twin-tar modality
folders, and Lance tables.
"""

from __future__ import annotations

import argparse
import json
import sys

from prx_data.cli.reporting import finish_run
from prx_data.core.errors import PrxDataError
from prx_data.core.runtime import add_run_args, run_options_from_args
from prx_data.ingest import FORMATS
from prx_data.pipelines.ingest import (
    DEFAULT_FRAGMENT_BYTES,
    MODES,
    IngestReport,
    ingest,
)

__all__ = ["IngestReport", "ingest", "main"]


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m prx_data.ingest",
        description="Load image-text collections into a Lance table. Every row "
        "gets a stable id '<source>/<key>', the image bytes as found, width/height/format "
        "from the header (unreadable images are kept with a probe_error), the caption, and "
        "the source's other metadata columns. Re-ingesting never duplicates ids. Small "
        "sources load in this process; larger ones on a local Ray, or the cluster in "
        "RAY_ADDRESS.",
    )
    p.add_argument(
        "sources",
        nargs="+",
        metavar="SOURCE",
        help="a folder, parquet file/folder, URL list (.txt one URL a line, .csv, .tsv "
        "with or without a header, .jsonl), tar(s), twin-tar root or .lance table; "
        "write NAME=PATH to choose the id prefix (default: the base name of PATH)",
    )
    p.add_argument(
        "--table", required=True, help="Lance table URI to write (local path or s3://...)"
    )
    p.add_argument(
        "--mode",
        choices=MODES,
        default="append",
        help="append: add new ids, create the table if missing (default); create: fail if "
        "the table exists; overwrite: replace the table",
    )
    p.add_argument(
        "--format",
        dest="fmt",
        choices=FORMATS,
        default=None,
        help="source format for all SOURCEs (default: detect from each path)",
    )
    p.add_argument(
        "--rows-per-fragment",
        type=int,
        default=None,
        help="at most this many rows per Lance fragment (default: about --fragment-mb of images "
        "per fragment, between 1024 and 1M rows); each write task holds one fragment in memory",
    )
    p.add_argument(
        "--fragment-mb",
        type=int,
        default=DEFAULT_FRAGMENT_BYTES // (1024 * 1024),
        help="target fragment size in MiB when --rows-per-fragment is not given "
        "(default: %(default)s)",
    )
    p.add_argument(
        "--items-per-unit",
        type=int,
        default=None,
        help="items per parallel work unit for folders and parquet (default: the reader's)",
    )
    p.add_argument("--image-column", default=None, help="parquet/lance: column with image bytes")
    p.add_argument(
        "--path-column",
        default=None,
        help="parquet: column with image paths (relative to the file)",
    )
    p.add_argument(
        "--url-column",
        default=None,
        help="csv/tsv/jsonl: column with the image URL (default: url, URL, image_url...; "
        "a file without a header calls it url)",
    )
    p.add_argument(
        "--caption-column",
        default=None,
        help="parquet/lance/csv/tsv/jsonl: caption column (default: caption, text, TEXT...)",
    )
    p.add_argument(
        "--key-column",
        default=None,
        help="parquet/lance/csv/tsv/jsonl: column giving the id key (default: key, uid... "
        "else the row number)",
    )
    p.add_argument(
        "--keys",
        default=None,
        help="twin tars: parquet file listing the keys to load (index mode; missing and "
        "out-of-order keys are tolerated); default: positional zip of the tars",
    )
    p.add_argument("--json", action="store_true", help="print the report as JSON")
    add_run_args(p)
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    reader_options = {
        k: v
        for k, v in {
            "image_column": args.image_column,
            "path_column": args.path_column,
            "url_column": args.url_column,
            "caption_column": args.caption_column,
            "key_column": args.key_column,
            "keys": args.keys,
        }.items()
        if v is not None
    }
    try:
        opts = run_options_from_args(args)
        report = ingest(
            args.sources,
            args.table,
            mode=args.mode,
            fmt=args.fmt,
            rows_per_fragment=args.rows_per_fragment,
            fragment_bytes=args.fragment_mb * 1024 * 1024,
            items_per_unit=args.items_per_unit,
            **opts.job_fields(),
            **reader_options,
        )
    except PrxDataError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return finish_run(
        report,
        opts,
        text=json.dumps(report.to_dict(), indent=2) if args.json else None,
    )


if __name__ == "__main__":
    sys.exit(main())
