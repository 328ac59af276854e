"""``write_mds --append``: what an append adds to a complete export, and how it joins it.

An append compares the table now with what the export last saw, by row id:

* the export's **row record** (``_progress/rows.lance``: ``id``, ``sha256`` of every row of
  the table version it reached, written at the end of every export and every append), or,
  for an export written before the record existed, the table at the version the export
  recorded (``table_version`` in its config), or, when that version was cleaned up, the
  ids of the export's id index with no digest;
* the table at its latest version (or ``--table-version``).

Rows the export has not seen are **new**; rows it saw whose ``sha256`` differs are
**changed** (exported again); rows it saw that the table no longer holds are **deleted**.
A seen row with no recorded digest (the id-index fallback, or a table without
``sha256``) cannot be compared: it is taken as unchanged, counted in the report as
``no_digest``, and its digest is recorded from then on. Both sides are streamed and
joined by id in hash partitions of at most :data:`DIFF_PART_ROWS` rows, on local disk: the
driver never holds a whole table.

The plan (:class:`AppendPlan`: the units, with the rows each takes by fragment
offset, and the ids deleted and replaced) is written to ``_progress/append/`` before any
unit runs, so ``--append --resume`` finishes exactly the same append. Units write
ordinary content-named parts (their digest salted by the version,
:func:`~prx_data.export.spec.append_salt`), packed like any export's; then each
bucket's ``index.json`` is rewritten as its old entries, unchanged and in their order,
followed by the new packs' (:func:`merge_appended`). The old shards, manifests and
sidecars are never opened for writing.
"""

from __future__ import annotations

import io
import json
import os
import shutil
import tempfile
from collections.abc import Iterator, Mapping
from dataclasses import asdict, dataclass, field

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from prx_data.core import storage
from prx_data.core.lease import Lease
from prx_data.core.schema import ID, MANIFEST_NAME, SHA256
from prx_data.export import idindex, layout
from prx_data.export.bounded import imap_bounded, io_workers
from prx_data.export.durable import fsync
from prx_data.export.merge import in_bucket
from prx_data.export.naming import (
    INDEX_NAME,
    PART_RE,
    PROGRESS_DIR,
    WRITING_DIR,
    ExportError,
)
from prx_data.export.safety import load_index, remove_tree
from prx_data.export.spec import AppendUnit, ExportConfig

#: Where an append in progress keeps its plan (removed once its report is written).
APPEND_DIR = f"{PROGRESS_DIR}/append"
PLAN_NAME = "plan"
DELETED_IDS = "deleted.parquet"
REPLACED_IDS = "replaced.parquet"
#: The ids and image digests of the table version the export last reached (a Lance table).
ROWS_RECORD = f"{PROGRESS_DIR}/rows.lance"
#: Where each replaced id's current sample is: the one sample of it ``replaced`` keeps.
LIVE_NAME = f"{PROGRESS_DIR}/replaced-live.parquet"
#: The skip lists an append writes (export-only entries: they name this tree's samples).
DELETED_LIST = "deleted"
REPLACED_LIST = "replaced"
#: Rows per side of one hash partition of the diff (about 0.5 GB of Arrow at 64-byte digests).
DIFF_PART_ROWS = 1 << 22
#: Rows a record or a table is read in.
SCAN_BATCH_ROWS = 1 << 16
LIVE_SCHEMA = pa.schema(
    [("id", pa.string()), ("bucket", pa.string()), ("shard", pa.string()), ("index", pa.int32())]
)


class AppendError(ExportError):
    """An append that cannot run on this export (what to do instead is in the message)."""


def plan_dir(out: str) -> str:
    return storage.join(out, *APPEND_DIR.split("/"))


def plan_path(out: str) -> str:
    return storage.join(plan_dir(out), PLAN_NAME)


def record_uri(out: str) -> str:
    return storage.join(out, *ROWS_RECORD.split("/"))


