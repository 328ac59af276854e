"""Once per node: local rank 0 does the work and writes a marker; the other ranks wait for it.

What a loader reads before streaming (a remote export's catalog, the
hold-out sets) is computed by the node's leader only. The leader writes the
marker last, or an error line when its work failed, so a waiting rank fails
with the leader's reason instead of timing out.
"""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Callable
from typing import TypeVar

from prx_data.core import storage
from prx_data.core.errors import PrxDataError

_ERROR = "ERROR "
#: The leader's failure was the user's to fix (a PrxDataError): the others fail with one line too.
_USER_ERROR = "USER ERROR "
_T = TypeVar("_T")


class LeaderFailed(PrxDataError, RuntimeError):
    """Local rank 0 failed with a user's error (its one line, relayed to the other ranks)."""


def wait_for_leader(marker: str, timeout: float, what: str) -> str:
    """A non-leader rank: wait for the leader's ``marker`` and return its text.

    The leader writes the marker last, or an error line when its work failed,
    so a waiting rank fails with the leader's reason instead of timing out.
    """
    _node_barrier()
    deadline = time.monotonic() + timeout
    while not os.path.exists(marker):
        if time.monotonic() > deadline:
            raise TimeoutError(f"{marker}: local rank 0 did not finish {what}")
        time.sleep(0.05)
    with open(marker) as f:
        text = f.read()
    if text.startswith(_USER_ERROR):
        raise LeaderFailed(f"local rank 0 failed {what}: {text[len(_USER_ERROR) :]}")
    if text.startswith(_ERROR):  # a bug on the leader: its traceback is on rank 0
        raise RuntimeError(f"local rank 0 failed {what}: {text[len(_ERROR) :]}")
    return text


def lead(marker: str, work: Callable[[], tuple[_T, bytes]]) -> _T:
    """The leader rank: run ``work`` (result, marker body), then write the marker for the others."""
    if os.path.exists(marker):
        os.remove(marker)
    try:
        result, body = work()
    except Exception as e:
        # Tell the waiting ranks why, instead of leaving them at the barrier.
        head = _USER_ERROR if isinstance(e, PrxDataError) else _ERROR
        storage.write_bytes_atomic(marker, f"{head}{type(e).__name__}: {e}".encode())
        _node_barrier()
        raise
    storage.write_bytes_atomic(marker, body)
    _node_barrier()
    return result


def _node_barrier() -> None:
    # No torch imported: no process group can be up, so there is no one to wait for.
    torch = sys.modules.get("torch")
    if (
        torch is not None
        and torch.distributed.is_available()
        and torch.distributed.is_initialized()
    ):
        torch.distributed.barrier()
