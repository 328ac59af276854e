"""Perceptual-hash deduplication of a Lance table, recorded as a ``dup_of`` column and a skip list.

Steps of ``python -m prx_data.dedup --table URI [--export OUT] [--radius R]``:

1. fill the ``phash`` column for rows that lack it (:mod:`pipelines.dedup`, resumable);
2. cluster the hashes: equal hashes at radius 0 (a sort), or hashes within
   Hamming distance ``R`` (multi-index hashing, then connected components);
3. keep one row per cluster: the largest ``width * height``, then the
   smallest ``id`` (deterministic);
4. write ``dup_of`` (null for keepers and unique rows, else the keeper's id)
   without rewriting images, and with ``--export`` replace the named skip
   list (``dedup``) on that export: nothing is rewritten, the loader leaves
   the samples out;
5. report clusters and removals per tier and bucket (printed and as JSON).

Clustering at radius > 0 is single-linkage: A~B and B~C put A, B and C in
one cluster even when A and C are further apart than ``R``.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import dataclass, field

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from prx_data import schema as S
from prx_data.buckets import DEFAULT_TIERS
from prx_data.phash import hamming

DUP_OF = "dup_of"
DEFAULT_SKIP_NAME = "dedup"
DEFAULT_REPORT = "dedup-report.json"
#: Past this skipped share the report suggests rewriting the export (the PRX recipe).
REWRITE_HINT_SHARE = 0.10
#: Multi-index hashing splits the 64 bits into radius + 1 blocks; past this the
#: blocks are so short that nearly every pair becomes a candidate.
MAX_RADIUS = 10


# --- clustering ----------------------------------------------------------------------------


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
        raise ValueError(f"radius must be between 0 and {MAX_RADIUS}, got {radius}")
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


# --- the job --------------------------------------------------------------------------------


@dataclass(frozen=True)
class DedupConfig:
    """One dedup run over a table (and optionally an export made from it)."""

    table: str
    export: str | None = None
    radius: int = 0
    skip_name: str = DEFAULT_SKIP_NAME
    #: Tiers used to name the bucket a row would get when there is no ``export``.
    tiers: tuple[int, ...] = DEFAULT_TIERS
    #: JSON report path (None: do not write one; the CLI defaults to DEFAULT_REPORT).
    report: str | None = None
    #: Write the ``dup_of`` column into the table.
    write_column: bool = True
    #: Hash rows that lack a ``phash`` first (else only existing hashes are used).
    compute: bool = True
    engine: str = "ray"
    exact: bool = False
    batch_size: int = 256
    ray_address: str | None = None
    num_cpus: int | None = None
    storage_options: dict | None = None
    progress: bool = True

    def __post_init__(self) -> None:
        if not 0 <= self.radius <= MAX_RADIUS:
            raise ValueError(f"radius must be between 0 and {MAX_RADIUS}, got {self.radius}")
        if self.export is not None:
            from prx_data.skiplist import validate_name

            validate_name(self.skip_name)


@dataclass
class Group:
    """Counts for one tier or bucket."""

    samples: int = 0
    in_clusters: int = 0
    clusters: int = 0
    removed: int = 0


@dataclass
class DedupReport:
    table: str
    table_version: int
    radius: int
    rows: int
    hashed: int
    unhashed: dict[str, int]
    clusters: int
    rows_in_clusters: int
    removed: int
    largest_cluster: int
    clusters_spanning_tiers: int
    #: "export" (sample counts from the export's manifests) or "table" (buckets the rows would get).
    grouped_by: str
    tiers: dict[str, Group] = field(default_factory=dict)
    buckets: dict[str, Group] = field(default_factory=dict)
    skip_list: dict | None = None
    phash_job: dict | None = None
    seconds: float = 0.0

    def to_dict(self) -> dict:
        from dataclasses import asdict

        return asdict(self)

    def table_text(self) -> str:
        lines = [
            f"table {self.table} (version {self.table_version}), radius {self.radius}",
            f"rows {self.rows:,}  hashed {self.hashed:,}  clusters {self.clusters:,}  "
            f"rows in clusters {self.rows_in_clusters:,}  removed {self.removed:,}  "
            f"largest cluster {self.largest_cluster}  spanning tiers {self.clusters_spanning_tiers}",
        ]
        if self.unhashed:
            lines.append(
                "not hashed: " + ", ".join(f"{k} {v}" for k, v in sorted(self.unhashed.items()))
            )
        what = "exported samples" if self.grouped_by == "export" else "rows (bucket they would get)"
        lines.append(
            f"{'tier / bucket':<22}{'samples':>10}{'clusters':>10}{'removed':>10}{'%':>7}   [{what}]"
        )
        for tier, g in self.tiers.items():
            lines.append(_row(tier, g))
            for name, b in self.buckets.items():
                if name.split("/")[0] == tier and name != tier:
                    lines.append(_row("  " + name, b))
        if self.skip_list:
            sl = self.skip_list
            lines.append(
                f"skip list {sl['name']!r}: {sl['samples_listed']:,} samples in {sl['shards_written']} shards"
                f" ({sl['stale_sidecars_removed']} stale sidecars removed)"
            )
            share = sl.get("skipped_share_all_lists", 0.0)
            lines.append(f"all skip lists together leave out {100 * share:.2f}% of the export")
            if share > REWRITE_HINT_SHARE:
                lines.append(
                    f"that is above {100 * REWRITE_HINT_SHARE:.0f}%: consider rewriting it: "
                    f"python -m prx_data.skips rewrite {sl['export']} NEW_ROOT"
                )
        return "\n".join(lines)


def _row(name: str, g: Group) -> str:
    pct = 100.0 * g.removed / g.samples if g.samples else 0.0
    return f"{name:<22}{g.samples:>10,}{g.clusters:>10,}{g.removed:>10,}{pct:>7.2f}"


def _group_counts(
    codes: np.ndarray, names: list[str], rows: np.ndarray, clusters: Clusters, removed: np.ndarray
) -> dict[str, Group]:
    """Counts per group over occurrences: ``codes[i]`` names the group of ``rows[i]``.

    A row may occur more than once (an export may hold it in several buckets).
    """
    k = len(names)
    clustered = np.zeros(len(clusters.labels), bool)
    clustered[clusters.ranked] = True
    inc = clustered[rows]
    samples = np.bincount(codes, minlength=k)
    in_clusters = np.bincount(codes[inc], minlength=k)
    n_removed = np.bincount(codes[removed], minlength=k)
    # Distinct (group, cluster) pairs among clustered occurrences.
    pairs = np.unique(np.stack([codes[inc], clusters.labels[rows[inc]]], axis=1), axis=0)
    n_clusters = np.bincount(pairs[:, 0], minlength=k) if len(pairs) else np.zeros(k, np.int64)
    return {
        names[i]: Group(int(samples[i]), int(in_clusters[i]), int(n_clusters[i]), int(n_removed[i]))
        for i in range(k)
        if samples[i]
    }


def _codes(values: pa.Array | pa.ChunkedArray) -> tuple[np.ndarray, list[str]]:
    """Integer codes and their names for a string column (Arrow dictionary encoding)."""
    enc = pc.dictionary_encode(values)
    if isinstance(enc, pa.ChunkedArray):
        enc = enc.combine_chunks() if enc.num_chunks != 1 else enc.chunk(0)
    return enc.indices.to_numpy(zero_copy_only=False).astype(np.int64), enc.dictionary.to_pylist()


def _sort_groups(groups: dict[str, Group]) -> dict[str, Group]:
    def key(name: str):
        head = name.split("/")[0]
        return (0, int(head), name) if head.isdigit() else (1, 0, name)

    return {k: groups[k] for k in sorted(groups, key=key)}


def _table_buckets(
    width: np.ndarray, height: np.ndarray, tiers: tuple[int, ...]
) -> tuple[np.ndarray, list[str]]:
    """Code per row and names of the buckets the rows would be exported to (or ``dropped:<reason>``)."""
    from prx_data.buckets import BucketSpec, assign_bucket

    spec = BucketSpec(tiers=tuple(tiers))
    w = np.nan_to_num(width, nan=0).astype(np.int64)
    h = np.nan_to_num(height, nan=0).astype(np.int64)
    if not len(w):
        return np.zeros(0, np.int64), []
    pairs, inv = np.unique(np.stack([w, h], axis=1), axis=0, return_inverse=True)
    names: list[str] = []
    code_of_pair = np.empty(len(pairs), np.int64)
    index: dict[str, int] = {}
    for i, (pw, ph) in enumerate(pairs):
        a = assign_bucket(int(pw), int(ph), spec)
        name = a.bucket.name if a.bucket else f"dropped:{a.reason}"
        code_of_pair[i] = index.setdefault(name, len(index))
        if len(names) < len(index):
            names.append(name)
    return code_of_pair[inv.reshape(-1)], names


def _replace_skip_list(export_root: str, name: str, skip_rows: pa.Table) -> dict:
    """Write the list from (bucket, shard, index) rows, then delete sidecars no longer needed.

    New sidecars replace old ones file by file (atomic writes), so a reader
    never sees the list missing; stale ones are removed afterwards.
    """
    from prx_data import skiplist as SL
    from prx_data import storage

    skips: dict[tuple[str, str], list[int]] = {}
    for b, s, i in zip(
        skip_rows["bucket"].to_pylist(),
        skip_rows["shard"].to_pylist(),
        skip_rows["index"].to_pylist(),
        strict=True,
    ):
        skips.setdefault((b, s), []).append(int(i))
    res = SL.add_skips(export_root, name, skips, replace=True)
    stale = 0
    for bucket in SL.list_buckets(export_root):
        shards = SL.read_index(export_root, bucket)
        for shard in SL.list_sidecars(export_root, bucket, shards).get(name, []):
            if (bucket, shard) not in skips:
                path = storage.join(
                    export_root, *bucket.split("/"), *SL.sidecar_basename(shard, name).split("/")
                )
                storage.delete(path)
                stale += 1
    everything = SL.skip_stats(export_root).get("*", [])
    total = sum(b.samples for b in everything)
    return {
        "name": name,
        "export": export_root,
        "shards_written": res.shards_written,
        "samples_listed": res.samples_listed,
        "stale_sidecars_removed": stale,
        "skipped_share_all_lists": sum(b.skipped for b in everything) / total if total else 0.0,
    }


def run_dedup(cfg: DedupConfig) -> DedupReport:
    """The whole job; see the module docstring."""
    from pipelines.dedup import PHASH, PHASH_ERROR, PhashJobConfig, compute_phash
    from prx_data.table import open_table, update_column

    start = time.perf_counter()
    job = None
    if cfg.compute:
        job = compute_phash(
            PhashJobConfig(
                table=cfg.table,
                engine=cfg.engine,
                exact=cfg.exact,
                batch_size=cfg.batch_size,
                ray_address=cfg.ray_address,
                num_cpus=cfg.num_cpus,
                storage_options=cfg.storage_options,
                progress=cfg.progress,
            )
        ).to_dict()
    ds = open_table(cfg.table, cfg.storage_options)
    if PHASH not in ds.schema.names:
        raise ValueError(f"table {cfg.table!r} has no {PHASH!r} column; run without --no-compute")
    cols = [S.ID, PHASH, S.WIDTH, S.HEIGHT] + (
        [PHASH_ERROR] if PHASH_ERROR in ds.schema.names else []
    )
    t = ds.to_table(columns=cols)
    ids = t[S.ID].combine_chunks()
    ph = t[PHASH].combine_chunks()
    valid = ph.is_valid().to_numpy(zero_copy_only=False)
    hashes = ph.fill_null(0).to_numpy(zero_copy_only=False).astype(np.uint64)
    width = t[S.WIDTH].cast(pa.float64()).to_numpy(zero_copy_only=False)
    height = t[S.HEIGHT].cast(pa.float64()).to_numpy(zero_copy_only=False)
    area = (np.nan_to_num(width, nan=0) * np.nan_to_num(height, nan=0)).astype(np.int64)
    unhashed: dict[str, int] = {}
    if (~valid).any():
        if PHASH_ERROR in t.column_names:
            reasons = t[PHASH_ERROR].filter(pa.array(~valid)).fill_null("not_hashed")
        else:
            reasons = pa.array(["not_hashed"] * int((~valid).sum()), pa.string())
        unhashed = {vc["values"]: vc["counts"] for vc in pc.value_counts(reasons).to_pylist()}

    clusters = find_duplicates(hashes, ids, area, valid=valid, radius=cfg.radius)
    n = len(ids)
    is_dup = clusters.is_dup
    if cfg.write_column:
        dup_of = ids.take(pa.array(np.where(is_dup, clusters.keeper, 0)))
        dup_of = pc.if_else(pa.array(is_dup), dup_of, pa.scalar(None, pa.string()))
        update_column(
            cfg.table,
            DUP_OF,
            pa.table({S.ID: ids, DUP_OF: dup_of}),
            storage_options=cfg.storage_options,
        )

    # Where each row lives: the export's manifests, or the bucket it would get.
    skip_info = None
    if cfg.export is not None:
        from prx_data.skiplist import read_manifests

        man = read_manifests(cfg.export)
        row_of = pc.index_in(man["id"], value_set=ids).fill_null(-1).to_numpy(zero_copy_only=False)
        row_of = row_of.astype(np.int64)
        exported = np.zeros(n, bool)
        exported[row_of[row_of >= 0]] = True
        skip_rows_idx = export_skips(clusters, exported)
        skip_mask = np.zeros(n, bool)
        skip_mask[skip_rows_idx] = True
        occ = np.flatnonzero(row_of >= 0)
        occ_rows = row_of[occ]
        removed_occ = skip_mask[occ_rows]
        codes, names = _codes(man["bucket"])
        codes = codes[occ]
        skip_info = _replace_skip_list(
            cfg.export, cfg.skip_name, man.take(pa.array(occ[removed_occ]))
        )
        skip_info["ids_not_in_table"] = int((row_of < 0).sum())
        grouped_by = "export"
    else:
        occ_rows = np.arange(n)
        codes, names = _table_buckets(width, height, cfg.tiers)
        removed_occ = is_dup
        grouped_by = "table"

    buckets = _group_counts(codes, names, occ_rows, clusters, removed_occ)
    tier_names = sorted({b.split("/")[0] for b in names})
    tier_code_of = np.array([tier_names.index(b.split("/")[0]) for b in names], np.int64)
    tier_codes = tier_code_of[codes] if len(codes) else codes
    tiers = _group_counts(tier_codes, tier_names, occ_rows, clusters, removed_occ)

    # Clusters whose members sit in more than one tier.
    spanning = 0
    if len(clusters.ranked):
        clustered = np.zeros(n, bool)
        clustered[clusters.ranked] = True
        inc = clustered[occ_rows]
        pairs = np.unique(
            np.stack([clusters.labels[occ_rows[inc]], tier_codes[inc]], axis=1), axis=0
        )
        spanning = int((np.bincount(pairs[:, 0]) > 1).sum()) if len(pairs) else 0
    sizes = (
        np.bincount(clusters.labels[clusters.ranked]) if len(clusters.ranked) else np.zeros(1, int)
    )

    report = DedupReport(
        table=cfg.table,
        table_version=open_table(cfg.table, cfg.storage_options).version,
        radius=cfg.radius,
        rows=n,
        hashed=int(valid.sum()),
        unhashed=dict(sorted(unhashed.items())),
        clusters=clusters.n_clusters,
        rows_in_clusters=int(len(clusters.ranked)),
        removed=clusters.n_removed,
        largest_cluster=int(sizes.max()),
        clusters_spanning_tiers=spanning,
        grouped_by=grouped_by,
        tiers=_sort_groups(tiers),
        buckets=_sort_groups(buckets),
        skip_list=skip_info,
        phash_job=job,
        seconds=round(time.perf_counter() - start, 3),
    )
    if cfg.report:
        from prx_data import storage

        storage.write_bytes_atomic(cfg.report, json.dumps(report.to_dict(), indent=2).encode())
    return report


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m prx_data.dedup",
        description="Find duplicate images in a Lance table by perceptual hash (pHash), keep the "
        "highest-resolution copy of each cluster, write a dup_of column and (with --export) a "
        "skip list on an export so the loader leaves the copies out without rewriting shards.",
    )
    p.add_argument("--table", required=True, help="Lance table URI (local path or s3://...).")
    p.add_argument(
        "--export",
        default=None,
        help="Export root made from this table (python -m prx_data.write_mds --out). The named "
        "skip list there is replaced with the duplicates found now.",
    )
    p.add_argument(
        "--radius",
        type=int,
        default=0,
        help="Largest Hamming distance between hashes that counts as a duplicate (default 0: "
        "identical hashes). 1-4 catch more re-encoded/resized copies; larger radii also "
        f"merge different images and get slow on big tables. At most {MAX_RADIUS}.",
    )
    p.add_argument(
        "--tiers",
        type=lambda v: tuple(int(x) for x in v.split(",") if x),
        default=DEFAULT_TIERS,
        help="Comma-separated tiers used, without --export, to name the bucket each row would "
        "get in the report (default: %(default)s, the exporter's default).",
    )
    p.add_argument(
        "--name",
        dest="skip_name",
        default=DEFAULT_SKIP_NAME,
        help="Skip-list name on the export (default: %(default)s).",
    )
    p.add_argument(
        "--report",
        default=DEFAULT_REPORT,
        help="Where to write the JSON report (default: %(default)s; '' for none). Keep it "
        "outside the export tree.",
    )
    p.add_argument(
        "--no-column",
        dest="write_column",
        action="store_false",
        help="Do not write the dup_of column into the table (report and skip list only).",
    )
    p.add_argument(
        "--no-compute",
        dest="compute",
        action="store_false",
        help="Use the phash column as it is; do not hash rows that lack it.",
    )
    p.add_argument(
        "--engine",
        choices=["ray", "local"],
        default="ray",
        help="Hash with Ray Data tasks (default) or in this process (small tables).",
    )
    p.add_argument(
        "--exact",
        action="store_true",
        help="Hash from a full Pillow decode, bit-identical to imagehash.phash (several "
        "times slower than the default reduced JPEG decode).",
    )
    p.add_argument(
        "--batch-size", type=int, default=256, help="Rows per hashing batch (default: %(default)s)."
    )
    p.add_argument(
        "--ray-address",
        default=None,
        help="Ray cluster address (default: $RAY_ADDRESS, else local Ray).",
    )
    p.add_argument(
        "--num-cpus", type=int, default=None, help="CPUs for a local Ray runtime (default: all)."
    )
    p.add_argument(
        "--no-progress", dest="progress", action="store_false", help="Hide the progress bar."
    )
    return p


def main(argv: list[str] | None = None) -> int:
    from prx_data.skiplist import lance_storage_options

    args = build_parser().parse_args(argv)
    cfg = DedupConfig(
        table=args.table,
        export=args.export,
        radius=args.radius,
        skip_name=args.skip_name,
        tiers=args.tiers,
        report=args.report or None,
        write_column=args.write_column,
        compute=args.compute,
        engine=args.engine,
        exact=args.exact,
        batch_size=args.batch_size,
        ray_address=args.ray_address,
        num_cpus=args.num_cpus,
        progress=args.progress,
        storage_options=lance_storage_options(args.table),
    )
    report = run_dedup(cfg)
    print(report.table_text())
    if cfg.report:
        print(f"report: {cfg.report}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
