"""One runner for every column job: pinned version, per fragment, written once, resumable.

Caption, classify, pHash, descriptors, quality and scores all turn some
columns of each row into new columns. They share this runner, which gives them the same
guarantees at any table size:

- **Pinned version.** The job reads the version current at its start. A
  missing output column is added (all null, metadata-only) just before the
  first data file is written, so a job that fails before that leaves the
  table as it was. Rows
  appended while it runs live in new fragments: they are not touched and stay
  pending for the next run.
- **Per fragment, written once.** Work is planned per fragment from one scan
  of the pending filter (``_rowaddr`` only), so rows are addressed by
  fragment id and row address, never by looking ids up. When a fragment's
  last result arrives its new values are placed by row address into one new
  data file holding only the output columns for all of the fragment's rows
  (:func:`write_columns`: a direct file write, no join); the image data
  files are never rewritten. Fragments are committed in batches, each batch
  one ``Update(rewrite_columns)`` checked against the pinned version. Cost
  is linear in the rows processed.
- **Pinned, also against cleanup.** While the job runs, its version
  carries a tag (``prx-col-<name>-...``, :mod:`prx_data.table.pins`), so
  ``table compact --cleanup`` keeps it; the job removes the tag when it
  ends, and a killed job's tag is moved and removed by its next run.
- **Resumable.** A fragment whose new data file is written gets a
  checkpoint (``<table>/_prx_column_jobs/<name>/f<id>.json``: the fragment
  as read and as written). A killed run leaves the committed fragments done
  and the checkpointed ones committable: the next run commits them without
  recomputing (when the fragment has not changed since) and plans the rest.
- **One runner.** Work units (a fragment, or a row range of a large one)
  run through :func:`prx_data.core.runtime.map_units`: on driver threads for
  a small job (``engine="auto"``, at most ``small_rows`` pending rows, no
  cluster named) or ``engine="local"``, else on Ray (a private local Ray or
  ``RAY_ADDRESS``). Each unit is read and passed through every step in one
  task (an actor holding the models when a step is a class), and only the
  output columns come back to the driver.
- **Failures per row.** Steps return an output row for every input row; a
  row that failed gets its reason in a ``<column>_status`` /
  ``<column>_error`` output column, so it is in the table, not only in the
  run report.

A step is a function ``batch -> batch`` or a class (one instance per
actor). It receives a ``pyarrow.Table`` with the job's ``read_columns`` plus
``_rowaddr`` and returns a table with the same rows in the same order; the
runner carries ``_rowaddr`` across steps when a step drops it.
"""

from __future__ import annotations

import json
import re
import time
import uuid
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from prx_data.columns.writeback import ColumnReport, count_into
from prx_data.core import lance_compat, runtime, storage
from prx_data.core.errors import Conflict, UsageError
from prx_data.core.runtime import RunOptions, run_field
from prx_data.table.pins import column_pin, pinned

__all__ = [
    "ColumnJob",
    "SMALL_ROWS",
    "Step",
    "commit_fragments",
    "ensure_columns",
    "iter_results",
    "pending_counts",
    "plan",
    "run_column_job",
    "write_columns",
]

ROWADDR = "_rowaddr"
#: Where a table keeps the checkpoints of unfinished column jobs.
CHECKPOINT_DIR = "_prx_column_jobs"
ENGINES = runtime.ENGINES
#: Column jobs with at most this many pending rows run on driver threads under
#: ``engine="auto"``: starting Ray and its workers costs more than their work.
SMALL_ROWS = 512


@dataclass
class Step:
    """One stage of a column job (see the module docstring for the contract).

    ``fn`` is a function (run as Ray tasks) or a class (``actors`` instances,
    each built once with ``constructor_args``; models live there).
    """

    fn: Callable | type
    kwargs: dict[str, Any] = field(default_factory=dict)
    constructor_args: tuple = ()
    batch_size: int | None = None
    actors: int | None = None
    num_cpus: float | None = None
    num_gpus: float | None = None
    zero_copy_batch: bool = False

    @property
    def is_class(self) -> bool:
        return isinstance(self.fn, type)


