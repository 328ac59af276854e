"""Ingest job graph: sources -> work units -> Ray Data load tasks -> one Lance commit.

The driver plans every source into small work units (cheap listing only),
Ray Data loads them in parallel (read bytes, probe headers, decode
captions), and ``lance_ray.write_lance`` writes fragments from the workers
and commits them once at the end, so a killed ingest leaves the table as it
was. Ray 2.60's own ``Dataset.write_lance`` does not work with pylance 14.

Ids are stable (``<source>/<key>``). A small ledger actor makes re-ingest
idempotent: ids already in the table are skipped, and within one ingest a
duplicate id is dropped after the first unit that claimed it (a retried
task keeps its own claims). Everything skipped or noteworthy is counted by
reason in the :class:`IngestReport`.
"""

from __future__ import annotations

import json
import time
from collections import Counter
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import lance
import pyarrow as pa
import pyarrow.compute as pc

from prx_data.core import schema as S
from prx_data.core.runtime import ensure_ray
from prx_data.ingest import (
    NOTES,
    Counts,
    SourceSpec,
    WorkUnit,
    conform,
    load_unit,
    parse_source,
    plan_source,
)
from prx_data.table import lance_ops as T

MODES = ("append", "create", "overwrite")
#: Fragments are sized to about this many bytes (mostly image bytes)...
DEFAULT_FRAGMENT_BYTES = 512 * 1024 * 1024
#: ...within these row bounds. One write task buffers a fragment's rows in
#: memory, which is why Ray's default of ~1M rows is far too many for images.
MIN_ROWS_PER_FRAGMENT = 1024
MAX_ROWS_PER_FRAGMENT = 1_000_000
FALLBACK_ROW_BYTES = 100_000
#: CPUs per load task: reading bytes and parsing headers is mostly I/O, so two
#: overlap per core. The write tasks ask for a different amount, which keeps Ray
#: Data from fusing load and write: fused, the write's row bundling hands every
#: unit to one task and nothing loads in parallel (measured: 8 one-second units
#: took 8.2 s fused, 5.6 s unfused on 2 CPUs).
LOAD_TASK_CPUS = 0.5
WRITE_TASK_CPUS = 0.25


@dataclass
class IngestConfig:
    """Options of one ingest run (see ``python -m prx_data.ingest --help``)."""

    sources: list[str]
    table_uri: str
    mode: str = "append"
    fmt: str | None = None
    rows_per_fragment: int | None = None  # None: from the images' size
    fragment_bytes: int = DEFAULT_FRAGMENT_BYTES
    items_per_unit: int | None = None  # None: the reader's default
    num_cpus: int | None = None  # local Ray only; None: all cores
    storage_options: dict | None = None
    reader_options: dict[str, Any] = field(default_factory=dict)
    progress: bool = True


@dataclass
class IngestReport:
    """What happened: rows written, counts by reason, fragment hygiene, speed."""

    table: str
    mode: str
    sources: list[str]
    units: int = 0
    rows_written: int = 0
    rows_in_table: int = 0
    kept: dict[str, int] = field(default_factory=dict)  # rows written with a note
    dropped: dict[str, int] = field(default_factory=dict)  # rows/units not written
    fragments: int = 0
    rows_per_fragment: int = 0
    seconds: float = 0.0
    #: Work units that could not be read at all: unit, kind, path, error, message.
    failures: list[dict[str, Any]] = field(default_factory=list)

    @property
    def rows_per_second(self) -> float:
        return self.rows_written / self.seconds if self.seconds > 0 else 0.0

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["rows_per_second"] = round(self.rows_per_second, 1)
        return d

    def format(self) -> str:
        lines = [
            f"ingest -> {self.table} ({self.mode})",
            f"  sources            {', '.join(self.sources)}",
            f"  work units         {self.units:,}",
            f"  rows written       {self.rows_written:,} "
            f"({self.rows_per_second:,.0f} rows/s over {self.seconds:.1f} s)",
            f"  rows in table      {self.rows_in_table:,}",
            f"  fragments          {self.fragments:,} (target {self.rows_per_fragment:,} rows each)",
        ]
        for title, counts in (("kept, with a note", self.kept), ("not written", self.dropped)):
            lines.append(f"  {title}:" + ("" if counts else " none"))
            for reason, n in sorted(counts.items(), key=lambda kv: (-kv[1], kv[0])):
                lines.append(f"    {reason:<40} {n:>10,}")
        if self.failures:
            lines.append(f"  failed units ({len(self.failures):,} of {self.units:,}):")
            for f in self.failures[:20]:
                lines.append(f"    {f['path']}: {f['error']}: {f['message']}")
            if len(self.failures) > 20:
                lines.append(f"    ... {len(self.failures) - 20:,} more (--json lists them all)")
        return "\n".join(lines)


