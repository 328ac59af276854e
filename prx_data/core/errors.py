"""One rule for every job: past a share of failed items the run fails, and says where to look.

A job that loses a few rows to broken files should finish and count them; a
job that loses most of them has a broken input or set-up, and a successful
exit would hide that. ``--max-error-rate`` (default 0.2) draws the line.
"""

from __future__ import annotations

import argparse
import os

DEFAULT_MAX_ERROR_RATE = 0.2


class PrxDataError(Exception):
    """Base of every error prx-data raises on purpose: bad input, a refused state, a set-up fault.

    A CLI catches this and prints one line saying what to do; anything else is a
    bug and keeps its traceback. Subclasses keep their standard bases
    (``ValueError``, ``TimeoutError``, ...) so existing ``except`` clauses still work.
    """


class UsageError(PrxDataError, ValueError):
    """A bad argument, setting or input value: the message names it and what to give instead."""


class NotFound(PrxDataError, FileNotFoundError):
    """A table, export or file the user named is not there."""


class AlreadyExists(PrxDataError, FileExistsError):
    """A destination the user named already holds something the job will not replace."""


class UnknownName(PrxDataError, KeyError):
    """A bucket, shard, row or column the user named is not in the data."""

    def __str__(self) -> str:  # KeyError quotes its message; this one is a sentence
        return Exception.__str__(self)


class OutOfRange(PrxDataError, IndexError):
    """A position the user gave lies outside what it points into."""


class Conflict(PrxDataError, RuntimeError):
    """The data changed under a run (another writer): what is committed stays; run it again."""


class ErrorRateExceeded(PrxDataError, RuntimeError):
    """More items failed than ``--max-error-rate`` allows."""


def undecodable_path(e: UnicodeEncodeError) -> str | None:
    """The one-line message for a path that is not UTF-8, or None if ``e`` is not about one.

    Python decodes a non-UTF-8 file name with ``surrogateescape``; Arrow and
    Lance take only UTF-8 paths, so such a name fails deep inside them as an
    encoding error that names no path. The string being encoded is the path;
    it is shown as the bytes the file system holds.
    """
    if not (isinstance(e.object, str) and "surrogates not allowed" in str(e.reason)):
        return None
    raw = os.fsencode(e.object)
    return (
        f"path {raw!r} is not valid UTF-8: Arrow and Lance read UTF-8 paths only; "
        "rename it (e.g. convmv -f latin1 -t utf8 --notest)"
    )


def read_user_text(path: str, what: str) -> str:
    """The text of a file the user named; a missing or unreadable one is a one-line error."""
    try:
        with open(path, encoding="utf-8") as f:
            return f.read()
    except FileNotFoundError:
        raise NotFound(f"{what} {path!r} does not exist: check the path") from None
    except (IsADirectoryError, PermissionError, UnicodeDecodeError) as e:
        why = getattr(e, "strerror", None) or str(e)
        raise UsageError(f"{what} {path!r} cannot be read: {why}") from None


def error_rate_arg(value: str) -> float:
    """argparse type: a share between 0 and 1."""
    try:
        v = float(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number: {value!r}") from None
    if not 0.0 <= v <= 1.0:
        raise argparse.ArgumentTypeError(f"must be between 0 and 1, got {v}")
    return v


def check_error_rate(
    job: str, failed: int, total: int, max_rate: float, details: str, what: str = "items"
) -> None:
    """Raise :class:`ErrorRateExceeded` when ``failed / total`` passes ``max_rate``."""
    if total and failed / total > max_rate:
        raise ErrorRateExceeded(
            f"{job}: {failed:,} of {total:,} {what} failed ({failed / total:.1%} > "
            f"--max-error-rate {max_rate:g}); details: {details}"
        )
