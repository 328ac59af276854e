"""Skip lists as one append-only log per table, and every export's lists derived from it.

A skip list is a set of row ids (the Lance ``id``). There is one source of
truth and everything else is derived from it:

* **The log.** Every change is an entry ``(seq, base, kind, list, id, op)``
  with ``op`` ``add`` or ``remove``. An id's state in a list is its *latest*
  entry; "latest" is the order ``(base, kind, seq)`` and never a clock
  (``at``, ``host``, ``command``, ``reason`` are kept as information only).

  - *Registry entries* (``kind`` 0) live in the table's registry, a small
    Lance table next to the table (``data/photos.lance`` ->
    ``data/photos.lists.lance``, resolved through ``realpath``). An append
    holds the registry's lease (:mod:`prx_data.core.lease`), reads the
    registry's Lance version ``v`` and commits its rows with ``seq = base =
    v + 1``, which is exactly the version that commit creates: commit order
    is the order, whatever the writers' clocks say.
  - *Export-only entries* (``kind`` 1) live in one export
    (``_lists/_local.parquet``): ``seq`` is that export's own counter, taken
    under its lease, and ``base`` is the registry version the change was made
    after. So an export-only change is newer than every registry entry it saw
    and older than every later one. Lists recovered from sidecars or from a
    store written before the log existed are imported as export-only adds
    with ``base = -1``: older than any registry entry.

* **The materialisation.** An export's ``_lists/<name>.parquet`` (the ids)
  and its ``.skip`` sidecars (the ids bound to sample positions through the
  export's id index) are a function of the log up to a position recorded in
  ``_lists/registry`` (``position``: the registry version; ``local``: the
  last export-only seq). :func:`materialise` runs under the export's lease
  and reads the log *after* taking it, so two of them, or one and a list
  update, cannot interleave; it is idempotent and rewrites or deletes every
  form of each list it touches (store file and sidecars), so a list the log
  emptied stops being skipped everywhere.

* **Identity.** A table's identity is a random id in the table folder
  (``_prx_table_id``), recorded in its registry's schema metadata and in each
  export's ``_lists/registry``. An export finds its registry from the table
  paths it recorded (relative to the export first, then absolute), or from
  ``--table``, which always wins; a path only counts when the table there
  has the export's identity. A reference read from an export never decides
  alone which registry is written: an export whose recorded table is not
  found (or has another identity) is refused for writes unless
  ``--export-only`` or ``--table`` says where they go.

* **Carrying.** ``write_mds --overwrite`` and ``skips rewrite`` carry the old
  tree's export-only entries into the registry, each only where the registry
  holds nothing newer for that id (:func:`carry`).

Ids are bound to shards through the export's id index
(:mod:`prx_data.export.idindex`: a BTREE lookup of the lists' ids only). An
export without a current index falls back, with one log line, to reading one
bucket's manifests at a time, in batches of at most :data:`BIND_BATCH_ROWS`
rows. Either way memory is bounded by the lists and a batch, not by the export.
"""

from __future__ import annotations

import datetime as dt
import io
import json
import logging
import os
import random
import socket
import time
import uuid
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from prx_data.core import storage
from prx_data.core.errors import NotFound, OutOfRange, PrxDataError, UnknownName
from prx_data.core.lease import Lease
from prx_data.core.schema import MANIFEST_NAME, REPORT_NAME
from prx_data.export import bounded, idindex, layout, naming, safety
from prx_data.export.lock import ExportLock
from prx_data.skips import sidecar as SL

log = logging.getLogger(__name__)

#: Manifest rows looked up at once (about 100 MB of ids at 10^6 rows).
BIND_BATCH_ROWS = 1 << 20
#: How long a list update waits for another writer of the same export or registry.
LOCK_TIMEOUT_S = SL.LOCK_TIMEOUT_S
#: Registry commits tried before giving up with one error (after backoff).
COMMIT_ATTEMPTS = 8
#: A list that leaves out more than this share of an export is reported with a warning.
WARN_SHARE = 0.10
#: The file in a table folder that holds the table's identity.
TABLE_ID_NAME = "_prx_table_id"
#: The export's own (export-only) log.
LOCAL_LOG_NAME = SL.LOCAL_LOG_NAME
#: Format of ``_lists/registry``.
STATE_FORMAT = 2
#: Schema metadata key of the registry's log identity (see :meth:`Registry.position`).
LOG_ID_KEY = b"prx.log_id"

TS = pa.timestamp("us", tz="UTC")
STORE_SCHEMA = pa.schema(
    [("id", pa.string()), ("added", TS), ("command", pa.string()), ("reason", pa.string())]
)
LOG_SCHEMA = pa.schema(
    [
        ("seq", pa.int64()),
        ("base", pa.int64()),
        ("kind", pa.int8()),
        ("list", pa.string()),
        ("id", pa.string()),
        ("op", pa.string()),
        ("at", TS),
        ("command", pa.string()),
        ("reason", pa.string()),
        ("export", pa.string()),
        ("host", pa.string()),
    ]
)
#: The store file also keeps each id's kind (the entry that decided it), so an update can
#: rewrite it from the entries since the recorded position alone (:func:`materialise`).
STORE_FILE_SCHEMA = STORE_SCHEMA.append(pa.field("kind", pa.int8()))
REGISTRY, EXPORT_ONLY = 0, 1
ADD, REMOVE = "add", "remove"


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


@dataclass(frozen=True)
class Provenance:
    """Who added ids to a list, and why (stored with every id)."""

    command: str
    reason: str = ""
    at: dt.datetime = field(default_factory=lambda: dt.datetime.now(dt.UTC))


def _unique_ids(ids: Iterable[str] | pa.Array | pa.ChunkedArray) -> pa.Array:
    if isinstance(ids, pa.ChunkedArray):
        arr = ids.combine_chunks()
    elif isinstance(ids, pa.Array):
        arr = ids
    else:
        arr = pa.array(list(ids), pa.string())
    arr = arr.cast(pa.string())
    arr = pc.drop_null(arr)
    arr = arr.filter(pc.not_equal(arr, ""))
    return pc.unique(arr).sort()


def store_table(ids: pa.Array, prov: Provenance) -> pa.Table:
    n = len(ids)
    return pa.table(
        {
            "id": ids,
            "added": pa.array([prov.at] * n, STORE_SCHEMA.field("added").type),
            "command": pa.array([prov.command] * n, pa.string()),
            "reason": pa.array([prov.reason] * n, pa.string()),
        },
        schema=STORE_SCHEMA,
    )


