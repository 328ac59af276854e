"""Skip lists as sets of row ids: the export's list store, the table's registry, and their lock.

A skip list is a set of row ids (the Lance ``id``) first; the per-shard
sidecars (:mod:`prx_data.skips.sidecar`) are derived from it through the
export's ``ids.parquet`` manifests. Two places hold the ids:

* **The export's list store**, ``<export>/_lists/<name>.parquet``: the ids of
  one list, sorted and unique, with their provenance (``added``, ``command``,
  ``reason``). ``_lists/registry`` names the table's registry.
* **The table's registry**, a small Lance table next to the source table
  (``data/photos.lance`` -> ``data/photos.lists.lance``, the same for
  ``s3://``): an append-only log of ``(list, id, op, at, command, reason,
  export)`` events, ``op`` being ``add`` or ``remove``. A list's ids are those
  whose latest event is ``add``. Every export of the table applies every
  registered list, so an id opted out once stays out of every later export
  and rewrite of that table, also where the export did not hold it yet, until
  it is removed explicitly (a ``remove`` event, which an older export's store
  cannot undo: :meth:`Registry.migrate` only records ids the log never saw).

Every operation that makes a new tree (``write_mds``, ``--overwrite``, a
rewrite, dedup) derives the tree's sidecars from the registry and the source
tree's store (:func:`sync_lists`). Updates of one export's lists hold
:class:`ListsLock` from reading the store to the last sidecar written: a
``flock`` on ``_lists/.lock`` locally, a lease object created and refreshed
with conditional PUTs (``If-None-Match``/``If-Match``) on ``s3://``.
Registry writes are Lance appends, which retry on a concurrent commit; the
one unsafe case, two processes creating the registry at once (one creation
silently replaces the other), is covered by reading the rows back.

Ids are bound to shards through the export's id index
(:mod:`prx_data.export.idindex`: a BTREE lookup of the lists' ids only). An
export without a current index (written before it existed) falls back, with
one log line, to reading one bucket's manifests at a time, in batches of at
most :data:`BIND_BATCH_ROWS` rows, against the union of the lists' ids.
Either way memory is bounded by the lists and a batch, not by the export.
"""

from __future__ import annotations

import datetime as dt
import io
import json
import logging
import os
import random
import socket
import threading
import time
import uuid
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from prx_data.core import storage
from prx_data.core.errors import NotFound, OutOfRange, PrxDataError, UnknownName
from prx_data.core.schema import MANIFEST_NAME, REPORT_NAME
from prx_data.export import idindex, layout
from prx_data.skips import sidecar as SL

log = logging.getLogger(__name__)

#: Manifest rows looked up at once (about 100 MB of ids at 10^6 rows).
BIND_BATCH_ROWS = 1 << 20
#: How long a list update waits for another one to finish before giving up.
LOCK_TIMEOUT_S = 900.0
#: Lease lifetime on object storage; refreshed every third of it while held.
LEASE_TTL_S = 60.0

STORE_SCHEMA = pa.schema(
    [
        ("id", pa.string()),
        ("added", pa.timestamp("us", tz="UTC")),
        ("command", pa.string()),
        ("reason", pa.string()),
    ]
)
REGISTRY_SCHEMA = pa.schema(
    [
        ("list", pa.string()),
        ("id", pa.string()),
        ("op", pa.string()),
        ("at", pa.timestamp("us", tz="UTC")),
        ("command", pa.string()),
        ("reason", pa.string()),
        ("export", pa.string()),
        ("txn", pa.string()),
    ]
)


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


# --- registry -------------------------------------------------------------------------------


def registry_uri(table: str) -> str:
    """``data/photos.lance`` -> ``data/photos.lists.lance`` (absolute locally; ``s3://`` too)."""
    base = table.rstrip("/")
    if not storage.is_remote(base):
        base = os.path.abspath(base.removeprefix("file://"))
    stem = base[: -len(".lance")] if base.endswith(".lance") else base
    return f"{stem}.lists.lance"


