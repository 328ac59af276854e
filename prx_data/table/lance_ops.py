"""Lance table helpers: open, add or fill a column without rewriting images, compact, stats.

Column jobs (captions, labels, hashes, embeddings) write one column at a
time into a table whose image bytes are large. Lance stores columns in
separate data files per fragment, so :func:`update_column` joins the new
values onto each fragment with ``LanceFragment.update_columns`` and commits
one ``Update`` (``rewrite_columns``) for the whole table: only the updated
column's data files are written, the image data files are never touched.
``merge_insert`` is deliberately not used: it rewrites whole rows.

Run ``python -m prx_data.table --help`` for the ``compact`` and ``stats``
commands.
"""

from __future__ import annotations

import json
import os
import statistics
from collections.abc import Iterator
from datetime import timedelta
from typing import Any

import lance
import pyarrow as pa
import pyarrow.compute as pc

from prx_data.core import schema as S
from prx_data.core import storage
from prx_data.core.errors import NotFound, UsageError
from prx_data.table.pins import list_tags

#: Compaction target: the PRX team saw slow scans with thousands of 100k-row
#: fragments and fixed them by compacting to about 1M rows per fragment.
DEFAULT_TARGET_ROWS_PER_FRAGMENT = 1_000_000


def quote(column: str) -> str:
    """Quote a column name for a Lance SQL filter (names may hold dots or dashes)."""
    return "`" + column.replace("`", "``") + "`"


def table_exists(uri: str, storage_options: dict | None = None) -> bool:
    try:
        open_table(uri, storage_options)
    except NotFound:
        return False
    return True


def open_table(
    uri: str, storage_options: dict | None = None, version: int | None = None, **options: Any
) -> lance.LanceDataset:
    """The one way the project opens a Lance table, with a clear error when there is none.

    ``storage_options=None`` takes them from the environment
    (:func:`lance_storage_options`), so an S3-compatible endpoint set once
    reaches every job, worker and version it opens. ``options`` go to
    ``lance.dataset`` (cache sizes, for example).
    """
    storage.check_store(uri)  # az://, hf://, ...: one line naming the supported stores
    opts = lance_storage_options(uri) if storage_options is None else storage_options
    try:
        return lance.dataset(uri, version=version, storage_options=opts, **options)
    except (ValueError, OSError) as e:
        at = f"version {version} of " if version is not None else ""
        raise NotFound(
            f"no Lance table at {at}{uri!r}: {str(e).splitlines()[0] if str(e) else e!r}. "
            "Check the URI (and S3_ENDPOINT_URL for s3://), or create the table with "
            "`python -m prx_data.ingest SOURCE --table URI`"
        ) from None


#: Tables opened at a pinned version, per process: ``(uri, version, options, run) -> dataset``.
_PINNED: dict[tuple, lance.LanceDataset] = {}
#: Enough for the few tables one worker reads at once; the oldest goes first.
PINNED_TABLES_MAX = 8


def pinned_table(
    uri: str, version: int, storage_options: dict | None = None, run: str = ""
) -> lance.LanceDataset:
    """The table at ``version``, opened once per process and run (a worker serves many units).

    ``run`` is unique per job run: a table deleted and made again at the same
    path can reach the same version number, and must not be served from cache.
    """
    key = (uri, version, json.dumps(storage_options, sort_keys=True), run)
    ds = _PINNED.get(key)
    if ds is None:
        while len(_PINNED) >= PINNED_TABLES_MAX:
            _PINNED.pop(next(iter(_PINNED)))
        ds = _PINNED[key] = open_table(uri, storage_options, version)
    return ds


def _dedupe_last(values: pa.Table, key: str) -> pa.Table:
    """Keep the last row per key (later values win) and drop null keys."""
    values = values.filter(pc.is_valid(values[key]))
    if values.num_rows == 0:
        return values
    if pc.count_distinct(values[key]).as_py() == values.num_rows:
        return values
    idx = pa.array(range(values.num_rows), pa.int64())
    last = (
        values.select([key])
        .append_column("__row", idx)
        .group_by(key, use_threads=False)
        .aggregate([("__row", "max")])
    )
    return values.take(pc.sort_indices(last["__row_max"]))