def merge_store(*tables: pa.Table) -> pa.Table:
    """Union by id; an id keeps its earliest provenance. Sorted by id."""
    tables = [t.select(STORE_SCHEMA.names).cast(STORE_SCHEMA) for t in tables if t is not None]
    if not tables:
        return STORE_SCHEMA.empty_table()
    t = pa.concat_tables(tables)
    if not len(t):
        return t
    return _first_per_id(t.sort_by([("id", "ascending"), ("added", "ascending")]))


def _first_per_id(t: pa.Table) -> pa.Table:
    """Rows of a table sorted by id where the id differs from the previous row's."""
    ids = t["id"].combine_chunks()
    if len(ids) < 2:
        return t
    keep = np.ones(len(ids), bool)
    keep[1:] = pc.not_equal(ids.slice(1), ids.slice(0, len(ids) - 1)).to_numpy(zero_copy_only=False)
    return t.filter(pa.array(keep))


def log_rows(
    name: str,
    ids: pa.Array,
    op: str,
    prov: Provenance | pa.Table,
    *,
    seq: int,
    base: int,
    kind: int,
    export: str,
) -> pa.Table:
    """Log entries for ``ids`` (``prov``: one provenance, or a store table of per-id ones)."""
    n = len(ids)
    if isinstance(prov, pa.Table):
        at, command, reason = prov["added"], prov["command"], prov["reason"]
    else:
        at = pa.array([prov.at] * n, TS)
        command = pa.array([prov.command] * n, pa.string())
        reason = pa.array([prov.reason] * n, pa.string())
    return pa.table(
        {
            "seq": pa.array(np.full(n, seq, np.int64)),
            "base": pa.array(np.full(n, base, np.int64)),
            "kind": pa.array(np.full(n, kind, np.int8)),
            "list": pa.array([name] * n, pa.string()),
            "id": ids.cast(pa.string()),
            "op": pa.array([op] * n, pa.string()),
            "at": at,
            "command": command,
            "reason": reason,
            "export": pa.array([export] * n, pa.string()),
            "host": pa.array([socket.gethostname()] * n, pa.string()),
        },
        schema=LOG_SCHEMA,
    )


def _concat(tables: Sequence[pa.Table]) -> pa.Table:
    tables = [t.select(LOG_SCHEMA.names).cast(LOG_SCHEMA) for t in tables if t is not None]
    return pa.concat_tables(tables) if tables else LOG_SCHEMA.empty_table()


def latest(entries: pa.Table) -> pa.Table:
    """The latest entry of every (list, id), by ``(base, kind, seq)`` (see the module docstring)."""
    if not len(entries):
        return entries
    t = entries.sort_by(
        [
            ("list", "ascending"),
            ("id", "ascending"),
            ("base", "descending"),
            ("kind", "descending"),
            ("seq", "descending"),
        ]
    )
    key = pc.binary_join_element_wise(t["list"], t["id"], "\x00").combine_chunks()
    keep = np.ones(len(key), bool)
    if len(key) > 1:
        keep[1:] = pc.not_equal(key.slice(1), key.slice(0, len(key) - 1)).to_numpy(
            zero_copy_only=False
        )
    return t.filter(pa.array(keep))


def state(entries: pa.Table, *, kinds: bool = False) -> dict[str, pa.Table]:
    """{list: store table} of the ids whose latest entry is ``add`` (empty lists left out);
    ``kinds``: with each id's ``kind`` (registry or export-only), as the store file keeps it."""
    last = latest(entries)
    if not len(last):
        return {}
    last = last.filter(pc.equal(last["op"], ADD))
    out = {}
    schema = STORE_FILE_SCHEMA if kinds else STORE_SCHEMA
    for name in sorted(pc.unique(last["list"]).to_pylist()):
        rows = last.filter(pc.equal(last["list"], name)).sort_by("id")
        out[name] = _store_rows(rows, schema)
    return out


def _store_rows(rows: pa.Table, schema: pa.Schema = STORE_SCHEMA) -> pa.Table:
    """Log entries (latest ``add`` per id) as store rows."""
    cols = {"id": rows["id"], "added": rows["at"], "command": rows["command"]}
    cols["reason"] = rows["reason"]
    if "kind" in schema.names:
        cols["kind"] = rows["kind"]
    return pa.table(cols, schema=schema)


def _source_text(kinds: Iterable[int]) -> str:
    kinds = set(kinds)
    return ", ".join(
        w for k, w in ((REGISTRY, "registry"), (EXPORT_ONLY, "export-only")) if k in kinds
    )


def _names_filter(names: Iterable[str] | None) -> str | None:
    if names is None:
        return None
    names = sorted(set(names))
    return "list IN (" + ", ".join(f"'{SL.validate_name(n)}'" for n in names) + ")"


# --- table identity and the registry ---------------------------------------------------------


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
            _concat(parts).cast(schema), self.uri, mode="overwrite", storage_options=self.options
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


# --- the export's store ----------------------------------------------------------------------


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


def _read_store_file(root: str, name: str) -> pa.Table | None:
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


# --- the export's side: its state, its own log, its registry ---------------------------------


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
    #: The registry's log identity at ``position`` (:meth:`Registry.position`).
    log_id: str | None = None
    #: The export's sample count, and {list: {ids, samples, shards}} as materialised.
    total: int | None = None
    counts: dict[str, dict[str, int]] = field(default_factory=dict)
    #: Set while a materialisation writes: the forms may be between two positions, so the
    #: next one rebinds every list.
    dirty: bool = False

    def to_json(self) -> bytes:
        return json.dumps(self.__dict__, sort_keys=True).encode()


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
    for k, typ in (("table_id", str), ("table", str), ("table_rel", str)):
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
        return pq.read_table(io.BytesIO(data)).select(LOG_SCHEMA.names).cast(LOG_SCHEMA)
    except (pa.ArrowException, KeyError, ValueError) as e:
        raise ListError(f"{path}: unreadable export-only list log ({e})") from None


def _write_local(root: str, t: pa.Table) -> None:
    buf = io.BytesIO()
    pq.write_table(t.cast(LOG_SCHEMA), buf, compression="zstd")
    storage.write_bytes_atomic(_local_path(root), buf.getvalue())


def _append_local(root: str, lease: Lease, rows: Callable[[int], pa.Table]) -> int:
    """Append export-only entries at the next local seq (the export's lease is held)."""
    have = read_local(root)
    seq = int(pc.max(have["seq"]).as_py() or 0) + 1 if len(have) else 1
    new = rows(seq)
    if not len(new):
        return 0
    lease.check()
    _write_local(root, _concat([have, new]))
    return seq