@dataclass
class AppendPlan:
    """An append, decided before any unit runs (JSON text at ``_progress/append/plan``)."""

    #: The table version the append reads and the export reaches.
    version: int
    #: The version the export held before (its config's), and where the comparison came from.
    base_version: int | None
    baseline: str
    units: list[AppendUnit] = field(default_factory=list)
    #: Rows by kind: new, changed, deleted, filtered, no_digest, re_added.
    counts: dict[str, int] = field(default_factory=dict)
    #: The export's time so far (its report's ``seconds``): the report adds the append's.
    seconds_before: float = 0.0

    def to_json(self) -> str:
        d = asdict(self)
        d["units"] = [json.loads(u.to_json()) for u in self.units]
        return json.dumps(d, sort_keys=True)

    @classmethod
    def from_json(cls, text: str | bytes) -> AppendPlan:
        d = json.loads(text)
        d["units"] = [AppendUnit.from_json(json.dumps(u)) for u in d["units"]]
        return cls(**d)


def read_plan(out: str) -> AppendPlan | None:
    """The plan of an append in progress (None: none is)."""
    try:
        return AppendPlan.from_json(storage.read_bytes(plan_path(out)))
    except FileNotFoundError:
        return None


def read_ids(out: str, name: str) -> pa.Array:
    """The ids a plan deleted or replaced (``DELETED_IDS`` / ``REPLACED_IDS``)."""
    try:
        data = storage.read_bytes(storage.join(plan_dir(out), name))
    except FileNotFoundError:
        return pa.array([], pa.string())
    return pq.read_table(io.BytesIO(data))["id"].combine_chunks()


def _write_ids(out: str, name: str, ids: pa.Array) -> None:
    buf = io.BytesIO()
    pq.write_table(pa.table({"id": ids.cast(pa.string())}), buf, compression="zstd")
    storage.write_bytes_atomic(storage.join(plan_dir(out), name), buf.getvalue())


# --- the two sides of the comparison ---------------------------------------------------------


def _digests(batch: pa.RecordBatch | pa.Table) -> pa.Array:
    if SHA256 in batch.schema.names:
        col = batch.column(batch.schema.get_field_index(SHA256))
        col = col.combine_chunks() if isinstance(col, pa.ChunkedArray) else col
        return pc.if_else(pc.equal(col, ""), pa.scalar(None, pa.string()), col.cast(pa.string()))
    return pa.nulls(batch.num_rows, pa.string())


def table_side(ds, row_filter: str | None) -> Iterator[pa.Table]:
    """``(id, new_sha, keep, fragment_id, offset)`` of every live row of ``ds``, by fragment.

    ``offset`` counts the fragment's live rows in scan order, as
    :meth:`lance.LanceFragment.take` does; ``keep`` is the export's ``--filter``.
    """
    cols = {ID: ID}
    if SHA256 in ds.schema.names:
        cols[SHA256] = SHA256
    if row_filter:
        cols["_keep"] = f"coalesce(({row_filter}), false)"
    for frag in ds.get_fragments():
        offset = 0
        for b in frag.to_batches(columns=cols, batch_size=SCAN_BATCH_ROWS):
            n = b.num_rows
            keep = b.column(b.schema.get_field_index("_keep")) if row_filter else None
            yield pa.table(
                {
                    "id": b.column(b.schema.get_field_index(ID)).cast(pa.string()),
                    "new_sha": _digests(b),
                    "keep": keep if keep is not None else pa.array(np.ones(n, bool)),
                    "fragment_id": pa.array(np.full(n, frag.fragment_id, np.int64)),
                    "offset": pa.array(np.arange(offset, offset + n, dtype=np.int64)),
                }
            )
            offset += n


def _seen(t: pa.Table) -> pa.Table:
    return pa.table({"id": t["id"].cast(pa.string()), "old_sha": _digests(t)})