def update_column(
    uri: str,
    column: str,
    values: pa.Table,
    *,
    key: str = S.ID,
    storage_options: dict | None = None,
) -> int:
    """Write ``column`` for the rows whose ``key`` appears in ``values``.

    ``values`` holds ``key`` and ``column``. The column is added (all null,
    with ``values``' type) when the table lacks it; rows not named in
    ``values`` keep their current value; keys absent from the table are
    ignored; a key given twice takes its last value. Only the column's own
    data files are written, so image bytes are never rewritten. Returns the
    number of table rows written.
    """
    if isinstance(values, pa.RecordBatch):
        values = pa.Table.from_batches([values])
    for name in (key, column):
        if name not in values.column_names:
            raise UsageError(
                f"values must have columns {key!r} and {column!r}, got {values.column_names}"
            )
    if column == key:
        raise UsageError(f"cannot update the key column {key!r}")
    if column == S.IMAGE:
        raise UsageError("update_column never rewrites image bytes; write a new table instead")
    ds = open_table(uri, storage_options)
    if key not in ds.schema.names:
        raise UsageError(f"table {uri!r} has no key column {key!r}")
    values = _dedupe_last(values.select([key, column]), key)
    if column not in ds.schema.names:
        field = values.schema.field(column)
        ds.add_columns(pa.field(column, field.type, nullable=True))
        ds = open_table(uri, storage_options)
    target_type = ds.schema.field(column).type
    if values.schema.field(column).type != target_type:
        try:
            values = values.set_column(1, column, values[column].cast(target_type))
        except (pa.ArrowInvalid, pa.ArrowNotImplementedError) as e:
            raise UsageError(
                f"values for {column!r} ({values.schema.field(column).type}) do not fit the "
                f"table's type {target_type}: {e}"
            ) from None
    key_type = ds.schema.field(key).type
    if values.schema.field(key).type != key_type:
        values = values.set_column(0, key, values[key].cast(key_type))
    if values.num_rows == 0:
        return 0

    written = 0
    updated: list = []
    fields_modified: set[int] = set()
    for frag in ds.get_fragments():
        frag_keys = frag.to_table(columns=[key])[key]
        hit = pc.is_in(frag_keys, value_set=values[key])
        n_hit = pc.sum(hit).as_py() or 0
        if not n_hit:
            continue
        sub = values.filter(pc.is_in(values[key], value_set=frag_keys))
        meta, fields = frag.update_columns(sub, left_on=key, right_on=key)
        updated.append(meta)
        fields_modified.update(fields)
        written += n_hit
    if not updated:
        return 0
    op = lance.LanceOperation.Update(
        updated_fragments=updated,
        fields_modified=sorted(fields_modified),
        update_mode="rewrite_columns",
    )
    lance.LanceDataset.commit(uri, op, read_version=ds.version, storage_options=storage_options)
    return written


def rows_missing(
    uri: str,
    column: str,
    columns: list[str],
    *,
    batch_size: int = 256,
    filter: str | None = None,
    storage_options: dict | None = None,
) -> Iterator[pa.RecordBatch]:
    """Batches of ``columns`` for rows where ``column`` is null or does not exist yet.

    A job that writes ``column`` in chunks with :func:`update_column` can be
    killed and rerun: the rerun sees only the rows still missing.
    """
    ds = open_table(uri, storage_options)
    missing = [c for c in columns if c not in ds.schema.names]
    if missing:
        raise UsageError(f"table {uri!r} has no columns {missing}")
    clauses = []
    if column in ds.schema.names:
        clauses.append(f"{quote(column)} IS NULL")
    if filter:
        clauses.append(f"({filter})")
    where = " AND ".join(clauses) or None
    for batch in ds.to_batches(columns=columns, filter=where, batch_size=batch_size):
        if batch.num_rows:
            yield batch


