"""One export's side of its skip lists: its store files, its state, its own log, its lease.

* **The store** (``_lists/<name>.parquet``): each list's ids with their
  provenance and the kind of entry that decided them
  (:data:`~prx_data.skips.log.STORE_FILE_SCHEMA`).
* **The state** (``_lists/registry``, :class:`ExportState`): which table the
  export's lists come from (its identity and paths) and up to where in the log
  they are materialised (``position``: the registry version; ``local``: the
  last export-only seq).
* **The export-only log** (``_lists/_local.parquet``, :data:`LOCAL_LOG_NAME`):
  the export's own entries (:mod:`prx_data.skips.log`), appended under the
  export's lease (:func:`export_lease`, the same lease export runs hold).
* **The entries that decide the export's lists** (:func:`export_entries`): the
  ledger's up to a position and the export's own.
"""

from __future__ import annotations

import io
import json
import logging
import os
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from prx_data.core import storage
from prx_data.core.lease import Lease
from prx_data.export import layout, naming
from prx_data.export.lock import ExportLock
from prx_data.skips import sidecar as SL
from prx_data.skips.errors import ListError
from prx_data.skips.ledger import (
    Ledger,
)
from prx_data.skips.log import (
    ADD,
    LOCK_TIMEOUT_S,
    LOG_SCHEMA,
    REGISTRY,
    STORE_FILE_SCHEMA,
    STORE_SCHEMA,
    concat_entries,
    conform_entries,
    log_rows,
)

log = logging.getLogger(__name__)

#: The export's own (export-only) log in ``_lists/``.
LOCAL_LOG_NAME = "_local.parquet"
#: Format of ``_lists/registry``.
STATE_FORMAT = 2

# --- the store ---------------------------------------------------------------------------------


def _store_path(root: str, name: str) -> str:
    return storage.join(root, naming.LISTS_DIR, f"{SL.validate_name(name)}.parquet")


def read_store_list(root: str, name: str) -> pa.Table | None:
    path = _store_path(root, name)
    try:
        data = storage.read_bytes(path)
    except FileNotFoundError:
        return None
    try:
        t = pq.read_table(io.BytesIO(data))
        return t.select(STORE_SCHEMA.names).cast(STORE_SCHEMA)
    except (pa.ArrowException, KeyError, ValueError) as e:
        raise ListError(f"{path}: unreadable list store ({e})") from None


def store_names(root: str) -> list[str]:
    names = []
    for rel in storage.list_files(storage.join(root, naming.LISTS_DIR), ".parquet", False):
        stem = rel.replace("\\", "/").rsplit("/", 1)[-1].removesuffix(".parquet")
        if SL.NAME_RE.fullmatch(stem):
            names.append(stem)
    return sorted(names)


def read_store_file(root: str, name: str) -> pa.Table | None:
    """The list's store with each id's kind (None: no store, or one without kinds)."""
    try:
        data = storage.read_bytes(_store_path(root, name))
    except FileNotFoundError:
        return None
    try:
        t = pq.read_table(io.BytesIO(data))
        if "kind" not in t.column_names:
            return None
        return t.select(STORE_FILE_SCHEMA.names).cast(STORE_FILE_SCHEMA)
    except (pa.ArrowException, KeyError, ValueError):
        return None  # the caller rebinds the list, which reports an unreadable store


def read_store(root: str) -> dict[str, pa.Table]:
    return {n: t for n in store_names(root) if (t := read_store_list(root, n)) is not None}


def write_store_list(root: str, name: str, table: pa.Table | None) -> None:
    """Replace the list's store file (None or empty: the list leaves the export)."""
    path = _store_path(root, name)
    if table is None or not len(table):
        storage.delete(path)
        return
    buf = io.BytesIO()
    schema = STORE_FILE_SCHEMA if "kind" in table.column_names else STORE_SCHEMA
    pq.write_table(table.select(schema.names).cast(schema), buf, compression="zstd")
    storage.write_bytes_atomic(path, buf.getvalue())


# --- the state, the export-only log, the lease, the registry ---------------------------------


def _lists_dir(root: str) -> str:
    path = storage.join(root, naming.LISTS_DIR)
    if not storage.is_remote(root) and os.path.islink(path):
        raise ListError(
            f"{path} is a symbolic link; the skip-list store must be a real directory inside "
            "the export: replace the link with a copy of what it points to"
        )
    return path


def _state_path(root: str) -> str:
    return storage.join(_lists_dir(root), naming.LISTS_REF_NAME)