class Registry:
    """The append-only log of list events next to a table (see the module docstring)."""

    def __init__(self, uri: str):
        from prx_data.table.lance_ops import lance_storage_options

        self.uri = uri
        self.options = lance_storage_options(uri)

    @classmethod
    def for_table(cls, table: str) -> Registry:
        return cls(registry_uri(table))

    def _open(self):
        from prx_data.table.lance_ops import open_table

        try:
            ds = open_table(self.uri, self.options)
        except NotFound:
            return None
        missing = set(REGISTRY_SCHEMA.names) - set(ds.schema.names)
        if missing:
            raise ListError(
                f"{self.uri} is not a skip-list registry (no {sorted(missing)} columns); move that "
                "table away: the registry of a table lives next to it under this name"
            )
        return ds

    def events(self, names: Sequence[str] | None = None) -> pa.Table:
        ds = self._open()
        if ds is None:
            return REGISTRY_SCHEMA.empty_table()
        where = None
        if names is not None:
            if not names:
                return REGISTRY_SCHEMA.empty_table()
            where = "list IN (" + ", ".join(f"'{SL.validate_name(n)}'" for n in names) + ")"
        return ds.to_table(columns=REGISTRY_SCHEMA.names, filter=where).cast(REGISTRY_SCHEMA)

    def effective(self, names: Sequence[str] | None = None) -> dict[str, pa.Table]:
        """{list: store table} of the ids whose latest event is ``add`` (empty lists left out)."""
        ev = self.events(names)
        out: dict[str, pa.Table] = {}
        if not len(ev):
            return out
        # Latest event per (list, id): sort by list, id, time descending; "remove" wins a tie.
        ev = ev.append_column("rank", pc.equal(ev["op"], "add").cast(pa.int8()))
        ev = ev.sort_by(
            [
                ("list", "ascending"),
                ("id", "ascending"),
                ("at", "descending"),
                ("rank", "ascending"),
            ]
        )
        key = pc.binary_join_element_wise(ev["list"], ev["id"], "\x00")
        first = _first_per_id(pa.table({"id": key, "i": pa.array(np.arange(len(ev)))}))
        latest = ev.take(first["i"])
        latest = latest.filter(pc.equal(latest["op"], "add"))
        for name in pc.unique(latest["list"]).to_pylist():
            rows = latest.filter(pc.equal(latest["list"], name))
            out[name] = pa.table(
                {
                    "id": rows["id"],
                    "added": rows["at"],
                    "command": rows["command"],
                    "reason": rows["reason"],
                },
                schema=STORE_SCHEMA,
            )
        return dict(sorted(out.items()))

    def _append(self, rows: pa.Table) -> None:
        import lance

        if not len(rows):
            return
        txn = uuid.uuid4().hex
        rows = rows.set_column(
            rows.schema.get_field_index("txn"), "txn", pa.array([txn] * len(rows), pa.string())
        )
        created = False
        if self._open() is None:
            try:
                lance.write_dataset(
                    REGISTRY_SCHEMA.empty_table(),
                    self.uri,
                    mode="create",
                    storage_options=self.options,
                )
                created = True
            except (OSError, ValueError):
                pass  # created by someone else meanwhile
        for _ in range(5):
            lance.write_dataset(rows, self.uri, mode="append", storage_options=self.options)
            # A creation racing another one can replace it, appends included: read back.
            if not created or self._open().count_rows(filter=f"txn = '{txn}'") == len(rows):
                return
        raise ListError(f"{self.uri}: registry rows did not land after 5 appends")

    def _rows(
        self, name: str, ids: pa.Array, op: str, prov: Provenance | pa.Table, export: str
    ) -> pa.Table:
        n = len(ids)
        if isinstance(prov, pa.Table):  # per-id provenance (a store carried into the registry)
            at, command, reason = prov["added"], prov["command"], prov["reason"]
        else:
            at = pa.array([prov.at] * n, REGISTRY_SCHEMA.field("at").type)
            command = pa.array([prov.command] * n, pa.string())
            reason = pa.array([prov.reason] * n, pa.string())
        return pa.table(
            {
                "list": pa.array([name] * n, pa.string()),
                "id": ids,
                "op": pa.array([op] * n, pa.string()),
                "at": at,
                "command": command,
                "reason": reason,
                "export": pa.array([export] * n, pa.string()),
                "txn": pa.array([""] * n, pa.string()),
            },
            schema=REGISTRY_SCHEMA,
        )

    def record(
        self, name: str, ids: pa.Array, mode: str, prov: Provenance, export: str
    ) -> dict[str, int]:
        """Log ``add`` / ``remove`` / ``replace`` (the list becomes exactly ``ids``)."""
        current = self.effective([name]).get(name)
        have = current["id"].combine_chunks() if current is not None else pa.array([], pa.string())
        if mode == "add":
            new, gone = ids.filter(pc.invert(pc.is_in(ids, value_set=have))), None
        elif mode == "remove":
            new, gone = None, ids.filter(pc.is_in(ids, value_set=have))
        elif mode == "replace":
            new = ids.filter(pc.invert(pc.is_in(ids, value_set=have)))
            gone = have.filter(pc.invert(pc.is_in(have, value_set=ids)))
        else:
            raise ValueError(f"unknown mode {mode!r}")
        parts = []
        if new is not None and len(new):
            parts.append(self._rows(name, new, "add", prov, export))
        if gone is not None and len(gone):
            parts.append(self._rows(name, gone, "remove", prov, export))
        if parts:
            self._append(pa.concat_tables(parts))  # one commit: a replace is atomic
        return {
            "added": 0 if new is None else len(new),
            "removed": 0 if gone is None else len(gone),
        }

    def migrate(self, lists: Mapping[str, pa.Table], export: str) -> dict[str, int]:
        """Record the ids of ``lists`` the log has never seen, with their own provenance.

        Ids with any event are left alone: an explicit removal stays removed.
        Returns {list: ids recorded}.
        """
        if not lists:
            return {}
        ev = self.events(sorted(lists))
        parts, counts = [], {}
        for name, t in sorted(lists.items()):
            seen = ev.filter(pc.equal(ev["list"], name))["id"].combine_chunks()
            fresh = t.filter(pc.invert(pc.is_in(t["id"], value_set=seen)))
            fresh = fresh.combine_chunks()
            if len(fresh):
                parts.append(self._rows(name, fresh["id"], "add", fresh, export))
            counts[name] = len(fresh)
        if parts:
            self._append(pa.concat_tables(parts))
        return counts