def table_stats(uri: str, storage_options: dict | None = None) -> dict[str, Any]:
    """Row count, fragment count and per-fragment rows and bytes (fragment hygiene)."""
    ds = open_table(uri, storage_options)
    frag_rows: list[int] = []
    frag_bytes: list[int] = []
    deleted = 0
    for frag in ds.get_fragments():
        meta = frag.metadata
        physical = meta.physical_rows or 0
        n_del = meta.num_deletions or 0
        frag_rows.append(physical - n_del)
        deleted += n_del
        frag_bytes.append(sum((df.file_size_bytes or 0) for df in meta.files))

    def summary(xs: list[int]) -> dict[str, float]:
        if not xs:
            return {"min": 0, "median": 0, "max": 0, "total": 0}
        return {"min": min(xs), "median": statistics.median(xs), "max": max(xs), "total": sum(xs)}

    try:
        indices = [
            {"name": i["name"], "type": i["type"], "fields": i["fields"]} for i in ds.list_indices()
        ]
    except Exception:  # older manifests without index details
        indices = []
    return {
        "uri": uri,
        "version": ds.version,
        "rows": ds.count_rows(),
        "deleted_rows": deleted,
        "fragments": len(frag_rows),
        "fragment_rows": summary(frag_rows),
        "fragment_bytes": summary(frag_bytes),
        "fragment_sizes": [
            {"rows": r, "bytes": b} for r, b in zip(frag_rows, frag_bytes, strict=True)
        ],
        "columns": ds.schema.names,
        "indices": indices,
    }


def format_stats(stats: dict[str, Any]) -> str:
    """Human summary of :func:`table_stats`."""
    fr, fb = stats["fragment_rows"], stats["fragment_bytes"]
    lines = [
        f"table     {stats['uri']} (version {stats['version']})",
        f"rows      {stats['rows']:,}"
        + (
            f" ({stats['deleted_rows']:,} deleted rows still stored; compaction drops them)"
            if stats["deleted_rows"]
            else ""
        ),
        f"fragments {stats['fragments']:,}",
        f"  rows per fragment  min {fr['min']:,} / median {fr['median']:,.0f} / max {fr['max']:,}",
        f"  MB per fragment    min {fb['min'] / 1e6:,.1f} / median {fb['median'] / 1e6:,.1f} "
        f"/ max {fb['max'] / 1e6:,.1f} (total {fb['total'] / 1e6:,.1f} MB)",
        f"columns   {', '.join(stats['columns'])}",
    ]
    if stats["indices"]:
        lines.append(
            "indices   " + ", ".join(f"{i['name']} ({i['type']})" for i in stats["indices"])
        )
    return "\n".join(lines)


def compact(
    uri: str,
    target_rows_per_fragment: int = DEFAULT_TARGET_ROWS_PER_FRAGMENT,
    *,
    cleanup: bool = False,
    storage_options: dict | None = None,
) -> dict[str, Any]:
    """Merge small fragments (and drop deleted rows) into ~``target_rows_per_fragment``.

    Compaction rewrites the data files of the fragments it merges (that is
    its job). With ``cleanup`` the files of older versions are deleted
    afterwards, which frees space but removes time travel to them. Tagged
    versions are kept: a paused export or a running column job tags the
    version it reads (:mod:`prx_data.table.pins`). ``kept_tags`` names the
    tags that held an older version back.
    """
    ds = open_table(uri, storage_options)
    before = len(ds.get_fragments())
    metrics = ds.optimize.compact_files(target_rows_per_fragment=target_rows_per_fragment)
    ds = open_table(uri, storage_options)
    out: dict[str, Any] = {
        "fragments_before": before,
        "fragments_after": len(ds.get_fragments()),
        "fragments_removed": metrics.fragments_removed,
        "fragments_added": metrics.fragments_added,
        "files_removed": metrics.files_removed,
        "files_added": metrics.files_added,
        "version": ds.version,
    }
    if cleanup:
        stats = ds.cleanup_old_versions(older_than=timedelta(0), error_if_tagged_old_versions=False)
        out["old_versions_removed"] = stats.old_versions
        out["bytes_removed"] = stats.bytes_removed
        out["kept_tags"] = {
            t["name"]: t["version"] for t in list_tags(ds) if t["version"] != ds.version
        }
    return out


