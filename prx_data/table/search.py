"""Search a Lance image table: full text on captions, nearest neighbours, and both fused.

Lance cannot combine a full-text query and a vector query in one scan, so
:func:`hybrid_search` runs both and merges the ranked lists by reciprocal
rank fusion (RRF: score = sum of 1 / (k + rank)), which needs no score
calibration between BM25 and cosine distance.

The vector column is the source's own ``embedding`` when it has one (e.g.
CLIP), else ``clip_image_embedding`` (``python -m prx_data.score clip``),
else the toolkit's pixel descriptor (:mod:`prx_data.core.descriptor`).
Filters are Lance SQL strings; :func:`filter_sql` builds them for tier,
aspect-ratio bucket and label columns.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import lance
import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
from lance.query import MatchQuery, MultiMatchQuery

from prx_data.core import descriptor
from prx_data.core import schema as S
from prx_data.core.buckets import DEFAULT_SPEC, BucketSpec, aspect_label
from prx_data.core.errors import UnknownName, UsageError
from prx_data.table import lance_ops as T

__all__ = [
    "CLIP_IMAGE_COLUMN",
    "DEFAULT_VECTOR_INDEX",
    "MIN_ROWS_FOR_ANN",
    "SEMDEDUP_CLUSTER_COLUMN",
    "SEMDEDUP_COSINE_COLUMN",
    "aspect_ranges",
    "build_indexes",
    "caption_columns",
    "filter_sql",
    "hybrid_search",
    "indexed_columns",
    "is_caption_column",
    "similar",
    "sql_str",
    "text_search",
    "vector_column",
    "vector_of",
    "vector_search",
]

DEFAULT_RRF_K = 60
#: The column ``python -m prx_data.score clip`` writes its image embedding to.
CLIP_IMAGE_COLUMN = "clip_image_embedding"
#: Written by semantic dedup (:mod:`prx_data.pipelines.semdedup`): each row's k-means cluster and its
#: best cosine to a better member of it (null for the cluster's best), so a cluster can be shown.
SEMDEDUP_CLUSTER_COLUMN = "semdedup_cluster"
SEMDEDUP_COSINE_COLUMN = "semdedup_cosine"
#: Below this many vectors a flat (exact) scan is as fast as an index.
MIN_ROWS_FOR_ANN = 10_000
#: The best recall@10 of the index types measured at the same nprobes
#: (benchmarks/results/search.md, benchmarks/bench_search.py).
DEFAULT_VECTOR_INDEX = "IVF_HNSW_SQ"
RESULT_COLUMNS = [S.ID, S.CAPTION, S.WIDTH, S.HEIGHT]

TableLike = str | lance.LanceDataset


def _ds(table: TableLike) -> lance.LanceDataset:
    return table if isinstance(table, lance.LanceDataset) else T.open_table(table)


def _is_text(t: pa.DataType) -> bool:
    return pa.types.is_string(t) or pa.types.is_large_string(t)


#: Suffixes of bookkeeping columns that column jobs write next to a caption column.


def is_caption_column(name: str) -> bool:
    """``caption`` and ``caption_*``/``*_caption``, but not ``*_status``/``*_error`` bookkeeping."""
    if S.is_job_column(name):
        return False
    return name == S.CAPTION or name.startswith("caption_") or name.endswith("_caption")


def caption_columns(table: TableLike) -> list[str]:
    """String columns that hold captions (see :func:`is_caption_column`)."""
    ds = _ds(table)
    return [f.name for f in ds.schema if _is_text(f.type) and is_caption_column(f.name)]


def vector_column(table: TableLike) -> str | None:
    """The first with values of: the source's ``embedding``, the CLIP score job's image
    embedding, the pixel descriptor; else None."""
    ds = _ds(table)
    for name in (S.EMBEDDING, CLIP_IMAGE_COLUMN, descriptor.COLUMN):
        if (
            name in ds.schema.names
            and pa.types.is_fixed_size_list(ds.schema.field(name).type)
            and ds.count_rows(f"{T.quote(name)} IS NOT NULL") > 0
        ):
            return name
    return None


def indexed_columns(ds: lance.LanceDataset) -> dict[str, str]:
    out = {}
    for idx in ds.list_indices():
        for f in idx["fields"]:
            out[f] = idx["type"]
    return out


def build_indexes(
    uri: str,
    *,
    text_columns: Sequence[str] | None = None,
    vector: str | None = None,
    min_rows_for_ann: int = MIN_ROWS_FOR_ANN,
    vector_index: str = DEFAULT_VECTOR_INDEX,
    storage_options: dict | None = None,
) -> dict[str, str]:
    """Create (or refresh) the exploration indexes; returns {column: index type}.

    INVERTED (BM25 full text) on every caption column, BTREE on ``id`` (fast
    lookups when an image is clicked), and a cosine vector index
    (``vector_index``: IVF_HNSW_SQ by default, for high recall; IVF_PQ or
    IVF_SQ build faster) once the vector column has ``min_rows_for_ann``
    rows (smaller tables are searched exactly, which is just as fast). Run again after ingesting or
    adding captions: Lance indexes cover only the rows present when built.
    """
    ds = T.open_table(uri, storage_options)
    made: dict[str, str] = {}
    for col in text_columns if text_columns is not None else caption_columns(ds):
        ds.create_scalar_index(col, "INVERTED", replace=True, with_position=False)
        made[col] = "INVERTED"
    ds.create_scalar_index(S.ID, "BTREE", replace=True)
    made[S.ID] = "BTREE"
    vec = vector or vector_column(ds)
    if vec is not None:
        n = ds.count_rows(f"{T.quote(vec)} IS NOT NULL")
        if n >= min_rows_for_ann:
            dim = ds.schema.field(vec).type.list_size
            kwargs: dict[str, Any] = {"num_partitions": _partitions(n, vector_index)}
            if vector_index == "IVF_PQ":
                kwargs["num_sub_vectors"] = _sub_vectors(dim)
            ds.create_index(vec, index_type=vector_index, metric="cosine", replace=True, **kwargs)
            made[vec] = vector_index
    return made


def _partitions(n: int, index_type: str) -> int:
    """IVF partitions: sqrt(n) for flat lists; fewer, larger ones when each holds an HNSW graph."""
    root = math.sqrt(n)
    return max(1, min(4096, int(root / 16 if "HNSW" in index_type else root)))


def _sub_vectors(dim: int) -> int:
    for s in (dim // 8, dim // 4, dim // 2, 1):
        if s >= 1 and dim % s == 0:
            return s
    return 1


def text_search(
    table: TableLike,
    query: str,
    *,
    k: int = 50,
    columns: Sequence[str] | None = None,
    search_columns: Sequence[str] | None = None,
    filter: str | None = None,
) -> pa.Table:
    """BM25 full-text search over caption columns; adds ``_score`` (higher is better)."""
    ds = _ds(table)
    query = query.strip()
    cols = list(columns or [c for c in RESULT_COLUMNS if c in ds.schema.names])
    if not query:
        return ds.to_table(columns=cols, limit=0).append_column(
            "_score", pa.array([], pa.float32())
        )
    targets = list(search_columns or [c for c in caption_columns(ds) if c in indexed_columns(ds)])
    if not targets:
        raise UsageError("no full-text index on a caption column; run build_indexes() first")
    ftq = MatchQuery(query, targets[0]) if len(targets) == 1 else MultiMatchQuery(query, targets)
    return ds.to_table(
        columns=[*cols, "_score"],
        full_text_query=ftq,
        limit=k,
        filter=filter,
        prefilter=filter is not None,
    )


def vector_search(
    table: TableLike,
    vector: Sequence[float] | np.ndarray,
    *,
    k: int = 50,
    column: str | None = None,
    columns: Sequence[str] | None = None,
    filter: str | None = None,
    nprobes: int = 20,
    refine_factor: int | None = None,
) -> pa.Table:
    """Nearest neighbours by cosine distance; adds ``_distance`` (lower is closer)."""
    ds = _ds(table)
    column = column or vector_column(ds)
    if column is None:
        raise UsageError("the table has no vector column; compute descriptors first")
    cols = list(columns or [c for c in RESULT_COLUMNS if c in ds.schema.names])
    q = np.asarray(vector, dtype=np.float32)
    nearest: dict[str, Any] = {"column": column, "q": q, "k": k, "metric": "cosine"}
    index_type = indexed_columns(ds).get(column)
    if index_type is not None:
        nearest["nprobes"] = nprobes
        # PQ codes are coarse: re-rank candidates on the full vectors. SQ is close enough.
        if refine_factor is None and "PQ" in index_type:
            refine_factor = 5
        if refine_factor:
            nearest["refine_factor"] = refine_factor
    return ds.to_table(columns=cols, nearest=nearest, filter=filter, prefilter=filter is not None)


def vector_of(table: TableLike, row_id: str, column: str | None = None) -> np.ndarray | None:
    ds = _ds(table)
    column = column or vector_column(ds)
    if column is None:
        return None
    t = ds.to_table(columns=[column], filter=f"{S.ID} = {sql_str(row_id)}", limit=1)
    if t.num_rows == 0 or t[column][0].as_py() is None:
        return None
    return np.asarray(t[column][0].as_py(), dtype=np.float32)


def similar(
    table: TableLike,
    row_id: str,
    *,
    k: int = 24,
    column: str | None = None,
    columns: Sequence[str] | None = None,
    filter: str | None = None,
) -> pa.Table:
    """The ``k`` images closest to ``row_id`` (itself excluded)."""
    ds = _ds(table)
    column = column or vector_column(ds)
    vec = vector_of(ds, row_id, column)
    if vec is None:
        raise UnknownName(f"{row_id!r} is not in the table or has no vector")
    res = vector_search(ds, vec, k=k + 1, column=column, columns=columns, filter=filter)
    return res.filter(pc.not_equal(res[S.ID], row_id)).slice(0, k)


def rrf(ranked: Sequence[Sequence[str]], k: int = DEFAULT_RRF_K) -> list[tuple[str, float]]:
    """Reciprocal rank fusion of ranked id lists (rank 1 = best), best first."""
    scores: dict[str, float] = {}
    for ids in ranked:
        for rank, i in enumerate(ids, start=1):
            scores[i] = scores.get(i, 0.0) + 1.0 / (k + rank)
    return sorted(scores.items(), key=lambda kv: (-kv[1], kv[0]))


def hybrid_search(
    table: TableLike,
    query: str,
    *,
    vector: Sequence[float] | np.ndarray | None = None,
    k: int = 50,
    column: str | None = None,
    filter: str | None = None,
    feedback: int = 5,
    rrf_k: int = DEFAULT_RRF_K,
) -> pa.Table:
    """Full-text and vector results fused by RRF: ``id, _score, text_rank, vector_rank``.

    ``vector`` is the query vector (e.g. a clicked image's). Without one, the
    mean vector of the top ``feedback`` text hits is used (pseudo-relevance
    feedback): the vector list then adds images that look like the best
    text matches but whose captions miss the words.
    """
    ds = _ds(table)
    text = text_search(ds, query, k=k, columns=[S.ID], filter=filter)
    text_ids = text[S.ID].to_pylist()
    column = column or vector_column(ds)
    vec_ids: list[str] = []
    if column is not None:
        q = None if vector is None else np.asarray(vector, np.float32)
        if q is None and text_ids:
            vecs = [vector_of(ds, i, column) for i in text_ids[:feedback]]
            vecs = [v for v in vecs if v is not None]
            q = np.mean(vecs, axis=0) if vecs else None
        if q is not None:
            vec_ids = vector_search(ds, q, k=k, column=column, columns=[S.ID], filter=filter)[
                S.ID
            ].to_pylist()
    fused = rrf([text_ids, vec_ids], rrf_k)[:k]
    t_rank = {i: r for r, i in enumerate(text_ids, 1)}
    v_rank = {i: r for r, i in enumerate(vec_ids, 1)}
    return pa.table(
        {
            S.ID: [i for i, _ in fused],
            "_score": pa.array([s for _, s in fused], pa.float64()),
            "text_rank": pa.array([t_rank.get(i) for i, _ in fused], pa.int32()),
            "vector_rank": pa.array([v_rank.get(i) for i, _ in fused], pa.int32()),
        }
    )


# --- filters -------------------------------------------------------------------


def sql_str(value: str) -> str:
    return "'" + str(value).replace("'", "''") + "'"


def aspect_ranges(spec: BucketSpec = DEFAULT_SPEC) -> dict[str, tuple[float, float]]:
    """Aspect-ratio bucket label -> [lo, hi) ratio range (log-space midpoints)."""
    shapes = spec.shapes(spec.tiers[0])
    ratios = [w / h for w, h in shapes]
    out = {}
    for i, (w, h) in enumerate(shapes):
        lo = spec.min_aspect if i == 0 else math.sqrt(ratios[i - 1] * ratios[i])
        hi = spec.max_aspect if i == len(shapes) - 1 else math.sqrt(ratios[i] * ratios[i + 1])
        out[aspect_label(w, h)] = (lo, hi)
    return out


def filter_sql(
    *,
    tier: int | str | None = None,
    aspect: str | None = None,
    labels: dict[str, str] | None = None,
    spec: BucketSpec = DEFAULT_SPEC,
) -> str | None:
    """A Lance filter for the explorer's facets.

    ``tier``: a tier (its pixel range per :func:`prx_data.core.buckets.assign_tier`)
    or ``"too_small"``; ``aspect``: a bucket label such as ``"1.000"`` or
    ``"out_of_range"``; ``labels``: exact matches on other columns.
    """
    clauses = []
    px = f"(CAST({S.WIDTH} AS BIGINT) * CAST({S.HEIGHT} AS BIGINT))"
    if tier not in (None, ""):
        tiers = list(spec.tiers)
        if str(tier) == "too_small":
            clauses.append(f"{px} < {math.ceil(spec.floor_pixels(tiers[0]))}")
        else:
            t = int(tier)
            if t not in tiers:
                raise UsageError(f"unknown tier {t}; tiers are {tiers}")
            clauses.append(f"{px} >= {math.ceil(spec.floor_pixels(t) - 1e-6)}")
            nxt = tiers.index(t) + 1
            if nxt < len(tiers):
                clauses.append(f"{px} < {math.ceil(spec.floor_pixels(tiers[nxt]) - 1e-6)}")
    if aspect not in (None, ""):
        if aspect == "out_of_range":
            clauses.append(
                f"({S.WIDTH} < {spec.min_aspect} * {S.HEIGHT} OR {S.WIDTH} > {spec.max_aspect} * {S.HEIGHT})"
            )
        else:
            ranges = aspect_ranges(spec)
            if aspect not in ranges:
                raise UsageError(f"unknown aspect bucket {aspect!r}; choose from {sorted(ranges)}")
            lo, hi = ranges[aspect]
            clauses.append(f"CAST({S.WIDTH} AS DOUBLE) >= {lo!r} * {S.HEIGHT}")
            op = "<=" if hi == spec.max_aspect else "<"
            clauses.append(f"CAST({S.WIDTH} AS DOUBLE) {op} {hi!r} * {S.HEIGHT}")
    for col, value in (labels or {}).items():
        if value in (None, ""):
            continue
        clauses.append(f"{T.quote(col)} = {sql_str(value)}")
    return " AND ".join(clauses) or None
