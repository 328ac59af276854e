"""``python -m prx_data.download``: argument parsing over :mod:`prx_data.pipelines.download`."""

from __future__ import annotations

import argparse
import sys

from prx_data.cli.reporting import finish_run
from prx_data.core.errors import Conflict, NotFound, PrxDataError
from prx_data.core.runtime import add_run_args, run_options_from_args
from prx_data.download import fetch as F
from prx_data.pipelines.download import DEFAULT_MAX_ERROR_RATE, FAILED, DownloadConfig, run_download

#: The politeness and limits options: (flag, its ``FetchConfig`` field, help), in help order.
#: Each default is the field's; ``--max-mb`` gives ``max_bytes`` in MiB.
_FETCH_OPTIONS: tuple[tuple[str, str, str], ...] = (
    (
        "--threads",
        "threads",
        "requests in flight per fetch task; the global figure is this times the "
        "tasks running (Ray CPUs / --task-cpus) (default: %(default)s)",
    ),
    ("--per-host", "per_host", "requests in flight per host and task (default: %(default)s)"),
    (
        "--per-host-rate",
        "per_host_rate",
        "requests started per second per host and task, 0 for no limit (default: %(default)s)",
    ),
    ("--user-agent", "user_agent", "User-Agent header (default: %(default)s)"),
    ("--connect-timeout", "connect_timeout", "seconds to connect (default: %(default)s)"),
    (
        "--read-timeout",
        "read_timeout",
        "seconds one read may wait: a stalled body fails after this (default: %(default)s)",
    ),
    (
        "--timeout",
        "total_timeout",
        "seconds for one attempt overall: DNS, connect, TLS, headers and body, over every "
        "redirect; held even against a server that trickles bytes (default: %(default)s)",
    ),
    (
        "--max-mb",
        "max_bytes",
        "largest body in MiB, enforced while streaming (default: %(default)s)",
    ),
    (
        "--max-redirects",
        "max_redirects",
        "redirects followed, each hop checked (default: %(default)s)",
    ),
    (
        "--retries",
        "retries",
        "attempts after the first for timeouts, resets, 429 and 5xx (default: %(default)s)",
    ),
    (
        "--backoff",
        "backoff",
        "first retry wait in seconds, doubled each time, with jitter (default: %(default)s)",
    ),
    (
        "--max-retry-after",
        "max_retry_after",
        "longest Retry-After honoured; longer ends the row's retries (default: %(default)s)",
    ),
)


def _fetch_options(args: argparse.Namespace) -> dict:
    """The ``FetchConfig`` fields the politeness and limits options set."""
    out = {field: getattr(args, flag[2:].replace("-", "_")) for flag, field, _ in _FETCH_OPTIONS}
    out["max_bytes"] = int(out["max_bytes"] * 2**20)
    return out


def build_parser() -> argparse.ArgumentParser:
    d = F.FetchConfig()
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
        "row's sha256/md5 column are not stored.",
    )
    p.add_argument("--table", required=True, help="Lance table URI")
    p.add_argument(
        "--url-column",
        default=None,
        help="column holding the URL (default: the first of url, URL, image_url, img_url)",
    )
    p.add_argument(
        "--hash-column",
        default=None,
        help="column of expected content hashes, hex md5, sha1 or sha256 by length (default: "
        "sha256 or md5 when the table has one); bytes that do not match are not stored and "
        "the row gets download_error hash_mismatch",
    )
    p.add_argument(
        "--no-hash-check", action="store_true", help="store the bytes whatever the hash column says"
    )
    p.add_argument(
        "--only",
        action="append",
        default=[],
        metavar="SELECTOR",
        help=f"redo rows fetched before instead of new ones: '{FAILED}' (transient, "
        "permanent and refused rows), a status (transient, permanent, refused, opted_out), or a "
        "reason such as http_503 or timeout ('*' matches any text: 'http_5*'); repeatable",
    )
    p.add_argument("--limit", type=int, default=None, help="fetch at most this many rows")
    g = p.add_argument_group("politeness and limits")
    for flag, field, help in _FETCH_OPTIONS:
        default = getattr(d, field)
        default = default / 2**20 if field == "max_bytes" else default
        g.add_argument(flag, type=type(default), default=default, help=help)
    s = p.add_argument_group("safety")
    s.add_argument(
        "--allow-private",
        action="append",
        default=[],
        metavar="ADDR",
        help="allow an otherwise refused address: IP, IP:PORT or network "
        "(127.0.0.1:8080, 10.0.0.0/8); for local mirrors and tests; repeatable",
    )
    s.add_argument(
        "--ignore-x-robots-tag",
        action="store_true",
        help="fetch images whose server sends X-Robots-Tag noai/noimageai (honoured by default)",
    )
    s.add_argument(
        "--ca-bundle",
        default=None,
        help="PEM file of certificate authorities to trust instead of the system's",
    )
    s.add_argument(
        "--insecure",
        action="store_true",
        help="do not verify TLS certificates",
    )
    r = p.add_argument_group("run")
    r.add_argument(
        "--task-cpus",
        type=float,
        default=DownloadConfig.task_cpus,
        help="Ray CPUs per fetch task: 0.5 runs two per CPU so that one's slow rows overlap "
        "another's work (default: %(default)s)",
    )
    r.add_argument(
        "--batch-size",
        type=int,
        default=DownloadConfig.batch_size,
        help="rows per fetch call; a call ends with its slowest row, so keep it many times "
        "--threads (default: %(default)s)",
    )
    r.add_argument(
        "--commit-rows",
        type=int,
        default=DownloadConfig.commit_rows,
        help="rows per commit; a killed run refetches at most these (default: %(default)s)",
    )
    r.add_argument(
        "--commit-mb",
        type=float,
        default=DownloadConfig.commit_bytes / 2**20,
        help="MiB buffered before a commit (default: %(default)s)",
    )
    add_run_args(p)
    p.set_defaults(max_error_rate=DEFAULT_MAX_ERROR_RATE)
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        opts = run_options_from_args(args)
        fetch = F.FetchConfig(
            **_fetch_options(args),
            allow=tuple(args.allow_private),
            opt_out=() if args.ignore_x_robots_tag else F.DEFAULT_OPT_OUT,
            verify_tls=not args.insecure,
            ca_bundle=args.ca_bundle,
        )
        cfg = DownloadConfig(
            table=args.table,
            url_column=args.url_column,
            hash_column=args.hash_column,
            check_hashes=not args.no_hash_check,
            only=tuple(args.only),
            limit=args.limit,
            fetch=fetch,
            task_cpus=args.task_cpus,
            batch_size=args.batch_size,
            commit_rows=args.commit_rows,
            commit_bytes=max(1, int(args.commit_mb * 2**20)),
            **opts.job_fields(),
        )
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