@dataclass
class ExportState:
    """``_lists/registry``: which table the export's lists come from and up to where."""

    table_id: str | None = None
    #: The table's canonical URI, and (local exports) its path relative to the export.
    table: str | None = None
    table_rel: str | None = None
    #: The registry version and the last export-only seq the lists are materialised at.
    position: int = 0
    local: int = 0
    #: {list: where its ids come from} as materialised.
    lists: dict[str, str] = field(default_factory=dict)
    format: int = STATE_FORMAT
    #: The ledger's log identity at ``position`` (:meth:`Ledger.position`).
    log_id: str | None = None
    #: The ledger the export follows: its identity, canonical URI, and (both local) its
    #: path relative to the export.
    ledger_id: str | None = None
    ledger: str | None = None
    ledger_rel: str | None = None
    #: The export's sample count, and {list: {ids, samples, shards}} as materialised.
    total: int | None = None
    counts: dict[str, dict[str, int]] = field(default_factory=dict)
    #: Set while a materialisation writes: the forms may be between two positions, so the
    #: next one rebinds every list.
    dirty: bool = False

    def to_json(self) -> bytes:
        return json.dumps(self.__dict__, sort_keys=True).encode()

    def copy(self, **kw) -> ExportState:
        """A copy (its own ``lists`` and ``counts``) with the fields in ``kw`` replaced."""
        out = ExportState(
            **{**self.__dict__, "lists": dict(self.lists), "counts": dict(self.counts)}
        )
        for k, v in kw.items():
            setattr(out, k, v)
        return out


def read_state(root: str) -> ExportState | None:
    """The export's list state (None: none; ``format`` 1: written before the log, a hint only)."""
    try:
        obj = json.loads(storage.read_bytes(_state_path(root)))
    except FileNotFoundError:
        return None
    except ValueError as e:
        raise ListError(
            f"{_state_path(root)}: unreadable ({e}); delete it and pass --table"
        ) from None
    if not isinstance(obj, dict):
        raise ListError(f"{_state_path(root)}: not a list state; delete it and pass --table")
    if obj.get("format") != STATE_FORMAT:
        return ExportState(format=1)  # an old reference ({"registry": path}): never trusted
    st = ExportState()
    for k, typ in (
        ("table_id", str),
        ("table", str),
        ("table_rel", str),
        ("ledger_id", str),
        ("ledger", str),
        ("ledger_rel", str),
    ):
        v = obj.get(k)
        setattr(st, k, v if isinstance(v, typ) else None)
    for k in ("position", "local"):
        v = obj.get(k)
        setattr(st, k, v if isinstance(v, int) and v >= 0 else 0)
    lists = obj.get("lists")
    st.lists = {str(k): str(v) for k, v in lists.items()} if isinstance(lists, dict) else {}
    v = obj.get("log_id")
    st.log_id = v if isinstance(v, str) and v else None
    v = obj.get("total")
    st.total = v if isinstance(v, int) and v >= 0 else None
    counts = obj.get("counts")
    if isinstance(counts, dict):
        for n, c in counts.items():
            if isinstance(c, dict) and all(
                isinstance(c.get(k), int) and c[k] >= 0 for k in ("ids", "samples", "shards")
            ):
                st.counts[str(n)] = {k: c[k] for k in ("ids", "samples", "shards")}
    st.dirty = obj.get("dirty") is not False  # absent in a state from before: not trusted
    return st


def write_state(root: str, st: ExportState) -> None:
    storage.write_bytes_atomic(_state_path(root), st.to_json())


def _rel(root: str, uri: str) -> str | None:
    if storage.is_remote(root) or storage.is_remote(uri):
        return None
    return os.path.relpath(uri, os.path.realpath(root))


def state_for(root: str, led: Ledger) -> ExportState:
    """The export's state (a new one when it has none of this format) bound to ``led``: the
    ledger's identity and place, and the table the job works on (when it names one)."""
    st = read_state(root)
    st = ExportState() if st is None or st.format != STATE_FORMAT else st
    if led.table:
        st.table_id, st.table, st.table_rel = led.table_id, led.table, _rel(root, led.table)
    st.ledger_id, st.ledger, st.ledger_rel = led.identity, led.uri, _rel(root, led.uri)
    return st


#: ``base`` of an export-only entry made while the export's ledger was out of reach: newer
#: than everything until the export next meets its ledger, which rebases it to its head.
PENDING_BASE = 1 << 62


