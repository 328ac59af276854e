"""Where a ledger lives and who it is: the corpus ledger's place beside the tables, the
table identity, and the names of a ledger's schema metadata.

Kept apart from :mod:`prx_data.skips.ledger` (the log itself) so that every room that
only needs to *find* a ledger, or a table's identity, reads this page alone.
"""

from __future__ import annotations

import os
import uuid

from prx_data.core import storage
from prx_data.core.errors import NotFound
from prx_data.core.lease import Lease
from prx_data.skips.errors import ListError
from prx_data.skips.log import LOCK_TIMEOUT_S

#: The ledger's folder name beside the corpus's tables.
LEDGER_NAME = "_prx_ledger.lance"
#: Names a ledger for every job that does not get ``--ledger``.
LEDGER_ENV = "PRX_LEDGER"
#: The file in a table folder that holds the table's identity.
TABLE_ID_NAME = "_prx_table_id"
#: Schema metadata keys: the log's identity (a position is only comparable within one
#: log), the ledger's identity and home, and the registries it adopted.
LOG_ID_KEY = b"prx.log_id"
LEDGER_ID_KEY = b"prx.ledger_id"
HOME_KEY = b"prx.ledger_home"
ADOPTED_KEY = b"prx.adopted"
#: Commits tried when the ledger's lease is held but a commit still meets a conflict.
COMMIT_ATTEMPTS = 3


def canonical(uri: str) -> str:
    """A URI with symlinks resolved (local), so every spelling finds one ledger."""
    base = uri.rstrip("/").removeprefix("file://")
    if storage.is_remote(base):
        return base
    return os.path.realpath(base)


def registry_uri(table: str) -> str:
    """The per-table registry of earlier versions: ``photos.lance`` -> ``photos.lists.lance``."""
    base = canonical(table)
    stem = base[: -len(".lance")] if base.endswith(".lance") else base
    return f"{stem}.lists.lance"


def default_ledger_uri(table: str) -> str:
    """The corpus ledger beside ``table``: one per folder of tables."""
    base = canonical(table)
    parent = base.rsplit("/", 1)[0] if "/" in base else "."
    return storage.join(parent, LEDGER_NAME)


def ledger_uri(table: str | None, ledger: str | None = None) -> str:
    """``ledger``, else ``$PRX_LEDGER``, else the ledger beside ``table``."""
    chosen = ledger or os.environ.get(LEDGER_ENV) or None
    if chosen:
        return canonical(chosen)
    if not table:
        raise ListError("no ledger named: pass --ledger URI (or --table, or set PRX_LEDGER)")
    return default_ledger_uri(table)


def lease_path(uri: str) -> str:
    return f"{uri}.lock" if not storage.is_remote(uri) else f"{uri}.lease"


def lease_at(path: str, what: str) -> Lease:
    return Lease(path, what=what, wait_s=LOCK_TIMEOUT_S)


def read_table_id(table: str) -> str | None:
    """The identity recorded in the table folder, or None (no table there, or none recorded)."""
    try:
        text = storage.read_bytes(storage.join(canonical(table), TABLE_ID_NAME)).decode().strip()
    except (FileNotFoundError, NotADirectoryError, UnicodeDecodeError):
        return None
    return text if text and len(text) <= 64 and text.isalnum() else None


def table_identity(table: str) -> str:
    """The table's identity, recorded in its folder on first use (under its own lease)."""
    tid = read_table_id(table)
    if tid is not None:
        return tid
    uri = canonical(table)
    from prx_data.table.lance_ops import open_table

    try:
        open_table(uri)
    except NotFound:
        raise ListError(f"{table}: no Lance table there") from None
    with lease_at(lease_path(registry_uri(uri)), "table identity writer"):
        tid = read_table_id(uri)
        if tid is None:
            tid = uuid.uuid4().hex
            storage.write_bytes_atomic(storage.join(uri, TABLE_ID_NAME), tid.encode())
    return tid


def schema_meta(ds) -> dict[bytes, bytes]:
    return dict(ds.schema.metadata or {}) if ds is not None else {}


def identity_at(uri: str) -> str | None:
    """The identity of the ledger at ``uri`` (None: no ledger there)."""
    from prx_data.table.lance_ops import lance_storage_options, open_table

    try:
        ds = open_table(uri, lance_storage_options(uri))
    except NotFound:
        return None
    return schema_meta(ds).get(LEDGER_ID_KEY, b"").decode() or None


__all__ = [
    "ADOPTED_KEY",
    "COMMIT_ATTEMPTS",
    "HOME_KEY",
    "LEDGER_ENV",
    "LEDGER_ID_KEY",
    "LEDGER_NAME",
    "LOG_ID_KEY",
    "TABLE_ID_NAME",
    "canonical",
    "default_ledger_uri",
    "identity_at",
    "lease_at",
    "lease_path",
    "ledger_uri",
    "read_table_id",
    "registry_uri",
    "schema_meta",
    "table_identity",
]
