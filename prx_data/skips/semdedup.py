"""Semantic dedup (SemDeDup): drop images whose embeddings nearly coincide, keep the largest.

pHash finds copies of the same pixels; embeddings also find the same photo
re-encoded, cropped or colour-shifted, and many shots of one concept. The
method of Abbas et al. (2023), as NeMo Curator ships it:

1. **Cluster** the L2-normalised embeddings with spherical k-means (seeded
   Lloyd iterations as BLAS products, :func:`train_centroids`, on a sample of
   ``train_rows``; every row is then assigned to its nearest centroid with
   one matrix product per batch). ``k = rows / cluster_size``. Lance's
   ``KMeans`` has no cosine metric and differs run to run; SciPy's ``kmeans2``
   took 180 s for 100k x 64 rows at k = 100 (this: 5 s, 20 iterations).
2. **Within each cluster**, order the members best first (largest
   width x height, then smallest id) and give each member the highest cosine
   to any better member (blocked matrix products, never a full n x n matrix).
3. At a threshold ``t``, a member whose best cosine is ``>= t`` is a near
   duplicate of that better member: it is removed, and the best member of a
   chain is kept. One pass gives the fraction removed at *every* threshold,
   so the report lists several and the user picks one.

Pairs that straddle two clusters are missed (the price of not comparing all
pairs); ``benchmarks/bench_scores.py`` measures this against brute force.
With ``--export`` only the export's rows take part and the removed ones go
to a skip list (default ``semdedup``) through
:func:`prx_data.skips.dedup.replace_skip_list` (the table's list registry,
then the export's sidecars), so the shards stay as they are and a rerun
replaces the list.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from prx_data.core.errors import UsageError
from prx_data.table.search import CLIP_IMAGE_COLUMN

DEFAULT_SKIP_NAME = "semdedup"
#: For CLIP ViT image embeddings, re-encodes, crops and colour shifts of one photo score
#: above this; 0.9 also merges near-identical scenes (check the report before lowering it).
DEFAULT_THRESHOLD = 0.95
DEFAULT_REPORT_THRESHOLDS = (0.8, 0.85, 0.9, 0.95, 0.98)
BLOCK = 2048


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
class SemDuplicates:
    """Per row (in the input order): cluster, best cosine to a better member, and which."""

    labels: np.ndarray
    best: np.ndarray
    #: Row of the better member ``best`` refers to; -1 for each cluster's best member.
    nearest: np.ndarray

    def removed(self, threshold: float) -> np.ndarray:
        return self.best >= threshold

    def keeper(self, threshold: float) -> np.ndarray:
        """The kept row each row stands for at ``threshold`` (itself when kept)."""
        n = len(self.best)
        keep = np.arange(n)
        rm = self.removed(threshold)
        # ``nearest`` always points to a better member, so a chain ends at a kept row.
        for _ in range(64):
            nxt = np.where(rm[keep], self.nearest[keep], keep)
            if np.array_equal(nxt, keep):
                break
            keep = nxt
        return keep


def normalise(x: np.ndarray) -> np.ndarray:
    x = np.asarray(x, np.float32)
    return x / np.maximum(np.linalg.norm(x, axis=1, keepdims=True), 1e-12)


def train_centroids(sample: np.ndarray, k: int, iters: int = 20, seed: int = 0) -> np.ndarray:
    """Spherical k-means on normalised rows: seeded Lloyd iterations as matrix products.

    Assignment is one BLAS product per block and the update one sparse
    product, so 262k x 768 rows with k = 1000 take seconds per iteration.
    Empty clusters are re-seeded from random rows (same seed, same result).
    """
    from scipy.sparse import csr_matrix

    rng = np.random.default_rng(seed)
    n = len(sample)
    k = max(1, min(k, n))
    centroids = sample[np.sort(rng.choice(n, size=k, replace=False))].copy()
    for _ in range(iters):
        labels = assign(sample, centroids)
        member = csr_matrix((np.ones(n, np.float32), (labels, np.arange(n))), shape=(k, n))
        sums = np.asarray(member @ sample, np.float32)
        empty = np.flatnonzero(np.bincount(labels, minlength=k) == 0)
        if len(empty):
            sums[empty] = sample[rng.choice(n, size=len(empty), replace=False)]
        new = normalise(sums)
        if np.array_equal(new, centroids):
            break
        centroids = new
    return centroids


def assign(x: np.ndarray, centroids: np.ndarray, block: int = 16_384) -> np.ndarray:
    """Nearest centroid (cosine) of each normalised row, in blocks of rows."""
    out = np.empty(len(x), np.int64)
    for s in range(0, len(x), block):
        out[s : s + block] = (x[s : s + block] @ centroids.T).argmax(axis=1)
    return out


def rank_members(labels: np.ndarray, area: np.ndarray, ids: pa.Array) -> np.ndarray:
    """All rows sorted by (cluster, largest area, smallest id)."""
    t = pa.table({"label": pa.array(labels), "area": pa.array(area), "id": ids})
    order = pc.sort_indices(
        t, sort_keys=[("label", "ascending"), ("area", "descending"), ("id", "ascending")]
    )
    return order.to_numpy()


def best_better(x: np.ndarray, block: int = BLOCK) -> tuple[np.ndarray, np.ndarray]:
    """For rows ordered best first: the highest cosine to an earlier row, and which row."""
    m = len(x)
    best = np.full(m, -np.inf, np.float32)
    arg = np.full(m, -1, np.int64)
    for s in range(1, m, block):
        e = min(m, s + block)
        sims = x[s:e] @ x[:e].T
        later = np.arange(e)[None, :] >= np.arange(s, e)[:, None]
        sims[later] = -np.inf
        arg[s:e] = sims.argmax(axis=1)
        best[s:e] = sims[np.arange(e - s), arg[s:e]]
    return best, arg


def find_semantic_duplicates(
    fetch: Callable[[np.ndarray], np.ndarray],
    n: int,
    area: np.ndarray,
    ids: pa.Array,
    *,
    cluster_size: int = 1000,
    train_rows: int = 262_144,
    iters: int = 20,
    seed: int = 0,
    batch_rows: int = 65_536,
) -> SemDuplicates:
    """SemDeDup over ``n`` rows whose embeddings ``fetch(rows)`` returns (sorted row indices).

    Memory holds a sample for training, one batch while assigning, and one
    group of whole clusters while comparing, never all embeddings at once.
    """
    rng = np.random.default_rng(seed)
    labels = np.zeros(n, np.int64)
    best = np.full(n, -np.inf, np.float32)
    nearest = np.full(n, -1, np.int64)
    if n == 0:
        return SemDuplicates(labels, best, nearest)
    k = max(1, round(n / cluster_size))
    if k > 1:
        sample = np.sort(rng.choice(n, size=min(n, train_rows), replace=False))
        centroids = train_centroids(normalise(fetch(sample)), k, iters, seed)
        for s in range(0, n, batch_rows):
            rows = np.arange(s, min(n, s + batch_rows))
            labels[rows] = assign(normalise(fetch(rows)), centroids)
    order = rank_members(labels, np.asarray(area, np.int64), ids)
    lab = labels[order]
    starts = np.flatnonzero(np.r_[True, lab[1:] != lab[:-1]])
    ends = np.r_[starts[1:], len(order)]
    # Groups of whole clusters, about batch_rows rows each, fetched in one read.
    g0 = 0
    while g0 < len(starts):
        g1 = g0 + 1
        while g1 < len(starts) and ends[g1] - starts[g0] <= batch_rows:
            g1 += 1
        members = order[starts[g0] : ends[g1 - 1]]
        by_row = np.argsort(members, kind="stable")
        got = normalise(fetch(members[by_row]))
        vecs = np.empty_like(got)
        vecs[by_row] = got
        for a, b in zip(starts[g0:g1], ends[g0:g1], strict=True):
            if b - a < 2:
                continue
            lo = a - starts[g0]
            cb, ca = best_better(vecs[lo : lo + (b - a)])
            rows = order[a:b]
            best[rows] = cb
            nearest[rows] = np.where(ca >= 0, rows[np.maximum(ca, 0)], -1)
        g0 = g1
    return SemDuplicates(labels, best, nearest)


@dataclass
class SemDedupReport:
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
    man = None
    if cfg.export is not None:
        from prx_data.export.layout import read_manifests

        man = read_manifests(cfg.export)
        keep = pc.is_in(ids, value_set=man["id"]).to_numpy(zero_copy_only=False)
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
        rows = man.filter(pc.is_in(man["id"], value_set=removed))
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