def _ref_path(root: str) -> str:
    return storage.join(root, layout.LISTS_DIR, layout.LISTS_REF_NAME)


def write_ref(root: str, reg: Registry) -> None:
    body = json.dumps({"registry": reg.uri}, sort_keys=True).encode()
    try:
        if storage.read_bytes(_ref_path(root)) == body:
            return
    except FileNotFoundError:
        pass
    storage.write_bytes_atomic(_ref_path(root), body)


def read_ref(root: str) -> Registry | None:
    try:
        obj = json.loads(storage.read_bytes(_ref_path(root)))
    except FileNotFoundError:
        return None
    except ValueError as e:
        raise ListError(
            f"{_ref_path(root)}: unreadable ({e}); delete it and pass --table"
        ) from None
    uri = obj.get("registry") if isinstance(obj, dict) else None
    if not isinstance(uri, str) or not uri.endswith(".lists.lance"):
        raise ListError(f"{_ref_path(root)}: names no registry; delete it and pass --table")
    return Registry(uri)


def registry_for(root: str, table: str | None = None, *, export_only: bool = False):
    """The registry the export at ``root`` references (None: the export names no table).

    The export's ``_lists/registry`` wins; else ``table``; else the table of the
    export's pinned config, which must exist (a relative path is read from here).
    """
    if export_only:
        return None
    ref = read_ref(root)
    if ref is not None:
        return ref
    if table:
        return Registry.for_table(table)
    try:
        cfg = json.loads(storage.read_bytes(storage.join(root, *layout.CONFIG_NAME.split("/"))))
    except (FileNotFoundError, ValueError):
        return None
    source = cfg.get("table") if isinstance(cfg, dict) else None
    if not isinstance(source, str):
        return None
    if not storage.exists(source):
        raise ListError(
            f"{root} was exported from table {source!r}, which is not found from here, so the "
            "list cannot be recorded in that table's registry: pass --table URI (where the table "
            "lives now), or --export-only to change only this export"
        )
    return Registry.for_table(source)


