"""A table's identity and its registry: the log of its skip-list entries (registry entries).

* **Identity.** A table's identity is a random id in the table folder
  (:data:`TABLE_ID_NAME`), recorded in its registry's schema metadata and in
  each export's ``_lists/registry`` (:mod:`prx_data.skips.export_state`).
* **The registry** is a small Lance table next to the table
  (``data/photos.lance`` -> ``data/photos.lists.lance``, resolved through
  ``realpath``) holding the log's registry entries (:mod:`prx_data.skips.log`).
  An append holds the registry's lease (:mod:`prx_data.core.lease`), reads the
  registry's Lance version ``v`` and commits its rows with ``seq = base =
  v + 1``, which is exactly the version that commit creates: commit order is
  the order, whatever the writers' clocks say.
* **Legacy conversion.** A registry written before the log was ordered by
  commit is read by its own (clock) rule (:func:`_legacy_entries`) and
  rewritten as its current state on the next append (:meth:`Registry._convert`),
  under a new log identity (:data:`LOG_ID_KEY`), so a position recorded
  against the old log is known not to be a prefix of the new one.
"""

from __future__ import annotations

import logging
import os
import random
import time
import uuid
from collections.abc import Callable, Iterable

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from prx_data.core import storage
from prx_data.core.errors import NotFound
from prx_data.core.lease import Lease
from prx_data.skips import sidecar as SL
from prx_data.skips.errors import ListError
from prx_data.skips.log import (
    ADD,
    LOCK_TIMEOUT_S,
    LOG_SCHEMA,
    REGISTRY,
    concat_entries,
    log_rows,
    state,
)

log = logging.getLogger(__name__)

#: Registry commits tried before giving up with one error (after backoff).
COMMIT_ATTEMPTS = 8
#: The file in a table folder that holds the table's identity.
TABLE_ID_NAME = "_prx_table_id"
#: Schema metadata key of the registry's log identity (see :meth:`Registry.position`).
LOG_ID_KEY = b"prx.log_id"


def canonical(table: str) -> str:
    """The table's URI with symlinks resolved (local), so every spelling finds one registry."""
    base = table.rstrip("/").removeprefix("file://")
    if storage.is_remote(base):
        return base
    return os.path.realpath(base)


def registry_uri(table: str) -> str:
    """``data/photos.lance`` -> ``data/photos.lists.lance`` (of the canonical table path)."""
    base = canonical(table)
    stem = base[: -len(".lance")] if base.endswith(".lance") else base
    return f"{stem}.lists.lance"


def _registry_lease_path(reg_uri: str) -> str:
    return f"{reg_uri}.lock" if not storage.is_remote(reg_uri) else f"{reg_uri}.lease"


def _lease(path: str, what: str) -> Lease:
    return Lease(path, what=what, wait_s=LOCK_TIMEOUT_S)


def read_table_id(table: str) -> str | None:
    """The identity recorded in the table folder, or None (no table there, or none recorded)."""
    try:
        text = storage.read_bytes(storage.join(canonical(table), TABLE_ID_NAME)).decode().strip()
    except (FileNotFoundError, NotADirectoryError, UnicodeDecodeError):
        return None
    return text if text and len(text) <= 64 and text.isalnum() else None


def table_identity(table: str) -> str:
    """The table's identity, recorded in its folder on first use (under the registry's lease)."""
    tid = read_table_id(table)
    if tid is not None:
        return tid
    uri = canonical(table)
    from prx_data.table.lance_ops import open_table

    try:
        open_table(uri)
    except NotFound:
        raise ListError(f"{table}: no Lance table there, so it has no skip-list registry") from None
    with _lease(_registry_lease_path(registry_uri(uri)), "skip-list registry writer"):
        tid = read_table_id(uri)
        if tid is None:
            tid = uuid.uuid4().hex
            storage.write_bytes_atomic(storage.join(uri, TABLE_ID_NAME), tid.encode())
    return tid


