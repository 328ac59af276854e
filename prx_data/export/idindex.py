"""The export's id index: one Lance table, ``<out>/_ids.lance``, from row id to sample.

Rows are ``(id, bucket, shard, index)``: every row of every part's
``ids.parquet`` manifest, with its bucket, and a BTREE scalar index on ``id``.
Opt-out, ``skips add --ids``, dedup and rewrite bind ids to shards through it
(:func:`lookup`), so a request of 10^3 ids reads a few index pages instead of
every manifest of the export (about 76 bytes per row, 7 GiB at 10^8 rows).

The export writes it in ``finalize``; whatever rewrites shards afterwards
(``skips rewrite``, the pack stage) calls :func:`write_id_index` once its
buckets are merged. It is built from the manifests a bounded batch at a time
(parts read in parallel), never as one table in memory.

The table's metadata records a SHA-256 of every bucket's merged ``index.json``
as it was when the index was built. :func:`open_index` compares them with the
tree: an index whose tree changed since (or that is missing, as in exports
written before it existed) is not used, :func:`lookup_or_manifests` says so in
one log line and reads the manifests as before, and ``python -m prx_data.skips
index ROOT`` builds it again.
"""

from __future__ import annotations

import hashlib
import io
import json
import logging
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from prx_data.core import confined, storage
from prx_data.core.errors import PrxDataError
from prx_data.core.schema import MANIFEST_NAME
from prx_data.export import bounded, layout, naming, safety

log = logging.getLogger(__name__)

SCHEMA = pa.schema(
    [
        ("id", pa.string()),
        ("bucket", pa.string()),
        ("shard", pa.string()),
        ("index", pa.int32()),
    ]
)
#: Table metadata key holding the build record (format, per-bucket digests and counts).
META_KEY = "prx_ids"
FORMAT = "prx-data id index"
#: The BTREE on ``id`` (one segment per data file of the table, :func:`_build_btree`).
BTREE_NAME = "id_idx"
#: Rows per data file of the table, so per BTREE segment: what one sort of the build holds,
#: against one more segment for every query to search (benchmarks/results/idindex.md).
ROWS_PER_FILE = 1 << 21
#: Manifest rows per record batch handed to Lance while building, and about the most
#: manifest rows read ahead of it: what the build holds besides Lance's own buffers.
BUILD_BATCH_ROWS = 1 << 16
#: BTREE pages one ``id IN (...)`` query should read. A query reads every page (Lance's
#: BTREE page: :data:`BTREE_PAGE_ROWS` keys) that holds one of its ids, all at once, and a
#: spread request touches a page per id, so its memory grows with the table (figures in
#: benchmarks/results/idindex.md). Ids are sorted and sliced so that a slice spans about this
#: many pages, whatever the table's size (:func:`slice_ids`).
QUERY_PAGES = 64
BTREE_PAGE_ROWS = 4096
#: The most ids in one query (a dense request: neighbouring ids share pages): near the
#: fastest per id of the sizes measured (benchmarks/results/idindex.md).
IN_CHUNK = 10_000
#: Ids taken from the caller's stream at once (bounds the memory of a lookup).
LOOKUP_CHUNK = 1 << 20
#: A chunk is looked up by one scan of the table, not by the BTREE, when it holds more than
#: 1 / SCAN_RATIO of the table's rows: about where a scan overtakes the BTREE
#: (benchmarks/results/idindex.md).
SCAN_RATIO = 40
#: Lance's caches for a lookup. Sorted chunks read each BTREE page once, so a cached page is
#: never read again: a cache only holds memory, and Lance's fills to its default caps,
#: which grow with the table (benchmarks/results/idindex.md). Small
#: caps keep what every query reads again (the page lookup table, the file metadata).
INDEX_CACHE_BYTES = 4 << 20
METADATA_CACHE_BYTES = 4 << 20


class IdIndexError(PrxDataError, ValueError):
    """The id index cannot be built from this tree (its manifests disagree with its indexes)."""


def index_uri(root: str) -> str:
    """Where the export's id index lives (the path :mod:`~prx_data.export.naming` names)."""
    return storage.join(root, naming.IDS_INDEX_NAME)


def _options(uri: str) -> dict | None:
    from prx_data.table.lance_ops import lance_storage_options

    return lance_storage_options(uri)