# --- the export's store ----------------------------------------------------------------------


def _store_path(root: str, name: str) -> str:
    return storage.join(root, layout.LISTS_DIR, f"{SL.validate_name(name)}.parquet")


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
    for rel in storage.list_files(storage.join(root, layout.LISTS_DIR), ".parquet", False):
        stem = rel.replace("\\", "/").rsplit("/", 1)[-1].removesuffix(".parquet")
        if SL.NAME_RE.fullmatch(stem):
            names.append(stem)
    return sorted(names)


def read_store(root: str) -> dict[str, pa.Table]:
    return {n: t for n in store_names(root) if (t := read_store_list(root, n)) is not None}


def write_store_list(root: str, name: str, table: pa.Table | None) -> None:
    """Replace the list's store file (None or empty: the list leaves the export)."""
    path = _store_path(root, name)
    if table is None or not len(table):
        storage.delete(path)
        return
    buf = io.BytesIO()
    pq.write_table(table.cast(STORE_SCHEMA), buf, compression="zstd")
    storage.write_bytes_atomic(path, buf.getvalue())


# --- the lock -------------------------------------------------------------------------------


class ListsLock:
    """Serialises read-merge-write of one export's lists (a context manager)."""

    def __init__(self, root: str, *, timeout_s: float = LOCK_TIMEOUT_S, ttl_s: float = LEASE_TTL_S):
        self.root = root
        self.timeout_s = timeout_s
        self.ttl_s = ttl_s
        self._fd: int | None = None
        self._s3 = None
        self._etag: str | None = None
        self._owner = uuid.uuid4().hex
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.lost: str | None = None

    def __enter__(self) -> ListsLock:
        if not storage.is_remote(self.root):
            self._acquire_local()
        elif self.root.startswith("s3://"):
            self._acquire_s3()
        return self

    def __exit__(self, *exc) -> None:
        self.release()

    def _acquire_local(self) -> None:
        import errno
        import fcntl

        d = os.path.join(self.root, layout.LISTS_DIR)
        os.makedirs(d, exist_ok=True)
        fd = os.open(os.path.join(d, layout.LISTS_LOCK_NAME), os.O_RDWR | os.O_CREAT, 0o644)
        deadline = time.monotonic() + self.timeout_s
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except OSError as e:
                if e.errno not in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
                    os.close(fd)
                    raise
                if time.monotonic() > deadline:
                    os.close(fd)
                    raise ListError(
                        f"{self.root}: another skip-list update held the lock for "
                        f"{self.timeout_s:.0f} s; try again when it has finished"
                    ) from None
                time.sleep(0.02 + random.random() * 0.03)
        self._fd = fd

    # S3: a lease object created with If-None-Match and refreshed with If-Match.
    def _key(self) -> tuple[str, str]:
        from urllib.parse import urlparse

        p = urlparse(self.root)
        key = f"{p.path.strip('/')}/{layout.LISTS_DIR}/{layout.LISTS_LOCK_NAME}".lstrip("/")
        return p.netloc, key

    def _body(self) -> bytes:
        info = {
            "owner": self._owner,
            "host": socket.gethostname(),
            "pid": os.getpid(),
            "expires": time.time() + self.ttl_s,
        }
        return json.dumps(info, sort_keys=True).encode()

    def _put(self, **cond) -> str | None:
        from botocore.exceptions import ClientError

        bucket, key = self._key()
        try:
            r = self._s3.put_object(Bucket=bucket, Key=key, Body=self._body(), **cond)
        except ClientError as e:
            code = e.response.get("Error", {}).get("Code", "")
            status = e.response.get("ResponseMetadata", {}).get("HTTPStatusCode")
            if status in (409, 412) or code in ("PreconditionFailed", "ConditionalRequestConflict"):
                return None
            raise
        return r["ETag"]

    def _get(self) -> tuple[dict, str] | None:
        from botocore.exceptions import ClientError

        bucket, key = self._key()
        try:
            r = self._s3.get_object(Bucket=bucket, Key=key)
        except ClientError as e:
            if e.response.get("Error", {}).get("Code") in ("NoSuchKey", "404"):
                return None
            raise
        try:
            info = json.loads(r["Body"].read())
        except ValueError:
            info = {}
        return (info if isinstance(info, dict) else {}), r["ETag"]

    def _acquire_s3(self) -> None:
        self._s3 = storage.s3_client()
        deadline = time.monotonic() + self.timeout_s
        while True:
            got = self._get()
            if got is None:
                etag = self._put(IfNoneMatch="*")
            elif got[0].get("expires", 0) < time.time():  # its holder died: take it over
                etag = self._put(IfMatch=got[1])
            else:
                etag = None
            if etag is not None:
                self._etag = etag
                break
            if time.monotonic() > deadline:
                raise ListError(
                    f"{self.root}: another skip-list update holds the lease "
                    f"({got[0] if got else {}}); try again when it has finished"
                )
            time.sleep(0.05 + random.random() * 0.15)
        self._thread = threading.Thread(target=self._beat, name="lists-lease", daemon=True)
        self._thread.start()

    def _beat(self) -> None:
        while not self._stop.wait(self.ttl_s / 3):
            try:
                etag = self._put(IfMatch=self._etag)
            except Exception:  # noqa: BLE001 - transient: the next beat retries
                continue
            if etag is None:
                self.lost = "another update took the lease over"
                return
            self._etag = etag

    def check(self) -> None:
        if self.lost:
            raise ListError(f"{self.root}: lost the skip-list lease ({self.lost}); run it again")

    def release(self) -> None:
        if self._fd is not None:
            os.close(self._fd)  # closing drops the flock; the file stays (no inode race)
            self._fd = None
        if self._s3 is not None:
            self._stop.set()
            if self._thread is not None:
                self._thread.join(timeout=10)
            got = self._get()
            if got is not None and got[0].get("owner") == self._owner:
                bucket, key = self._key()
                self._s3.delete_object(Bucket=bucket, Key=key)
            self._s3 = None


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
        if not layout.PART_SHARD_RE.fullmatch(s.basename):
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
    step = layout.IO_THREADS * 4 if remote else 64

    def read(part: str) -> pa.Table:
        path = layout.rel_join(root, f"{bucket}/{part}/{MANIFEST_NAME}")
        try:
            t = pq.read_table(
                io.BytesIO(storage.read_bytes(path)), columns=["shard", "index", "id"]
            )
        except FileNotFoundError:
            raise ListError(f"{path}: missing manifest, so list ids cannot be found") from None
        layout.check_manifest_shards(path, part, t["shard"])
        bad = set(pc.unique(t["shard"]).to_pylist()) - known
        if bad:
            raise ListError(f"{path}: shard(s) {sorted(bad)} are not in {bucket}/index.json")
        return t

    pending: list[pa.Table] = []
    rows = 0
    for i in range(0, len(parts), step):
        for t in layout.map_io(read, parts[i : i + step], remote):
            pending.append(t)
            rows += len(t)
            if rows >= batch_rows:
                yield pa.concat_tables(pending)
                pending, rows = [], 0
    if pending:
        yield pa.concat_tables(pending)


