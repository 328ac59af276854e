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

from dataclasses import dataclass, field

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from prx_data.core.buckets import DEFAULT_TIERS
from prx_data.core.clusters import MAX_RADIUS, Clusters  # noqa: F401 (re-exported)
from prx_data.core.errors import UsageError

DUP_OF = "dup_of"
DEFAULT_SKIP_NAME = "dedup"
DEFAULT_REPORT = "dedup-report.json"
#: Past this skipped share the report suggests rewriting the export (the PRX recipe).
REWRITE_HINT_SHARE = 0.10


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
            raise UsageError(f"radius must be between 0 and {MAX_RADIUS}, got {self.radius}")
        if self.export is not None:
            from prx_data.skips.sidecar import validate_name

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

    The ids go to the registry of ``table`` (:mod:`prx_data.skips.lists`, one
    commit), then to the export's store, and the sidecars are derived from it
    under the export's list lock. New sidecars replace old ones file by file
    (atomic writes), so a reader never sees the list missing; stale ones are
    removed afterwards.
    """
    from prx_data.skips import lists as LS
    from prx_data.skips import sidecar as SL

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
        ids = LS.ids_at(export_root, positions)
    res = LS.update_list(
        export_root,
        name,
        ids,
        LS.Provenance("dedup", reason),
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
        "skipped_share_all_lists": sum(b.skipped for b in everything) / total if total else 0.0,
    }