class Registry:
    """The table's log of list entries (see the module docstring)."""

    def __init__(self, table: str, table_id: str):
        from prx_data.table.lance_ops import lance_storage_options

        self.table = canonical(table)
        self.table_id = table_id
        self.uri = registry_uri(self.table)
        self.options = lance_storage_options(self.uri)

    @classmethod
    def for_table(cls, table: str) -> Registry:
        """The registry of ``table`` (its identity is recorded on first use)."""
        return cls(table, table_identity(table))

    def _open(self, version: int | None = None):
        from prx_data.table.lance_ops import open_table

        try:
            ds = open_table(self.uri, self.options, version=version)
        except NotFound:
            return None
        if "seq" not in ds.schema.names:
            return ds  # written before the log was ordered by commit: converted on next append
        got = (ds.schema.metadata or {}).get(b"prx.table_id", b"").decode()
        if got != self.table_id:
            raise ListError(
                f"{self.uri} is the list registry of another table (identity {got or 'none'}, "
                f"{self.table} is {self.table_id}); move it away: a table's registry lives "
                "next to it under this name"
            )
        return ds

    def head(self) -> int:
        """The registry's position: the Lance version of its last commit (0: no registry yet)."""
        return self.position()[0]

    def position(self) -> tuple[int, str | None]:
        """(head, the log's identity): a registry rewritten other than by appends (converted,
        recreated) gets a new identity, so a position recorded against the old one is known
        not to be a prefix of this log."""
        ds = self._open()
        if ds is None:
            return 0, None
        got = (ds.schema.metadata or {}).get(LOG_ID_KEY, b"").decode()
        return ds.version, (got or None) if "seq" in ds.schema.names else None

    def entries(
        self, names: Iterable[str] | None = None, *, upto: int | None = None, after: int = 0
    ) -> pa.Table:
        """Entries (of ``names``) with ``after < seq <= upto`` (``upto``: a version read before)."""
        if names is not None and not list(names):
            return LOG_SCHEMA.empty_table()
        ds = self._open(upto)
        if ds is None or "seq" not in ds.schema.names:
            return LOG_SCHEMA.empty_table() if ds is None else _legacy_entries(ds, names)
        where = [w for w in (_names_filter(names), f"seq > {after}" if after else None) if w]
        t = ds.to_table(columns=LOG_SCHEMA.names, filter=" AND ".join(where) or None)
        return t.cast(LOG_SCHEMA)

    def touched(self, after: int, upto: int) -> set[str]:
        """Lists with an entry in ``after < seq <= upto``."""
        if upto <= after:
            return set()
        ds = self._open(upto)
        if ds is None:
            return set()
        if "seq" not in ds.schema.names:
            return set(pc.unique(ds.to_table(columns=["list"])["list"]).to_pylist())
        t = ds.to_table(columns=["list"], filter=f"seq > {after}")
        return set(pc.unique(t["list"]).to_pylist())

    def state(self, names: Iterable[str] | None = None) -> dict[str, pa.Table]:
        return state(self.entries(names))

    def append(self, make: Callable[[int], pa.Table | None]) -> int:
        """Commit ``make(seq)``'s rows at ``seq`` = the version this commit creates.

        Holds the registry's lease, so ``make`` sees every earlier commit (read
        the registry inside it) and nobody commits in between. A failed commit
        is retried with backoff :data:`COMMIT_ATTEMPTS` times, then one error.
        Returns the seq (0: ``make`` had nothing to write).
        """
        import lance

        last: Exception | None = None
        with _lease(_registry_lease_path(self.uri), "skip-list registry writer") as lease:
            for attempt in range(COMMIT_ATTEMPTS):
                ds = self._open()
                if ds is not None and "seq" not in ds.schema.names:
                    self._convert(ds, lease)
                    ds = self._open()
                elif ds is not None and LOG_ID_KEY not in (ds.schema.metadata or {}):
                    lease.check()  # a log from before log identities: give it one (a commit)
                    ds.update_schema_metadata({LOG_ID_KEY.decode(): uuid.uuid4().hex})
                    ds = self._open()
                v = 0 if ds is None else ds.version
                rows = make(v + 1)
                if rows is None or not len(rows):
                    return 0
                rows = rows.replace_schema_metadata(None).cast(LOG_SCHEMA)
                lease.check()  # fenced: no commit after the lease was lost
                try:
                    if ds is None:
                        schema = self._schema()
                        lance.write_dataset(
                            rows.cast(schema), self.uri, mode="create", storage_options=self.options
                        )
                    else:
                        lance.write_dataset(
                            rows, self.uri, mode="append", storage_options=self.options
                        )
                except (OSError, ValueError, RuntimeError) as e:
                    last = e
                    time.sleep(min(2.0, 0.05 * 2**attempt) * (0.5 + random.random()))
                    continue
                got = self.head()
                if got != v + 1:
                    raise ListError(
                        f"{self.uri}: another writer committed without the registry's lease "
                        f"(version {got}, expected {v + 1}); stop it and run this again"
                    )
                return v + 1
        raise ListError(
            f"{self.uri}: the registry commit failed {COMMIT_ATTEMPTS} times ({last}); nothing "
            "of this request was recorded, run it again"
        )

    def _schema(self) -> pa.Schema:
        """The schema of a new log: the table's identity and a new log identity."""
        meta = {"prx.table_id": self.table_id, LOG_ID_KEY.decode(): uuid.uuid4().hex}
        return LOG_SCHEMA.with_metadata(meta)

    def _convert(self, ds, lease: Lease) -> None:
        """Rewrite a registry from before commit ordering as its current state (one commit)."""
        import lance

        old = _legacy_entries(ds, None)
        seq = ds.version + 1
        rows = state(old)
        parts = [
            log_rows(n, t["id"], ADD, t, seq=seq, base=seq, kind=REGISTRY, export="")
            for n, t in rows.items()
        ]
        schema = self._schema()
        lease.check()
        lance.write_dataset(
            concat_entries(parts).cast(schema),
            self.uri,
            mode="overwrite",
            storage_options=self.options,
        )
        log.warning("%s: converted to the commit-ordered log (%d lists)", self.uri, len(rows))


