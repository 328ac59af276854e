"""One runner for every column job: pinned version, per fragment, written once, resumable.

Caption, classify, pHash, descriptors, quality and scores all turn some
columns of each row into new columns. They share this runner, which gives them the same
guarantees at any table size:

- **Pinned version.** The job reads the version current at its start (after
  adding any missing output column, all null and metadata-only). Rows
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
- **Distributed.** With ``engine="ray"`` (local Ray or ``RAY_ADDRESS``) each
  work unit (a fragment, or a row range of a large one) is one Ray Data read
  task; the job's steps run as Ray Data stages (tasks, or an actor pool for
  models) and only the output columns come back to the driver.
  ``engine="local"`` runs the same steps in this process.
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
import time
import uuid
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from prx_data.columns.writeback import ColumnReport, count_into
from prx_data.core import lance_compat, storage
from prx_data.core.errors import Conflict, UsageError
from prx_data.table.pins import column_pin, pinned

ROWADDR = "_rowaddr"
#: Where a table keeps the checkpoints of unfinished column jobs.
CHECKPOINT_DIR = "_prx_column_jobs"
ENGINES = ("ray", "local")


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
    engine: str = "ray"
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
    ray_address: str | None = None
    num_cpus: int | None = None
    #: CPUs each read task asks Ray for.
    read_cpus: float = 0.5
    progress: bool = True
    desc: str | None = None
    #: Called with (fragment id, fragments checkpointed so far) after each
    #: checkpoint: progress hooks, and tests that simulate a kill.
    on_fragment: Callable[[int, int], None] | None = None

    def __post_init__(self) -> None:
        if self.engine not in ENGINES:
            raise UsageError(f"engine must be one of {ENGINES}, got {self.engine!r}")
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


def ensure_columns(uri: str, outputs: pa.Schema, storage_options: dict | None = None) -> int:
    """Add the output columns the table lacks (all null, no data written); returns the version."""
    ds = _open(uri, storage_options)
    names = ds.schema.names
    for f in outputs:
        if f.name in names and ds.schema.field(f.name).type != f.type:
            raise UsageError(
                f"column {f.name!r} is {ds.schema.field(f.name).type} in {uri!r}, "
                f"this job writes {f.type}"
            )
    missing = [pa.field(f.name, f.type, nullable=True) for f in outputs if f.name not in names]
    if missing:
        ds.add_columns(missing)
        ds = _open(uri, storage_options)
    return ds.version


def pending_counts(ds, where: str | None) -> dict[int, int]:
    """Pending rows per fragment id, in fragment order, from one ``_rowaddr`` scan."""
    if where is None:
        return {f.fragment_id: f.count_rows() for f in ds.get_fragments()}
    counts: Counter = Counter()
    scanner = ds.scanner(columns=[], filter=where, with_row_address=True, batch_size=1 << 16)
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


def unit_rows(job: ColumnJob, pending: int) -> int | None:
    """Rows per unit: ``job.rows_per_unit``, smaller when that leaves CPUs idle."""
    import ray

    from prx_data.core.runtime import ensure_ray

    ensure_ray(job.ray_address, job.num_cpus)
    cpus = max(1, int(ray.cluster_resources().get("CPU", 1)))
    fair = max(MIN_ROWS_PER_UNIT, -(-pending // (UNITS_PER_CPU * cpus)))
    return min(job.rows_per_unit, fair) if job.rows_per_unit else fair


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

    def write(self, fragment: int, values: pa.Table) -> None:
        """Join ``values`` (``_rowaddr`` + outputs) onto the fragment: one new data file."""
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
        raise ValueError(
            f"column job step {getattr(fn, '__name__', fn)!r} returned {out.num_rows} rows "
            f"for {batch.num_rows}: steps must return one row per input row"
        )
    if ROWADDR not in out.column_names:
        out = out.append_column(ROWADDR, batch[ROWADDR])
    return out


def _read_batch(batch: pa.Table, **kwargs) -> Iterator[pa.Table]:
    """Ray Data stage: one unit per call (``batch_size=1``), its rows in batches."""
    for text in batch["unit"].to_pylist():
        yield from read_unit(Unit(**json.loads(text)), **kwargs)


def _function_stage(batch: pa.Table, fn: Callable, fn_kwargs: dict) -> pa.Table:
    return apply_step(fn, batch, fn_kwargs)


class _ActorStage:
    """Ray Data actor: builds the step's class once, carries ``_rowaddr``."""

    def __init__(self, cls: type, args: tuple):
        self.inner = cls(*args)

    def __call__(self, batch: pa.Table) -> pa.Table:
        return apply_step(self.inner, batch)