# --- the ledger ---------------------------------------------------------------


class _Ledger:
    """Claims ids (first unit wins, retries keep their claims) and collects counts."""

    def __init__(self) -> None:
        self.owner: dict[str, int] = {}
        self.existing: set[str] = set()
        self.unit_counts: dict[int, dict[str, int]] = {}
        self.unit_rows: dict[int, int] = {}
        self.unit_failures: dict[int, dict[str, Any]] = {}

    def seed(self, ids: list[str]) -> int:
        self.existing.update(ids)
        return len(self.existing)

    def claim(self, unit: int, ids: list[str]) -> list[int]:
        """0: keep, 1: already in the table, 2: duplicate in this ingest."""
        out = []
        for i in ids:
            if i in self.existing:
                out.append(1)
                continue
            owner = self.owner.setdefault(i, unit)
            out.append(0 if owner == unit else 2)
        return out

    def report(
        self, unit: int, counts: dict[str, int], rows: int, failure: dict | None = None
    ) -> None:
        self.unit_counts[unit] = counts  # a retried unit replaces its counts (and failure)
        self.unit_rows[unit] = rows
        if failure is None:
            self.unit_failures.pop(unit, None)
        else:
            self.unit_failures[unit] = failure

    def failures(self) -> list[dict[str, Any]]:
        return [self.unit_failures[u] for u in sorted(self.unit_failures)]

    def progress(self) -> tuple[int, int]:
        return len(self.unit_rows), sum(self.unit_rows.values())

    def totals(self) -> tuple[dict[str, int], int]:
        total: Counter = Counter()
        for c in self.unit_counts.values():
            total.update(c)
        return dict(total), sum(self.unit_rows.values())


def unit_location(unit: WorkUnit) -> str:
    """Where a work unit reads from, for error reports (file, tar, table fragment or folder)."""
    a = unit.args
    if "file" in a:
        return str(a["file"])
    if "tar" in a:
        return str(a["tar"])
    if "uri" in a:
        return f"{a['uri']} fragment {a.get('fragment')} rows {a.get('offset')}+{a.get('limit')}"
    if "shard" in a:
        return f"{a.get('root')}/{a['shard']}"
    items = a.get("items") or []
    first = f", first {items[0][0]}" if items and items[0] else ""
    return f"{a.get('root', unit.source)} ({len(items)} items{first})"


def _load_batch(batch: pa.Table, ledger, schema: pa.Schema) -> pa.Table:
    """Ray Data UDF: load the work units of one batch, drop claimed/existing ids."""
    import ray

    outs = []
    for unit_json, unit_index in zip(
        batch["unit"].to_pylist(), batch["index"].to_pylist(), strict=True
    ):
        counts = Counts()
        unit = WorkUnit.from_json(unit_json)
        failure = None
        try:
            table = load_unit(unit, counts)
        except Exception as e:  # a unit that cannot be read is recorded; the error rate decides
            counts.dropped(f"unit_failed:{type(e).__name__}")
            failure = {
                "unit": unit_index,
                "kind": unit.kind,
                "path": unit_location(unit),
                "error": type(e).__name__,
                "message": str(e)[:500],
            }
            table = schema.empty_table()
        if table.num_rows:
            # Within a unit the first occurrence of an id wins.
            ids = table[S.ID].to_pylist()
            seen: set[str] = set()
            first = []
            for i in ids:
                first.append(i not in seen)
                seen.add(i)
            status = ray.get(ledger.claim.remote(unit_index, list(seen)))
            by_id = dict(zip(seen, status, strict=True))
            keep = []
            for i, is_first in zip(ids, first, strict=True):
                if not is_first:
                    counts.dropped("duplicate_id")
                    keep.append(False)
                elif by_id[i] == 1:
                    counts.dropped("already_in_table")
                    keep.append(False)
                elif by_id[i] == 2:
                    counts.dropped("duplicate_id")
                    keep.append(False)
                else:
                    keep.append(True)
            table = table.filter(pa.array(keep, pa.bool_()))
        if NOTES in table.column_names:
            counts.tally_notes(table[NOTES].to_pylist())
        table = conform(table, schema)
        ray.get(ledger.report.remote(unit_index, dict(counts), table.num_rows, failure))
        outs.append(table)
    return pa.concat_tables(outs) if outs else schema.empty_table()


# --- schema -------------------------------------------------------------------


def _merge_fields(base: list[pa.Field], extra: list[pa.Field], where: str) -> list[pa.Field]:
    by_name = {f.name: f for f in base}
    out = list(base)
    for f in extra:
        if f.name in by_name:
            if by_name[f.name].type != f.type:
                raise ValueError(
                    f"column {f.name!r} is {by_name[f.name].type} in {where} but {f.type} in a source"
                )
            continue
        by_name[f.name] = f
        out.append(f)
    return out