def export_lease(root: str) -> ExportLock:
    """The export's lease (the same one export runs hold), waited for by list updates."""
    _lists_dir(root)
    return ExportLock(root, wait_s=LOCK_TIMEOUT_S, what="skip-list update or export run")


def _candidates(root: str, st: ExportState | None) -> list[str]:
    out = []
    if st is not None and st.table_rel and not storage.is_remote(root):
        out.append(os.path.normpath(os.path.join(root, st.table_rel)))
    if st is not None and st.table:
        out.append(st.table)
    cfg_table = table_of(root)
    if cfg_table:
        out.append(cfg_table)
    seen, uniq = set(), []
    for c in out:
        if c not in seen:
            seen.add(c)
            uniq.append(c)
    return uniq


def resolve(
    root: str, table: str | None = None, *, export_only: bool = False, strict: bool = True
) -> Registry | None:
    """The registry the export's lists are recorded in (None: export-only).

    ``table`` always wins (an export that recorded another table's identity is
    refused). Otherwise a path the export recorded counts only when the table
    there has the identity the export recorded; an export that names a table
    which is not found is refused when ``strict`` (writes: pass ``--table`` or
    ``--export-only``) and export-only otherwise. An export that names no table
    (made without one, or received without its identity) is export-only.
    """
    if export_only:
        return None
    st = read_state(root) if storage.exists(root) else None
    recorded = st.table_id if st is not None else None
    if table:
        tid = table_identity(table)
        if recorded and recorded != tid:
            raise ListError(
                f"{root} holds the lists of another table (identity {recorded}; {table} is "
                f"{tid}); pass the table it was exported from, or --export-only"
            )
        return Registry(table, tid)
    names = _candidates(root, st)
    if recorded:
        for c in names:
            if read_table_id(c) == recorded:
                return Registry(c, recorded)
    if not names:
        return None
    if not strict:
        log.warning("%s: its table is not found with its identity; lists are export-only", root)
        return None
    why = (
        f"was exported from table {recorded} (last seen at {names[0]}), which is not found there"
        if recorded
        else f"names table {names[0]} but records no identity of it (written before tables had "
        "one, or received from elsewhere)"
    )
    raise ListError(
        f"{root} {why}, so the change cannot be recorded in its registry: pass --table URI "
        "(where the table lives now), or --export-only to change only this export"
    )


def _bind_state(root: str, reg: Registry) -> ExportState:
    st = read_state(root)
    st = ExportState() if st is None or st.format != STATE_FORMAT else st
    st.table_id, st.table = reg.table_id, reg.table
    st.table_rel = (
        os.path.relpath(reg.table, os.path.realpath(root))
        if not storage.is_remote(root) and not storage.is_remote(reg.table)
        else None
    )
    return st


# --- the materialisation ----------------------------------------------------------------------


def _sidecar_names(root: str) -> set[str]:
    names: set[str] = set()
    if not storage.exists(root):
        return names
    for bucket in layout.list_buckets(root):
        names |= set(SL.list_sidecars(root, bucket, layout.read_index(root, bucket)))
    return names


def _unlogged(root: str, st: ExportState | None, drop=()) -> dict[str, pa.Table]:
    """Lists the log does not know: held only in sidecars, or in a store from before the log."""
    if not storage.exists(root):
        return {}
    local_lists = set(pc.unique(read_local(root)["list"]).to_pylist())
    forms = _sidecar_names(root)
    if st is None or st.format != STATE_FORMAT:
        forms |= set(store_names(root))
        known: set[str] = set()
    else:
        known = set(st.lists)  # a materialised export's stores are derived, not a source
    unknown = forms - known - local_lists - set(drop)
    if not unknown:
        return {}
    found = collect(root, drop=set(drop) | (forms - unknown))
    return {n: t for n, t in sorted(found.items()) if n in unknown and len(t)}


def _import_rows(found: Mapping[str, pa.Table], seq: int, root: str) -> pa.Table:
    return _concat(
        [
            log_rows(n, t["id"], ADD, t, seq=seq, base=-1, kind=EXPORT_ONLY, export=root)
            for n, t in sorted(found.items())
        ]
    )


def _import_unlogged(root: str, lease: Lease, drop=()) -> int:
    """Record lists the log does not know as export-only adds with ``base = -1``: older than
    every registry entry, so the log decides wherever it holds anything about an id."""
    found = _unlogged(root, read_state(root), drop)
    if found:
        _append_local(root, lease, lambda seq: _import_rows(found, seq, root))
        log.warning("%s: recorded list(s) the log did not hold yet: %s", root, sorted(found))
    return len(found)


