"""Clustering 64-bit perceptual hashes: exact groups (a sort) or Hamming radius (multi-index hashing).

Pure numpy. At radius > 0 the clusters are single-linkage: A~B and B~C put
A, B and C in one cluster even when A and C are further apart than the radius.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from prx_data.core.errors import UsageError
from prx_data.core.phash import hamming

#: Multi-index hashing splits the 64 bits into radius + 1 blocks; past this the
#: blocks are so short that nearly every pair becomes a candidate.
MAX_RADIUS = 10


def _blocks(radius: int) -> list[tuple[int, int]]:
    """(shift, width) of ``radius + 1`` nearly equal bit blocks covering the 64 bits."""
    m = radius + 1
    widths = [64 // m + (1 if i < 64 % m else 0) for i in range(m)]
    out, shift = [], 64
    for w in widths:
        shift -= w
        out.append((shift, w))
    return out


def near_pairs(uniq: np.ndarray, radius: int) -> tuple[np.ndarray, np.ndarray]:
    """Index pairs (i, j) of distinct hashes in ``uniq`` within Hamming distance ``radius``.

    Multi-index hashing: split the 64 bits into ``radius + 1`` blocks; by the
    pigeonhole principle two hashes within ``radius`` agree exactly on at
    least one block. Per block, sort by the block value and compare each
    hash only with the others of its group; the work is the number of
    candidate pairs, about ``N**2 / 2**(64 / (radius + 1))`` per block for
    uniformly spread hashes, so it suits ``64 / (radius + 1) >= log2(N)``.
    """
    uniq = np.asarray(uniq, np.uint64)
    n = len(uniq)
    if radius < 1 or n < 2:
        return np.zeros(0, np.int64), np.zeros(0, np.int64)
    found_i: list[np.ndarray] = []
    found_j: list[np.ndarray] = []
    for shift, width in _blocks(radius):
        mask = np.uint64((1 << width) - 1)
        key = (uniq >> np.uint64(shift)) & mask
        order = np.argsort(key, kind="stable")
        k = key[order]
        starts = np.flatnonzero(np.r_[True, k[1:] != k[:-1]])
        ends = np.r_[starts[1:], n]
        group_end = np.repeat(ends, ends - starts)
        remaining = group_end - np.arange(n) - 1  # later members of the same group
        active = np.flatnonzero(remaining >= 1)
        d = 1
        while active.size:
            a, b = order[active], order[active + d]
            close = hamming(uniq[a], uniq[b]) <= radius
            if close.any():
                found_i.append(a[close])
                found_j.append(b[close])
            d += 1
            active = active[remaining[active] >= d]
    if not found_i:
        return np.zeros(0, np.int64), np.zeros(0, np.int64)
    return np.concatenate(found_i).astype(np.int64), np.concatenate(found_j).astype(np.int64)


def _group_equal(hashes: np.ndarray) -> tuple[np.ndarray, int]:
    """Labels for equal hashes: ``(labels, m)`` with labels ``< m`` exactly for repeated hashes.

    One value sort finds the repeated values (an argsort of uint64 is several
    times slower); a hash lookup (Arrow ``index_in``) then labels their rows.
    Unique hashes get labels ``m, m + 1, ...`` in row order.
    """
    n = len(hashes)
    s = np.sort(hashes)
    repeated = s[1:][s[1:] == s[:-1]]
    del s
    if len(repeated):
        repeated = repeated[np.r_[True, repeated[1:] != repeated[:-1]]]  # sorted: unique by diff
    m = len(repeated)
    if m == 0:
        return np.arange(n, dtype=np.int64), 0
    pos = pc.index_in(pa.array(hashes), value_set=pa.array(repeated)).fill_null(-1)
    labels = pos.to_numpy(zero_copy_only=False).astype(np.int64)
    single = labels < 0
    labels[single] = m + np.arange(int(single.sum()))
    return labels, m


def _cluster(hashes: np.ndarray, radius: int) -> tuple[np.ndarray, int]:
    """Dense labels with the multi-member clusters first: ``labels < m`` marks rows with copies."""
    if not 0 <= radius <= MAX_RADIUS:
        raise UsageError(f"radius must be between 0 and {MAX_RADIUS}, got {radius}")
    hashes = np.asarray(hashes, np.uint64).reshape(-1)
    if radius == 0 or len(hashes) < 2:
        return _group_equal(hashes)
    from scipy.sparse import coo_matrix
    from scipy.sparse.csgraph import connected_components

    uniq, inverse = np.unique(hashes, return_inverse=True)
    inverse = inverse.reshape(-1)
    i, j = near_pairs(uniq, radius)
    graph = coo_matrix((np.ones(len(i), np.int8), (i, j)), shape=(len(uniq), len(uniq)))
    _, comp = connected_components(graph, directed=False)
    labels = comp.astype(np.int64)[inverse]
    # Renumber so that clusters with several rows come first.
    sizes = np.bincount(labels)
    multi = sizes > 1
    m = int(multi.sum())
    remap = np.empty(len(sizes), np.int64)
    remap[multi] = np.arange(m)
    remap[~multi] = m + np.arange(len(sizes) - m)
    return remap[labels], m


def cluster_hashes(hashes: np.ndarray, radius: int = 0) -> np.ndarray:
    """Cluster label per hash (int64, dense from 0): equal labels = duplicates.

    Radius 0 groups equal hashes (one sort). For radius > 0 the distinct
    hashes are linked by :func:`near_pairs` and labelled by connected components.
    """
    return _cluster(hashes, radius)[0]


@dataclass
class Clusters:
    """Duplicate clusters over the rows of a table (rows without a hash take no part)."""

    #: Cluster label per row; -1 for rows without a hash.
    labels: np.ndarray
    #: Row index of the keeper of the row's cluster; the row itself when unique; -1 without a hash.
    keeper: np.ndarray
    #: Rows of clusters with more than one member, best first within each cluster.
    ranked: np.ndarray

    @property
    def is_dup(self) -> np.ndarray:
        return (self.keeper >= 0) & (self.keeper != np.arange(len(self.keeper)))

    @property
    def n_clusters(self) -> int:
        """Clusters with at least two members."""
        return int(len(np.unique(self.labels[self.ranked]))) if len(self.ranked) else 0

    @property
    def n_removed(self) -> int:
        return int(self.is_dup.sum())


def rank_in_clusters(
    labels: np.ndarray, rows: np.ndarray, area: np.ndarray, ids: pa.Array
) -> np.ndarray:
    """``rows`` sorted by (cluster, largest area, smallest id): each cluster's best row first."""
    sub = pa.table(
        {
            "label": pa.array(labels[rows]),
            "area": pa.array(area[rows]),
            "id": ids.take(pa.array(rows)),
        }
    )
    order = pc.sort_indices(
        sub, sort_keys=[("label", "ascending"), ("area", "descending"), ("id", "ascending")]
    )
    return rows[order.to_numpy()]