def _bucket_record(root: str, bucket: str) -> tuple[str, dict, dict[str, frozenset[str]]]:
    """(bucket, {"sha256", "samples", "shards"}, {part: its shard basenames}) from one read
    of the bucket's merged index."""
    path = layout.rel_join(root, f"{safety.check_bucket(bucket)}/{naming.INDEX_NAME}")
    data = confined.read(root, path, confined.INDEX_MAX_BYTES)
    try:
        obj = json.loads(data)
    except ValueError as e:
        raise safety.UnsafeIndexError(f"{path}: not valid JSON ({e})") from None
    entries = safety.check_index_entries(path, obj)
    by_part: dict[str, set[str]] = {}
    for e in entries:
        base = e["raw_data"]["basename"]
        by_part.setdefault(base.split("/")[0], set()).add(base)
    parts = {p: frozenset(by_part[p]) for p in sorted(by_part)}
    rec = {
        "sha256": hashlib.sha256(data).hexdigest(),
        "samples": sum(int(e["samples"]) for e in entries),
        "shards": len(entries),
    }
    return bucket, rec, parts


def _digest(root: str, bucket: str) -> tuple[str, str]:
    path = layout.rel_join(root, f"{safety.check_bucket(bucket)}/{naming.INDEX_NAME}")
    return bucket, hashlib.sha256(confined.read(root, path, confined.INDEX_MAX_BYTES)).hexdigest()


def _read_manifest(root: str, bucket: str, part: str, known: frozenset[str]) -> pa.Table:
    path = layout.rel_join(root, f"{bucket}/{part}/{MANIFEST_NAME}")
    try:
        data = confined.read(root, path, confined.MANIFEST_MAX_BYTES)
    except FileNotFoundError:
        raise IdIndexError(
            f"{path}: missing manifest, so the id index cannot be built; check the tree with "
            f"`python -m prx_data.verify {root}`"
        ) from None
    t = pq.read_table(io.BytesIO(data), columns=["shard", "index", "id"])
    safety.check_manifest_shards(path, part, t["shard"])
    bad = set(pc.unique(t["shard"]).to_pylist()) - known
    if bad:
        raise IdIndexError(f"{path}: shard(s) {sorted(bad)} are not in {bucket}/index.json")
    return t


