"""Where a rewrite stages files, and how much: the local-disk bound and streaming's log.

A rewrite of a remote or compressed export stages shards on local disk (a
source shard to check, an output shard before its upload). :class:`Staging`
holds the bytes staged at once under ``--max-local-bytes`` (or
``PRX_REWRITE_DISK``), so concurrent packs wait for room instead of filling
the disk; :class:`QuietStreaming` keeps streaming's per-writer warnings off
the terminal and counts them for the report. Used by the re-shard stage
(:mod:`prx_data.skips.repack`); nothing here reads or writes an export.
"""

from __future__ import annotations

import logging
import os
import re
import threading

from prx_data.core.errors import PrxDataError, UsageError

#: Default bound on the bytes a rewrite stages on local disk (``--max-local-bytes``).
DEFAULT_MAX_LOCAL_BYTES = 8 << 30
#: Environment setting for the bound when the flag is not given (``8G``, ``500M``, bytes).
DISK_ENV = "PRX_REWRITE_DISK"
#: The plan a rewrite writes before its first pack; ``resume`` continues only the same plan.
#: Staged bytes reserved per pack for its index and manifest (plus per shard and per id).
META_BYTES = (8 << 10, 1 << 10, 64)


class RewriteDiskError(PrxDataError, ValueError):
    """One shard needs more local disk than the rewrite may stage."""


def parse_bytes(text: str, what: str = "size") -> int:
    """``8G``, ``500M``, ``64k`` (binary units) or a plain byte count; positive."""
    units = {"": 1, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40}
    m = re.fullmatch(r"([0-9]+(?:\.[0-9]+)?)([kmgt]?)(?:i?b)?", text.strip().lower())
    value = int(float(m.group(1)) * units[m.group(2)]) if m else 0
    if value <= 0:
        raise UsageError(f"{what} {text!r} is not a positive size (e.g. 8G, 500M, 1048576)")
    return value


def max_local_bytes(value: int | str | None = None) -> int:
    """The staging bound: ``value``, else ``PRX_REWRITE_DISK``, else 8 GiB."""
    if value is None:
        raw = os.environ.get(DISK_ENV)
        return parse_bytes(raw, DISK_ENV) if raw else DEFAULT_MAX_LOCAL_BYTES
    return value if isinstance(value, int) and value > 0 else parse_bytes(str(value))


class Staging:
    """The local directory a rewrite stages files in, holding at most ``limit`` bytes.

    A pack reserves its room before it starts and releases it at its end, so
    concurrent packs wait for room instead of filling the disk. Each staged
    write is reported to :meth:`written` (a test hook: it can measure the disk).
    """

    def __init__(self, directory: str, limit: int) -> None:
        self.directory = directory
        self.limit = limit
        self.used = 0
        self._cond = threading.Condition()

    def reserve(self, n: int) -> None:
        if n > self.limit:  # would wait forever (the plan checks first, with the shard named)
            raise RewriteDiskError(f"{n:,} bytes do not fit in {self.limit:,} of local disk")
        with self._cond:
            while self.used + n > self.limit:
                self._cond.wait()
            self.used += n

    def release(self, n: int) -> None:
        with self._cond:
            self.used -= n
            self._cond.notify_all()

    def written(self, path: str) -> None:
        """Called after each file written under :attr:`directory`."""


class QuietStreaming(logging.Handler):
    """Keeps streaming's log warnings off the terminal for a run and counts them for the report.

    Streaming logs per writer (e.g. about existing directories); a rewrite
    opens one writer per part, so the lines would bury the output. The driver
    holds one for the run; a pack on a Ray worker holds its own and reports its counts.
    """

    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.seen: dict[str, int] = {}
        self._logger = logging.getLogger("streaming")
        self._saved = (self._logger.propagate, list(self._logger.handlers))
        self._logger.propagate = False
        self._logger.handlers = [self]

    @staticmethod
    def active() -> bool:
        return any(isinstance(h, QuietStreaming) for h in logging.getLogger("streaming").handlers)

    def emit(self, record: logging.LogRecord) -> None:
        msg = record.getMessage()
        self.seen[msg] = self.seen.get(msg, 0) + 1

    def close(self) -> None:
        self._logger.propagate, self._logger.handlers = self._saved
        super().close()


def check_room(root: str, packs, limit: int) -> None:
    """Refuse, before anything is written, a bound that one pack's staging does not fit in."""
    for p in packs:
        if p.stage > limit:
            raise RewriteDiskError(
                f"{root}/{p.bucket}/{p.part}: one shard needs {p.stage:,} bytes of local disk (a "
                f"source shard and its output) but the rewrite may stage {limit:,}; raise "
                f"--max-local-bytes (or {DISK_ENV})"
            )