def output_schema(extra_fields: list[pa.Field], existing: pa.Schema | None) -> pa.Schema:
    """TABLE_SCHEMA + source extras (+ the existing table's other columns)."""
    fields = _merge_fields(list(S.TABLE_SCHEMA), extra_fields, "the table contract")
    if existing is None:
        return pa.schema(fields)
    for f in fields:
        if f.name in existing.names and existing.field(f.name).type != f.type:
            raise ValueError(
                f"column {f.name!r} is {existing.field(f.name).type} in the table but "
                f"{f.type} in this ingest; ingest into a new table or cast the source"
            )
    return existing


def _rows_per_fragment(cfg: IngestConfig, approx_row_bytes: float | None) -> int:
    if cfg.rows_per_fragment:
        return cfg.rows_per_fragment
    per_row = approx_row_bytes or FALLBACK_ROW_BYTES
    rows = int(cfg.fragment_bytes / max(per_row, 1.0))
    return max(MIN_ROWS_PER_FRAGMENT, min(MAX_ROWS_PER_FRAGMENT, rows))


def _progress_thread(ledger, total_units: int, enabled: bool):
    """A tqdm bar on the driver, fed by polling the ledger while Ray Data runs."""
    import threading

    import ray
    from tqdm import tqdm

    stop = threading.Event()

    def poll() -> None:
        bar = tqdm(total=total_units, desc="ingest", unit="unit", disable=not enabled)
        done = 0
        while True:
            try:
                units, rows = ray.get(ledger.progress.remote(), timeout=10)
            except Exception:
                units, rows = done, None
            bar.update(units - done)
            done = units
            if rows is not None:
                bar.set_postfix(rows=rows, refresh=False)
            if stop.wait(0.5):
                break
        bar.close()

    t = threading.Thread(target=poll, daemon=True)
    t.start()
    return stop, t


# --- the job -------------------------------------------------------------------