def rebase_local(root: str, lease: Lease, led: Ledger, st: ExportState | None) -> None:
    """Place the export's own entries in ``led``'s order at the export's first contact with
    it (an export bound to a per-table registry of an earlier version) and wherever an entry
    was made while the ledger was out of reach (:data:`PENDING_BASE`)."""
    local = read_local(root)
    if not len(local):
        return
    base = local["base"].to_numpy().copy()
    head = led.head()
    first = st is not None and st.format == STATE_FORMAT and st.ledger_id is None
    if first:
        at = led.adopted().get(st.log_id or "", head)
        base[(base >= 0) & (base < PENDING_BASE)] = at
    base[base >= PENDING_BASE] = head
    if (base == local["base"].to_numpy()).all():
        return
    lease.check()
    _write_local(
        root, local.set_column(local.schema.get_field_index("base"), "base", pa.array(base))
    )


def _local_path(root: str) -> str:
    return storage.join(_lists_dir(root), LOCAL_LOG_NAME)


def read_local(root: str) -> pa.Table:
    """The export's own (export-only) entries."""
    path = _local_path(root)
    try:
        data = storage.read_bytes(path)
    except FileNotFoundError:
        return LOG_SCHEMA.empty_table()
    try:
        return conform_entries(pq.read_table(io.BytesIO(data)))
    except (pa.ArrowException, KeyError, ValueError) as e:
        raise ListError(f"{path}: unreadable export-only list log ({e})") from None


def _write_local(root: str, t: pa.Table) -> None:
    buf = io.BytesIO()
    pq.write_table(t.cast(LOG_SCHEMA), buf, compression="zstd")
    storage.write_bytes_atomic(_local_path(root), buf.getvalue())


def append_local(root: str, lease: Lease, rows: Callable[[int], pa.Table]) -> int:
    """Append export-only entries at the next local seq (the export's lease is held)."""
    have = read_local(root)
    seq = int(pc.max(have["seq"]).as_py() or 0) + 1 if len(have) else 1
    new = rows(seq)
    if not len(new):
        return 0
    lease.check()
    _write_local(root, concat_entries([have, new]))
    return seq


def export_lease(root: str) -> ExportLock:
    """The export's lease (the same one export runs hold), waited for by list updates."""
    _lists_dir(root)
    return ExportLock(root, wait_s=LOCK_TIMEOUT_S, what="skip-list update or export run")


def export_entries(
    root: str, reg: Ledger | None, names: Iterable[str] | None, upto: int | None = None
) -> tuple[pa.Table, int]:
    """(entries that decide the export's lists, the ledger position they stand for).

    Without a reachable ledger, an export that was materialised from one keeps
    what it holds: its stores stand for the ledger at the recorded position.
    """
    st = read_state(root)
    st = None if st is None or st.format != STATE_FORMAT else st
    local = read_local(root)
    if names is not None:
        want = pa.array(sorted(set(names)), pa.string())
        local = local.filter(pc.is_in(local["list"], value_set=want))
    if reg is not None:
        head = reg.head() if upto is None else upto
        got = reg.entries(names, upto=head) if head else LOG_SCHEMA.empty_table()
        return concat_entries([got, local]), head
    if st is None or not (st.table_id or st.ledger_id):
        return local, st.position if st else 0
    p = st.position
    snap = [
        log_rows(n, t["id"], ADD, t, seq=p, base=p, kind=REGISTRY, export=root)
        for n in store_names(root)
        if (names is None or n in set(names)) and (t := read_store_list(root, n)) is not None
    ]
    return concat_entries([*snap, local]), p


def samples_total(root: str) -> int:
    return sum(s.samples for b in layout.list_buckets(root) for s in layout.read_index(root, b))


def sidecar_names(root: str) -> set[str]:
    names: set[str] = set()
    if not storage.exists(root):
        return names
    for bucket in layout.list_buckets(root):
        names |= set(SL.list_sidecars(root, bucket, layout.read_index(root, bucket)))
    return names


__all__ = [
    "ExportState",
    "LOCAL_LOG_NAME",
    "PENDING_BASE",
    "STATE_FORMAT",
    "append_local",
    "export_entries",
    "export_lease",
    "read_local",
    "read_state",
    "read_store",
    "read_store_file",
    "read_store_list",
    "rebase_local",
    "samples_total",
    "sidecar_names",
    "state_for",
    "store_names",
    "write_state",
    "write_store_list",
]