def _rows_of(root: str, ids: pa.Array) -> Iterator[tuple[str, pa.Table]]:
    """(bucket, rows with ``shard``, ``index``, ``id``) covering every row of ``ids``.

    Through the export's id index when it is current (a lookup of the ids
    only); else, in one log line saying why, every manifest a batch at a time.
    """
    index, why = idindex.open_index(root)
    if index is not None:
        for t in index.lookup(ids):
            buckets = pc.unique(t["bucket"]).to_pylist()
            for b in buckets:
                yield b, t if len(buckets) == 1 else t.filter(pc.equal(t["bucket"], b))
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
            yield bucket, batch


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
        for bucket, batch in _rows_of(root, union):
            code = pc.index_in(batch["id"], value_set=union)
            hit = pc.is_valid(code)
            if not pc.any(hit).as_py():
                continue
            sel = batch.filter(hit)
            codes = code.filter(hit).to_numpy(zero_copy_only=False).astype(np.int64)
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
            layout.check_manifest_shards(path, part, t["shard"])
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
    lock: ListsLock | None = None,
) -> dict[str, int]:
    """Write the list's sidecars; ``replace`` also deletes its sidecars on other shards."""
    if lock is not None:
        lock.check()
    res = SL.add_skips(root, name, positions, replace=replace)
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
        layout.map_io(storage.delete, paths, storage.is_remote(root))
        stale = len(paths)
    return {
        "shards_written": res.shards_written,
        "samples_listed": res.samples_listed,
        "stale": stale,
    }


