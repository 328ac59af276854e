"""One rule for every job: past a share of failed items the run fails, and says where to look.

A job that loses a few rows to broken files should finish and count them; a
job that loses most of them has a broken input or set-up, and a successful
exit would hide that. ``--max-error-rate`` (default 0.2) draws the line.
"""

from __future__ import annotations

import argparse

DEFAULT_MAX_ERROR_RATE = 0.2


class PrxDataError(Exception):
    """Base of every error prx-data raises on purpose: bad input, a refused state, a set-up fault.

    A CLI catches this and prints one line saying what to do; anything else is a
    bug and keeps its traceback. Subclasses keep their standard bases
    (``ValueError``, ``TimeoutError``, ...) so existing ``except`` clauses still work.
    """


class ErrorRateExceeded(PrxDataError, RuntimeError):
    """More items failed than ``--max-error-rate`` allows."""


def error_rate_arg(value: str) -> float:
    """argparse type: a share between 0 and 1."""
    try:
        v = float(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number: {value!r}") from None
    if not 0.0 <= v <= 1.0:
        raise argparse.ArgumentTypeError(f"must be between 0 and 1, got {v}")
    return v


def add_max_error_rate(p: argparse.ArgumentParser | argparse._ArgumentGroup, what: str) -> None:
    """The shared ``--max-error-rate`` option; ``what`` names the items counted."""
    p.add_argument(
        "--max-error-rate",
        type=error_rate_arg,
        default=DEFAULT_MAX_ERROR_RATE,
        help=f"fail (exit status 1) when more than this share of {what} failed "
        "(default: %(default)s; 1 never fails)",
    )


def check_error_rate(
    job: str, failed: int, total: int, max_rate: float, details: str, what: str = "items"
) -> None:
    """Raise :class:`ErrorRateExceeded` when ``failed / total`` passes ``max_rate``."""
    if total and failed / total > max_rate:
        raise ErrorRateExceeded(
            f"{job}: {failed:,} of {total:,} {what} failed ({failed / total:.1%} > "
            f"--max-error-rate {max_rate:g}); details: {details}"
        )


def error_rate_status(
    job: str, failed: int, total: int, max_rate: float, details: str, what: str = "items"
) -> int:
    """A CLI's exit status: 0, or 1 after printing why when the error rate is passed."""
    import sys

    try:
        check_error_rate(job, failed, total, max_rate, details, what)
    except ErrorRateExceeded as err:
        print(f"error: {err}", file=sys.stderr)
        return 1
    return 0