def find_duplicates(
    hashes: np.ndarray,
    ids: pa.Array | list[str],
    area: np.ndarray,
    valid: np.ndarray | None = None,
    radius: int = 0,
) -> Clusters:
    """Cluster rows by pHash and choose one keeper per cluster.

    ``area`` is width * height (0 when unknown); ties go to the smallest id.
    ``valid`` marks rows that have a hash (default: all).
    """
    n = len(hashes)
    hashes = np.asarray(hashes, np.uint64)
    area = np.asarray(area, np.int64)
    if isinstance(ids, pa.ChunkedArray):
        ids = ids.combine_chunks()
    elif not isinstance(ids, pa.Array):
        ids = pa.array(ids, pa.string())
    if len(ids) != n or len(area) != n:
        raise ValueError("hashes, ids and area must have the same length")
    if valid is None or np.all(valid):
        rows_valid = None
        labels, m = _cluster(hashes, radius)
        keeper = np.arange(n, dtype=np.int64)
        in_cluster = np.flatnonzero(labels < m)
    else:
        rows_valid = np.flatnonzero(np.asarray(valid, bool))
        sub, m = _cluster(hashes[rows_valid], radius)
        labels = np.full(n, -1, np.int64)
        labels[rows_valid] = sub
        keeper = np.full(n, -1, np.int64)
        keeper[rows_valid] = rows_valid
        in_cluster = rows_valid[sub < m]
    ranked = rank_in_clusters(labels, in_cluster, area, ids)
    if len(ranked):
        lab = labels[ranked]
        first = np.r_[True, lab[1:] != lab[:-1]]
        best = np.full(m, -1, np.int64)
        best[lab[first]] = ranked[first]
        keeper[ranked] = best[lab]
    return Clusters(labels, keeper, ranked)


def export_skips(clusters: Clusters, exported: np.ndarray) -> np.ndarray:
    """Rows to skip in an export: every exported cluster member but the best exported one.

    Usually that is every duplicate; when a cluster's keeper is not in the
    export (filtered out or dropped), its best exported copy stays.
    """
    r = clusters.ranked[exported[clusters.ranked]]
    if not len(r):
        return r
    lab = clusters.labels[r]
    first = np.r_[True, lab[1:] != lab[:-1]]
    return r[~first]
