"""Output steps every job shares: one-line errors, and :func:`finish` (print, JSON, exit status)."""

from __future__ import annotations

import json
import sys
from collections.abc import Callable
from typing import Any

__all__ = [
    "finish",
]


def print_error(e: BaseException, prefix: str = "error") -> None:
    """Print ``<prefix>: <first line>`` to stderr (the exception's type when it has no message)."""
    print(f"{prefix}: {str(e).splitlines()[0] if str(e) else type(e).__name__}", file=sys.stderr)


def write_json(path: str | None, data: dict, *, sort_keys: bool = False) -> None:
    """Write ``data`` to ``path`` (local or object storage) whole or not at all; None: nothing."""
    if path:
        from prx_data.core import storage

        text = json.dumps(data, indent=2, sort_keys=sort_keys)
        storage.write_bytes_atomic(path, text.encode())


def finish(
    report: Any,
    *,
    report_json: str | None = None,
    max_error_rate: float | None = None,
    text: str | None = None,
    footer: str | None = None,
    sort_keys: bool = False,
) -> int:
    """The end of every job's ``main``: print the report, write it as JSON, return the status.

    ``text`` replaces ``report.text()`` (e.g. ``--json`` output), ``footer`` follows
    it. The status comes from the report's own failure counts
    (:class:`prx_data.core.reports.FailureCounts`): 1, with one line on stderr,
    when more than ``max_error_rate`` of its items failed; else 0.
    """
    print(report.text() if text is None else text)
    if footer:
        print(footer)
    write_json(report_json, report.to_dict(), sort_keys=sort_keys)
    status = getattr(report, "failure", None)
    message = status(max_error_rate, report_json) if status else None
    if message:
        print(f"error: {message}", file=sys.stderr)
        return 1
    return 0


def run_job(
    args: Any,
    config: type,
    run: Callable[[Any], Any],
    *,
    footer: Callable[[Any], str | None] | None = None,
    text: Callable[[Any], str | None] | None = None,
    **overrides: Any,
) -> int:
    """A thin CLI's ``main`` after parsing: ``config`` from its flags
    (:func:`prx_data.core.flags.from_args`, with the run options and ``overrides``),
    ``run(cfg)``, then :func:`finish_run` (``footer(cfg)`` and ``text(report)`` when
    given). A configuration or job error is one line, exit status 2.
    """
    from prx_data.core.errors import PrxDataError
    from prx_data.core.flags import from_args
    from prx_data.core.runtime import run_options_from_args

    try:
        opts = run_options_from_args(args)
        cfg = from_args(config, args, **opts.job_fields(), **overrides)
        report = run(cfg)
    except PrxDataError as e:
        print_error(e)
        return 2
    return finish_run(
        report,
        opts,
        footer=footer(cfg) if footer else None,
        text=text(report) if text else None,
    )


def finish_run(report: Any, opts: Any, **kwargs: Any) -> int:
    """:func:`finish` with the report JSON path and error rate of ``opts``
    (:class:`prx_data.core.runtime.RunOptions`)."""
    return finish(
        report, report_json=opts.report_json, max_error_rate=opts.max_error_rate, **kwargs
    )