def _ray_results(job: ColumnJob, units: list[Unit], version: int) -> Iterator[pa.Table]:
    import ray

    from prx_data.core.runtime import ensure_ray, unit_dataset

    ensure_ray(job.ray_address, job.num_cpus)
    items = [{"unit": json.dumps(u.__dict__)} for u in units]
    # Task steps on the read's resources fuse with it into one operator.
    fused = all(
        not s.is_class and not s.num_gpus and s.num_cpus in (None, job.read_cpus) for s in job.steps
    )
    ds = unit_dataset(items, single_operator=fused)
    ds = ds.map_batches(
        _read_batch,
        batch_size=1,
        batch_format="pyarrow",
        num_cpus=job.read_cpus,
        fn_kwargs={
            "uri": job.table,
            "version": version,
            "columns": job.read_columns,
            "where": job.where,
            "batch_size": job.batch_size,
            "storage_options": job.storage_options,
            "run": uuid.uuid4().hex,
        },
    )
    for step in job.steps:
        kw: dict[str, Any] = {"batch_format": "pyarrow", "batch_size": step.batch_size}
        if step.num_cpus is not None:
            kw["num_cpus"] = step.num_cpus
        elif not step.is_class:
            # Same resources as the read: Ray Data fuses the read and the task steps into
            # one task per unit, so rows do not cross the object store between them.
            kw["num_cpus"] = job.read_cpus
        if step.num_gpus:
            kw["num_gpus"] = step.num_gpus
        if step.is_class:
            ds = ds.map_batches(
                _ActorStage,
                fn_constructor_args=(step.fn, tuple(step.constructor_args)),
                compute=ray.data.ActorPoolStrategy(size=step.actors or 1),
                **kw,
            )
        else:
            ds = ds.map_batches(
                _function_stage,
                fn_kwargs={"fn": step.fn, "fn_kwargs": step.kwargs},
                zero_copy_batch=step.zero_copy_batch,
                **kw,
            )
    yield from ds.iter_batches(batch_format="pyarrow", batch_size=None)


def _local_results(job: ColumnJob, units: list[Unit], version: int) -> Iterator[pa.Table]:
    instances: dict[int, Any] = {}
    try:
        for unit in units:
            for batch in read_unit(
                unit,
                uri=job.table,
                version=version,
                columns=job.read_columns,
                where=job.where,
                batch_size=job.batch_size,
                storage_options=job.storage_options,
            ):
                for i, step in enumerate(job.steps):
                    if step.is_class:
                        if i not in instances:
                            instances[i] = step.fn(*step.constructor_args)
                        batch = apply_step(instances[i], batch)
                    else:
                        batch = apply_step(step.fn, batch, step.kwargs)
                yield batch
    finally:
        for inst in instances.values():
            close = getattr(inst, "close", None)
            if callable(close):
                close()


def iter_results(job: ColumnJob, units: list[Unit], version: int) -> Iterator[pa.Table]:
    """The last step's batches for ``units`` at the pinned ``version``, written nowhere.

    For jobs that place their rows themselves (the download job moves the rows
    it fills into new fragments instead of rewriting a fragment's column).
    """
    if job.engine == "ray":
        return _ray_results(job, units, version)
    return _local_results(job, units, version)


# --- the job -------------------------------------------------------------------------------


def run_column_job(job: ColumnJob) -> ColumnReport:
    """Run ``job`` (see the module docstring); returns the report (rows, counts, reasons)."""
    start = time.perf_counter()
    name = job.job_name
    report = ColumnReport(job.table, list(job.outputs.names))
    ensure_columns(job.table, job.outputs, job.storage_options)
    report.recovered_fragments, report.recovered_rows = recover(
        job.table, name, job.storage_options
    )
    ds = _open(job.table, job.storage_options)  # the pinned version
    with pinned(ds, column_pin(name), job.table, job="column job", column=name):
        return _run_pinned(job, ds, report, start)


def _run_pinned(job: ColumnJob, ds, report: ColumnReport, start: float) -> ColumnReport:
    """The job at its pinned version ``ds`` (tagged, so a cleanup meanwhile keeps it)."""
    from tqdm.auto import tqdm

    name = job.job_name
    report.table_version = ds.version
    counts_by_fragment = pending_counts(ds, job.where)
    rows_per_unit = job.rows_per_unit
    if job.engine == "ray":
        rows_per_unit = unit_rows(job, sum(counts_by_fragment.values()))
    units, expected = plan_units(counts_by_fragment, job.limit, rows_per_unit)
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
    results = (
        _ray_results(job, units, ds.version)
        if job.engine == "ray"
        else _local_results(job, units, ds.version)
    )
    bar = tqdm(
        total=total,
        desc=job.desc or f"column job {name}",
        unit="row",
        disable=not job.progress,
        smoothing=0.1,
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
                raise ValueError(f"the last step of column job {name!r} did not return {missing}")
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
            bar.update(batch.num_rows)
            if counts:
                bar.set_postfix(dict(counts.most_common(4)), refresh=False)
        ok = True
    finally:
        bar.close()
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
