"""Fill the ``phash`` column of a Lance table as a column job, then find duplicates.

Graph (:mod:`prx_data.columns.runner`)::

    read id, image, width, height of rows whose phash and phash_error are null
                                          tasks, one per fragment (or row range)
      -> map_batches(hash_batch)          tasks: reduced JPEG decode + DCT hash
      -> driver: each finished fragment's phash and phash_error written once

Only the two small columns are written (never the image bytes). A killed
run keeps its committed and checkpointed fragments; a rerun reads only the
rows still missing. Rows that cannot be decoded get ``phash`` null and a
reason in ``phash_error`` so that reruns do not retry them; ``redo_errors``
retries. ``engine="local"`` runs the same steps in this process without Ray
(for notebooks and small tables).
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from prx_data.columns.runner import ColumnJob, Step, run_column_job
from prx_data.core import schema as S
from prx_data.core.buckets import DEFAULT_TIERS
from prx_data.core.clusters import MAX_RADIUS, export_skips, find_duplicates
from prx_data.core.errors import UsageError
from prx_data.core.flags import REQUIRED, comma_ints, flag
from prx_data.core.reports import FailureCounts
from prx_data.core.runtime import RunOptions, run_field
from prx_data.skips.dedup import (
    DEFAULT_SKIP_NAME,
    DUP_OF,
    PHASH,
    PHASH_ERROR,
    REWRITE_HINT_SHARE,
    Group,
    bucket_codes,
    group_counts,
    replace_skip_list,
    sort_groups,
    table_buckets,
)

_READ_COLUMNS = [S.ID, S.IMAGE, S.WIDTH, S.HEIGHT]


@dataclass(frozen=True)
class DedupConfig:
    """One dedup run over a table (and optionally an export made from it)."""

    table: str = flag(REQUIRED, "--table", help="Lance table URI (local path or s3://...).")
    export: str | None = flag(
        None,
        "--export",
        help="Export root made from this table (python -m prx_data.write_mds --out). The named "
        "skip list there is replaced with the duplicates found now.",
    )
    radius: int = flag(
        0,
        "--radius",
        type=int,
        help="Largest Hamming distance between hashes that counts as a duplicate (default 0: "
        "identical hashes). 1-4 catch more re-encoded/resized copies; larger radii also "
        f"merge different images and get slow on big tables. At most {MAX_RADIUS}.",
    )
    skip_name: str = flag(
        DEFAULT_SKIP_NAME, "--name", help="Skip-list name on the export (default: %(default)s)."
    )
    #: Tiers used to name the bucket a row would get when there is no ``export``.
    tiers: tuple[int, ...] = flag(
        DEFAULT_TIERS,
        "--tiers",
        type=comma_ints,
        help="Comma-separated tiers used, without --export, to name the bucket each row would "
        "get in the report (default: %(default)s, the exporter's default).",
    )
    #: JSON report path (None: do not write one; the CLI defaults to the one beside the table).
    report: str | None = flag(
        None,
        "--report",
        help="Where to write the JSON report (default: beside the table, "
        "<table>.dedup-report.json; '' for none). Keep it outside the export tree.",
    )
    write_column: bool = flag(
        True,
        "--no-column",
        negate=True,
        help="Do not write the dup_of column into the table (report and skip list only).",
    )
    compute: bool = flag(
        True,
        "--no-compute",
        negate=True,
        help="Use the phash column as it is; do not hash rows that lack it.",
    )
    #: engine, Ray cluster, CPUs, progress bar: the same for every job (``--engine``, ...).
    run: RunOptions = run_field()
    exact: bool = flag(
        False,
        "--exact",
        help="Hash from a full Pillow decode, bit-identical to imagehash.phash (several "
        "times slower than the default reduced JPEG decode).",
    )
    batch_size: int = flag(
        256, "--batch-size", type=int, help="Rows per hashing batch (default: %(default)s)."
    )
    storage_options: dict | None = None

    def __post_init__(self) -> None:
        if not 0 <= self.radius <= MAX_RADIUS:
            raise UsageError(f"radius must be between 0 and {MAX_RADIUS}, got {self.radius}")
        if self.export is not None:
            from prx_data.skips.sidecar import validate_name

            validate_name(self.skip_name)


@dataclass
class DedupReport(FailureCounts):
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
    #: {opt-out list: group members added}: an opted-out row's duplicates follow it.
    optouts_extended: dict[str, int] = field(default_factory=dict)
    seconds: float = 0.0

    counted = "rows"
    job_label = "dedup"

    @property
    def failed(self) -> int:
        """Rows whose image could not be hashed ("not_hashed": never tried, with --no-compute)."""
        return sum(n for reason, n in self.unhashed.items() if reason != "not_hashed")

    @property
    def total(self) -> int:
        return self.rows

    def failure_details(self, report_json: str | None = None) -> str:
        return f"the 'not hashed' reasons above and the {PHASH_ERROR} column of {self.table}"

    def to_dict(self) -> dict:
        from dataclasses import asdict

        return asdict(self)

    def text(self) -> str:
        return self.table_text()

    def table_text(self) -> str:
        lines = [
            f"table {self.table} (version {self.table_version}), radius {self.radius}",
            f"rows {self.rows:,}  hashed {self.hashed:,}  clusters {self.clusters:,}  "
            f"rows in clusters {self.rows_in_clusters:,}  removed {self.removed:,}  "
            f"largest cluster {self.largest_cluster}  spanning tiers {self.clusters_spanning_tiers}",
        ]
        if self.optouts_extended:
            lines.append(
                "opt-outs extended to their duplicate groups: "
                + ", ".join(f"{k} +{v}" for k, v in self.optouts_extended.items())
            )
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


@dataclass(frozen=True)
class PhashJobConfig:
    """Options of one hashing run."""

    table: str
    #: engine, Ray cluster, CPUs, progress bar: the same for every job (``--engine``, ...).
    run: RunOptions = run_field()
    #: Full Pillow decode, bit-identical to ``imagehash.phash`` (slower). Default: reduced JPEG decode.
    exact: bool = False
    batch_size: int = 256
    #: Fragments per commit (each finished fragment is checkpointed regardless).
    commit_every: int = 16
    #: Hash again the rows that failed before (their ``phash_error`` is set).
    redo_errors: bool = False
    storage_options: dict | None = None

    def __post_init__(self) -> None:
        if self.batch_size < 1 or self.commit_every < 1:
            raise UsageError("batch_size and commit_every must be >= 1")


@dataclass
class PhashJobReport(FailureCounts):
    """The hashing step of a dedup run: rows it tried, hashed, and why the others failed."""

    rows_pending: int = 0
    rows_hashed: int = 0
    errors: dict[str, int] = field(default_factory=dict)
    seconds: float = 0.0

    job_label = "phash"
    counted = "rows"

    @property
    def failed(self) -> int:
        return sum(self.errors.values())

    @property
    def total(self) -> int:
        return self.rows_pending

    def text(self) -> str:
        errors = ", ".join(f"{k} {v:,}" for k, v in sorted(self.errors.items()))
        return (
            f"phash: {self.rows_hashed:,} of {self.rows_pending:,} pending rows hashed in "
            f"{self.seconds:.1f} s" + (f"; not hashed: {errors}" if errors else "")
        )

    def to_dict(self) -> dict:
        return {
            "rows_pending": self.rows_pending,
            "rows_hashed": self.rows_hashed,
            "errors": dict(sorted(self.errors.items())),
            "seconds": round(self.seconds, 3),
        }


def hash_batch(batch: pa.Table | pa.RecordBatch, exact: bool = False) -> pa.Table:
    """(id, image, width, height) -> (id, phash uint64, phash_error string)."""
    from prx_data.core.phash import phash_many

    images = batch.column(S.IMAGE).to_pylist()
    widths = batch.column(S.WIDTH).to_pylist()
    heights = batch.column(S.HEIGHT).to_pylist()
    sizes = [(w, h) if w and h else None for w, h in zip(widths, heights, strict=True)]
    res = phash_many(images, sizes=sizes, exact=exact)
    ok = res.ok
    return pa.table(
        {
            S.ID: batch.column(S.ID),
            PHASH: pa.array(res.hashes, pa.uint64(), mask=~ok),
            PHASH_ERROR: pa.array(res.errors, pa.string()),
        }
    )


def pending_filter(schema_names: list[str], redo_errors: bool = False) -> str | None:
    """Lance SQL for rows still to hash (None: every row): no hash, and no error unless
    ``redo_errors`` (:func:`prx_data.columns.writeback.pending_filter`)."""
    from prx_data.columns import writeback

    return writeback.pending_filter(schema_names, PHASH if redo_errors else PHASH_ERROR, PHASH)


def phash_job(cfg: PhashJobConfig) -> ColumnJob:
    """The column job that fills ``phash`` and ``phash_error``."""
    from prx_data.table.lance_ops import open_table

    names = open_table(cfg.table, cfg.storage_options).schema.names
    return ColumnJob(
        table=cfg.table,
        outputs=pa.schema([pa.field(PHASH, pa.uint64()), pa.field(PHASH_ERROR, pa.string())]),
        read_columns=_READ_COLUMNS,
        steps=[
            Step(
                hash_batch,
                kwargs={"exact": cfg.exact},
                batch_size=cfg.batch_size,
                zero_copy_batch=True,
            )
        ],
        where=pending_filter(names, cfg.redo_errors),
        run=cfg.run,
        batch_size=cfg.batch_size,
        commit_every=cfg.commit_every,
        reason_column=PHASH_ERROR,
        storage_options=cfg.storage_options,
        desc="phash",
    )


def compute_phash(cfg: PhashJobConfig) -> PhashJobReport:
    """Hash every row that has no ``phash`` yet and write the column back (resumable)."""
    rep = run_column_job(phash_job(cfg))
    errors = dict(rep.reasons)
    return PhashJobReport(
        rows_pending=rep.pending,
        rows_hashed=rep.rows - sum(errors.values()),
        errors=errors,
        seconds=rep.seconds,
    )


def run_dedup(cfg: DedupConfig) -> DedupReport:
    """The whole job; see the module docstring."""
    from prx_data.table.lance_ops import open_table, update_column

    start = time.perf_counter()
    job = None
    if cfg.compute:
        job = compute_phash(
            PhashJobConfig(
                table=cfg.table,
                run=cfg.run,
                exact=cfg.exact,
                batch_size=cfg.batch_size,
                storage_options=cfg.storage_options,
            )
        ).to_dict()
    ds = open_table(cfg.table, cfg.storage_options)
    if PHASH not in ds.schema.names:
        raise UsageError(f"table {cfg.table!r} has no {PHASH!r} column; run without --no-compute")
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

    # An opted-out row's group leaves with it, before the export's lists are updated below.
    from prx_data.skips.optout import extend_to_groups

    extended = extend_to_groups(cfg.table, ids, clusters.keeper)
    # Where each row lives: the export's manifests, or the bucket it would get.
    skip_info = None
    if cfg.export is not None:
        from prx_data.export.layout import read_manifests

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
        codes, names = bucket_codes(man["bucket"])
        codes = codes[occ]
        skip_info = replace_skip_list(
            cfg.export,
            cfg.skip_name,
            man.take(pa.array(occ[removed_occ])),
            table=cfg.table,
            reason=f"pHash radius {cfg.radius}",
        )
        skip_info["ids_not_in_table"] = int((row_of < 0).sum())
        grouped_by = "export"
    else:
        occ_rows = np.arange(n)
        codes, names = table_buckets(width, height, cfg.tiers)
        removed_occ = is_dup
        grouped_by = "table"

    buckets = group_counts(codes, names, occ_rows, clusters, removed_occ)
    tier_names = sorted({b.split("/")[0] for b in names})
    tier_code_of = np.array([tier_names.index(b.split("/")[0]) for b in names], np.int64)
    tier_codes = tier_code_of[codes] if len(codes) else codes
    tiers = group_counts(tier_codes, tier_names, occ_rows, clusters, removed_occ)

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
        tiers=sort_groups(tiers),
        buckets=sort_groups(buckets),
        skip_list=skip_info,
        phash_job=job,
        optouts_extended=extended,
        seconds=round(time.perf_counter() - start, 3),
    )
    if cfg.report:
        from prx_data.core import storage

        storage.write_bytes_atomic(cfg.report, json.dumps(report.to_dict(), indent=2).encode())
    return report