def _export_entries(
    root: str, reg: Registry | None, names: Iterable[str] | None, upto: int | None = None
) -> tuple[pa.Table, int]:
    """(entries that decide the export's lists, the registry position they stand for).

    Without a reachable registry, an export that was materialised from one keeps
    what it holds: its stores stand for the registry at the recorded position.
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
        return _concat([got, local]), head
    if st is None or not st.table_id:
        return local, st.position if st else 0
    p = st.position
    snap = [
        log_rows(n, t["id"], ADD, t, seq=p, base=p, kind=REGISTRY, export=root)
        for n in store_names(root)
        if (names is None or n in set(names)) and (t := read_store_list(root, n)) is not None
    ]
    return _concat([*snap, local]), p


def _samples_total(root: str) -> int:
    return sum(s.samples for b in layout.list_buckets(root) for s in layout.read_index(root, b))


def materialise(
    root: str,
    reg: Registry | None,
    lease: Lease,
    *,
    names: Iterable[str] | None = None,
    full: bool = False,
    missing: dict[str, pa.Array] | None = None,
) -> dict[str, dict]:
    """Make the export's lists the state of the log (registry up to its head, and the export's
    own entries); the export's ``lease`` must be held. Touches the lists changed since the
    recorded position, ``names``, and (``full``) every list. Returns
    ``{list: {ids, samples, shards, share, source}}`` for the lists it wrote.

    A touched list is updated from the entries after the recorded position alone (only
    those ids are bound, only their shards' sidecars rewritten) when that position is a
    known prefix of the log (:func:`_delta_lists`); otherwise, and with ``full``, it is
    rebound whole from the log.
    """
    old = read_state(root)
    old = old if old is not None and old.format == STATE_FORMAT else None
    st = _bind_state(root, reg) if reg is not None else (old or ExportState())
    if reg is not None:
        head, log_id = reg.position()
    else:
        head, log_id = st.position, st.log_id
    local = read_local(root)
    local_seq = int(pc.max(local["seq"]).as_py() or 0) if len(local) else 0
    if full or (not st.lists and not names):
        touched = None
    else:
        touched = set(names or ())
        if reg is not None:
            touched |= reg.touched(st.position, head)
        if local_seq > st.local:
            newer = local.filter(pc.greater(local["seq"], st.local))
            touched |= set(pc.unique(newer["list"]).to_pylist())
    delta = _delta_lists(old, reg, head, log_id, local, touched)
    if old is not None and (touched is None or touched):
        lease.check()
        write_state(root, _replace_state(old, dirty=True))  # cleared by the last write below
    total = old.total if delta and old is not None and old.total is not None else None
    total = _samples_total(root) if total is None else total
    report: dict[str, dict] = {}
    rebind = None if touched is None else touched - delta
    if delta:
        done, failed = _apply_changes(
            root, reg, lease, old, st, head, local, delta, set(names or ()), missing, total
        )
        report.update(done)
        rebind = (rebind or set()) | failed
    if rebind is None or rebind:
        report.update(_rebind(root, reg, lease, st, head, rebind, names, missing, total))
    st.position, st.local = head, max(st.local, local_seq)
    st.log_id, st.total, st.dirty = log_id, total, False
    st.counts = {n: c for n, c in st.counts.items() if n in st.lists}
    lease.check()
    write_state(root, st)
    return report


def _replace_state(st: ExportState, **kw) -> ExportState:
    out = ExportState(**{**st.__dict__, "lists": dict(st.lists), "counts": dict(st.counts)})
    for k, v in kw.items():
        setattr(out, k, v)
    return out


def _delta_lists(
    old: ExportState | None,
    reg: Registry | None,
    head: int,
    log_id: str | None,
    local: pa.Table,
    touched: set[str] | None,
) -> set[str]:
    """The touched lists whose materialised form can be brought to ``head`` from the entries
    after the recorded position alone.

    That holds when every such entry is ordered after every entry the forms already
    reflect: registry entries after ``position`` are (their ``base`` is their commit), and
    export-only entries after ``local`` are when their ``base`` is at least ``position``
    and the earlier ones' at most (an import of an unlogged list has ``base = -1``: it is
    older than the registry, so that list is rebound). Everything is rebound when the
    position is not a known prefix of this log (no state, another table, another log
    identity, a position past the head), or a materialisation was interrupted (``dirty``).
    """
    if touched is None or old is None or old.dirty or old.total is None:
        return set()
    p = old.position
    if reg is not None and (
        old.table_id != reg.table_id or not log_id or old.log_id != log_id or p > head
    ):
        return set()
    bad: set[str] = set()
    if len(local):
        seq, base = local["seq"], local["base"]
        early = pc.and_(pc.less_equal(seq, old.local), pc.greater(base, p))
        late = pc.and_(pc.greater(seq, old.local), pc.less(base, p))
        bad = set(pc.unique(local.filter(pc.or_(early, late))["list"]).to_pylist())
    return {n for n in touched - bad if n not in old.lists or n in old.counts}


def _apply_changes(
    root: str,
    reg: Registry | None,
    lease: Lease,
    old: ExportState,
    st: ExportState,
    head: int,
    local: pa.Table,
    names: set[str],
    asked: set[str],
    missing: dict[str, pa.Array] | None,
    total: int,
) -> tuple[dict[str, dict], set[str]]:
    """Bring ``names`` from the recorded position to ``head`` by their entries since then.

    Returns (report rows, lists that could not be updated so and must be rebound: a store
    without kinds, a sidecar that does not match its shard)."""
    got = [reg.entries(names, upto=head, after=old.position)] if reg is not None and head else []
    mine = local.filter(
        pc.and_(
            pc.greater(local["seq"], old.local),
            pc.is_in(local["list"], value_set=pa.array(sorted(names), pa.string())),
        )
    )
    last = latest(_concat([*got, mine]))
    changes = {n: last.filter(pc.equal(last["list"], n)) for n in names} if len(last) else {}
    keys: dict[str, pa.Array] = {}
    for n, c in changes.items():
        keys[f"+{n}"] = c.filter(pc.equal(c["op"], ADD))["id"].combine_chunks()
        keys[f"-{n}"] = c.filter(pc.equal(c["op"], REMOVE))["id"].combine_chunks()
    want = [f"+{n}" for n in sorted(asked & set(changes))] if missing is not None else []
    bound = bind(root, keys, want_missing=want)
    report: dict[str, dict] = {}
    failed: set[str] = set()
    for n in sorted(names):
        c = changes.get(n)
        if c is None or not len(c):
            if n in old.lists:
                report[n] = _report_row(old.counts[n], total, old.lists[n])
            continue
        have = STORE_FILE_SCHEMA.empty_table()
        if n in old.lists:
            have = _read_store_file(root, n)
            if have is None:
                failed.add(n)
                continue
        keep = have.filter(pc.invert(pc.is_in(have["id"], value_set=c["id"].combine_chunks())))
        adds = c.filter(pc.equal(c["op"], ADD))
        new = pa.concat_tables([keep, _store_rows(adds, STORE_FILE_SCHEMA)]).sort_by("id")
        lease.check()  # fenced: nothing is written after the lease was lost
        try:
            d_samples, d_shards = _patch_sidecars(
                root, n, bound[f"+{n}"].positions, bound[f"-{n}"].positions, lease
            )
        except SL.SkipListError as e:
            log.warning("%s: list %r is rebound whole (%s)", root, n, e)
            failed.add(n)
            continue
        write_store_list(root, n, new)
        if want and f"+{n}" in want and bound[f"+{n}"].missing is not None:
            missing[n] = bound[f"+{n}"].missing
        was = old.counts.get(n, {"ids": 0, "samples": 0, "shards": 0})
        if not len(new):
            st.lists.pop(n, None)
            st.counts.pop(n, None)
            continue
        st.lists[n] = _source_text(pc.unique(new["kind"]).to_pylist())
        st.counts[n] = {
            "ids": len(new),
            "samples": was["samples"] + d_samples,
            "shards": was["shards"] + d_shards,
        }
        report[n] = _report_row(st.counts[n], total, st.lists[n])
    return report, failed


def _report_row(counts: Mapping[str, int], total: int, source: str) -> dict:
    return {
        "ids": counts["ids"],
        "samples": counts["samples"],
        "shards": counts["shards"],
        "share": round(counts["samples"] / total, 6) if total else 0.0,
        "source": source,
    }


def _patch_sidecars(
    root: str,
    name: str,
    add: Mapping[tuple[str, str], np.ndarray],
    remove: Mapping[tuple[str, str], np.ndarray],
    lease: Lease,
) -> tuple[int, int]:
    """Add and remove sample positions in the list's sidecars of those shards only.

    Returns (change in samples skipped, change in shards with a sidecar)."""
    indexes: dict[str, dict[str, layout.ShardInfo]] = {}
    positions: dict[tuple[str, str], np.ndarray] = {}
    existing: set[tuple[str, str]] = set()
    d_samples = d_shards = 0
    for key in sorted(set(add) | set(remove)):
        bucket, shard = key
        if bucket not in indexes:
            indexes[bucket] = {s.basename: s for s in layout.read_index(root, bucket)}
        try:
            was = SL.read_sidecar(root, bucket, indexes[bucket][shard], name).indices
            was = was.astype(np.int64)
            existing.add(key)
        except FileNotFoundError:
            was = np.zeros(0, np.int64)
        now = np.setdiff1d(was, remove.get(key, np.zeros(0, np.int64)))
        now = np.union1d(now, add.get(key, np.zeros(0, np.int64)))
        positions[key] = now
        d_samples += len(now) - len(was)
        d_shards += int(len(now) > 0) - int(len(was) > 0)
    lease.check()
    SL.write_skips(root, name, positions, replace=True, existing=existing)
    return d_samples, d_shards


def _rebind(
    root: str,
    reg: Registry | None,
    lease: Lease,
    st: ExportState,
    head: int,
    names: set[str] | None,
    asked: Iterable[str] | None,
    missing: dict[str, pa.Array] | None,
    total: int,
) -> dict[str, dict]:
    """Rebind ``names`` (None: every list any form of the export holds) whole from the log."""
    entries, _ = _export_entries(root, reg, names, upto=head)
    lists = state(entries, kinds=True)
    if names is None:
        # Every list any form of the export holds: those the log emptied are cleared.
        names = set(lists) | set(st.lists) | set(store_names(root)) | _sidecar_names(root)
    want = sorted(set(asked or ()) & set(lists)) if missing is not None else []
    bound = bind(root, {n: t["id"].combine_chunks() for n, t in lists.items()}, want_missing=want)
    if missing is not None:
        missing.update({n: bound[n].missing for n in want if bound[n].missing is not None})
    report: dict[str, dict] = {}
    for n in sorted(names):
        lease.check()  # fenced: nothing is written after the lease was lost
        t = lists.get(n)
        write_store_list(root, n, t)
        positions = bound[n].positions if t is not None else {}
        w = write_sidecars(root, n, positions, replace=True, lock=lease)
        if t is None:
            st.lists.pop(n, None)
            st.counts.pop(n, None)
            continue
        st.lists[n] = _source_text(pc.unique(t["kind"]).to_pylist())
        st.counts[n] = {"ids": len(t), "samples": bound[n].samples, "shards": w["shards_written"]}
        report[n] = _report_row(st.counts[n], total, st.lists[n])
    return report


def applied(root: str) -> dict[str, dict]:
    """{list: {ids, samples, share, source}} of every list the export holds now."""
    st = read_state(root)
    total = _samples_total(root)
    out = {}
    stats = SL.skip_stats(root)
    for n in store_names(root):
        t = read_store_list(root, n)
        samples = sum(r.skipped for r in stats.get(n, []))
        out[n] = {
            "ids": 0 if t is None else len(t),
            "samples": samples,
            "share": samples / total if total else 0.0,
            "source": (st.lists.get(n, "") if st is not None else "") or "sidecars",
        }
    return out


def share_warning(name: str, share: float, root: str) -> str | None:
    """The warning for a list that leaves out more than :data:`WARN_SHARE` of an export."""
    if share <= WARN_SHARE:
        return None
    return (
        f"warning: list {name!r} leaves out {100 * share:.1f}% of {root} (above "
        f"{100 * WARN_SHARE:.0f}%); if it came from a trial, undo it with: python -m "
        f"prx_data.skips remove {root} {name}"
    )


# --- binding ids to shards --------------------------------------------------------------------


@dataclass
class Bound:
    """Where one list's ids sit in an export."""

    positions: dict[tuple[str, str], np.ndarray] = field(default_factory=dict)
    samples: int = 0
    #: Ids of the list found in some manifest (of ``ids`` given).
    found: int = 0
    ids: int = 0
    missing: pa.Array | None = None


