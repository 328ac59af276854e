"""The semantic dedup job: read a table's embeddings, find near duplicates, write a skip list.

The method (spherical k-means, then the best cosine to a better member within
each cluster) is :mod:`prx_data.skips.semdedup`; this module reads the rows
(only those of ``--export`` when given), reports the share removed at several
thresholds and replaces the skip list through
:func:`prx_data.skips.dedup.replace_skip_list`.
"""

from __future__ import annotations

import json
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from prx_data.core.errors import UsageError
from prx_data.core.reports import FailureCounts
from prx_data.skips.semdedup import (
    DEFAULT_REPORT_THRESHOLDS,
    DEFAULT_SKIP_NAME,
    DEFAULT_THRESHOLD,
    SemDuplicates,
    find_semantic_duplicates,
)
from prx_data.table.search import CLIP_IMAGE_COLUMN


@dataclass(frozen=True)
class SemDedupConfig:
    """One semantic dedup run over a table (and optionally its export)."""

    table: str
    export: str | None = None
    embedding_column: str = CLIP_IMAGE_COLUMN
    threshold: float = DEFAULT_THRESHOLD
    report_thresholds: tuple[float, ...] = DEFAULT_REPORT_THRESHOLDS
    #: Mean rows per k-means cluster (k = rows / cluster_size).
    cluster_size: int = 1000
    #: Rows k-means is trained on (a seeded uniform sample).
    train_rows: int = 262_144
    iters: int = 20
    seed: int = 0
    skip_name: str = DEFAULT_SKIP_NAME
    #: Rows fetched per read while assigning clusters.
    batch_rows: int = 65_536
    storage_options: dict | None = field(default=None, hash=False)

    def __post_init__(self) -> None:
        for t in (self.threshold, *self.report_thresholds):
            if not -1.0 <= t <= 1.0:
                raise UsageError(f"cosine thresholds lie in [-1, 1], got {t}")
        if self.cluster_size < 1 or self.train_rows < 1 or self.iters < 1 or self.batch_rows < 1:
            raise UsageError("cluster_size, train_rows, iters and batch_rows must be >= 1")


@dataclass
class SemDedupReport(FailureCounts):
    """What a semantic dedup found; it fails no item (rows without an embedding are left alone)."""

    table: str
    embedding_column: str
    rows: int = 0
    rows_without_embedding: int = 0
    clusters: int = 0
    cluster_sizes: dict[str, int] = field(default_factory=dict)
    threshold: float = DEFAULT_THRESHOLD
    #: threshold -> (rows removed, fraction removed)
    by_threshold: dict[str, dict] = field(default_factory=dict)
    removed: int = 0
    examples: list[dict] = field(default_factory=list)
    skip_list: dict | None = None
    seconds: float = 0.0

    job_label = "semdedup"
    counted = "rows"

    @property
    def total(self) -> int:
        return self.rows

    def to_dict(self) -> dict:
        return {k: getattr(self, k) for k in self.__dataclass_fields__}

    def text(self) -> str:
        sizes = self.cluster_sizes
        lines = [
            f"semantic dedup on {self.embedding_column}: {self.rows:,} rows in {self.clusters:,} "
            f"clusters (sizes min {sizes.get('min', 0)}, median {sizes.get('median', 0)}, "
            f"max {sizes.get('max', 0)}), {self.seconds:.1f}s"
            + (
                f"; {self.rows_without_embedding:,} rows without an embedding left alone"
                if self.rows_without_embedding
                else ""
            ),
            "cosine threshold  removed  fraction",
        ]
        for t, v in self.by_threshold.items():
            mark = "  <- chosen" if float(t) == self.threshold else ""
            lines.append(f"  {float(t):>14.3f}  {v['removed']:>7,}  {v['fraction']:>8.2%}{mark}")
        if self.skip_list is not None:
            lines.append(f"skip list: {json.dumps(self.skip_list)}")
        return "\n".join(lines)