# --- operations on one export -----------------------------------------------------------------


@dataclass
class ListUpdate:
    """What one add / remove / replace did."""

    name: str
    export: str
    ids_requested: int
    #: Ids the list holds afterwards (in this export's store).
    ids_in_list: int
    #: Requested ids that are in no manifest of this export (kept in the list all the same).
    ids_not_in_export: int
    missing_ids: list[str]
    shards_written: int
    samples_listed: int
    stale_sidecars_removed: int = 0
    #: The registry the update was recorded in (None: the export names no table).
    registry: str | None = None
    registry_changes: dict[str, int] = field(default_factory=dict)


def update_list(
    root: str,
    name: str,
    ids: Iterable[str] | pa.Array,
    prov: Provenance,
    *,
    mode: str = "add",
    table: str | None = None,
    export_only: bool = False,
    registry: Registry | None = None,
) -> ListUpdate:
    """Add ids to / remove ids from / replace the list ``name``: registry, store, sidecars.

    The registry is written first, so a failure after it still keeps the ids
    out of later exports; then, under :class:`ListsLock`, the export's store is
    merged and the sidecars derived from it.
    """
    SL.validate_name(name)
    if mode not in ("add", "remove", "replace"):
        raise ValueError(f"unknown mode {mode!r}")
    ids = _unique_ids(ids)
    reg = registry or registry_for(root, table, export_only=export_only)
    changes = reg.record(name, ids, mode, prov, root) if reg is not None else {}
    with ListsLock(root) as lock:
        if reg is not None:
            write_ref(root, reg)
        old = read_store_list(root, name)
        if mode == "add":
            new = merge_store(old, store_table(ids, prov))
            bound = bind(root, {name: ids}, want_missing=[name])[name]
        elif mode == "remove":
            new = None
            if old is not None:
                new = old.filter(pc.invert(pc.is_in(old["id"], value_set=ids)))
            keep = new["id"].combine_chunks() if new is not None else pa.array([], pa.string())
            bound = bind(root, {name: keep})[name]
        else:
            fresh = store_table(ids, prov)
            if old is not None:  # an id that stays keeps its first provenance
                kept = old.filter(pc.is_in(old["id"], value_set=ids))
                fresh = merge_store(kept, fresh)
            new = fresh
            bound = bind(root, {name: ids}, want_missing=[name])[name]
        lock.check()
        write_store_list(root, name, new)
        w = write_sidecars(root, name, bound.positions, replace=mode != "add", lock=lock)
    missing = bound.missing.to_pylist() if bound.missing is not None else []
    return ListUpdate(
        name=name,
        export=root,
        ids_requested=len(ids),
        ids_in_list=len(new) if new is not None else 0,
        ids_not_in_export=len(missing),
        missing_ids=missing,
        shards_written=w["shards_written"],
        samples_listed=w["samples_listed"],
        stale_sidecars_removed=w["stale"],
        registry=reg.uri if reg is not None else None,
        registry_changes=changes,
    )


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
        except (ListError, KeyError, IndexError, layout.UnsafeIndexError) as e:
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