def _check_parts(root: str, bucket: str, shards: Sequence[layout.ShardInfo]) -> None:
    """Shards outside part folders: a tree another writer made, which has no id manifests yet."""
    for s in shards:
        if not naming.PART_SHARD_RE.fullmatch(s.basename):
            raise ListError(
                f"{layout.rel_join(root, bucket)}: shard {s.basename!r} is not in a part folder "
                f"of an export, so the tree has no id manifests; run python -m prx_data.adopt "
                f"{root} once (it writes them without touching the shards)"
            )


def _parts(shards: Sequence[layout.ShardInfo]) -> list[str]:
    return sorted({s.basename.split("/")[0] for s in shards})


def iter_manifests(
    root: str, bucket: str, shards: Sequence[layout.ShardInfo], batch_rows: int = BIND_BATCH_ROWS
) -> Iterator[pa.Table]:
    """The bucket's manifest rows (shard, index, id), a bounded batch at a time."""
    remote = storage.is_remote(root)
    known = {s.basename for s in shards}
    adopted = layout.adopted_manifest(root, bucket)
    if storage.exists(adopted):  # an adopted tree: one manifest per bucket
        yield from layout.read_adopted_manifest(root, bucket, known, batch_rows)
        return
    _check_parts(root, bucket, shards)
    parts = _parts(shards)
    step = bounded.IO_THREADS * 4 if remote else 64

    def read(part: str) -> pa.Table:
        path = layout.rel_join(root, f"{bucket}/{part}/{MANIFEST_NAME}")
        try:
            t = pq.read_table(
                io.BytesIO(storage.read_bytes(path)), columns=["shard", "index", "id"]
            )
        except FileNotFoundError:
            raise ListError(f"{path}: missing manifest, so list ids cannot be found") from None
        safety.check_manifest_shards(path, part, t["shard"])
        bad = set(pc.unique(t["shard"]).to_pylist()) - known
        if bad:
            raise ListError(f"{path}: shard(s) {sorted(bad)} are not in {bucket}/index.json")
        return t

    pending: list[pa.Table] = []
    rows = 0
    for i in range(0, len(parts), step):
        for t in bounded.map_io(read, parts[i : i + step], remote):
            pending.append(t)
            rows += len(t)
            if rows >= batch_rows:
                yield pa.concat_tables(pending)
                pending, rows = [], 0
    if pending:
        yield pa.concat_tables(pending)