def _batches(
    root: str, buckets: Sequence[str], records: dict[str, dict], batch_rows: int
) -> Iterator[pa.RecordBatch]:
    """Manifest rows of ``buckets`` as record batches of about ``batch_rows`` rows."""
    workers = bounded.io_workers(root)
    pending: list[pa.Table] = []
    rows = 0
    for bucket, rec, parts in bounded.imap_bounded(
        lambda b: _bucket_record(root, b), buckets, min(workers, 4)
    ):
        records[bucket] = rec
        got = 0
        # imap_bounded holds up to 2 * readers manifests: about batch_rows rows in all.
        per_part = rec["samples"] // max(1, len(parts))
        readers = max(1, min(workers, batch_rows // max(1, 2 * per_part)))
        for t in bounded.imap_bounded(
            lambda p, b=bucket, k=parts: _read_manifest(root, b, p, k[p]), parts, readers
        ):
            got += len(t)
            t = pa.table(
                {
                    "id": t["id"].cast(pa.string()),
                    "bucket": pa.array([bucket] * len(t), pa.string()),
                    "shard": t["shard"].cast(pa.string()),
                    "index": t["index"].cast(pa.int32()),
                },
                schema=SCHEMA,
            )
            pending.append(t)
            rows += len(t)
            if rows >= batch_rows:
                yield from pa.concat_tables(pending).combine_chunks().to_batches()
                pending, rows = [], 0
        if got != rec["samples"]:
            raise IdIndexError(
                f"{layout.rel_join(root, bucket)}: the manifests hold {got} rows but index.json "
                f"{rec['samples']} samples; check the tree with `python -m prx_data.verify {root}`"
            )
    if pending:
        yield from pa.concat_tables(pending).combine_chunks().to_batches()


def _build_btree(ds):  # noqa: ANN001, ANN202  (lance.LanceDataset, imported lazily)
    """The BTREE on ``id``, built one data file (fragment) at a time and committed as one
    index of one segment per file.

    One BTREE over the whole table sorts every id at once: over an id-only table its
    build peaked at +229 MB at 10^7 rows and +757 MB at 10^8. A segment per file (at
    most :data:`ROWS_PER_FILE` rows) keeps the build at one file's sort, whatever the
    table's size; a query searches every segment (benchmarks/results/scale.md).
    """
    segments = [
        ds.create_index_uncommitted("id", "BTREE", name=BTREE_NAME, fragment_ids=[f.fragment_id])
        for f in ds.get_fragments()
    ]
    return ds.commit_existing_index_segments(BTREE_NAME, "id", segments)


@dataclass(frozen=True)
class IdIndexInfo:
    """What :func:`write_id_index` wrote."""

    uri: str
    rows: int
    buckets: int


def write_id_index(
    out_root: str,
    buckets: Sequence[str] | None = None,
    *,
    batch_rows: int = BUILD_BATCH_ROWS,
    check: Callable[[], None] = lambda: None,
) -> IdIndexInfo:
    """(Re)build ``<out_root>/_ids.lance`` from the tree's manifests; call after every merge.

    ``buckets`` defaults to every bucket with a merged index. ``check`` (a run
    lock's) runs before each commit. The build record goes in last: a build
    killed part-way leaves an index :func:`open_index` does not use.
    """
    import lance

    from prx_data.table.lance_ops import open_table

    uri = index_uri(out_root)
    opts = _options(uri)
    names = list(layout.list_buckets(out_root) if buckets is None else buckets)
    records: dict[str, dict] = {}
    check()
    mode = "create"
    try:  # an older build's record must not vouch for the rows written now
        open_table(uri, opts).update_metadata({META_KEY: None})
        mode = "overwrite"
    except (ValueError, OSError):
        pass  # no index yet
    failed: list[BaseException] = []

    def batches() -> Iterator[pa.RecordBatch]:
        try:
            yield from _batches(out_root, names, records, batch_rows)
        except BaseException as e:  # Lance wraps it in an OSError: keep ours for the caller
            failed.append(e)
            raise

    reader = pa.RecordBatchReader.from_batches(SCHEMA, batches())
    try:
        ds = lance.write_dataset(
            reader, uri, mode=mode, storage_options=opts, max_rows_per_file=ROWS_PER_FILE
        )
    except Exception:
        if failed:
            raise failed[0] from None
        raise
    rows = ds.count_rows()
    check()
    if rows:
        ds = _build_btree(ds)
    record = {
        "format": FORMAT,
        "version": 1,
        "rows": rows,
        "buckets": dict(sorted(records.items())),
    }
    check()
    ds.update_metadata({META_KEY: json.dumps(record, sort_keys=True)})
    try:  # the previous build's files: an index is rebuilt whole, old versions serve nothing
        import datetime as dt

        ds.cleanup_old_versions(older_than=dt.timedelta(0), error_if_tagged_old_versions=False)
    except (ValueError, OSError) as e:
        log.warning("%s: could not remove the previous build's files (%s)", uri, e)
    return IdIndexInfo(uri, rows, len(records))


def extend_id_index(
    out_root: str,
    index: IdIndex,
    parts: Mapping[str, Iterable[str]],
    *,
    check: Callable[[], None] = lambda: None,
) -> IdIndexInfo:
    """Add the manifest rows of new ``parts`` ({bucket: [part]}) to a current id index, as an
    append wrote them after the index was opened: their rows appended as new data files,
    one BTREE segment more (the old segments are not rebuilt), and the build record
    updated for the touched buckets. Reads only the new parts' manifests.

    ``index`` must have been current before the buckets' ``index.json`` gained the parts.
    The record is cleared first and written last: a run killed in between leaves an index
    :func:`open_index` does not use (the caller then rebuilds it, :func:`write_id_index`).
    """
    import lance

    uri = index_uri(out_root)
    ds = index.dataset
    raw = (ds.metadata or {}).get(META_KEY)  # type: ignore[attr-defined]
    record = json.loads(raw) if raw else {}
    touched = sorted(parts)
    check()
    ds.update_metadata({META_KEY: None})  # type: ignore[attr-defined]
    found: dict[str, dict] = {}

    def batches() -> Iterator[pa.RecordBatch]:
        for bucket in touched:
            _, rec, known = _bucket_record(out_root, bucket)
            found[bucket] = rec
            for part in sorted(parts[bucket]):
                t = _read_manifest(out_root, bucket, part, known[part])
                yield from pa.table(
                    {
                        "id": t["id"].cast(pa.string()),
                        "bucket": pa.array([bucket] * len(t), pa.string()),
                        "shard": t["shard"].cast(pa.string()),
                        "index": t["index"].cast(pa.int32()),
                    },
                    schema=SCHEMA,
                ).to_batches()

    reader = pa.RecordBatchReader.from_batches(SCHEMA, batches())
    ds = lance.write_dataset(
        reader, uri, mode="append", storage_options=_options(uri), max_rows_per_file=ROWS_PER_FILE
    )
    rows = ds.count_rows()
    buckets = {**(record.get("buckets") or {}), **found}
    expected = sum(int(b["samples"]) for b in buckets.values())
    if rows != expected:
        raise IdIndexError(f"{uri}: {rows} rows after the append, the buckets hold {expected}")
    check()
    if rows and index.rows:  # the new rows get a segment of their own
        ds.optimize.optimize_indices(index_names=[BTREE_NAME], num_indices_to_merge=0)
    elif rows:
        ds = _build_btree(ds)
    record = {
        "format": FORMAT,
        "version": 1,
        "rows": rows,
        "buckets": dict(sorted(buckets.items())),
    }
    check()
    ds.update_metadata({META_KEY: json.dumps(record, sort_keys=True)})
    return IdIndexInfo(uri, rows, len(buckets))


@dataclass
class IdIndex:
    """An open, current id index of one export (:func:`open_index`)."""

    root: str
    dataset: object
    rows: int

    def lookup(self, ids: Iterable[str] | pa.Array | pa.ChunkedArray) -> Iterator[pa.Table]:
        """Tables of ``(id, bucket, shard, index)`` for the ids found, a bounded chunk at a time.

        ``ids`` may be any iterable (a stream of 10^6+ ids): it is consumed
        :data:`LOOKUP_CHUNK` ids at a time, each chunk deduplicated, sorted and
        looked up with the BTREE (``id IN (...)``, :func:`slice_ids` ids per query), or,
        when the chunk is a large share of the table, by one streamed scan
        joined against it. An id held in several buckets (tiers) gives a row
        per bucket; an id repeated in different chunks gives its rows again.
        """
        for chunk in _chunks(ids, LOOKUP_CHUNK):
            chunk = pc.unique(pc.drop_null(chunk.cast(pa.string())))
            if not len(chunk) or not self.rows:
                continue
            if len(chunk) * SCAN_RATIO > self.rows:
                yield from self._scan(chunk)
            else:
                yield from self._seek(chunk)

    def _seek(self, chunk: pa.Array) -> Iterator[pa.Table]:
        """Sorted slices of :func:`slice_ids` ids, one BTREE query each: neighbouring ids
        share pages, and only one slice's pages are read at a time."""
        chunk = chunk.take(pc.sort_indices(chunk))
        step = slice_ids(len(chunk), self.rows)
        for i in range(0, len(chunk), step):
            t = self.dataset.to_table(  # type: ignore[attr-defined]
                columns=SCHEMA.names, filter=pc.field("id").isin(chunk.slice(i, step))
            )
            if len(t):
                yield self._checked(t)

    def _scan(self, chunk: pa.Array) -> Iterator[pa.Table]:
        for b in self.dataset.to_batches(columns=SCHEMA.names, batch_size=1 << 17):  # type: ignore[attr-defined]
            hit = b.filter(pc.is_in(b["id"], value_set=chunk))
            if hit.num_rows:
                yield self._checked(pa.Table.from_batches([hit]))

    def _checked(self, t: pa.Table) -> pa.Table:
        """The index is data too: its bucket and shard names must stay inside the export."""
        uri = index_uri(self.root)
        for b in pc.unique(t["bucket"]).to_pylist():
            safety.check_bucket(b)
        for s in pc.unique(t["shard"]).to_pylist():
            safety.check_shard_basename(uri, s)
        return t


def slice_ids(ids: int, rows: int) -> int:
    """Ids per query for a sorted request of ``ids`` ids over ``rows`` rows.

    Spread over the table, neighbouring requested ids lie ``rows / ids`` keys
    apart, so a slice of ``k`` ids spans about ``k * rows / ids`` keys: the slice
    is sized to span :data:`QUERY_PAGES` pages, between that many ids (a sparse
    request: a page per id) and :data:`IN_CHUNK`.
    """
    per_page = max(1.0, BTREE_PAGE_ROWS * ids / max(1, rows))
    return max(1, min(IN_CHUNK, int(QUERY_PAGES * per_page)))


def _chunks(ids: Iterable[str] | pa.Array | pa.ChunkedArray, size: int) -> Iterator[pa.Array]:
    if isinstance(ids, pa.ChunkedArray):
        ids = ids.combine_chunks()
    if isinstance(ids, pa.Array):
        for i in range(0, len(ids), size):
            yield ids.slice(i, size)
        return
    buf: list[str] = []
    for x in ids:
        buf.append(x)
        if len(buf) >= size:
            yield pa.array(buf, pa.string())
            buf = []
    if buf:
        yield pa.array(buf, pa.string())


def open_index(root: str) -> tuple[IdIndex | None, str]:
    """The export's id index if it is current, else ``(None, why not)``.

    Current means: complete (its build record is there), and built from
    exactly the merged indexes the tree holds now (same buckets, same bytes).
    """
    from prx_data.table.lance_ops import open_table

    uri = index_uri(root)
    if not storage.exists(uri):
        return None, f"{root} has no id index ({naming.IDS_INDEX_NAME})"
    try:
        ds = open_table(
            uri,
            _options(uri),
            index_cache_size_bytes=INDEX_CACHE_BYTES,
            metadata_cache_size_bytes=METADATA_CACHE_BYTES,
        )
        raw = (ds.metadata or {}).get(META_KEY)
    except (ValueError, OSError) as e:
        return None, f"{uri} cannot be opened ({e})"
    try:
        record = json.loads(raw) if raw else None
    except ValueError:
        record = None
    if not isinstance(record, dict) or record.get("format") != FORMAT:
        return None, f"{uri} is incomplete (its build did not finish)"
    built = record.get("buckets") or {}
    now = layout.list_buckets(root)
    if set(built) != set(now):
        return None, f"{uri} was built for other buckets than the tree holds now"
    for bucket, digest in bounded.imap_bounded(
        lambda b: _digest(root, b), now, bounded.io_workers(root)
    ):
        if (built[bucket] or {}).get("sha256") != digest:
            return None, f"{uri} is out of date: {bucket}/index.json changed since it was built"
    rows = int(record.get("rows", -1))
    if rows != ds.count_rows():
        return None, f"{uri} holds {ds.count_rows()} rows, its build record {rows}"
    return IdIndex(root, ds, rows), ""


def manifest_rows(root: str, ids: pa.Array) -> Iterator[pa.Table]:
    """The manifest path: every bucket's manifests streamed, joined against ``ids``."""
    if not len(ids):
        return
    workers = bounded.io_workers(root)
    for bucket in layout.list_buckets(root):
        _, _rec, parts = _bucket_record(root, bucket)
        read = lambda p, b=bucket, k=parts: _read_manifest(root, b, p, k[p])  # noqa: E731
        for t in bounded.imap_bounded(read, parts, workers):
            hit = t.filter(pc.is_in(t["id"], value_set=ids))
            if len(hit):
                yield pa.table(
                    {
                        "id": hit["id"].cast(pa.string()),
                        "bucket": pa.array([bucket] * len(hit), pa.string()),
                        "shard": hit["shard"].cast(pa.string()),
                        "index": hit["index"].cast(pa.int32()),
                    },
                    schema=SCHEMA,
                )


def lookup_or_manifests(root: str, ids: pa.Array) -> Iterator[pa.Table]:
    """Rows ``(id, bucket, shard, index)`` of ``ids`` (unique strings): the index when current.

    Without a current index (an export written before it existed, or a tree
    changed since) one log line says so and every manifest is read instead.
    """
    index, why = open_index(root)
    if index is not None:
        yield from index.lookup(ids)
        return
    log.warning(
        "%s; reading every manifest instead (build it with `python -m prx_data.skips index %s`)",
        why,
        root,
    )
    yield from manifest_rows(root, ids)