def baseline(out: str, cfg: ExportConfig, previous_version: int | None):
    """(``(id, old_sha)`` tables of what the export saw, where they come from)."""
    from prx_data.table.lance_ops import open_table

    uri = record_uri(out)
    if storage.exists(uri):
        ds = open_table(uri)
        return (_seen(b) for b in ds.to_batches(batch_size=SCAN_BATCH_ROWS)), "record"
    if previous_version is not None:
        try:
            old = open_table(cfg.table, version=previous_version)
        except (ValueError, OSError):
            old = None
        if old is not None:
            cols = [c for c in (ID, SHA256) if c in old.schema.names]
            batches = old.to_batches(columns=cols, batch_size=SCAN_BATCH_ROWS)
            return (_seen(pa.Table.from_batches([b])) for b in batches), f"table@{previous_version}"
    index, why = idindex.open_index(out)
    if index is None:
        raise AppendError(
            f"cannot append to {out}: version {previous_version} of {cfg.table}, which it "
            f"holds, was cleaned up and {why}; build the id index with `python -m "
            f"prx_data.skips index {out}`, then append again"
        )
    batches = index.dataset.to_batches(columns=[ID], batch_size=SCAN_BATCH_ROWS)  # type: ignore[attr-defined]
    return (_seen(pa.Table.from_batches([b])) for b in batches), "id-index"


# --- the diff -------------------------------------------------------------------------------


def _partition_of(ids: pa.Array, parts: int) -> np.ndarray:
    import pandas as pd

    values = ids.to_numpy(zero_copy_only=False)
    return (pd.util.hash_array(values, categorize=False) % np.uint64(parts)).astype(np.int64)


class _Spill:
    """Tables of one side, hash-partitioned by id into ``parts`` parquet files on local disk."""

    def __init__(self, tmp: str, side: str, parts: int):
        self.parts, self.paths = (
            parts,
            [os.path.join(tmp, f"{side}-{i}.parquet") for i in range(parts)],
        )
        self.writers: list[pq.ParquetWriter | None] = [None] * parts

    def add(self, t: pa.Table) -> None:
        if not len(t):
            return
        if self.parts == 1:
            self._write(0, t)
            return
        which = _partition_of(t["id"].combine_chunks(), self.parts)
        order = np.argsort(which, kind="stable")
        which, t = which[order], t.take(pa.array(order))
        cuts = np.flatnonzero(np.diff(which)) + 1
        for lo, hi in zip(np.r_[0, cuts], np.r_[cuts, len(which)], strict=True):
            self._write(int(which[lo]), t.slice(int(lo), int(hi - lo)))

    def _write(self, i: int, t: pa.Table) -> None:
        if self.writers[i] is None:
            self.writers[i] = pq.ParquetWriter(self.paths[i], t.schema)
        self.writers[i].write_table(t)  # type: ignore[union-attr]

    def close(self) -> None:
        for w in self.writers:
            if w is not None:
                w.close()

    def read(self, i: int, schema: pa.Schema) -> pa.Table:
        if self.writers[i] is None:
            return schema.empty_table()
        return pq.read_table(self.paths[i])


@dataclass
class Diff:
    """What :func:`diff` found: the rows to write (fragment, offset), and the ids to skip."""

    todo: pa.Table
    deleted: pa.Array
    replaced: pa.Array
    counts: dict[str, int]


TODO_SCHEMA = pa.schema([("fragment_id", pa.int64()), ("offset", pa.int64()), ("id", pa.string())])


