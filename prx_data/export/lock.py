"""One writer per export: the project's lease (:mod:`prx_data.core.lease`) on ``--out``.

Two runs on the same output, or a run and a ``--resume``, would delete and
rewrite each other's parts; a skip-list update during a run would be
undone by the run's own list materialisation. Every export run (plain,
``--overwrite`` or ``--resume``) and every update of an export's skip lists
holds this lease from before it looks at the tree until its last write:
``OUT/.prx-export.lock`` (``flock``) locally, ``OUT/.prx-export.lease`` (a
conditional-PUT lease) on ``s3://``; other stores are refused. Export runs
refuse a held lease at once; list updates wait for it (``wait_s``).
"""

from __future__ import annotations

from prx_data.core import storage
from prx_data.core.lease import DEFAULT_LEASE_TTL_S, LEASE_MARGIN, Lease, LeaseHeld, S3LeaseStore
from prx_data.export.naming import LEASE_NAME, LOCK_NAME, ExportError

__all__ = ["DEFAULT_LEASE_TTL_S", "LEASE_MARGIN", "ExportLock", "ExportLocked", "S3LeaseStore"]


class ExportLocked(ExportError, LeaseHeld):
    """Another run holds the lease on this output (or this run lost it)."""


def lease_path(out: str) -> str:
    """Where the lease of the export at ``out`` lives."""
    if storage.is_remote(out):
        return storage.join(out, LEASE_NAME)
    return storage.join(out, LOCK_NAME)


class ExportLock(Lease):
    """The lease on an export output; a context manager (see the module docstring).

    Args:
        out: the export root.
        ttl_s: remote lease lifetime without a heartbeat.
        wait_s: how long to wait for a live holder (0: refuse at once, as export runs do).
        what: what the holder is, for messages.
    """

    def __init__(
        self,
        out: str,
        *,
        ttl_s: float = DEFAULT_LEASE_TTL_S,
        wait_s: float = 0.0,
        what: str = "export run",
    ):
        self.out = out
        super().__init__(lease_path(out), what=what, wait_s=wait_s, ttl_s=ttl_s, error=ExportLocked)
