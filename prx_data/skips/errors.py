"""The errors of skip-list operations (every room of :mod:`prx_data.skips` raises these)."""

from __future__ import annotations

from collections.abc import Mapping

from prx_data.core.errors import PrxDataError


class ListError(PrxDataError, ValueError):
    """A skip-list operation that cannot go ahead; the message says what to do."""


class UncarriableList(ListError):
    """Lists of a tree whose ids cannot be recovered, so a new tree cannot carry them."""

    def __init__(self, root: str, problems: Mapping[str, str], flag: str = "--drop-lists"):
        self.names = sorted(problems)
        what = "; ".join(f"{n!r}: {problems[n]}" for n in self.names)
        super().__init__(
            f"{root}: cannot carry skip list(s) {', '.join(map(repr, self.names))} to the new "
            f"tree ({what}); nothing was changed. Fix them, or pass "
            + " ".join(f"{flag} {n}" for n in self.names)
            + " to leave them behind"
        )


__all__ = [
    "ListError",
    "UncarriableList",
]
