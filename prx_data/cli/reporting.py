"""Output steps every job shares: one-line errors, and :func:`finish` (print, JSON, exit status)."""

from __future__ import annotations

import json
import sys
import warnings
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

from prx_data.core.errors import DEFAULT_MAX_ERROR_RATE, UsageError, error_rate_arg
from prx_data.core.flags import add_flags, flag, from_args


@dataclass(frozen=True)
class ReportOptions:
    """How a CLI reports a job: when it fails, where its JSON report goes, how loud it is.

    Not a job setting (a notebook reads the report it gets back), so no job
    config holds it: each CLI adds these flags with :func:`add_report_args`.
    """

    max_error_rate: float = flag(
        DEFAULT_MAX_ERROR_RATE,
        "--max-error-rate",
        help="fail (exit status 1) when more than this share of the job's items (rows, work "
        "units) failed (default: %(default)s; 1 never fails)",
        type=error_rate_arg,
    )
    report_json: str | None = flag(
        None, "--report-json", help="also write the final report to this JSON file"
    )
    verbose: bool = flag(
        False,
        "-v",
        "--verbose",
        help="show Ray's and Lance's full logs (by default known warnings are shown once)",
    )

    def __post_init__(self) -> None:
        if not 0.0 <= self.max_error_rate <= 1.0:
            raise UsageError(f"max_error_rate must be between 0 and 1, got {self.max_error_rate}")


def add_report_args(p, *, title: str = "reporting") -> None:
    """Add the :class:`ReportOptions` flags to ``p`` (a parser), in one group."""
    add_flags(p.add_argument_group(title), ReportOptions)


def report_options_from_args(args: Any) -> ReportOptions:
    """The :class:`ReportOptions` that ``args`` spell; ``-v`` also turns the known warnings
    back on for this process (:func:`prx_data.core.runtime.quiet_logs`)."""
    from prx_data.core.runtime import quiet_logs

    opts = from_args(ReportOptions, args)
    quiet_logs(verbose=opts.verbose)
    return opts


__all__ = [
    "ReportOptions",
    "add_report_args",
    "finish",
    "finish_run",
    "report_options_from_args",
]


@contextmanager
def warnings_once(reported: set[str]) -> Iterator[set[str]]:
    """Show each warning raised inside once, as ``warning: <message>``, after the block,
    leaving out those the job's own report prints (the messages added to ``reported``).

    A job that lists its warnings in its report would otherwise show each twice
    (Python's ``file:line: UserWarning`` form first, then the report's list), and
    the same message from several threads more often still. Warnings already
    filtered out (:func:`prx_data.core.runtime.quiet_logs`) stay out; when the block
    raises, every warning is still shown once.
    """
    with warnings.catch_warnings(record=True) as caught:
        try:
            yield reported
        finally:
            shown = set(reported)
            for w in caught:
                message = str(w.message)
                if message not in shown:
                    shown.add(message)
                    print(f"warning: {message}", file=sys.stderr)


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
    (:func:`prx_data.core.flags.from_args`, its run options nested, and ``overrides``),
    ``run(cfg)``, then :func:`finish_run` (``footer(cfg)`` and ``text(report)`` when
    given). A configuration or job error is one line, exit status 2.
    """
    from prx_data.core.errors import PrxDataError

    try:
        opts = report_options_from_args(args)
        cfg = from_args(config, args, **overrides)
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
    (:class:`ReportOptions`)."""
    return finish(
        report, report_json=opts.report_json, max_error_rate=opts.max_error_rate, **kwargs
    )
