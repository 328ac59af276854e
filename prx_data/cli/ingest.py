"""``python -m prx_data.ingest SOURCE... --table URI``: load image-text sources into Lance.

Thin CLI over :func:`prx_data.pipelines.ingest.run_ingest`: the flags are
:class:`~prx_data.pipelines.ingest.IngestConfig`'s fields. Sources: image folders
(captions from same-stem ``.txt``/``.json``), parquet (image bytes or paths, HF
exports, LAION-style metadata), URL lists (txt, csv, tsv, JSON lines), WebDataset
tars, twin-tar modality folders, and Lance tables.
"""

from __future__ import annotations

import argparse
import json
import sys

from prx_data.cli.reporting import add_report_args, run_job
from prx_data.core.flags import add_flags
from prx_data.pipelines.ingest import IngestConfig, IngestReport, ingest, run_ingest

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
    add_flags(p, IngestConfig)
    p.add_argument("--json", action="store_true", help="print the report as JSON")
    add_report_args(p)
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    as_json = (lambda report: json.dumps(report.to_dict(), indent=2)) if args.json else None
    return run_job(args, IngestConfig, run_ingest, text=as_json)


if __name__ == "__main__":
    sys.exit(main())
