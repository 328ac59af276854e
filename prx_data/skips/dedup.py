"""Perceptual-hash deduplication of a Lance table, recorded as a ``dup_of`` column and a skip list.

Steps of ``python -m prx_data.dedup --table URI [--export OUT] [--radius R]``:

1. fill the ``phash`` column for rows that lack it (:mod:`prx_data.pipelines.dedup`, resumable);
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

This module holds the parts the job calls (group counts, bucket names, the
skip-list replacement); the job itself (:class:`prx_data.pipelines.dedup.DedupConfig`,
:func:`prx_data.pipelines.dedup.run_dedup`, :class:`prx_data.pipelines.dedup.DedupReport`) is in
:mod:`prx_data.pipelines.dedup`.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from prx_data.core import schema as S
from prx_data.core.clusters import MAX_RADIUS, Clusters  # noqa: F401 (re-exported)

DUP_OF = "dup_of"
#: The perceptual-hash column the dedup job fills, and why a row has none.
PHASH = S.PHASH
PHASH_ERROR = "phash_error"
DEFAULT_SKIP_NAME = "dedup"
DEFAULT_REPORT = "dedup-report.json"


def default_report(table: str) -> str:
    """Where a dedup run's JSON report goes unless told: beside the table it describes
    (``data/photos.lance`` -> ``data/photos.dedup-report.json``), never the working folder."""
    base = table.rstrip("/")
    stem = base[: -len(".lance")] if base.endswith(".lance") else base
    return f"{stem}.{DEFAULT_REPORT}"


#: Past this skipped share the report suggests rewriting the export (the PRX recipe).
REWRITE_HINT_SHARE = 0.10


@dataclass
class Group:
    """Counts for one tier or bucket."""

    samples: int = 0
    in_clusters: int = 0
    clusters: int = 0
    removed: int = 0


def group_counts(
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


def bucket_codes(values: pa.Array | pa.ChunkedArray) -> tuple[np.ndarray, list[str]]:
    """Integer codes and their names for a string column (Arrow dictionary encoding)."""
    enc = pc.dictionary_encode(values)
    if isinstance(enc, pa.ChunkedArray):
        enc = enc.combine_chunks() if enc.num_chunks != 1 else enc.chunk(0)
    return enc.indices.to_numpy(zero_copy_only=False).astype(np.int64), enc.dictionary.to_pylist()


def sort_groups(groups: dict[str, Group]) -> dict[str, Group]:
    def key(name: str):
        head = name.split("/")[0]
        return (0, int(head), name) if head.isdigit() else (1, 0, name)

    return {k: groups[k] for k in sorted(groups, key=key)}


def table_buckets(
    width: np.ndarray, height: np.ndarray, tiers: tuple[int, ...]
) -> tuple[np.ndarray, list[str]]:
    """Code per row and names of the buckets the rows would be exported to (or ``dropped:<reason>``)."""
    from prx_data.core.buckets import BucketSpec, assign_bucket

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


def replace_skip_list(
    export_root: str,
    name: str,
    skip_rows: pa.Table,
    *,
    table: str | None = None,
    reason: str = "",
) -> dict:
    """Make the list exactly the ids of ``skip_rows`` (manifest rows: bucket, shard, index, id;
    without ``id`` the positions are turned into ids through the manifests).

    The ids go to the registry of ``table`` (:mod:`prx_data.skips.ops`, one
    commit), then to the export's store, and the sidecars are derived from it
    under the export's lease. New sidecars replace old ones file by file
    (atomic writes), so a reader never sees the list missing; stale ones are
    removed afterwards.
    """
    from prx_data.skips import sidecar as SL
    from prx_data.skips.bind import ids_at
    from prx_data.skips.log import Provenance
    from prx_data.skips.ops import update_list

    if "id" in skip_rows.column_names:
        ids = skip_rows["id"]
    else:
        positions: dict[tuple[str, str], list[int]] = {}
        for b, s, i in zip(
            skip_rows["bucket"].to_pylist(),
            skip_rows["shard"].to_pylist(),
            skip_rows["index"].to_pylist(),
            strict=True,
        ):
            positions.setdefault((b, s), []).append(int(i))
        ids = ids_at(export_root, positions)
    res = update_list(
        export_root,
        name,
        ids,
        Provenance("dedup", reason),
        mode="replace",
        table=table,
    )
    everything = SL.skip_stats(export_root).get("*", [])
    total = sum(b.samples for b in everything)
    return {
        "name": name,
        "export": export_root,
        "shards_written": res.shards_written,
        "samples_listed": res.samples_listed,
        "stale_sidecars_removed": res.stale_sidecars_removed,
        "registry": res.registry,
        "share": res.share,
        "warning": res.warning,
        "skipped_share_all_lists": sum(b.skipped for b in everything) / total if total else 0.0,
    }