def sync_lists(
    root: str,
    registry: Registry | None,
    *,
    carried: Mapping[str, pa.Table] | None = None,
    skip: Iterable[str] = (),
) -> dict[str, dict[str, int]]:
    """Give the tree at ``root`` every list: the registry's and ``carried``, minus ``skip``.

    ``carried`` (a source tree's lists) is recorded in the registry first
    (:meth:`Registry.migrate`: only ids it never saw), so the registry's view
    wins and explicit removals stay removed. Every list's store file is
    written and its sidecars derived (replacing what was there). Returns
    ``{list: {"ids", "samples", "shards"}}`` for the report.
    """
    skip = set(skip)
    carried = dict(carried or {})
    if registry is not None:
        if carried:
            registry.migrate(carried, root)
        lists = registry.effective()  # ids the registry saw removed stay out
    else:
        lists = carried
    lists = {n: t for n, t in lists.items() if n not in skip and t is not None and len(t)}
    bound = bind(root, {n: t["id"].combine_chunks() for n, t in lists.items()})
    report: dict[str, dict[str, int]] = {}
    with ListsLock(root) as lock:
        if registry is not None:
            write_ref(root, registry)
        for n in store_names(root):
            if n not in lists:
                write_store_list(root, n, None)
        for n, t in sorted(lists.items()):
            lock.check()
            write_store_list(root, n, t)
            w = write_sidecars(root, n, bound[n].positions, replace=True, lock=lock)
            report[n] = {
                "ids": len(t),
                "samples": bound[n].samples,
                "shards": w["shards_written"],
            }
    return report


def list_ids(root: str, name: str, *, export_only: bool = False) -> pa.Array:
    """Every id of list ``name``: the export's store and (unless ``export_only``) its registry."""
    got = [t["id"].combine_chunks() for t in [read_store_list(root, name)] if t is not None]
    reg = registry_for(root, export_only=export_only)
    if reg is not None:
        t = reg.effective([name]).get(name)
        if t is not None:
            got.append(t["id"].combine_chunks())
    return _unique_ids(pa.concat_arrays(got)) if got else pa.array([], pa.string())


def table_of(root: str) -> str | None:
    """The table an export was made from (its pinned config, or a rewrite's report)."""
    for name in (layout.CONFIG_NAME, REPORT_NAME):
        try:
            obj = json.loads(storage.read_bytes(storage.join(root, *name.split("/"))))
        except (FileNotFoundError, ValueError):
            continue
        t = obj.get("table") if isinstance(obj, dict) else None
        if isinstance(t, str) and t and not t.startswith("("):
            return t
    return None


def lists_text(lists: Mapping[str, Mapping[str, int]]) -> list[str]:
    return [
        f"  {n}: {v['ids']:,} ids, {v['samples']:,} samples skipped in {v['shards']} shards"
        for n, v in lists.items()
    ]


__all__ = [
    "ListError",
    "ListUpdate",
    "ListsLock",
    "Provenance",
    "Registry",
    "UncarriableList",
    "bind",
    "collect",
    "registry_for",
    "registry_uri",
    "sync_lists",
    "update_list",
]