@dataclass
class ColumnJob:
    """What a column job computes and where it writes; see :func:`run_column_job`."""

    table: str
    #: Columns written to the table (all nullable), in order.
    outputs: pa.Schema
    #: Table columns the first step reads.
    read_columns: list[str]
    steps: list[Step]
    #: Lance SQL selecting the rows to process at the pinned version (None: all).
    where: str | None = None
    #: Checkpoint namespace (default: the first output column).
    name: str | None = None
    limit: int | None = None
    #: engine, Ray cluster, CPUs, progress bar: the same for every job (``--engine``, ...).
    run: RunOptions = run_field()
    #: ``engine="auto"``: jobs of at most this many pending rows stay on driver threads.
    small_rows: int = SMALL_ROWS
    #: Rows per read batch.
    batch_size: int = 256
    #: Split fragments with more pending rows than this into row-range units
    #: (with Ray, also smaller ones so that every CPU gets about four units).
    rows_per_unit: int | None = 100_000
    #: Fragments per commit; a commit also happens every ``commit_seconds``.
    commit_every: int = 16
    commit_seconds: float = 60.0
    #: Report: count the values of this column (nulls as ``null_as``) ...
    count_column: str | None = None
    null_as: str | None = "error"
    #: ... and of this one (a reason column; it need not be written).
    reason_column: str | None = None
    storage_options: dict | None = None
    #: CPUs each read task asks Ray for.
    read_cpus: float = 0.5
    desc: str | None = None
    #: Called with (fragment id, fragments checkpointed so far) after each
    #: checkpoint: progress hooks, and tests that simulate a kill.
    on_fragment: Callable[[int, int], None] | None = None

    def __post_init__(self) -> None:
        if not len(self.outputs):
            raise UsageError("a column job needs at least one output column")
        if ROWADDR in self.outputs.names:
            raise UsageError(f"{ROWADDR} is not an output column")
        if self.limit is not None and self.limit < 0:
            raise UsageError(f"limit must be >= 0, got {self.limit}")
        if self.commit_every < 1 or self.batch_size < 1:
            raise UsageError("commit_every and batch_size must be >= 1")
        if self.rows_per_unit is not None and self.rows_per_unit < 1:
            raise UsageError("rows_per_unit must be >= 1 (or None)")

    @property
    def job_name(self) -> str:
        return self.name or self.outputs.names[0]


@dataclass(frozen=True)
class Unit:
    """Rows ``offset .. offset+count`` of a fragment's pending rows (in physical order)."""

    fragment: int
    offset: int
    count: int


# --- table-side helpers ------------------------------------------------------------------


def _open(uri: str, storage_options: dict | None, version: int | None = None):
    from prx_data.table.lance_ops import open_table

    return open_table(uri, storage_options, version)


def missing_columns(ds, outputs: pa.Schema) -> list[pa.Field]:
    """The output columns ``ds`` lacks; an existing one of another type is refused."""
    names = ds.schema.names
    for f in outputs:
        if f.name in names and ds.schema.field(f.name).type != f.type:
            raise UsageError(
                f"column {f.name!r} is {ds.schema.field(f.name).type} in {ds.uri!r}, "
                f"this job writes {f.type}"
            )
    return [pa.field(f.name, f.type, nullable=True) for f in outputs if f.name not in names]


def ensure_columns(uri: str, outputs: pa.Schema, storage_options: dict | None = None) -> int:
    """Add the output columns the table lacks (all null, no data written); returns the version."""
    ds = _open(uri, storage_options)
    missing = missing_columns(ds, outputs)
    if missing:
        ds.add_columns(missing)
        ds = _open(uri, storage_options)
    return ds.version


def pending_counts(ds, where: str | None) -> dict[int, int]:
    """Pending rows per fragment id, in fragment order, from one ``_rowaddr`` scan."""
    if where is None:
        return {f.fragment_id: f.count_rows() for f in ds.get_fragments()}
    counts: Counter = Counter()
    # One fragment read ahead: Lance's default buffers several, which at 10^7 rows and
    # more is what the driver's memory grows with (benchmarks/results/download-plan.md).
    scanner = ds.scanner(
        columns=[],
        filter=where,
        with_row_address=True,
        batch_size=1 << 16,
        fragment_readahead=1,
        batch_readahead=4,
    )
    for batch in scanner.to_batches():
        if batch.num_rows:
            frag = np.asarray(batch.column(ROWADDR)) >> np.uint64(32)
            ids, n = np.unique(frag, return_counts=True)
            for i, c in zip(ids.tolist(), n.tolist(), strict=True):
                counts[int(i)] += c
    order = [f.fragment_id for f in ds.get_fragments()]
    return {i: counts[i] for i in order if counts.get(i)}


