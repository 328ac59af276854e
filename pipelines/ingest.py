"""Ingest job: sources -> work units -> staged Lance fragments -> one Lance commit.

The driver plans every source into small work units (cheap listing only).
The units run through the one runner (:func:`prx_data.core.runtime.map_units`):
a few of them load on driver threads, which stage their rows here in
fragments of ``rows_per_fragment``; more run on Ray, one task per run of
consecutive units that together fill about one fragment
(:func:`stage_groups`): the task reads bytes, probes headers, decodes
captions and stages its fragments (``write_fragments``, not yet part of the
table), and returns its claims, counts and failures as JSON, tallied here.
The driver commits the fragments **once** at the end
(``Append``; ``Merge`` when new source columns come along; ``Overwrite``
for ``overwrite``/``create``, with the new schema in the same commit), so a
killed ingest leaves the table exactly as it was: staged files are never
referenced and Lance's cleanup removes them.

Ids are stable (``<source>/<key>``) and de-duplication is deterministic:

- **already in the table**: the job reads the version current at its start
  (pinned). A source none of whose ids are there (one range probe on the
  ``id`` column per source) skips the check; otherwise each unit's load looks
  its unit's ids up in the pinned version (``id IN ...``, served by the
  BTREE index on ``id`` that ingest keeps up to date) and drops those found.
- **twice in this ingest**: every row carries its *order* (unit number in
  plan order, position in the unit). Staging returns each staged
  row's id and order; the driver keeps, per duplicated id, the row with the
  smallest order (the first in source order, whatever the scheduling) and
  drops the others by restaging the few fragments that hold one.

So the same inputs give the same table content in any scheduling order.
Everything skipped or noteworthy is counted by reason in the
:class:`IngestReport`.
"""

from __future__ import annotations

