"""``python -m prx_data.download``: argument parsing over :mod:`prx_data.pipelines.download`."""

from __future__ import annotations

import argparse
import sys

from prx_data.cli.reporting import add_report_args, finish_run, report_options_from_args
from prx_data.core.errors import Conflict, NotFound, PrxDataError
from prx_data.core.flags import add_flags, from_args
from prx_data.download import fetch as F
from prx_data.pipelines.download import DEFAULT_MAX_ERROR_RATE, DownloadConfig, run_download


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m prx_data.download",
        description="Fetch the images of rows that have a URL and no image (LAION-style "
        "parquet, CSV, TSV, txt or JSON lines ingested with `python -m prx_data.ingest`) "
        "into the table: image, width, "
        "height, format and probe_error are filled as ingest fills them, and "
        "download_status / download_error say what happened per row. Resumable: a rerun "
        "fetches only rows without a status; each URL is fetched once per table. Private, "
        "loopback, link-local and metadata addresses are refused unless --allow-private "
        "names them; X-Robots-Tag noai/noimageai is honoured; bytes that do not match the "
        "row's sha256/md5 column are not stored. Small work runs on threads of this process; "
        "on Ray (larger work, or a cluster) the fetch tasks share one per-host budget through "
        "a Ray actor it starts.",
    )
    add_flags(p, DownloadConfig)
    add_flags(p.add_argument_group("politeness, limits and safety"), F.FetchConfig)
    add_report_args(p)
    p.set_defaults(max_error_rate=DEFAULT_MAX_ERROR_RATE)
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        opts = report_options_from_args(args)
        cfg = from_args(DownloadConfig, args, fetch=from_args(F.FetchConfig, args))
        from prx_data.table.lance_ops import table_exists

        if not table_exists(args.table):
            raise NotFound(f"no Lance table at {args.table!r}: ingest the URL list first")
        report = run_download(cfg)
    except Conflict as e:  # the table changed under the run: what is committed stays
        print(f"download: {e}", file=sys.stderr)
        return 1
    except PrxDataError as e:
        print(f"download: {e}", file=sys.stderr)
        return 2
    return finish_run(report, opts, sort_keys=True)


if __name__ == "__main__":
    sys.exit(main())