def plan_units(
    counts: dict[int, int], limit: int | None, rows_per_unit: int | None
) -> tuple[list[Unit], dict[int, int]]:
    """Work units and the rows expected per fragment (``limit`` takes fragments in order)."""
    units: list[Unit] = []
    expected: dict[int, int] = {}
    left = limit
    for frag, n in counts.items():
        if left is not None:
            if left <= 0:
                break
            n = min(n, left)
            left -= n
        if n <= 0:
            continue
        expected[frag] = n
        step = rows_per_unit or n
        for off in range(0, n, step):
            units.append(Unit(frag, off, min(step, n - off)))
    return units, expected


#: Units per cluster CPU the planner aims for (so every CPU has work even when
#: a table has few fragments), and the smallest row range worth a task.
UNITS_PER_CPU = 4
MIN_ROWS_PER_UNIT = 64


def unit_rows(job: ColumnJob, pending: int, cpus: int) -> int | None:
    """Rows per unit: ``job.rows_per_unit``, smaller when that leaves some of ``cpus`` idle."""
    fair = max(MIN_ROWS_PER_UNIT, -(-pending // (UNITS_PER_CPU * cpus)))
    return min(job.rows_per_unit, fair) if job.rows_per_unit else fair


def plan(
    job: ColumnJob, counts: dict[int, int]
) -> tuple[runtime.Placement, list[Unit], dict[int, int]]:
    """Where ``job`` runs (:func:`prx_data.core.runtime.place` by its pending rows), its
    work units and the rows expected per fragment. On Ray every CPU gets units."""
    pending = sum(counts.values())
    if job.limit is not None:
        pending = min(pending, job.limit)
    where = runtime.place(
        job.run.engine,
        size=pending,
        small=job.small_rows,
        ray_address=job.run.ray_address,
        num_cpus=job.run.num_cpus,
    )
    rows_per_unit = job.rows_per_unit
    if where.on_ray and pending:
        rows_per_unit = unit_rows(job, pending, runtime.placement_cpus(where))
    units, expected = plan_units(counts, job.limit, rows_per_unit)
    return where, units, expected


def _pinned(uri: str, version: int, storage_options: dict | None, run: str = ""):
    """The pinned dataset, from the process's one cache (:func:`lance_ops.pinned_table`)."""
    from prx_data.table.lance_ops import pinned_table

    return pinned_table(uri, version, storage_options, run)


def read_unit(
    unit: Unit,
    *,
    uri: str,
    version: int,
    columns: list[str],
    where: str | None,
    batch_size: int,
    storage_options: dict | None = None,
    run: str = "",
) -> Iterator[pa.Table]:
    """The unit's rows (``columns`` + ``_rowaddr``) at the pinned version, in batches."""
    frag = _pinned(uri, version, storage_options, run).get_fragment(unit.fragment)
    scanner = frag.scanner(
        columns=columns,
        filter=where,
        offset=unit.offset or None,
        limit=unit.count,
        with_row_address=True,
        batch_size=batch_size,
    )
    for batch in scanner.to_batches():
        if batch.num_rows:
            yield pa.Table.from_batches([batch])


# --- checkpoints and commits ----------------------------------------------------------


def checkpoint_root(uri: str, name: str) -> str:
    return storage.join(uri, CHECKPOINT_DIR, name)


def _storage_version(ds) -> tuple[int, int] | None:
    try:
        major, minor = (int(x) for x in str(ds.data_storage_version).split(".")[:2])
    except (ValueError, AttributeError):
        return None
    return (major, minor) if major >= 2 else None


def _flat(t: pa.DataType) -> bool:
    """One column per field in the file (no child field ids): primitives, fixed-size lists."""
    if pa.types.is_fixed_size_list(t):
        return _flat(t.value_type) and not pa.types.is_nested(t.value_type)
    return not pa.types.is_nested(t)


def write_columns(ds, frag, values: pa.Table, outputs: pa.Schema, storage_options=None):
    """One new data file with ``outputs`` for every physical row of ``frag``.

    ``values`` (``_rowaddr`` + outputs) sets the rows it names; the others
    keep their current value (null when the fragment holds none yet). The
    file is written directly (``LanceFileWriter``) and the fragment's
    metadata points the output fields at it (older files holding them get
    the field tombstoned, as ``update_columns`` does), so there is no join:
    the cost is one pass over the fragment's output columns. Tables in the
    legacy file format, and nested output types (structs, variable lists:
    their child fields have ids of their own), fall back to
    ``LanceFragment.update_columns``.
    Returns ``(FragmentMetadata, field ids)`` for an ``Update(rewrite_columns)``.
    """
    from lance.file import LanceFileWriter

    version = _storage_version(ds)
    if version is None or not all(_flat(f.type) for f in outputs):
        return frag.update_columns(values, left_on=ROWADDR)
    base = frag.metadata
    n = base.physical_rows
    ids = [ds.lance_schema.field(name).id() for name in outputs.names]
    held = any(set(f.field_ids()) & set(ids) for f in base.data_files())
    sources = []
    index = np.full(n, -1, np.int64)
    if held:  # rows the job does not set keep what the table has
        cur = frag.to_table(columns=outputs.names, with_row_address=True)
        cur_off = (np.asarray(cur[ROWADDR]) & np.uint64(0xFFFFFFFF)).astype(np.int64)
        index[cur_off] = np.arange(cur.num_rows)
        sources.append(cur.select(outputs.names))
    new_off = (np.asarray(values[ROWADDR]) & np.uint64(0xFFFFFFFF)).astype(np.int64)
    offset = sum(t.num_rows for t in sources)
    index[new_off] = offset + np.arange(values.num_rows)
    sources.append(values.select(outputs.names))
    src = pa.concat_tables(sources).cast(outputs)
    take = pa.array(index, pa.int64(), mask=index < 0)
    table = pa.Table.from_arrays([pc.take(src[c], take) for c in outputs.names], schema=outputs)
    name = f"{uuid.uuid4().hex}.lance"
    path = storage.join(ds.uri, "data", name)
    writer = LanceFileWriter(
        path, outputs, version=f"{version[0]}.{version[1]}", storage_options=storage_options
    )
    writer.write_batch(table)
    writer.close()
    try:
        fs, inner = storage.filesystem(path)
        size = fs.get_file_info(inner).size
    except Exception:  # the size is a hint to readers, not required
        size = None
    return lance_compat.with_data_file(base, name, ids, version, size), ids


def _fragment_key(meta) -> tuple:
    """What a fragment's rows are: its data files, row count and deletions."""
    deletion = meta.deletion_file
    return (
        tuple(f.path for f in meta.data_files()),
        meta.physical_rows,
        None if deletion is None else str(deletion),
    )


class Committer:
    """Writes each finished fragment's columns once, checkpoints it, commits in batches."""

    def __init__(self, job: ColumnJob, ds, name: str):
        self.job = job
        self.ds = ds  # the pinned version
        self.root = checkpoint_root(job.table, name)
        self.pending: list[tuple[int, Any, list[int], str]] = []
        self.last_commit = time.monotonic()
        self.fragments_written = 0
        self.rows_written = 0
        self.commits = 0
        self.bytes_written = 0
        self.version = ds.version

    def _add_columns(self) -> None:
        """Add the missing output columns, just before the first data file is written.

        Deferred so that a job failing before it has anything to write (a wrong
        model, a backend that is down) leaves the table as it was: no columns,
        no version. Adding all-null columns touches no fragment; the pinned
        fragments must still be there, unchanged, or the job stops (rerun it).
        """
        if not missing_columns(self.ds, self.job.outputs):
            return
        version = ensure_columns(self.job.table, self.job.outputs, self.job.storage_options)
        ds = _open(self.job.table, self.job.storage_options, version)
        now = {f.fragment_id: f.metadata for f in ds.get_fragments()}
        for f in self.ds.get_fragments():
            new = now.get(f.fragment_id)
            if new is None or _fragment_key(new) != _fragment_key(f.metadata):
                raise Conflict(
                    f"the fragments of {self.job.table!r} changed while the column job ran "
                    "(compaction or deletion); nothing was written. Rerun the job."
                )
        self.ds = ds
        self.version = ds.version

    def write(self, fragment: int, values: pa.Table) -> None:
        """Join ``values`` (``_rowaddr`` + outputs) onto the fragment: one new data file."""
        self._add_columns()
        frag = self.ds.get_fragment(fragment)
        base = frag.metadata
        meta, fields = write_columns(
            self.ds, frag, values, self.job.outputs, self.job.storage_options
        )
        old = {f.path for f in base.data_files()}
        self.bytes_written += sum(
            f.file_size_bytes or 0 for f in meta.data_files() if f.path not in old
        )
        path = storage.join(self.root, f"f{fragment}.json")
        record = {
            "fragment": fragment,
            "read_version": self.ds.version,
            "base": base.to_json(),
            "new": meta.to_json(),
            "fields": sorted(int(f) for f in fields),
            "rows": values.num_rows,
        }
        storage.write_bytes_atomic(path, json.dumps(record).encode())
        self.pending.append((fragment, meta, list(fields), path))
        self.fragments_written += 1
        self.rows_written += values.num_rows
        if self.job.on_fragment is not None:
            self.job.on_fragment(fragment, self.fragments_written)
        if (
            len(self.pending) >= self.job.commit_every
            or time.monotonic() - self.last_commit >= self.job.commit_seconds
        ):
            self.commit()

    def commit(self) -> None:
        self.last_commit = time.monotonic()
        if not self.pending:
            return
        self.version = commit_fragments(
            self.job.table,
            [m for _, m, _, _ in self.pending],
            sorted({f for _, _, fs, _ in self.pending for f in fs}),
            self.ds.version,
            self.job.storage_options,
        )
        self.commits += 1
        for _, _, _, path in self.pending:
            storage.delete(path)
        self.pending = []


def commit_fragments(
    uri: str, metas: list, fields: list[int], read_version: int, storage_options=None
) -> int:
    """One ``Update(rewrite_columns)`` for these fragments, checked against ``read_version``."""
    import lance

    op = lance.LanceOperation.Update(
        updated_fragments=metas, fields_modified=fields, update_mode="rewrite_columns"
    )
    try:
        ds = lance.LanceDataset.commit(
            uri, op, read_version=read_version, storage_options=storage_options
        )
    except Exception as e:
        if "conflict" in str(e).lower():
            raise Conflict(
                f"the fragments of {uri!r} changed while the column job ran (compaction, "
                f"deletion or another job on the same column): {str(e).splitlines()[0]}. "
                "Rerun the job: it continues from what is committed."
            ) from e
        raise
    return ds.version


def recover(uri: str, name: str, storage_options: dict | None = None) -> tuple[int, int]:
    """Commit the checkpoints a killed run left (fragments unchanged since); drop the rest.

    Returns (fragments recovered, rows in them).
    """
    root = checkpoint_root(uri, name)
    files = [f for f in storage.list_files(root, ".json")]
    if not files:
        return 0, 0
    ds = _open(uri, storage_options)
    current = {f.fragment_id: f.metadata for f in ds.get_fragments()}
    metas, fields, rows, paths = [], set(), 0, []
    for rel in files:
        path = storage.join(root, rel)
        paths.append(path)
        try:
            rec = json.loads(storage.read_bytes(path))
            base = lance_compat.fragment_from_dict(rec["base"])
            new = lance_compat.fragment_from_dict(rec["new"])
        except (ValueError, KeyError, OSError):
            continue  # a torn or foreign file: ignore
        now = current.get(rec["fragment"])
        if now is None or lance_compat.fragment_key(now) != lance_compat.fragment_key(base):
            continue  # committed already, or the fragment changed: recompute
        old = {f.path for f in base.data_files()}
        if not all(
            storage.exists(storage.join(uri, "data", f.path))
            for f in new.data_files()
            if f.path not in old
        ):
            continue
        metas.append(new)
        fields.update(rec["fields"])
        rows += int(rec.get("rows", 0))
    if metas:
        commit_fragments(uri, metas, sorted(fields), ds.version, storage_options)
    for path in paths:
        storage.delete(path)
    return len(metas), rows


# --- running the steps -----------------------------------------------------------------


def apply_step(fn: Callable, batch: pa.Table, kwargs: dict | None = None) -> pa.Table:
    """Run one step and carry ``_rowaddr`` over (the step must keep rows and their order)."""
    out = fn(batch, **(kwargs or {}))
    if isinstance(out, pa.RecordBatch):
        out = pa.Table.from_batches([out])
    elif isinstance(out, dict):
        out = pa.table(out)
    if out.num_rows != batch.num_rows:
        raise UsageError(
            f"column job step {getattr(fn, '__name__', fn)!r} returned {out.num_rows} rows "
            f"for {batch.num_rows}: steps must return one row per input row"
        )
    if ROWADDR not in out.column_names:
        out = out.append_column(ROWADDR, batch[ROWADDR])
    return out


class _UnitWorker:
    """Reads one work unit and passes it through every step; one per thread or Ray actor.

    Class steps are built once per worker (the models live here) and closed at
    the end; a step's ``batch_size`` splits larger read batches before it.
    """

    def __init__(self, job: ColumnJob, version: int, run: str):
        self.job = job
        self.version = version
        self.run = run
        self.instances = {
            i: s.fn(*s.constructor_args) for i, s in enumerate(job.steps) if s.is_class
        }

    def __call__(self, unit: dict) -> Iterator[pa.Table]:
        job = self.job
        for batch in read_unit(
            Unit(**unit),
            uri=job.table,
            version=self.version,
            columns=job.read_columns,
            where=job.where,
            batch_size=job.batch_size,
            storage_options=job.storage_options,
            run=self.run,
        ):
            for i, step in enumerate(job.steps):
                fn = self.instances.get(i, step.fn)
                kwargs = None if step.is_class else step.kwargs
                n = step.batch_size
                if n and batch.num_rows > n:
                    parts = [batch.slice(o, n) for o in range(0, batch.num_rows, n)]
                    batch = pa.concat_tables([apply_step(fn, b, kwargs) for b in parts])
                else:
                    batch = apply_step(fn, batch, kwargs)
            yield batch

    def close(self) -> None:
        for inst in self.instances.values():
            close = getattr(inst, "close", None)
            if callable(close):
                close()


def _resources(job: ColumnJob) -> runtime.Resources:
    """One task per unit on the read's CPUs; an actor (pool) sized by the model steps."""
    classes = [s for s in job.steps if s.is_class]
    cpus = max([job.read_cpus, *(s.num_cpus for s in job.steps if s.num_cpus is not None)])
    return runtime.Resources(
        num_cpus=cpus,
        num_gpus=max([0.0, *(s.num_gpus or 0.0 for s in job.steps)]),
        actors=max(s.actors or 1 for s in classes) if classes else None,
    )


def _results(
    job: ColumnJob, units: list[Unit], version: int, where: runtime.Placement, **bar
) -> Iterator[pa.Table]:
    worker = _UnitWorker if any(s.is_class for s in job.steps) else None
    items = [u.__dict__ for u in units]
    res = _resources(job)
    run = uuid.uuid4().hex
    if worker is None:  # a plain function: no instances to hold
        fn = _UnitWorker(job, version, run)
    else:
        fn, res = worker, replace(res, constructor_args=(job, version, run))
    return runtime.map_units(fn, items, where, res, tables=True, **bar)


def iter_results(
    job: ColumnJob, units: list[Unit], version: int, where: runtime.Placement | None = None
) -> Iterator[pa.Table]:
    """The last step's batches for ``units`` at the pinned ``version``, written nowhere.

    For jobs that place their rows themselves (the download job moves the rows
    it fills into new fragments instead of rewriting a fragment's column).
    ``where``: from :func:`plan` (default: placed by the units' rows).
    """
    if where is None:
        where = runtime.place(
            job.run.engine,
            size=sum(u.count for u in units),
            small=job.small_rows,
            ray_address=job.run.ray_address,
            num_cpus=job.run.num_cpus,
        )
    return _results(job, units, version, where)


# --- the job -------------------------------------------------------------------------------


def run_column_job(job: ColumnJob) -> ColumnReport:
    """Run ``job`` (see the module docstring); returns the report (rows, counts, reasons)."""
    start = time.perf_counter()
    name = job.job_name
    report = ColumnReport(job.table, list(job.outputs.names))
    # A column of the wrong type stops here; missing ones are added by the first write,
    # unless the pending filter names one (it must exist to be scanned).
    missing = missing_columns(_open(job.table, job.storage_options), job.outputs)
    if job.where and any(re.search(rf"\b{re.escape(f.name)}\b", job.where) for f in missing):
        ensure_columns(job.table, job.outputs, job.storage_options)
    report.recovered_fragments, report.recovered_rows = recover(
        job.table, name, job.storage_options
    )
    ds = _open(job.table, job.storage_options)  # the pinned version
    with pinned(ds, column_pin(name), job.table, job="column job", column=name):
        return _run_pinned(job, ds, report, start)


def _run_pinned(job: ColumnJob, ds, report: ColumnReport, start: float) -> ColumnReport:
    """The job at its pinned version ``ds`` (tagged, so a cleanup meanwhile keeps it)."""
    name = job.job_name
    report.table_version = ds.version
    where, units, expected = plan(job, pending_counts(ds, job.where))
    total = report.pending = sum(expected.values())
    report.fragments = len(expected)
    report.units = len(units)
    if not units:
        report.seconds = time.perf_counter() - start
        return report

    committer = Committer(job, ds, name)
    keep = [ROWADDR, *job.outputs.names]
    buffers: dict[int, list[pa.Table]] = {}
    received: Counter = Counter()
    counts: Counter = Counter()
    reasons: Counter = Counter()
    results = _results(
        job,
        units,
        ds.version,
        where,
        desc=job.desc or f"column job {name}",
        progress=job.run.progress,
        total=total,
        weight=lambda b: b.num_rows,
        postfix=lambda: dict(counts.most_common(4)),
        unit_name="row",
    )
    t0 = time.perf_counter()
    ok = False
    try:
        for batch in results:
            if batch.num_rows == 0:
                continue
            if not report.first_rows:
                report.first_result_s = time.perf_counter() - t0
                report.first_rows = batch.num_rows
            missing = [c for c in keep if c not in batch.column_names]
            if missing:
                raise UsageError(f"the last step of column job {name!r} did not return {missing}")
            if job.count_column:
                col = batch[job.count_column]
                count_into(counts, col)
                if col.null_count and job.null_as:
                    counts[job.null_as] += col.null_count
            if job.reason_column and job.reason_column in batch.column_names:
                count_into(reasons, batch[job.reason_column])
            out = batch.select(keep).cast(pa.schema([pa.field(ROWADDR, pa.uint64()), *job.outputs]))
            frag = pc.shift_right(out[ROWADDR], 32)
            frags = pc.unique(frag).to_pylist()
            for f in frags:
                part = out if len(frags) == 1 else out.filter(pc.equal(frag, f))
                buffers.setdefault(f, []).append(part)
                received[f] += part.num_rows
                if received[f] >= expected.get(f, 0):
                    committer.write(f, pa.concat_tables(buffers.pop(f)))
            report.rows += batch.num_rows
        ok = True
    finally:
        results.close()
        try:
            if ok:
                # Rows a step left out stay pending; the rest of those fragments is written.
                for f in list(buffers):
                    committer.write(f, pa.concat_tables(buffers.pop(f)))
            committer.commit()  # keep what is done, also when the job stops early
        except Exception:
            if ok:
                raise
        report.seconds = time.perf_counter() - start
        report.counts = dict(counts)
        report.reasons = dict(reasons)
        report.written = committer.rows_written
        report.fragments_written = committer.fragments_written
        report.commits = committer.commits
        report.bytes_written = committer.bytes_written
        report.final_version = committer.version
    return report