import dataclasses
import json
import time
import uuid
import warnings
from collections import Counter
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import lance
import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from prx_data.core import lance_compat, storage
from prx_data.core import schema as S
from prx_data.core.errors import AlreadyExists, UsageError
from prx_data.core.flags import REQUIRED, flag, mebibytes
from prx_data.core.reports import FailureCounts
from prx_data.core.runtime import RunOptions, check_engine, map_units, run_field
from prx_data.ingest import (
    FORMATS,
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
#: Ingest builds (or updates) the BTREE index on ``id`` after its commit once the
#: table has this many rows; below it a scan is as fast as the index.
ID_INDEX_MIN_ROWS = 100_000
#: Ids per ``id IN (...)`` lookup in the pinned table.
LOOKUP_CHUNK = 2048
#: Internal columns: a row's place in the plan, and its notes (counted once written).
ORDER = "__order"
#: CPUs per Ray staging task (a run of units: read, probe, write a fragment). Reading
#: bytes and parsing headers is mostly I/O, so two overlap per core.
STAGE_TASK_CPUS = 0.5
#: Ingests of at most this many rows (by the plan: a folder's files, a parquet file's or
#: table's rows, a URL list's lines; a tar counts as ``UNKNOWN_UNIT_ROWS``) load on driver
#: threads under ``engine="auto"``: starting Ray costs more than their work.
SMALL_ROWS = 20_000
UNKNOWN_UNIT_ROWS = 4096


@dataclass(frozen=True)
class IngestConfig:
    """Options of one ingest run; each field carries its ``python -m prx_data.ingest`` flag."""

    sources: list[str] = flag(
        REQUIRED,
        "sources",
        nargs="+",
        metavar="SOURCE",
        help="a folder, parquet file/folder, URL list (.txt one URL a line, .csv, .tsv "
        "with or without a header, .jsonl, a .json array; any of them .gz/.bz2/.zst) or a "
        "folder of them, tar(s), twin-tar root or .lance table; "
        "write NAME=PATH to choose the id prefix (default: the base name of PATH)",
    )
    table_uri: str = flag(
        REQUIRED, "--table", help="Lance table URI to write (local path or s3://...)"
    )
    mode: str = flag(
        "append",
        "--mode",
        choices=MODES,
        help="append: add new ids, create the table if missing (default); create: fail if "
        "the table exists; overwrite: replace the table",
    )
    fmt: str | None = flag(
        None,
        "--format",
        choices=FORMATS,
        help="source format for all SOURCEs (default: detect from each path)",
    )
    rows_per_fragment: int | None = flag(
        None,
        "--rows-per-fragment",
        type=int,
        help="at most this many rows per Lance fragment (default: about --fragment-mb of "
        "images per fragment, between 1024 and 1M rows); each write task holds one fragment "
        "in memory",
    )
    fragment_bytes: int = flag(
        DEFAULT_FRAGMENT_BYTES,
        "--fragment-mb",
        type=mebibytes,
        metavar="MIB",
        help="target fragment size in MiB when --rows-per-fragment is not given "
        f"(default: {DEFAULT_FRAGMENT_BYTES >> 20})",
    )
    items_per_unit: int | None = flag(
        None,
        "--items-per-unit",
        type=int,
        help="items per parallel work unit for folders and parquet (default: the reader's)",
    )
    image_column: str | None = flag(
        None, "--image-column", help="parquet/lance: column with image bytes"
    )
    path_column: str | None = flag(
        None, "--path-column", help="parquet: column with image paths (relative to the file)"
    )
    url_column: str | None = flag(
        None,
        "--url-column",
        "--url-col",
        help="csv/tsv/jsonl: column with the image URL, stored as url (default: url, URL, "
        "image_url...; a file without a header calls it url); --url-col as img2dataset spells it",
    )
    caption_column: str | None = flag(
        None,
        "--caption-column",
        "--caption-col",
        help="parquet/lance/csv/tsv/jsonl: caption column (default: caption, text, TEXT...); "
        "--caption-col as img2dataset spells it",
    )
    key_column: str | None = flag(
        None,
        "--key-column",
        help="parquet/lance/csv/tsv/jsonl: column giving the id key (default: key, uid... "
        "else the row number)",
    )
    embedding_column: str | None = flag(
        None,
        "--embedding-column",
        help="parquet/lance: a vector column to keep as the row's embedding (default: "
        "embedding, clip_embedding...)",
    )
    keys: str | None = flag(
        None,
        "--keys",
        help="twin tars: parquet file listing the keys to load (index mode; missing and "
        "out-of-order keys are tolerated); default: positional zip of the tars",
    )
    #: engine, Ray cluster, CPUs, progress bar: the same for every job (``--engine``, ...).
    run: RunOptions = run_field()
    storage_options: dict | None = None
    #: Build or update the BTREE index on ``id`` after the commit (large tables).
    id_index: bool = True

    @property
    def reader_options(self) -> dict[str, Any]:
        """The options the source readers take (each reader picks the ones it knows)."""
        return {name: getattr(self, name) for name in READER_OPTIONS}


#: The :class:`IngestConfig` fields handed to the source readers.
READER_OPTIONS = (
    "items_per_unit",
    "image_column",
    "path_column",
    "url_column",
    "caption_column",
    "key_column",
    "embedding_column",
    "keys",
)


@dataclass
class IngestReport(FailureCounts):
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
    #: Units that could not be read at all: unit, kind, path, error, message.
    failures: list[dict[str, Any]] = field(default_factory=list)

    counted = "work units"
    job_label = "ingest"

    @property
    def failed(self) -> int:
        """Work units (files, tars, fragments) that could not be read at all."""
        return len(self.failures)

    @property
    def total(self) -> int:
        return self.units

    def failure_details(self, report_json: str | None = None) -> str:
        return "the failed units above (all of them with --json)"

    @property
    def rows_per_second(self) -> float:
        return self.rows_written / self.seconds if self.seconds > 0 else 0.0

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["rows_per_second"] = round(self.rows_per_second, 1)
        d["next_step"] = self.next_step
        return d

    def text(self) -> str:
        return self.format()

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
        hint = self.next_step
        if hint:
            lines.append(f"  next: {hint}")
        return "\n".join(lines)

    @property
    def next_step(self) -> str | None:
        """What to run next when every row written is a URL without image bytes."""
        urls = self.kept.get("probe_error:missing_image", 0)
        if urls and urls == self.rows_written:
            return (
                f"python -m prx_data.download --table {self.table} "
                f"(the {urls:,} rows have a URL and no image yet)"
            )
        return None


# --- schema -------------------------------------------------------------------


def _merge_fields(base: list[pa.Field], extra: list[pa.Field], where: str) -> list[pa.Field]:
    by_name = {f.name: f for f in base}
    out = list(base)
    for f in extra:
        if f.name in by_name:
            if by_name[f.name].type != f.type:
                raise UsageError(
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
            raise UsageError(
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


# --- load tasks: read units, drop ids already in the table ---------------------------


def ids_in_table(ds, ids: list[str]) -> set[str]:
    """Which of ``ids`` the table holds (chunked ``id IN`` lookups; BTREE-served when indexed)."""
    found: set[str] = set()
    for i in range(0, len(ids), LOOKUP_CHUNK):
        chunk = ids[i : i + LOOKUP_CHUNK]
        hit = ds.to_table(columns=[S.ID], filter=pc.field(S.ID).isin(chunk))
        found.update(hit[S.ID].to_pylist())
    return found


def sources_in_table(ds, sources: Sequence[str]) -> set[str]:
    """Source names with at least one id ``<source>/...`` in the table (a range probe each)."""
    present = set()
    for name in sorted(set(sources)):
        prefix = f"{name}/"
        probe = (pc.field(S.ID) >= prefix) & (pc.field(S.ID) < f"{name}0")  # "0" follows "/"
        if ds.to_table(columns=[S.ID], filter=probe, limit=1).num_rows:
            present.add(name)
    return present


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


def load_staged(
    unit_json: str, unit_index: int, schema: pa.Schema, check: dict | None = None
) -> tuple[pa.Table, Counts, dict | None]:
    """Load one work unit in the staging schema; drop ids already in the table.

    ``check`` (appends to a non-empty table): the pinned table and the
    sources it already has ids of. Rows keep their notes and get their order.
    Returns the rows, the unit's counts and its failure record (None: read).
    """
    staged = _staging_schema(schema)
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
    order = pa.array([(unit_index << 32) + i for i in range(table.num_rows)], pa.int64())
    table = table.append_column(ORDER, order)
    if table.num_rows:
        # Within a unit the first occurrence of an id wins.
        ids = table[S.ID].to_pylist()
        seen: set[str] = set()
        keep = []
        for i in ids:
            keep.append(i not in seen)
            seen.add(i)
        counts.dropped("duplicate_id", keep.count(False))
        if check is not None:
            prefix = f"{unit.source}/"
            ask = [
                i
                for i, k in zip(ids, keep, strict=True)
                if k and (unit.source in check["sources"] or not i.startswith(prefix))
            ]
            if ask:
                ds = T.pinned_table(
                    check["uri"], check["version"], check["storage_options"], check["run"]
                )
                found = ids_in_table(ds, ask)
                for n, i in enumerate(ids):
                    if keep[n] and i in found:
                        keep[n] = False
                        counts.dropped("already_in_table")
        table = table.filter(pa.array(keep, pa.bool_()))
    table = conform(table, staged)
    return table, counts, failure


def _staging_schema(schema: pa.Schema) -> pa.Schema:
    return pa.schema([*schema, pa.field(NOTES, pa.list_(pa.string())), pa.field(ORDER, pa.int64())])


# --- write tasks: stage fragments, return their claims ------------------------------------


def _write_batch(
    batch: pa.Table,
    uri: str,
    schema: pa.Schema,
    write_mode: str,
    max_rows: int,
    storage_options: dict | None,
) -> pa.Table:
    """Stage fragments (not committed) of ``batch``; one row per fragment with its claims."""
    from lance.fragment import write_fragments

    out: dict[str, list] = {k: [] for k in _NO_CLAIMS}
    if batch.num_rows == 0:
        return _claims_table(out)
    data = batch.select(schema.names).cast(schema)
    frags = write_fragments(
        data,
        uri,
        schema=schema,
        mode=write_mode,
        max_rows_per_file=max_rows,
        storage_options=storage_options,
    )
    ids = batch[S.ID].to_pylist()
    orders = batch[ORDER].to_pylist()
    notes = batch[NOTES].to_pylist()
    off = 0
    for frag in frags:
        n = frag.physical_rows
        out["fragment"].append(lance_compat.fragment_text(frag))
        out["ids"].append(ids[off : off + n])
        out["orders"].append(orders[off : off + n])
        out["notes"].append(
            json.dumps({str(j): notes[off + j] for j in range(n) if notes[off + j]})
        )
        off += n
    return _claims_table(out)


#: The claims of no fragment.
_NO_CLAIMS: dict[str, list] = {"fragment": [], "ids": [], "orders": [], "notes": []}


def _claims_table(out: dict[str, list]) -> pa.Table:
    return pa.table(
        {
            "fragment": pa.array(out["fragment"], pa.string()),
            "ids": pa.array(out["ids"], pa.list_(pa.string())),
            "orders": pa.array(out["orders"], pa.list_(pa.int64())),
            "notes": pa.array(out["notes"], pa.string()),
        }
    )


# --- the driver: resolve duplicates, restage, commit once --------------------------------


def losers(claims: pa.Table) -> dict[int, list[int]]:
    """Rows to drop, by staged fragment: for each id staged twice, all but the smallest order."""
    if claims.num_rows == 0:
        return {}
    lengths = pc.list_value_length(claims["ids"]).to_numpy(zero_copy_only=False)
    frag = np.repeat(np.arange(claims.num_rows), lengths)
    offset = np.concatenate([np.arange(n) for n in lengths]) if len(lengths) else lengths
    rows = pa.table(
        {
            S.ID: pc.list_flatten(claims["ids"]),
            "order": pc.list_flatten(claims["orders"]),
            "frag": pa.array(frag, pa.int64()),
            "offset": pa.array(offset, pa.int64()),
        }
    )
    if pc.count_distinct(rows[S.ID]).as_py() == rows.num_rows:
        return {}
    best = rows.group_by(S.ID, use_threads=False).aggregate([("order", "min")])
    joined = rows.join(best, S.ID)
    lost = joined.filter(pc.not_equal(joined["order"], joined["order_min"]))
    out: dict[int, list[int]] = {}
    for f, o in zip(lost["frag"].to_pylist(), lost["offset"].to_pylist(), strict=True):
        out.setdefault(f, []).append(o)
    return {f: sorted(o) for f, o in sorted(out.items())}


def restage(
    uri: str,
    meta,
    drop: list[int],
    schema: pa.Schema,
    write_mode: str,
    storage_options: dict | None,
) -> list:
    """Write a staged fragment again without the rows at ``drop``; delete the old file."""
    from lance.file import LanceFileReader
    from lance.fragment import write_fragments

    (data_file,) = meta.data_files()
    path = storage.join(uri, "data", data_file.path)
    table = LanceFileReader(path, storage_options=storage_options).read_all().to_table()
    keep = np.ones(table.num_rows, bool)
    keep[drop] = False
    table = table.filter(pa.array(keep)).cast(schema)
    new = []
    if table.num_rows:
        new = write_fragments(
            table,
            uri,
            schema=schema,
            mode=write_mode,
            max_rows_per_file=max(table.num_rows, 1),
            storage_options=storage_options,
        )
    storage.delete(path)
    return new


def commit_ingest(
    uri: str,
    kind: str,
    fragments: list,
    schema: pa.Schema,
    read_version: int | None,
    storage_options: dict | None,
) -> int:
    """The ingest's one commit: ``append``, ``merge`` (new columns) or ``overwrite``."""
    from lance.schema import LanceSchema

    if kind == "append":
        op = lance.LanceOperation.Append(fragments)
    elif kind == "merge":
        old = T.open_table(uri, storage_options, read_version)
        existing = [f.metadata for f in old.get_fragments()]
        op = lance.LanceOperation.Merge(existing + fragments, LanceSchema.from_pyarrow(schema))
    else:
        op = lance.LanceOperation.Overwrite(schema, fragments)
    ds = lance.LanceDataset.commit(
        uri, op, read_version=read_version, storage_options=storage_options
    )
    return ds.version


def update_id_index(uri: str, storage_options: dict | None = None) -> str | None:
    """Create the BTREE index on ``id`` for a large table, or fold new fragments into it."""
    ds = T.open_table(uri, storage_options)
    if ds.count_rows() < ID_INDEX_MIN_ROWS:
        return None
    names = [i["name"] for i in ds.list_indices() if i["fields"] == [S.ID]]
    if not names:
        ds.create_scalar_index(S.ID, "BTREE")
        return "created"
    ds.optimize.optimize_indices(index_names=names[:1])
    return "updated"


def _fresh_ids(ds) -> bool:
    """True when ``LanceSchema.from_pyarrow`` numbers the table's fields as the table does.

    Then new columns can be added by the ingest's own commit (``Merge``);
    otherwise (columns were dropped in the past, say) they are added first.
    """
    from lance.schema import LanceSchema

    try:
        return LanceSchema.from_pyarrow(ds.schema) == ds.lance_schema
    except Exception:
        return False


def _schedule(items: list) -> list:
    """The order work is handed to the runner (plan order; tests permute it)."""
    return items


# --- staging: driver threads or Ray, both through map_units -------------------------------


class _Stager:
    """Loaded rows in (plan order within a caller), staged fragments of at most
    ``max_rows`` rows out; :meth:`claims` is one row per fragment written."""

    def __init__(self, uri: str, schema: pa.Schema, write_mode: str, max_rows: int, options):
        self.args = (uri, schema, write_mode, max_rows, options)
        self.max_rows = max_rows
        self.buffer: list[pa.Table] = []
        self.buffered = 0
        self.parts: list[pa.Table] = []

    def _write(self, table: pa.Table) -> None:
        uri, schema, write_mode, max_rows, options = self.args
        self.parts.append(_write_batch(table, uri, schema, write_mode, max_rows, options))

    def add(self, table: pa.Table) -> None:
        if not table.num_rows:
            return
        self.buffer.append(table)
        self.buffered += table.num_rows
        if self.buffered >= self.max_rows:
            whole = pa.concat_tables(self.buffer)
            cut = self.buffered - self.buffered % self.max_rows
            self._write(whole.slice(0, cut))
            self.buffer = [whole.slice(cut)] if cut < self.buffered else []
            self.buffered -= cut

    def claims(self) -> pa.Table:
        if self.buffered:
            self._write(pa.concat_tables(self.buffer))
            self.buffer, self.buffered = [], 0
        return pa.concat_tables(self.parts) if self.parts else _claims_table(_NO_CLAIMS)


def _unit_rows(unit: WorkUnit) -> int | None:
    """The rows a work unit holds, when its plan says (folder items, table and parquet rows)."""
    a = unit.args
    if isinstance(a.get("items"), list):
        return len(a["items"])
    for key in ("rows", "limit"):
        if isinstance(a.get(key), int):
            return a[key]
    return None


def stage_groups(units: Sequence[WorkUnit], rows_per_fragment: int, cpus: int) -> list[list[int]]:
    """Runs of consecutive work units (their plan indexes), each staged by one Ray task.

    A run holds about ``rows_per_fragment`` rows by the plan's counts (a unit
    whose size is not known fills one), so fragments keep their target size
    though no rows cross between tasks; and there are at least ``2 * cpus``
    runs (when there are that many units), so every CPU has work.
    """
    most = max(1, -(-len(units) // (2 * max(1, cpus))))
    groups: list[list[int]] = []
    run: list[int] = []
    rows = 0
    for i, unit in enumerate(units):
        n = _unit_rows(unit) or rows_per_fragment
        if run and (rows + n > rows_per_fragment or len(run) >= most):
            groups.append(run)
            run, rows = [], 0
        run.append(i)
        rows += n
    if run:
        groups.append(run)
    return groups


def _stage_group(task: dict) -> dict:
    """One Ray task: load a run of work units, stage their rows, return what happened.

    ``task`` is JSON: the units with their plan indexes and the job's shared
    inputs (schema as Arrow IPC in base64). The result is JSON too: the
    staged fragments' claims, and per unit its counts, rows and failure.
    """
    import base64

    job = task["job"]
    schema = pa.ipc.read_schema(pa.py_buffer(base64.b64decode(job["schema"])))
    stager = _Stager(job["uri"], schema, job["write_mode"], job["max_rows"], job["options"])
    done = []
    for index, unit_json in task["units"]:
        table, counts, failure = load_staged(unit_json, index, schema, job["check"])
        stager.add(table)
        done.append(
            {"index": index, "counts": dict(counts), "rows": table.num_rows, "failure": failure}
        )
    claims = stager.claims()
    return {"claims": claims.to_pydict(), "units": done}


def _stage_on_ray(cfg, units, schema, check, rows_per_fragment, write_mode, where):
    """Load and stage on Ray (:func:`prx_data.core.runtime.map_units`): one task per run of
    units (:func:`stage_groups`); counts and failures come back with each task's result and
    are tallied here. Returns (claims, counts, failures)."""
    import base64

    from prx_data.core.runtime import Resources, placement_cpus

    job = {
        "uri": cfg.table_uri,
        "schema": base64.b64encode(schema.serialize().to_pybytes()).decode("ascii"),
        "write_mode": write_mode,
        "max_rows": rows_per_fragment,
        "options": cfg.storage_options,
        "check": check,
    }
    groups = stage_groups(units, rows_per_fragment, placement_cpus(where)) if units else []
    tasks = _schedule([{"job": job, "units": [[i, units[i].to_json()] for i in g]} for g in groups])
    counts: Counter = Counter()
    failures: list[dict] = []
    parts: list[pa.Table] = []
    rows = [0]

    results = map_units(
        _stage_group,
        tasks,
        where,
        Resources(num_cpus=STAGE_TASK_CPUS),
        desc="ingest",
        progress=cfg.run.progress,
        total=len(units),
        weight=lambda result: len(result["units"]),
        postfix=lambda: {"rows": rows[0]},
    )
    for result in results:  # a retried task's result comes once: nothing is counted twice
        for u in result["units"]:
            counts.update(u["counts"])
            rows[0] += u["rows"]
            if u["failure"] is not None:
                failures.append(u["failure"])
        parts.append(_claims_table(result["claims"]))
    claims = pa.concat_tables(parts) if parts else _claims_table(_NO_CLAIMS)
    return claims, dict(counts), sorted(failures, key=lambda f: f["unit"])


def _stage_on_threads(cfg, units, schema, check, rows_per_fragment, write_mode, where):
    """Load on driver threads (:func:`prx_data.core.runtime.map_units`), units in plan
    order, and stage their rows here in ``rows_per_fragment`` batches."""
    items = _schedule([{"unit": u.to_json(), "index": i} for i, u in enumerate(units)])
    counts: Counter = Counter()
    failures: list[dict] = []
    rows = [0]
    stager = _Stager(cfg.table_uri, schema, write_mode, rows_per_fragment, cfg.storage_options)

    def load(item: dict):
        return load_staged(item["unit"], item["index"], schema, check)

    loaded = map_units(
        load,
        items,
        where,
        desc="ingest",
        progress=cfg.run.progress,
        postfix=lambda: {"rows": rows[0]},
    )
    for table, unit_counts, failure in loaded:
        counts.update(dict(unit_counts))
        if failure is not None:
            failures.append(failure)
        rows[0] += table.num_rows
        stager.add(table)
    return stager.claims(), dict(counts), sorted(failures, key=lambda f: f["unit"])


def run_ingest(cfg: IngestConfig) -> IngestReport:
    """Plan the sources, load and stage them (driver threads for up to ``SMALL_ROWS`` rows,
    else Ray), de-duplicate, commit once, report."""
    check_engine(cfg.run.engine)
    if cfg.mode not in MODES:
        raise UsageError(f"mode must be one of {MODES}, got {cfg.mode!r}")
    t0 = time.perf_counter()
    specs: list[SourceSpec] = [parse_source(s, cfg.fmt) for s in cfg.sources]
    exists = T.table_exists(cfg.table_uri, cfg.storage_options)
    if cfg.mode == "create" and exists:
        raise AlreadyExists(
            f"table {cfg.table_uri!r} exists; use --mode append or --mode overwrite"
        )
    appending = cfg.mode == "append" and exists

    # Plan (driver): list sources, cut into units.
    units: list[WorkUnit] = []
    plan_counts = Counts()
    extra: list[pa.Field] = []
    sizes: list[tuple[int, float]] = []
    options = cfg.reader_options
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

    # The table as found (pinned), the schema to write and how to commit.
    pinned = None
    check = None
    if appending:
        pinned = T.open_table(cfg.table_uri, cfg.storage_options)
        output_schema(extra, pinned.schema)  # type check before anything changes
        missing = [
            pa.field(f.name, f.type, nullable=True)
            for f in extra
            if f.name not in pinned.schema.names
        ]
        if missing and not _fresh_ids(pinned):
            # Field ids this table numbers its own way: add the (all-null) columns first.
            pinned.add_columns(missing)
            pinned = T.open_table(cfg.table_uri, cfg.storage_options)
            missing = []
        schema = pa.schema([*pinned.schema, *missing])
        kind, write_mode = ("merge", "overwrite") if missing else ("append", "append")
        if pinned.count_rows():
            check = {
                "uri": cfg.table_uri,
                "version": pinned.version,
                "storage_options": cfg.storage_options,
                "run": uuid.uuid4().hex,  # never serve a cached copy of another table
                "sources": sorted(sources_in_table(pinned, [u.source for u in units])),
            }
    else:
        schema = output_schema(extra, None)
        # Staging into a table that is not there yet is "create": Lance warns at every
        # fragment that an "overwrite" or "append" found no dataset to write over.
        kind, write_mode = "overwrite", ("overwrite" if exists else "create")
        if exists:
            pinned = T.open_table(cfg.table_uri, cfg.storage_options)
    read_version = pinned.version if pinned is not None else None

    where = cfg.run.place(
        size=sum(_unit_rows(u) or UNKNOWN_UNIT_ROWS for u in units),
        small=SMALL_ROWS,
    )
    run = _stage_on_ray if where.on_ray else _stage_on_threads
    claims, counts, failures = run(cfg, units, schema, check, rows_per_fragment, write_mode, where)

    # Resolve duplicates across units (smallest order wins), then commit once.
    all_counts = Counter(plan_counts)
    all_counts.update(counts)
    drop = losers(claims)
    fragments = []
    rows_written = 0
    for k, (text, notes) in enumerate(
        zip(claims["fragment"].to_pylist(), claims["notes"].to_pylist(), strict=True)
    ):
        meta = lance_compat.fragment_from_text(text)
        gone = set(drop.get(k, ()))
        for off, row_notes in json.loads(notes).items():
            if int(off) not in gone:
                for reason in row_notes:
                    all_counts[f"kept:{reason}"] += 1
        if gone:
            all_counts["dropped:duplicate_id"] += len(gone)
            fragments.extend(
                restage(cfg.table_uri, meta, sorted(gone), schema, write_mode, cfg.storage_options)
            )
        else:
            fragments.append(meta)
        rows_written += meta.physical_rows - len(gone)
    if fragments or not appending:
        commit_ingest(cfg.table_uri, kind, fragments, schema, read_version, cfg.storage_options)
    if cfg.id_index and fragments:
        try:
            update_id_index(cfg.table_uri, cfg.storage_options)
        except Exception as e:  # the rows are committed; the index only speeds up lookups
            warnings.warn(f"could not update the id index of {cfg.table_uri}: {e}", stacklevel=2)

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


def ingest(sources: Sequence[str], table_uri: str, **options: Any) -> IngestReport:
    """Ingest ``sources`` (paths, or ``NAME=PATH`` to set the id prefix) into ``table_uri``.

    Args:
        sources: the sources, as on the command line.
        table_uri: the Lance table to write (created when missing).
        options: any other :class:`IngestConfig` field, e.g. ``mode="overwrite"``
            (``append``, the default, skips ids already in the table; ``create``
            fails if the table exists), ``caption_column=``, ``keys=`` for twin tars;
            or a :class:`RunOptions` field (``engine=``, ``progress=``, ...), which
            goes into ``run`` (defaults: RunOptions').
    """
    run_names = {f.name for f in dataclasses.fields(RunOptions)}
    moved = {k: options.pop(k) for k in list(options) if k in run_names}
    if moved:
        options["run"] = dataclasses.replace(options.get("run", RunOptions()), **moved)
    return run_ingest(IngestConfig(sources=list(sources), table_uri=table_uri, **options))