def run_semdedup(cfg: SemDedupConfig) -> SemDedupReport:
    """Cluster the table's embeddings, report every threshold, write the skip list."""
    from prx_data.core import schema as S
    from prx_data.table.lance_ops import open_table, quote

    start = time.perf_counter()
    ds = open_table(cfg.table, cfg.storage_options)
    col = cfg.embedding_column
    if col not in ds.schema.names or not pa.types.is_fixed_size_list(ds.schema.field(col).type):
        raise UsageError(
            f"{cfg.table!r} has no vector column {col!r}; run `python -m prx_data.score clip "
            f"--table {cfg.table} --model ...` first, or name one with --embedding-column"
        )
    meta = ds.to_table(
        columns=[S.ID, S.WIDTH, S.HEIGHT],
        filter=f"{quote(col)} IS NOT NULL",
        with_row_address=False,
        with_row_id=False,
    )
    rows_all = ds.count_rows()
    offsets = _offsets(ds, col)
    ids = meta[S.ID].combine_chunks()
    keep = np.ones(len(ids), bool)
    if cfg.export is not None:  # only the rows the export holds, found through its id index
        from prx_data.export.idindex import lookup_or_manifests

        hits = [c for t in lookup_or_manifests(cfg.export, pc.unique(ids)) for c in t["id"].chunks]
        exported = pa.concat_arrays(hits) if hits else pa.array([], pa.string())
        keep = pc.is_in(ids, value_set=exported).to_numpy(zero_copy_only=False)
    sel = np.flatnonzero(keep)
    ids = ids.take(pa.array(sel))
    offsets = offsets[sel]
    w = meta[S.WIDTH].cast(pa.float64()).fill_null(0).to_numpy(zero_copy_only=False)[sel]
    h = meta[S.HEIGHT].cast(pa.float64()).fill_null(0).to_numpy(zero_copy_only=False)[sel]
    area = (w * h).astype(np.int64)

    def fetch(rows: np.ndarray) -> np.ndarray:
        t = ds.take(offsets[rows], columns=[col])
        arr = t[col].combine_chunks()
        return arr.flatten().to_numpy(zero_copy_only=False).reshape(len(rows), arr.type.list_size)

    dups = find_semantic_duplicates(
        fetch,
        len(ids),
        area,
        ids,
        cluster_size=cfg.cluster_size,
        train_rows=cfg.train_rows,
        iters=cfg.iters,
        seed=cfg.seed,
        batch_rows=cfg.batch_rows,
    )
    rep = summarise(dups, cfg, ids)
    rep.table = cfg.table
    rep.rows_without_embedding = rows_all - len(meta)
    if cfg.export is not None:
        from prx_data.skips.dedup import replace_skip_list

        removed = ids.filter(pa.array(dups.removed(cfg.threshold)))
        rows = pa.table({"id": removed})  # every one is in the export (``keep`` above)
        rep.skip_list = replace_skip_list(
            cfg.export,
            cfg.skip_name,
            rows,
            table=cfg.table,
            reason=f"semdedup: {col} cosine >= {cfg.threshold:g} to a larger image",
        )
    rep.seconds = time.perf_counter() - start
    return rep


def _offsets(ds, col: str) -> np.ndarray:
    """Row offsets (``take`` positions) of the rows with an embedding, in scan order."""
    parts, base = [], 0
    for batch in ds.scanner(columns=[col], batch_size=1 << 16).to_batches():
        valid = np.asarray(batch.column(0).is_valid(), bool)
        parts.append(base + np.flatnonzero(valid))
        base += batch.num_rows
    return np.concatenate(parts) if parts else np.zeros(0, np.int64)


def summarise(dups: SemDuplicates, cfg: SemDedupConfig, ids: pa.Array) -> SemDedupReport:
    """Cluster sizes, the rows removed at each threshold, a few example pairs."""
    n = len(dups.best)
    sizes = np.bincount(dups.labels) if n else np.zeros(0, np.int64)
    sizes = sizes[sizes > 0]
    thresholds: Sequence[float] = sorted({*cfg.report_thresholds, cfg.threshold})
    by = {}
    for t in thresholds:
        r = int(dups.removed(t).sum())
        by[f"{t:g}"] = {"removed": r, "fraction": r / n if n else 0.0}
    rm = np.flatnonzero(dups.removed(cfg.threshold))
    keeper = dups.keeper(cfg.threshold)
    ex = rm[np.argsort(-dups.best[rm], kind="stable")][:10]
    return SemDedupReport(
        table=cfg.table,
        embedding_column=cfg.embedding_column,
        rows=n,
        clusters=len(sizes),
        cluster_sizes={
            "min": int(sizes.min()) if len(sizes) else 0,
            "median": int(np.median(sizes)) if len(sizes) else 0,
            "p90": int(np.percentile(sizes, 90)) if len(sizes) else 0,
            "max": int(sizes.max()) if len(sizes) else 0,
        },
        threshold=cfg.threshold,
        by_threshold=by,
        removed=len(rm),
        examples=[
            {
                "id": ids[int(i)].as_py(),
                "kept": ids[int(keeper[i])].as_py(),
                "cosine": round(float(dups.best[i]), 4),
            }
            for i in ex
        ],
    )