def diff(table: Iterator[pa.Table], seen: Iterator[pa.Table], rows: int) -> Diff:
    """Join the table's rows with the export's by id (see the module docstring).

    ``rows``: about how many rows both sides hold, which sets the partitions.
    """
    parts = max(1, -(-rows // DIFF_PART_ROWS))
    tmp = tempfile.mkdtemp(prefix="prx-append-diff-")
    try:
        new, old = _Spill(tmp, "new", parts), _Spill(tmp, "old", parts)
        new_schema = old_schema = None
        for t in table:
            new_schema = t.schema
            new.add(t)
        for t in seen:
            old_schema = t.schema
            old.add(t)
        new.close()
        old.close()
        todo, deleted, replaced = [], [], []
        counts = dict.fromkeys(("new", "changed", "deleted", "filtered", "no_digest"), 0)
        for i in range(parts):
            n = new.read(i, new_schema or pa.schema([]))
            o = old.read(i, old_schema or pa.schema([]))
            if old_schema is None or not len(o):
                o = pa.table(
                    {"id": pa.array([], pa.string()), "old_sha": pa.array([], pa.string())}
                )
            g = o.group_by("id").aggregate([("old_sha", "max")])  # an id in several buckets
            o = pa.table(
                {
                    "id": g["id"],
                    "old_sha": g["old_sha_max"],
                    "seen": pa.array(np.ones(len(g), bool)),
                }
            )
            if new_schema is None or not len(n):
                gone = o["id"]
                deleted.append(gone.combine_chunks())
                counts["deleted"] += len(gone)
                continue
            n = n.append_column("here", pa.array(np.ones(len(n), bool)))
            j = n.join(o, keys="id", join_type="full outer")
            here = pc.fill_null(j["here"], False)
            seen_ = pc.fill_null(j["seen"], False)
            keep = pc.fill_null(j["keep"], False)
            fresh = pc.and_(here, pc.invert(seen_))
            gone = pc.and_(seen_, pc.invert(here))
            both = pc.and_(here, seen_)
            no_digest = pc.and_(both, pc.is_null(j["old_sha"]))
            changed = pc.and_(both, pc.fill_null(pc.not_equal(j["old_sha"], j["new_sha"]), False))
            write = pc.and_(pc.or_(fresh, changed), keep)
            counts["new"] += pc.sum(pc.and_(fresh, keep)).as_py() or 0
            counts["filtered"] += pc.sum(pc.and_(fresh, pc.invert(keep))).as_py() or 0
            counts["changed"] += pc.sum(changed).as_py() or 0
            counts["deleted"] += pc.sum(gone).as_py() or 0
            counts["no_digest"] += pc.sum(no_digest).as_py() or 0
            todo.append(j.filter(write).select(["fragment_id", "offset", "id"]))
            deleted.append(j.filter(gone)["id"].combine_chunks())
            replaced.append(j.filter(changed)["id"].combine_chunks())
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    todo_t = (
        pa.concat_tables([t.cast(TODO_SCHEMA) for t in todo]) if todo else TODO_SCHEMA.empty_table()
    )
    todo_t = todo_t.sort_by([("fragment_id", "ascending"), ("offset", "ascending")])

    def ids(arrays: list[pa.Array]) -> pa.Array:
        a = (
            pa.concat_arrays([x.cast(pa.string()) for x in arrays])
            if arrays
            else pa.array([], pa.string())
        )
        return a.take(pc.sort_indices(a))

    return Diff(todo_t, ids(deleted), ids(replaced), counts)


def plan_units(
    todo: pa.Table, rows_per_task: int, version: int, min_units: int | None = None
) -> list[AppendUnit]:
    """Cut the rows to write (sorted by fragment and offset) into units of one fragment and
    at most ``rows_per_task`` rows (and at most ``ceil(rows / min_units)``, so that a small
    append still uses every core, as an export's plan does), each as runs of consecutive
    offsets."""
    per_unit = max(1, rows_per_task)
    if (min_units or 0) > 0 and len(todo):
        per_unit = min(per_unit, -(-len(todo) // min_units))  # type: ignore[operator]
    frags = todo["fragment_id"].to_numpy()
    offs = todo["offset"].to_numpy()
    units: list[AppendUnit] = []
    if not len(frags):
        return units
    bounds = np.flatnonzero(np.diff(frags)) + 1
    for lo, hi in zip(np.r_[0, bounds], np.r_[bounds, len(frags)], strict=True):
        for s in range(int(lo), int(hi), per_unit):
            e = min(int(hi), s + per_unit)
            o = offs[s:e]
            breaks = np.flatnonzero(np.diff(o) != 1) + 1
            starts = np.r_[0, breaks]
            ends = np.r_[breaks, len(o)]
            runs = tuple((int(o[a]), int(o[b - 1]) + 1) for a, b in zip(starts, ends, strict=True))
            units.append(AppendUnit(int(frags[s]), s, e - s, runs, version))
    return units


def write_plan(out: str, plan: AppendPlan, d: Diff) -> None:
    """The ids lists first, the plan last: a plan on disk is a whole one."""
    _write_ids(out, DELETED_IDS, d.deleted)
    _write_ids(out, REPLACED_IDS, d.replaced)
    storage.write_bytes_atomic(plan_path(out), plan.to_json().encode())


def drop_plan(out: str) -> None:
    storage.delete(plan_dir(out))


# --- joining the export -----------------------------------------------------------------------


def old_parts(out: str, bucket: str, new: set[str]) -> list[dict]:
    """The bucket's merged index entries that this append did not write, in their order."""
    path = storage.join(out, *bucket.split("/"), INDEX_NAME)
    if not storage.exists(path):
        return []
    entries = load_index(path, root=out)
    return [e for e in entries if e["raw_data"]["basename"].split("/")[0] not in new]


def merge_appended(
    out: str, new: Mapping[str, Mapping[str, int]], lease: Lease | None = None
) -> dict[str, int]:
    """Each touched bucket's ``index.json``: its old entries, byte for byte the same objects in
    the same order, then the new parts' (``new``: {bucket: {part: samples}}), written atomically.

    Idempotent: entries of the new parts already merged (a resumed append) are replaced,
    never doubled. Returns the samples each touched bucket holds now.
    """
    counts: dict[str, int] = {}
    for bucket, parts in sorted(new.items()):
        names = set(parts)
        shards = old_parts(out, bucket, names)
        bdir = storage.join(out, *bucket.split("/"))
        for part in sorted(parts):
            entries = load_index(storage.join(bdir, part, INDEX_NAME), in_part=True, root=out)
            n = sum(int(e["samples"]) for e in entries)
            if n != parts[part]:
                raise ExportError(
                    f"{bucket}/{part}: its index holds {n} samples, the append wrote {parts[part]}"
                )
            shards += in_bucket(entries, part)
        body = json.dumps({"version": 2, "shards": shards}, sort_keys=True)
        if lease is not None:
            lease.check()
        storage.write_bytes_atomic(storage.join(bdir, INDEX_NAME), body.encode())
        if not storage.is_remote(out):
            fsync(bdir)
        counts[bucket] = sum(int(s["samples"]) for s in shards)
    return counts


def bucket_counts(out: str) -> dict[str, int]:
    """Samples of every bucket of the export, from its merged indexes."""
    return {b: sum(s.samples for s in layout.read_index(out, b)) for b in layout.list_buckets(out)}


def remove_unlisted_parts(out: str, keep: set[str]) -> int:
    """Part folders no merged index names and no finished unit or pack of this append keeps
    (``keep``: ``<tier>/<ar>/<part>``): what a killed append left half-written. Local or remote."""
    removed = 0
    if not storage.is_remote(out):
        remove_tree(os.path.join(out, *WRITING_DIR.split("/")))
    for bucket in layout.list_buckets(out) + _unindexed_buckets(out):
        path = storage.join(out, *bucket.split("/"), INDEX_NAME)
        listed = set()
        if storage.exists(path):
            listed = {e["raw_data"]["basename"].split("/")[0] for e in load_index(path, root=out)}
        for part in _part_dirs(out, bucket):
            if part not in listed and f"{bucket}/{part}" not in keep:
                storage.delete(storage.join(out, *bucket.split("/"), part))
                removed += 1
    return removed


def _part_dirs(out: str, bucket: str) -> list[str]:
    bdir = storage.join(out, *bucket.split("/"))
    if storage.is_remote(out):
        names = {r.split("/")[0] for r in storage.list_files(bdir) if "/" in r}
    else:
        names = {n for n in os.listdir(bdir) if os.path.isdir(os.path.join(bdir, n))}
    return sorted(n for n in names if PART_RE.fullmatch(n))


def _unindexed_buckets(out: str) -> list[str]:
    """Buckets with part folders but no merged index yet (a bucket an append opened)."""
    from prx_data.export.naming import AR_RE, TIER_RE

    found = set()
    if storage.is_remote(out):
        for rel in storage.list_files(out):
            bits = rel.split("/")
            if len(bits) == 4 and TIER_RE.fullmatch(bits[0]) and AR_RE.fullmatch(bits[1]):
                found.add(f"{bits[0]}/{bits[1]}")
    else:
        for tier in os.listdir(out):
            tdir = os.path.join(out, tier)
            if TIER_RE.fullmatch(tier) and os.path.isdir(tdir) and not os.path.islink(tdir):
                for ar in os.listdir(tdir):
                    if AR_RE.fullmatch(ar) and os.path.isdir(os.path.join(tdir, ar)):
                        found.add(f"{tier}/{ar}")
    return sorted(found - set(layout.list_buckets(out)))


# --- state kept after the append ------------------------------------------------------------


def write_record(out: str, ds) -> int:
    """``_progress/rows.lance``: ``(id, sha256)`` of every row of ``ds`` (streamed), replacing
    the previous record. Returns its rows."""
    import lance

    from prx_data.table.lance_ops import lance_storage_options

    cols = [c for c in (ID, SHA256) if c in ds.schema.names]
    schema = pa.schema([("id", pa.string()), ("sha256", pa.string())])

    def batches() -> Iterator[pa.RecordBatch]:
        for b in ds.to_batches(columns=cols, batch_size=SCAN_BATCH_ROWS):
            t = pa.table({"id": b.column(0).cast(pa.string()), "sha256": _digests(b)})
            yield from t.to_batches()

    uri = record_uri(out)
    reader = pa.RecordBatchReader.from_batches(schema, batches())
    rec = lance.write_dataset(
        reader,
        uri,
        mode="overwrite" if storage.exists(uri) else "create",
        storage_options=lance_storage_options(uri),
    )
    try:
        import datetime as dt

        rec.cleanup_old_versions(older_than=dt.timedelta(0), error_if_tagged_old_versions=False)
    except (ValueError, OSError):
        pass  # an older record's files: they only take room
    return rec.count_rows()


def read_live(out: str) -> pa.Table:
    """Where each replaced id's current sample is (``id, bucket, shard, index``)."""
    path = storage.join(out, *LIVE_NAME.split("/"))
    try:
        data = storage.read_bytes(path)
    except FileNotFoundError:
        return LIVE_SCHEMA.empty_table()
    return pq.read_table(io.BytesIO(data)).cast(LIVE_SCHEMA)


def update_live(out: str, new_parts: Mapping[str, Mapping[str, int]], ids: pa.Array) -> int:
    """Record where the samples this append wrote for ``ids`` (replaced rows) are, in place of
    what was recorded for those ids before. Reads only the new parts' manifests."""
    if not len(ids):
        return 0
    found = []
    jobs = [(b, p) for b, parts in sorted(new_parts.items()) for p in sorted(parts)]

    def read(bp: tuple[str, str]) -> pa.Table:
        b, p = bp
        data = storage.read_bytes(storage.join(out, *b.split("/"), p, MANIFEST_NAME))
        t = pq.read_table(io.BytesIO(data), columns=["shard", "index", "id"])
        t = t.filter(pc.is_in(t["id"], value_set=ids))
        return pa.table(
            {
                "id": t["id"].cast(pa.string()),
                "bucket": pa.array([b] * len(t), pa.string()),
                "shard": t["shard"].cast(pa.string()),
                "index": t["index"].cast(pa.int32()),
            },
            schema=LIVE_SCHEMA,
        )

    for t in imap_bounded(read, jobs, io_workers(out)):
        if len(t):
            found.append(t)
    live = read_live(out)
    live = live.filter(pc.invert(pc.is_in(live["id"], value_set=ids)))
    live = pa.concat_tables([live, *found]).sort_by("id")
    buf = io.BytesIO()
    pq.write_table(live, buf, compression="zstd")
    storage.write_bytes_atomic(storage.join(out, *LIVE_NAME.split("/")), buf.getvalue())
    return sum(len(t) for t in found)


def live_keys(out: str, bucket: str) -> pa.Array:
    """``<shard>#<index>`` of the current samples of replaced ids in ``bucket``."""
    live = read_live(out)
    live = live.filter(pc.equal(live["bucket"], bucket))
    return pc.binary_join_element_wise(
        live["shard"], live["index"].cast(pa.string()), "#"
    ).combine_chunks()