def _rows_of(root: str, ids: pa.Array) -> Iterator[tuple[str, pa.Table, np.ndarray]]:
    """(bucket, rows with ``shard``, ``index``, ``id``, each row's position in ``ids``).

    ``ids`` must be unique. Through the export's id index when it is current (a
    lookup of the ids only, a chunk at a time, each chunk's hits matched to their
    positions in one pass, so the cost is linear in the ids); else, in one log line
    saying why, every manifest a batch at a time.
    """
    index, why = idindex.open_index(root)
    if index is not None:
        for start in range(0, len(ids), idindex.LOOKUP_CHUNK):
            chunk = ids.slice(start, idindex.LOOKUP_CHUNK)
            found = list(index.lookup(chunk))
            if found:
                yield from _coded(pa.concat_tables(found), chunk, start)
        return
    log.warning(
        "%s; reading every manifest to find the ids (build it with `python -m prx_data.skips "
        "index %s`)",
        why,
        root,
    )
    for bucket in layout.list_buckets(root):
        shards = layout.read_index(root, bucket)
        for batch in iter_manifests(root, bucket, shards):
            for _, sel, codes in _coded(batch, ids, 0):
                yield bucket, sel, codes


def _coded(t: pa.Table, ids: pa.Array, offset: int) -> Iterator[tuple[str, pa.Table, np.ndarray]]:
    """Per bucket of ``t`` (or the one bucket of a manifest batch): the rows whose id is in
    ``ids`` and their positions there (plus ``offset``)."""
    code = pc.index_in(t["id"], value_set=ids)
    hit = pc.is_valid(code)
    if not pc.any(hit).as_py():
        return
    t = t.filter(hit)
    codes = code.filter(hit).to_numpy(zero_copy_only=False).astype(np.int64) + offset
    if "bucket" not in t.column_names:
        yield "", t, codes
        return
    enc = pc.dictionary_encode(t["bucket"].combine_chunks())
    which = enc.indices.to_numpy(zero_copy_only=False)
    for k, b in enumerate(enc.dictionary.to_pylist()):
        m = which == k
        yield b, t.filter(pa.array(m)), codes[m]


def bind(
    root: str, lists: Mapping[str, pa.Array], *, want_missing: Sequence[str] = ()
) -> dict[str, Bound]:
    """{list: Bound}: the (bucket, shard) positions of each list's ids in the export."""
    out = {n: Bound(ids=len(ids)) for n, ids in lists.items()}
    if not lists:
        return out
    names = sorted(lists)
    union = pc.unique(pa.concat_arrays([lists[n].cast(pa.string()) for n in names]))
    member = {n: pc.is_in(union, value_set=lists[n]).to_numpy(zero_copy_only=False) for n in names}
    found = np.zeros(len(union), bool)
    pieces: dict[str, dict[tuple[str, str], list[np.ndarray]]] = {}
    if len(union):
        for bucket, sel, codes in _rows_of(root, union):
            found[codes] = True
            enc = pc.dictionary_encode(sel["shard"].combine_chunks())
            shard_names = enc.dictionary.to_pylist()
            shard_code = enc.indices.to_numpy(zero_copy_only=False).astype(np.int64)
            index_col = sel["index"].to_numpy(zero_copy_only=False).astype(np.int64)
            for n in names:
                m = member[n][codes]
                if not m.any():
                    continue
                sc, ix = shard_code[m], index_col[m]
                order = np.argsort(sc, kind="stable")
                sc, ix = sc[order], ix[order]
                cuts = np.flatnonzero(np.diff(sc)) + 1
                for chunk in np.split(np.arange(len(sc)), cuts):
                    key = (bucket, shard_names[int(sc[chunk[0]])])
                    pieces.setdefault(n, {}).setdefault(key, []).append(ix[chunk])
    for n, per_key in pieces.items():
        out[n].positions = {k: np.concatenate(v) for k, v in per_key.items()}
    for n in names:
        b = out[n]
        b.positions = {k: np.unique(v) for k, v in sorted(b.positions.items())}
        b.samples = int(sum(len(v) for v in b.positions.values()))
        f = found[pc.index_in(lists[n], value_set=union).to_numpy(zero_copy_only=False)]
        b.found = int(f.sum())
        if n in want_missing:
            b.missing = lists[n].filter(pa.array(~f))
    return out


def ids_at(root: str, positions: Mapping[tuple[str, str], Iterable[int]]) -> pa.Array:
    """The row ids at (bucket, shard) sample positions, read from those parts' manifests.

    Positions are checked against the index first (shard known, index in range).
    """
    by_part: dict[tuple[str, str], dict[str, np.ndarray]] = {}
    indexes: dict[str, dict[str, layout.ShardInfo]] = {}
    adopted: dict[str, bool] = {}
    for (bucket, shard), idx in positions.items():
        if bucket not in indexes:
            shards = layout.read_index(root, bucket)
            indexes[bucket] = {s.basename: s for s in shards}
            adopted[bucket] = storage.exists(layout.adopted_manifest(root, bucket))
            if not adopted[bucket]:
                _check_parts(root, bucket, shards)
        info = indexes[bucket].get(shard)
        if info is None:
            raise UnknownName(
                f"shard {shard!r} is not in the index of bucket {bucket!r} under {root}"
            )
        arr = np.unique(np.asarray(list(idx), np.int64))
        if len(arr) and (arr[0] < 0 or arr[-1] >= info.samples):
            bad = int(arr[-1] if arr[-1] >= info.samples else arr[0])
            raise OutOfRange(
                f"{bucket}/{shard}: sample index {bad} is outside 0..{info.samples - 1}"
            )
        part = "" if adopted[bucket] else shard.split("/")[0]
        by_part.setdefault((bucket, part), {})[shard] = arr
    found = []
    for (bucket, part), wanted in sorted(by_part.items()):
        if adopted[bucket]:
            path = layout.adopted_manifest(root, bucket)
            t = layout.read_adopted_manifest(root, bucket, set(indexes[bucket]))
        else:
            path = layout.rel_join(root, f"{bucket}/{part}/{MANIFEST_NAME}")
            try:
                t = pq.read_table(
                    io.BytesIO(storage.read_bytes(path)), columns=["shard", "index", "id"]
                )
            except FileNotFoundError:
                raise ListError(
                    f"{path}: missing manifest, so the samples have no row ids"
                ) from None
            safety.check_manifest_shards(path, part, t["shard"])
        for shard, arr in wanted.items():
            rows = t.filter(pc.equal(t["shard"], shard))
            hit = rows.filter(pc.is_in(rows["index"], value_set=pa.array(arr, rows["index"].type)))
            if len(hit) != len(arr):
                raise ListError(f"{path}: {len(arr) - len(hit)} sample(s) of {shard} have no id")
            found.append(hit["id"].combine_chunks())
    if not found:
        return pa.array([], pa.string())
    return _unique_ids(pa.concat_arrays(found))