def run_ingest(cfg: IngestConfig) -> IngestReport:
    """Plan the sources, load them with Ray Data, write and commit once, report."""
    import ray
    import ray.data
    from lance_ray import write_lance

    if cfg.mode not in MODES:
        raise ValueError(f"mode must be one of {MODES}, got {cfg.mode!r}")
    t0 = time.perf_counter()
    specs: list[SourceSpec] = [parse_source(s, cfg.fmt) for s in cfg.sources]
    exists = T.table_exists(cfg.table_uri, cfg.storage_options)
    if cfg.mode == "create" and exists:
        raise FileExistsError(
            f"table {cfg.table_uri!r} exists; use --mode append or --mode overwrite"
        )
    appending = cfg.mode == "append" and exists

    # Plan (driver): list sources, cut into units.
    units: list[WorkUnit] = []
    plan_counts = Counts()
    extra: list[pa.Field] = []
    sizes: list[tuple[int, float]] = []
    options = dict(cfg.reader_options)
    if cfg.items_per_unit:
        options["items_per_unit"] = cfg.items_per_unit
    finalizers = []
    for spec in specs:
        plan = plan_source(spec, **options)
        if plan.finalize is not None:
            finalizers.append(plan.finalize)
        units.extend(plan.units)
        plan_counts.update(plan.counts)
        extra = _merge_fields(extra, plan.extra_fields, "another source")
        if plan.approx_row_bytes:
            sizes.append((len(plan.units), plan.approx_row_bytes))
    approx = sum(n * b for n, b in sizes) / sum(n for n, _ in sizes) if sizes else None
    rows_per_fragment = _rows_per_fragment(cfg, approx)

    existing_schema = None
    existing_ids: pa.Array | None = None
    if appending:
        ds = T.open_table(cfg.table_uri, cfg.storage_options)
        missing = [f for f in extra if f.name not in ds.schema.names]
        output_schema(extra, ds.schema)  # type check before anything changes
        if missing:
            ds.add_columns([pa.field(f.name, f.type, nullable=True) for f in missing])
            ds = T.open_table(cfg.table_uri, cfg.storage_options)
        existing_schema = ds.schema
        existing_ids = ds.to_table(columns=[S.ID])[S.ID].combine_chunks()
    schema = output_schema(extra, existing_schema)

    if cfg.mode == "overwrite" and exists and units:
        old = T.open_table(cfg.table_uri, cfg.storage_options).schema
        if not old.equals(schema, check_metadata=False):
            # lance_ray writes fragments against the existing schema, so a new schema
            # first gets an empty version of its own. The old rows stay reachable in
            # the previous version until old versions are cleaned up.
            lance.write_dataset(
                schema.empty_table(),
                cfg.table_uri,
                mode="overwrite",
                storage_options=cfg.storage_options,
            )
    started = not ray.is_initialized()
    ensure_ray(num_cpus=cfg.num_cpus)
    try:
        ledger = ray.remote(num_cpus=0)(_Ledger).remote()
        if existing_ids is not None and len(existing_ids):
            ray.get(ledger.seed.remote(existing_ids.to_pylist()))
        if units:
            items = [{"unit": u.to_json(), "index": i} for i, u in enumerate(units)]
            ds = ray.data.from_items(items, override_num_blocks=len(items))
            ds = ds.map_batches(
                _load_batch,
                batch_size=1,
                batch_format="pyarrow",
                num_cpus=LOAD_TASK_CPUS,
                fn_kwargs={"ledger": ledger, "schema": schema},
            )
            stop, poller = _progress_thread(ledger, len(units), cfg.progress)
            try:
                write_lance(
                    ds,
                    cfg.table_uri,
                    schema=schema,
                    mode="append" if appending else ("create" if not exists else "overwrite"),
                    min_rows_per_file=rows_per_fragment,
                    max_rows_per_file=rows_per_fragment,  # a cap: --rows-per-fragment N means <= N
                    storage_options=cfg.storage_options,
                    ray_remote_args={"num_cpus": WRITE_TASK_CPUS},  # not fused with loading
                )
            finally:
                stop.set()
                poller.join()
        counts, rows_written = ray.get(ledger.totals.remote())
        failures = ray.get(ledger.failures.remote())
        ray.kill(ledger)
    finally:
        if started:
            ray.shutdown()

    if rows_written == 0 and not appending:
        # Nothing to write still leaves a (possibly empty) table with the schema.
        mode = "overwrite" if exists else "create"
        if cfg.mode == "overwrite" or not T.table_exists(cfg.table_uri, cfg.storage_options):
            lance.write_dataset(
                schema.empty_table(), cfg.table_uri, mode=mode, storage_options=cfg.storage_options
            )
    all_counts = Counter(plan_counts)
    all_counts.update(counts)
    for finalize in finalizers:
        finalize(all_counts)
    kept = {k.split(":", 1)[1]: v for k, v in all_counts.items() if k.startswith("kept:") and v}
    dropped = {
        k.split(":", 1)[1]: v for k, v in all_counts.items() if k.startswith("dropped:") and v
    }
    final = T.open_table(cfg.table_uri, cfg.storage_options)
    return IngestReport(
        table=cfg.table_uri,
        mode=cfg.mode,
        sources=[s.path for s in specs],
        units=len(units),
        rows_written=rows_written,
        rows_in_table=final.count_rows(),
        kept=dict(sorted(kept.items())),
        dropped=dict(sorted(dropped.items())),
        fragments=len(final.get_fragments()),
        rows_per_fragment=rows_per_fragment,
        seconds=time.perf_counter() - t0,
        failures=failures,
    )


def duplicate_ids(uri: str, storage_options: dict | None = None) -> int:
    """How many rows share an id with an earlier row (0 for a healthy table)."""
    ids = T.open_table(uri, storage_options).to_table(columns=[S.ID])[S.ID]
    return len(ids) - pc.count_distinct(ids).as_py()


def report_json(report: IngestReport) -> str:
    return json.dumps(report.to_dict(), indent=2)


def ingest(
    sources: Sequence[str],
    table_uri: str,
    *,
    mode: str = "append",
    fmt: str | None = None,
    rows_per_fragment: int | None = None,
    fragment_bytes: int = DEFAULT_FRAGMENT_BYTES,
    items_per_unit: int | None = None,
    num_cpus: int | None = None,
    storage_options: dict | None = None,
    progress: bool = True,
    **reader_options,
) -> IngestReport:
    """Ingest ``sources`` (paths, or ``NAME=PATH`` to set the id prefix) into ``table_uri``.

    ``mode``: ``append`` (default; creates the table if missing and skips ids
    already in it), ``create`` (fails if the table exists) or ``overwrite``.
    ``reader_options`` go to the source readers (e.g. ``image_column=``,
    ``caption_column=``, ``keys=`` for twin tars). Returns the report.
    """
    cfg = IngestConfig(
        sources=list(sources),
        table_uri=table_uri,
        mode=mode,
        fmt=fmt,
        rows_per_fragment=rows_per_fragment,
        fragment_bytes=fragment_bytes,
        items_per_unit=items_per_unit,
        num_cpus=num_cpus,
        storage_options=storage_options,
        reader_options=reader_options,
        progress=progress,
    )
    return run_ingest(cfg)
