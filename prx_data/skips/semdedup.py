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

This module holds the method; the job (:class:`prx_data.pipelines.semdedup.SemDedupConfig`,
:func:`prx_data.pipelines.semdedup.run_semdedup`: read, cluster, report, skip list) is
in :mod:`prx_data.pipelines.semdedup`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

DEFAULT_SKIP_NAME = "semdedup"
#: For CLIP ViT image embeddings, re-encodes, crops and colour shifts of one photo score
#: above this; 0.9 also merges near-identical scenes (check the report before lowering it).
DEFAULT_THRESHOLD = 0.95
DEFAULT_REPORT_THRESHOLDS = (0.8, 0.85, 0.9, 0.95, 0.98)
BLOCK = 2048


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
    """Nearest centroid (cosine) of each normalised row, in blocks of rows.

    The block shrinks with ``k`` so a block's similarities stay within 256 MiB
    (k = 10^5 at 10^8 rows).
    """
    block = min(block, max(256, (1 << 26) // max(1, len(centroids))))
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