# --- sidecars from ids ------------------------------------------------------------------------


def write_sidecars(
    root: str,
    name: str,
    positions: Mapping[tuple[str, str], np.ndarray],
    *,
    replace: bool,
    lock: Lease | None = None,
) -> dict[str, int]:
    """Write the list's sidecars; ``replace`` also deletes its sidecars on other shards."""
    if lock is not None:
        lock.check()
    res = SL.write_skips(root, name, positions, replace=replace)
    stale = 0
    if replace:
        paths = []
        for bucket in layout.list_buckets(root):
            shards = layout.read_index(root, bucket)
            for shard in SL.list_sidecars(root, bucket, shards).get(name, []):
                if (bucket, shard) not in positions:
                    paths.append(
                        layout.rel_join(root, f"{bucket}/{SL.sidecar_basename(shard, name)}")
                    )
        bounded.map_io(storage.delete, paths, storage.is_remote(root))
        stale = len(paths)
    return {
        "shards_written": res.shards_written,
        "samples_listed": res.samples_listed,
        "stale": stale,
    }


def collect(root: str, *, drop: Iterable[str] = ()) -> dict[str, pa.Table]:
    """Every list of the tree at ``root`` as ids (store ∪ what its sidecars skip).

    A list with sidecars and no store (written before lists had one, or by the
    low-level sidecar API) is turned into ids through the manifests. A list
    whose ids cannot be recovered (unreadable store, stale or corrupt sidecar,
    missing manifest) raises :class:`UncarriableList` naming it, unless it is
    in ``drop``.
    """
    drop = {SL.validate_name(n) for n in drop}
    out: dict[str, pa.Table] = {}
    problems: dict[str, str] = {}
    for n in store_names(root):
        if n in drop:
            continue
        try:
            t = read_store_list(root, n)
        except ListError as e:
            problems[n] = str(e)
            continue
        if t is not None:
            out[n] = t
    # Lists as the loader sees them: the sidecars.
    per_list: dict[str, dict[tuple[str, str], np.ndarray]] = {}
    buckets = layout.list_buckets(root) if storage.exists(root) else []
    for bucket in buckets:
        shards = layout.read_index(root, bucket)
        listing = SL.list_sidecars(root, bucket, shards)
        for n in listing:
            if n in drop or n in problems:
                continue
            try:
                skips = SL.load_skips(root, bucket, shards, [n], listing=listing)
            except SL.SkipListError as e:
                problems[n] = str(e)
                continue
            for shard, idx in skips.items():
                per_list.setdefault(n, {})[(bucket, shard)] = idx
    ctime = _sidecar_provenance(root)
    for n, positions in sorted(per_list.items()):
        if n in problems:
            continue
        try:
            ids = ids_at(root, positions)
        except (ListError, KeyError, IndexError, safety.UnsafeIndexError) as e:
            problems[n] = str(e)
            continue
        have = out.get(n)
        if have is None:
            extra = ids
        else:
            extra = ids.filter(pc.invert(pc.is_in(ids, value_set=have["id"].combine_chunks())))
        if len(extra):
            out[n] = merge_store(have, store_table(extra, ctime))
    if problems:
        raise UncarriableList(root, problems)
    return dict(sorted(out.items()))


def _sidecar_provenance(root: str) -> Provenance:
    return Provenance(command="sidecars", reason=f"recovered from the sidecars of {root}")


def table_of(root: str) -> str | None:
    """The table an export was made from (its pinned config, or a rewrite's report)."""
    for name in (naming.CONFIG_NAME, REPORT_NAME):
        try:
            obj = json.loads(storage.read_bytes(storage.join(root, *name.split("/"))))
        except (FileNotFoundError, ValueError):
            continue
        t = obj.get("table") if isinstance(obj, dict) else None
        if isinstance(t, str) and t and not t.startswith("("):
            return t
    return None


# --- operations -------------------------------------------------------------------------------


@dataclass
class ListUpdate:
    """What one add / remove / replace did."""

    name: str
    export: str
    ids_requested: int
    #: Ids the list holds afterwards in this export.
    ids_in_list: int
    #: Requested ids that are in no manifest of this export (kept in the list all the same).
    ids_not_in_export: int
    missing_ids: list[str]
    shards_written: int
    samples_listed: int
    stale_sidecars_removed: int = 0
    #: The registry the update was recorded in (None: only this export).
    registry: str | None = None
    registry_changes: dict[str, int] = field(default_factory=dict)
    #: Share of the export's samples the list leaves out, and the warning above WARN_SHARE.
    share: float = 0.0
    warning: str | None = None


def _view(root: str, reg: Registry | None, name: str) -> pa.Array:
    """The ids list ``name`` holds for this export now (the log's state)."""
    entries, _ = _export_entries(root, reg, [name])
    t = state(entries).get(name)
    return t["id"].combine_chunks() if t is not None else pa.array([], pa.string())


def _quiet_resolve(root: str) -> Registry | None:
    try:
        return resolve(root, strict=False)
    except ListError:
        return None


def _change_rows(
    name: str, ids: pa.Array, mode: str, have: pa.Array, prov: Provenance, **kw
) -> pa.Table:
    """Entries that make the list ``mode`` ``ids`` given what it holds (``have``)."""
    if mode == "add":
        return log_rows(name, ids, ADD, prov, **kw)
    if mode == "remove":
        return log_rows(name, ids, REMOVE, prov, **kw)
    gone = have.filter(pc.invert(pc.is_in(have, value_set=ids)))
    return _concat([log_rows(name, gone, REMOVE, prov, **kw), log_rows(name, ids, ADD, prov, **kw)])