def _legacy_entries(ds, names) -> pa.Table:
    """A registry from before commit ordering: its state by its own (clock) rule, as seq 0."""
    t = ds.to_table(filter=_names_filter(names))
    if not len(t):
        return LOG_SCHEMA.empty_table()
    rank = pc.if_else(pc.equal(t["op"], ADD), 1, 0)
    order = pa.table({"list": t["list"], "id": t["id"], "at": t["at"], "rank": rank})
    order = order.append_column("i", pa.array(np.arange(len(t))))
    order = order.sort_by([("at", "ascending"), ("rank", "descending")])
    # Position in clock order becomes seq, which is what the old rule meant.
    idx = order["i"].to_numpy()
    seq = np.empty(len(t), np.int64)
    seq[idx] = -np.arange(len(t), 0, -1)  # all older than any commit-ordered entry
    n = len(t)
    return pa.table(
        {
            "seq": pa.array(seq),
            "base": pa.array(seq),
            "kind": pa.array(np.zeros(n, np.int8)),
            "list": t["list"],
            "id": t["id"],
            "op": t["op"],
            "at": t["at"],
            "command": t["command"],
            "reason": t["reason"],
            "export": t["export"],
            "host": pa.array([""] * n, pa.string()),
        },
        schema=LOG_SCHEMA,
    )


def _names_filter(names: Iterable[str] | None) -> str | None:
    if names is None:
        return None
    names = sorted(set(names))
    return "list IN (" + ", ".join(f"'{SL.validate_name(n)}'" for n in names) + ")"


__all__ = [
    "COMMIT_ATTEMPTS",
    "LOG_ID_KEY",
    "Registry",
    "TABLE_ID_NAME",
    "canonical",
    "read_table_id",
    "registry_uri",
    "table_identity",
]