def lance_storage_options(uri: str) -> dict[str, str] | None:
    """Storage options for a Lance URI on an S3-compatible endpoint (``S3_ENDPOINT_URL``) or a
    GCS emulator (``STORAGE_EMULATOR_HOST``: Lance's GCS client takes it as
    ``google_base_url``, unsigned over http). Lance lists a table's versions through GCS's
    XML API, which neither fake-gcs-server nor gcp-storage-emulator implements: a Lance table
    on ``gs://`` is exercised against real GCS only (README, "Stores")."""
    storage.check_store(uri)  # a table on another store is refused like any other URI
    if uri.startswith("gs://"):
        from prx_data.core.storage import gcs_emulator

        emulator = gcs_emulator()
        if not emulator:
            return None
        return {"google_base_url": emulator, "allow_http": "true", "google_skip_signature": "true"}
    if not uri.startswith("s3://"):
        return None
    opts: dict[str, str] = {}
    endpoint = os.environ.get("S3_ENDPOINT_URL")
    if endpoint:
        opts["aws_endpoint"] = endpoint
        if endpoint.startswith("http://"):
            opts["allow_http"] = "true"
    region = os.environ.get("AWS_REGION") or os.environ.get("AWS_DEFAULT_REGION")
    if region:
        opts["aws_region"] = region
    return opts or None


def query_ids(table_uri: str, where: str) -> list[str]:
    """Row ids of a Lance table matching a SQL filter (only the ``id`` column is read)."""
    ds = open_table(table_uri)
    try:
        return ds.to_table(columns=["id"], filter=where)["id"].to_pylist()
    except ValueError as e:  # lance reports a filter it cannot parse or bind this way
        raise UsageError(f"filter {where!r} on {table_uri}: {str(e).splitlines()[0]}") from None


def append_at_version(
    uri: str,
    rows: pa.Table,
    read_version: int | None,
    storage_options: dict | None = None,
    schema: pa.Schema | None = None,
    metadata: dict[str, str] | None = None,
) -> int:
    """Append ``rows`` as the commit right after ``read_version``, or not at all.

    A fenced append: the store itself refuses it when anyone committed after
    ``read_version`` (Lance rebases a plain ``Append`` over a concurrent one, so
    this commits a ``Merge`` of the fragments seen plus the new one, which
    conflicts with every concurrent commit). ``read_version=None`` creates the
    table (refused when one exists) with ``schema``. ``metadata`` entries are set in
    the schema's metadata by the same commit. Returns the version created; raises
    :class:`~prx_data.core.errors.Conflict` when preempted (nothing is visible).
    """
    from prx_data.core.errors import Conflict

    opts = lance_storage_options(uri) if storage_options is None else storage_options
    if read_version is None:
        try:
            ds = lance.write_dataset(
                rows.cast(schema) if schema is not None else rows,
                uri,
                mode="create",
                storage_options=opts,
            )
        except (OSError, ValueError) as e:
            raise Conflict(f"{uri}: created by another writer meanwhile ({e})") from None
        return ds.version
    base = open_table(uri, opts, version=read_version)
    frags = lance.fragment.write_fragments(
        rows.cast(base.schema), uri, schema=base.schema, storage_options=opts
    )
    new_schema = base.schema
    if metadata:
        meta = {k.decode(): v.decode() for k, v in (base.schema.metadata or {}).items()}
        new_schema = base.schema.with_metadata({**meta, **metadata})
    op = lance.LanceOperation.Merge(
        [f.metadata for f in base.get_fragments()] + list(frags), new_schema
    )
    try:
        ds = lance.LanceDataset.commit(
            uri, op, read_version=read_version, storage_options=opts, max_retries=0
        )
    except (OSError, ValueError, RuntimeError) as e:
        if "conflict" in str(e).lower() or "preempted" in str(e).lower():
            raise Conflict(
                f"{uri}: another writer committed after version {read_version}; "
                "nothing was recorded, run it again"
            ) from None
        raise
    return ds.version