def update_list(
    root: str,
    name: str,
    ids: Iterable[str] | pa.Array | None,
    prov: Provenance,
    *,
    mode: str = "add",
    table: str | None = None,
    export_only: bool = False,
    registry: Registry | None = None,
) -> ListUpdate:
    """Add ids to / remove ids from / replace the list ``name``, then materialise the export.

    ``mode="remove"`` with ``ids=None`` removes the whole list (every id it
    holds for this export). Everything happens under the export's lease: the
    entry goes to the registry (or, ``export_only``, to the export's own log),
    and the export's lists are materialised from the log read afterwards.
    """
    SL.validate_name(name)
    if mode not in ("add", "remove", "replace"):
        raise ValueError(f"unknown mode {mode!r}")
    whole = ids is None
    req = None if whole else _unique_ids(ids)
    with export_lease(root) as lease:
        reg = registry if registry is not None else resolve(root, table, export_only=export_only)
        view = reg if reg is not None else _quiet_resolve(root)  # what materialises the export
        _import_unlogged(root, lease)
        # A registry entry is based on its own commit; an export-only one on the registry
        # position this export has seen (its order against later registry entries).
        seen: int | None = None
        if reg is None:
            st = read_state(root)
            seen = view.head() if view is not None else (st.position if st else 0)

        def rows(seq: int) -> pa.Table:
            # What the list holds (under the lease) matters only to a whole-list remove and
            # a replace; an add or a remove of given ids is its entries alone.
            needs = whole or mode == "replace"
            have = _view(root, reg if reg is not None else view, name) if needs else req
            return _change_rows(
                name,
                have if whole else req,
                mode,
                have,
                prov,
                seq=seq,
                base=seq if seen is None else seen,
                kind=REGISTRY if reg is not None else EXPORT_ONLY,
                export=root,
            )

        if reg is not None:
            changes = {"seq": reg.append(rows)}
        else:
            changes = {"local_seq": _append_local(root, lease, rows)}
        lost: dict[str, pa.Array] = {}
        done = materialise(root, view, lease, names=[name], missing=lost)
        missing: list[str] = []
        if mode != "remove" and req is not None and len(req) and name in lost:
            missing = lost[name].filter(pc.is_in(lost[name], value_set=req)).to_pylist()
    requested = 0 if req is None else len(req)
    r = done.get(name, {"ids": 0, "samples": 0, "shards": 0, "share": 0.0})
    return ListUpdate(
        name=name,
        export=root,
        ids_requested=requested,
        ids_in_list=r["ids"],
        ids_not_in_export=len(missing),
        missing_ids=missing,
        shards_written=r["shards"],
        samples_listed=r["samples"],
        registry=reg.uri if reg is not None else None,
        registry_changes=changes,
        share=r["share"],
        warning=share_warning(name, r["share"], root),
    )


def sync(root: str, table: str | None = None, *, drop: Iterable[str] = ()) -> dict[str, dict]:
    """Materialise every list of the export from the log (``skips sync``); idempotent.

    Reads the log after taking the export's lease. A list the log emptied
    leaves the export in every form (store and sidecars).
    """
    with export_lease(root) as lease:
        reg = resolve(root, table, strict=table is not None)
        _import_unlogged(root, lease, drop)
        return materialise(root, reg, lease, full=True)


def carry(src: str, reg: Registry, *, drop: Iterable[str] = ()) -> int:
    """Record ``src``'s export-only entries (and lists the log does not hold yet) in ``reg``,
    each where the registry holds nothing newer for that id. Returns the entries carried."""
    found = _unlogged(src, read_state(src), drop)
    local = _concat([read_local(src), _import_rows(found, 0, src) if found else None])
    drop = set(drop)
    if drop:
        local = local.filter(pc.invert(pc.is_in(local["list"], value_set=pa.array(sorted(drop)))))
    last = latest(local)
    if not len(last):
        return 0
    names = sorted(pc.unique(last["list"]).to_pylist())
    counted: dict[str, int] = {}

    def make(seq: int) -> pa.Table:
        theirs = latest(reg.entries(names)).select(["list", "id", "seq"])
        theirs = theirs.rename_columns(["list", "id", "rseq"])
        j = last.join(theirs, keys=["list", "id"], join_type="left outer")
        newer = j.filter(pc.or_kleene(pc.is_null(j["rseq"]), pc.less_equal(j["rseq"], j["base"])))
        n = len(newer)
        out = newer.drop_columns(["rseq"])
        for col, val in (("seq", seq), ("base", seq)):
            out = out.set_column(out.schema.get_field_index(col), col, pa.array(np.full(n, val)))
        kind = pa.array(np.full(n, REGISTRY, np.int8))
        out = out.set_column(out.schema.get_field_index("kind"), "kind", kind)
        counted["n"] = n
        return out.select(LOG_SCHEMA.names).cast(LOG_SCHEMA)

    reg.append(make)
    return counted.get("n", 0)


def snapshot_local(src: str, dst: str, lease: Lease, *, drop: Iterable[str] = ()) -> None:
    """Give ``dst`` (a new tree without a registry) ``src``'s lists as its own entries."""
    entries, _ = _export_entries(src, None, None)
    found = _unlogged(src, read_state(src), drop)
    lists = state(_concat([entries, _import_rows(found, 0, src) if found else None]))
    lists = {n: t for n, t in lists.items() if n not in set(drop)}
    if lists:
        _append_local(dst, lease, lambda seq: _import_rows(lists, seq, src))


def remove_list(reg: Registry, name: str, prov: Provenance) -> int:
    """Remove every id of list ``name`` from the registry (``write_mds --drop-list``)."""
    SL.validate_name(name)

    def make(seq: int) -> pa.Table:
        t = reg.state([name]).get(name)
        if t is None:
            return LOG_SCHEMA.empty_table()
        return log_rows(name, t["id"], REMOVE, prov, seq=seq, base=seq, kind=REGISTRY, export="")

    return reg.append(make)


def lists_of(root: str, reg: Registry | None, *, drop: Iterable[str] = ()) -> dict[str, pa.Table]:
    """{list: ids} the export holds by the log's state, with lists the log does not hold yet
    (raises :class:`UncarriableList` for one whose ids cannot be recovered, unless dropped)."""
    entries, _ = _export_entries(root, reg, None)
    found = _unlogged(root, read_state(root), drop)
    lists = state(_concat([entries, _import_rows(found, 0, root) if found else None]))
    return {n: t for n, t in lists.items() if n not in set(drop)}


def list_ids(root: str, name: str, *, export_only: bool = False) -> pa.Array:
    """Every id list ``name`` holds for the export (its log's state)."""
    return _view(root, None if export_only else _quiet_resolve(root), name)


def lists_text(lists: Mapping[str, Mapping]) -> list[str]:
    out = []
    for n, v in lists.items():
        line = f"  {n}: {v['ids']:,} ids, {v['samples']:,} samples skipped in {v['shards']} shards"
        if "share" in v:
            line += f" ({100 * v['share']:.1f}% of the export; from {v.get('source') or '?'})"
        out.append(line)
    return out


__all__ = [
    "ListError",
    "ListUpdate",
    "Provenance",
    "Registry",
    "UncarriableList",
    "bind",
    "carry",
    "collect",
    "materialise",
    "registry_uri",
    "resolve",
    "sync",
    "update_list",
]
