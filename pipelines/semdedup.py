"""The semantic dedup job: read a table's embeddings, find near duplicates, write a skip list.

The method (spherical k-means, then the best cosine to a better member within
each cluster) is :mod:`prx_data.skips.semdedup`; this module reads the rows
(only those of ``--export`` when given), reports the share removed at several
thresholds, stores each row's cluster and best cosine as columns
(``semdedup_cluster``, ``semdedup_cosine``; only those columns' files are
written) and replaces the skip list through
:func:`prx_data.skips.dedup.replace_skip_list`.

Two engines give the same result:

- ``local``: everything in this process (ids, areas and labels of every row
  in memory; small tables and tests).
- ``ray``: the driver holds only the seeded training sample, the centroids
  and per-cluster summaries. Each stage runs on the one runner
  (:func:`prx_data.core.runtime.map_units`, JSON units; what the tasks share
  travels in the units or in files in the spill directory). Ray tasks, one
  per fragment, count the rows,
  read the sample rows, then read each row's embedding, id and size, assign
  it and spill ``(cluster, id, area, row address, embedding)`` to Arrow IPC
  files, one record batch per cluster bucket. One task per bucket ranks its
  clusters' members and finds the best cosine to a better member
  (:func:`prx_data.skips.semdedup.best_better`); it returns counts and
  examples and spills the removed ids and the per-row columns (by fragment
  group). Tasks per fragment group then write the columns
  (:func:`prx_data.columns.runner.write_columns`) and the driver commits them
  in one ``Update``. The spill directory must be visible to every node
  (``spill_dir``; default a local temporary directory).
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
import time
from dataclasses import asdict, dataclass, field

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from prx_data.core import lance_compat
from prx_data.core.errors import UsageError
from prx_data.core.flags import REQUIRED, comma_floats, flag
from prx_data.core.reports import FailureCounts
from prx_data.core.runtime import RunOptions, run_field
from prx_data.skips.semdedup import (
    DEFAULT_REPORT_THRESHOLDS,
    DEFAULT_SKIP_NAME,
    DEFAULT_THRESHOLD,
    SemDuplicates,
    find_semantic_duplicates,
)
from prx_data.table.search import (
    CLIP_IMAGE_COLUMN,
    SEMDEDUP_CLUSTER_COLUMN,
    SEMDEDUP_COSINE_COLUMN,
)

#: Tables of at most this many rows are deduplicated in this process under ``engine="auto"``
#: (the local engine holds every vector in memory; starting Ray costs more than their work).
SMALL_ROWS = 50_000
#: The columns the job stores (null for rows that took no part).
OUTPUTS = pa.schema(
    [
        pa.field(SEMDEDUP_CLUSTER_COLUMN, pa.int32()),
        pa.field(SEMDEDUP_COSINE_COLUMN, pa.float32()),
    ]
)


@dataclass(frozen=True)
class SemDedupConfig:
    """One semantic dedup run over a table (and optionally its export)."""

    table: str = flag(REQUIRED, "--table", help="Lance table URI")
    export: str | None = flag(
        None,
        "--export",
        help="export made from the table (write_mds --out): only its rows take part, and the "
        "near duplicates go to the skip list --name there. Without it: a report only.",
    )
    embedding_column: str = flag(
        CLIP_IMAGE_COLUMN,
        "--embedding-column",
        help="fixed-size vector column (default: %(default)s, from `python -m prx_data.score "
        "clip`; pixel_descriptor also works for near-identical copies)",
    )
    threshold: float = flag(
        DEFAULT_THRESHOLD,
        "--threshold",
        type=float,
        help="cosine at or above which an image is a duplicate of a larger one "
        "(default: %(default)s; see the report's table before lowering it)",
    )
    report_thresholds: tuple[float, ...] = flag(
        DEFAULT_REPORT_THRESHOLDS,
        "--report-thresholds",
        type=comma_floats,
        help="comma-separated thresholds to report the share removed at (default: %(default)s)",
    )
    #: Mean rows per k-means cluster (k = rows / cluster_size).
    cluster_size: int = flag(
        1000,
        "--cluster-size",
        type=int,
        help="mean rows per k-means cluster: larger finds more pairs, costs more "
        "(default: %(default)s)",
    )
    #: Rows k-means is trained on (a seeded uniform sample).
    train_rows: int = flag(
        262_144,
        "--train-rows",
        type=int,
        help="rows k-means is trained on, a seeded sample (default: %(default)s)",
    )
    iters: int = flag(20, "--iters", type=int, help="k-means iterations (default: %(default)s)")
    seed: int = flag(0, "--seed", type=int, help="sampling and k-means seed (default: 0)")
    skip_name: str = flag(
        DEFAULT_SKIP_NAME, "--name", help="skip-list name on the export (default: %(default)s)"
    )
    #: Rows fetched per read while assigning clusters.
    batch_rows: int = 65_536
    storage_options: dict | None = field(default=None, hash=False)
    #: engine, Ray cluster, CPUs, progress bar: the same for every job (``--engine``, ...).
    run: RunOptions = run_field()
    #: Store ``semdedup_cluster`` / ``semdedup_cosine`` in the table.
    store_columns: bool = flag(
        True,
        "--no-columns",
        negate=True,
        help="do not store semdedup_cluster / semdedup_cosine in the table",
    )
    #: Rows per cluster-bucket task (whole clusters; ray engine).
    rows_per_task: int = 262_144
    #: Spilled assignments (ray engine); must be shared by all nodes. None: a temporary dir.
    spill_dir: str | None = flag(
        None,
        "--spill-dir",
        help="where the ray engine spills assignments; must be shared by all nodes "
        "(default: a local temporary directory)",
    )

    def __post_init__(self) -> None:
        if self.rows_per_task < 1:
            raise UsageError("rows_per_task must be >= 1")
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
            if self.skip_list.get("warning"):
                lines.append(self.skip_list["warning"])
        return "\n".join(lines)


def run_semdedup(cfg: SemDedupConfig) -> SemDedupReport:
    """Cluster the table's embeddings, report every threshold, store columns, write the skip list."""
    from prx_data.columns.runner import ensure_columns

    start = time.perf_counter()
    ds = _open(cfg.table, cfg.storage_options)
    col = cfg.embedding_column
    if col not in ds.schema.names or not pa.types.is_fixed_size_list(ds.schema.field(col).type):
        raise UsageError(
            f"{cfg.table!r} has no vector column {col!r}; run `python -m prx_data.score clip "
            f"--table {cfg.table} --model ...` first, or name one with --embedding-column"
        )
    if cfg.store_columns:  # metadata only; every read below is pinned to this version
        ds = _open(cfg.table, cfg.storage_options, ensure_columns(cfg.table, OUTPUTS))
    where = cfg.run.place(
        size=ds.count_rows(),
        small=SMALL_ROWS,
    )
    rep, removed = _run_ray(cfg, ds, where) if where.on_ray else _run_local(cfg, ds)
    rep.table = cfg.table
    if cfg.export is not None:
        from prx_data.skips.dedup import replace_skip_list

        rep.skip_list = replace_skip_list(
            cfg.export,
            cfg.skip_name,
            pa.table({"id": removed}),  # every one is in the export
            table=cfg.table,
            reason=f"semdedup: {col} cosine >= {cfg.threshold:g} to a larger image",
        )
    rep.seconds = time.perf_counter() - start
    return rep


def _open(uri: str, storage_options: dict | None, version: int | None = None):
    from prx_data.table.lance_ops import open_table

    return open_table(uri, storage_options, version)


def _thresholds(cfg: SemDedupConfig) -> list[float]:
    return sorted({*cfg.report_thresholds, cfg.threshold})


def _exported(export: str, ids: pa.Array) -> np.ndarray:
    """Which of ``ids`` the export holds (through its id index)."""
    from prx_data.export.idindex import lookup_or_manifests

    hits = [c for t in lookup_or_manifests(export, pc.unique(ids)) for c in t["id"].chunks]
    held = pa.concat_arrays(hits) if hits else pa.array([], pa.string())
    return pc.is_in(ids, value_set=held).to_numpy(zero_copy_only=False)


def _area(t: pa.Table) -> np.ndarray:
    from prx_data.core import schema as S

    w = t[S.WIDTH].cast(pa.float64()).fill_null(0).to_numpy(zero_copy_only=False)
    h = t[S.HEIGHT].cast(pa.float64()).fill_null(0).to_numpy(zero_copy_only=False)
    return (w * h).astype(np.int64)


def _vectors(arr: pa.Array | pa.ChunkedArray) -> np.ndarray:
    if isinstance(arr, pa.ChunkedArray):
        arr = arr.combine_chunks()
    flat = arr.flatten().to_numpy(zero_copy_only=False)
    return flat.reshape(len(arr), arr.type.list_size)


def _report(
    cfg: SemDedupConfig, n: int, sizes: np.ndarray, removed_at: dict[float, int], examples
) -> SemDedupReport:
    """The report from per-cluster summaries; ``examples``: (id, kept, cosine) candidates."""
    sizes = sizes[sizes > 0]
    ex = sorted(examples, key=lambda e: (-e[2], e[0]))[:10]
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
        by_threshold={
            f"{t:g}": {"removed": r, "fraction": r / n if n else 0.0} for t, r in removed_at.items()
        },
        removed=removed_at[cfg.threshold],
        examples=[{"id": i, "kept": k, "cosine": round(float(c), 4)} for i, k, c in ex],
    )


def summarise(dups: SemDuplicates, cfg: SemDedupConfig, ids: pa.Array) -> SemDedupReport:
    """Cluster sizes, the rows removed at each threshold, a few example pairs."""
    n = len(dups.best)
    sizes = np.bincount(dups.labels) if n else np.zeros(0, np.int64)
    removed_at = {t: int(dups.removed(t).sum()) for t in _thresholds(cfg)}
    rm = np.flatnonzero(dups.removed(cfg.threshold))
    keeper = dups.keeper(cfg.threshold)
    # Candidates for the ten examples: the highest cosines (ties by id, as the ray engine).
    top = rm[np.argsort(-dups.best[rm], kind="stable")]
    if len(top) > 10:
        top = top[dups.best[top] >= dups.best[top[9]]]
    examples = [
        (ids[int(i)].as_py(), ids[int(keeper[i])].as_py(), float(dups.best[i])) for i in top
    ]
    return _report(cfg, n, sizes, removed_at, examples)


# --- local engine ------------------------------------------------------------------------


def _run_local(cfg: SemDedupConfig, ds) -> tuple[SemDedupReport, pa.Array]:
    """Everything in this process: ids, areas and labels of every row in memory."""
    from prx_data.core import schema as S
    from prx_data.table.lance_ops import quote

    col = cfg.embedding_column
    meta = ds.to_table(
        columns=[S.ID, S.WIDTH, S.HEIGHT],
        filter=f"{quote(col)} IS NOT NULL",
        with_row_address=True,
        with_row_id=False,
    )
    rows_all = ds.count_rows()
    offsets = _offsets(ds, col)
    ids = meta[S.ID].combine_chunks()
    keep = _exported(cfg.export, ids) if cfg.export is not None else np.ones(len(ids), bool)
    sel = np.flatnonzero(keep)
    ids = ids.take(pa.array(sel))
    offsets = offsets[sel]
    area = _area(meta)[sel]
    rowaddr = np.asarray(meta["_rowaddr"].combine_chunks(), np.uint64)[sel]

    def fetch(rows: np.ndarray) -> np.ndarray:
        return _vectors(ds.take(offsets[rows], columns=[col])[col])

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
    rep.rows_without_embedding = rows_all - len(meta)
    if cfg.store_columns:
        by_frag = np.argsort(rowaddr >> np.uint64(32), kind="stable")
        values = _values(rowaddr, dups.labels, dups.best).take(pa.array(by_frag))
        frag_of = rowaddr[by_frag] >> np.uint64(32)
        metas = []
        for frag in ds.get_fragments():
            f = np.uint64(frag.fragment_id)
            a, b = np.searchsorted(frag_of, f), np.searchsorted(frag_of, f, side="right")
            part = values.slice(a, b - a)
            metas.append(_write_fragment(ds, frag.fragment_id, part, cfg.storage_options))
        _commit(cfg, ds, metas)
    return rep, ids.filter(pa.array(dups.removed(cfg.threshold)))


def _offsets(ds, col: str) -> np.ndarray:
    """Row offsets (``take`` positions) of the rows with an embedding, in scan order."""
    parts, base = [], 0
    for batch in ds.scanner(columns=[col], batch_size=1 << 16).to_batches():
        valid = np.asarray(batch.column(0).is_valid(), bool)
        parts.append(base + np.flatnonzero(valid))
        base += batch.num_rows
    return np.concatenate(parts) if parts else np.zeros(0, np.int64)


# --- stored columns ----------------------------------------------------------------------


def _values(rowaddr: np.ndarray, labels: np.ndarray, best: np.ndarray) -> pa.Table:
    """``_rowaddr`` + the stored columns; a cluster's best member has no cosine (null)."""
    best = np.asarray(best, np.float32)
    return pa.table(
        {
            "_rowaddr": pa.array(np.asarray(rowaddr, np.uint64)),
            SEMDEDUP_CLUSTER_COLUMN: pa.array(np.asarray(labels, np.int32)),
            SEMDEDUP_COSINE_COLUMN: pa.array(best, mask=~np.isfinite(best)),
        }
    )


def _write_fragment(ds, fragment: int, values: pa.Table, storage_options=None) -> tuple[str, list]:
    """The fragment's new column file: ``values`` where given, null for every other row.

    Every physical row is set, so a rerun over fewer rows (another export)
    leaves no stale value. Returns the fragment metadata (JSON) and field ids.
    """
    from prx_data.columns.runner import write_columns

    frag = ds.get_fragment(fragment)
    n = frag.metadata.physical_rows
    given = (np.asarray(values["_rowaddr"], np.uint64) & np.uint64(0xFFFFFFFF)).astype(np.int64)
    rest = np.setdiff1d(np.arange(n), given)
    nulls = pa.table(
        {
            "_rowaddr": pa.array((np.uint64(fragment) << np.uint64(32)) + rest.astype(np.uint64)),
            SEMDEDUP_CLUSTER_COLUMN: pa.nulls(len(rest), pa.int32()),
            SEMDEDUP_COSINE_COLUMN: pa.nulls(len(rest), pa.float32()),
        }
    )
    full = pa.concat_tables([values.cast(nulls.schema), nulls])
    meta, fields = write_columns(ds, frag, full, OUTPUTS, storage_options)
    return meta.to_json() if not isinstance(meta, str) else meta, [int(f) for f in fields]


def _commit(cfg: SemDedupConfig, ds, metas: list[tuple[str, list]]) -> None:
    from prx_data.columns.runner import commit_fragments

    if not metas:
        return
    frags = [
        lance_compat.fragment_from_text(m)
        if isinstance(m, str)
        else lance_compat.fragment_from_dict(m)
        for m, _ in metas
    ]
    fields = sorted({f for _, fs in metas for f in fs})
    commit_fragments(cfg.table, frags, fields, ds.version, cfg.storage_options)


# --- ray engine --------------------------------------------------------------------------
#
# Tasks get (uri, version, options) and reopen the pinned table themselves; what comes
# back to the driver is counts, the training sample, per-cluster sizes and examples.


def _selected(cfg: SemDedupConfig, version: int, fragment: int, vectors: bool) -> tuple:
    """The fragment's rows with an embedding (and in the export): table, rows with embedding."""
    from prx_data.core import schema as S
    from prx_data.table.lance_ops import quote

    col = cfg.embedding_column
    frag = _open(cfg.table, cfg.storage_options, version).get_fragment(fragment)
    cols = [S.ID, S.WIDTH, S.HEIGHT] + ([col] if vectors else [])
    t = frag.to_table(columns=cols, filter=f"{quote(col)} IS NOT NULL", with_row_address=True)
    with_vec = t.num_rows
    if cfg.export is not None and t.num_rows:
        t = t.filter(pa.array(_exported(cfg.export, t[S.ID].combine_chunks())))
    return t, with_vec


def _count_task(cfg: SemDedupConfig, version: int, fragment: int) -> tuple[int, int]:
    t, with_vec = _selected(cfg, version, fragment, vectors=False)
    return t.num_rows, with_vec


def _sample_task(cfg: SemDedupConfig, version: int, fragment: int, pos: np.ndarray) -> np.ndarray:
    t, _ = _selected(cfg, version, fragment, vectors=True)
    return _vectors(t[cfg.embedding_column].take(pa.array(pos)))


def _spill_path(root: str, kind: str, i: int) -> str:
    return f"{root}/{kind}{i:08d}.arrow"


def _write_parts(path: str, table: pa.Table, part: np.ndarray, parts: int) -> np.ndarray:
    """One Arrow IPC file with record batch ``p`` holding the rows of part ``p``; row counts."""
    order = np.argsort(part, kind="stable")
    table, part = table.take(pa.array(order)), part[order]
    bounds = np.searchsorted(part, np.arange(parts + 1))
    with pa.OSFile(path, "wb") as f, pa.ipc.new_file(f, table.schema) as w:
        for p in range(parts):
            sub = table.slice(bounds[p], bounds[p + 1] - bounds[p]).combine_chunks()
            w.write_batch(sub.to_batches()[0] if sub.num_rows else _empty_batch(table.schema))
    return np.diff(bounds)


def _empty_batch(schema: pa.Schema) -> pa.RecordBatch:
    return pa.RecordBatch.from_arrays([pa.array([], f.type) for f in schema], schema=schema)


def _read_part(paths: list[str], p: int) -> pa.Table | None:
    batches = []
    for path in paths:
        with pa.memory_map(path) as src:
            b = pa.ipc.open_file(src).get_batch(p)
            if b.num_rows:
                batches.append(pa.Table.from_batches([b]).combine_chunks())
    return pa.concat_tables(batches) if batches else None


def _assign_task(
    cfg: SemDedupConfig,
    version: int,
    fragment: int,
    centroids: np.ndarray | None,
    k: int,
    buckets: int,
    root: str,
) -> np.ndarray:
    """Assign the fragment's rows and spill them by cluster bucket; rows per bucket."""
    from prx_data.core import schema as S
    from prx_data.skips.semdedup import assign, normalise

    t, _ = _selected(cfg, version, fragment, vectors=True)
    vec = normalise(_vectors(t[cfg.embedding_column])) if t.num_rows else np.zeros((0, 1))
    labels = np.zeros(t.num_rows, np.int64)
    if centroids is not None and t.num_rows:
        labels = assign(vec, centroids)
    dim = vec.shape[1]
    out = pa.table(
        {
            "cluster": pa.array(labels),
            "id": t[S.ID].combine_chunks(),
            "area": pa.array(_area(t)),
            "_rowaddr": t["_rowaddr"].combine_chunks(),
            "vec": pa.FixedSizeListArray.from_arrays(pa.array(vec.astype(np.float32).ravel()), dim),
        }
    )
    return _write_parts(_spill_path(root, "a", fragment), out, labels * buckets // k, buckets)


def _bucket_task(
    cfg: SemDedupConfig, bucket: int, paths: list[str], groups: int, frag_group: dict, root: str
) -> dict:
    """Rank the bucket's clusters, best cosine to a better member; spill removed ids and columns."""
    from prx_data.skips.semdedup import best_better, rank_members

    t = _read_part(paths, bucket)
    thresholds = _thresholds(cfg)
    if t is None:
        return {
            "sizes": np.zeros(0, np.int64),
            "removed_at": dict.fromkeys(thresholds, 0),
            "examples": [],
            "removed": 0,
        }
    labels = t["cluster"].to_numpy()
    order = rank_members(labels, t["area"].to_numpy(), t["id"])
    lab = labels[order]
    starts = np.flatnonzero(np.r_[True, lab[1:] != lab[:-1]])
    ends = np.r_[starts[1:], len(order)]
    vec = _vectors(t["vec"])
    n = t.num_rows
    best = np.full(n, -np.inf, np.float32)
    nearest = np.full(n, -1, np.int64)
    for a, b in zip(starts, ends, strict=True):
        if b - a < 2:
            continue
        rows = order[a:b]
        cb, ca = best_better(vec[rows])
        best[rows] = cb
        nearest[rows] = np.where(ca >= 0, rows[np.maximum(ca, 0)], -1)
    dups = SemDuplicates(labels, best, nearest)
    rm = dups.removed(cfg.threshold)
    keeper = dups.keeper(cfg.threshold)
    ids = t["id"].combine_chunks()
    removed_ids = ids.filter(pa.array(rm))
    with (
        pa.OSFile(_spill_path(root, "r", bucket), "wb") as f,
        pa.ipc.new_file(f, pa.schema([("id", ids.type)])) as w,
    ):
        w.write_table(pa.table({"id": removed_ids}))
    idx = np.flatnonzero(rm)
    top = idx[np.argsort(-best[idx], kind="stable")]
    if len(top) > 10:
        top = top[best[top] >= best[top[9]]]
    if cfg.store_columns:
        rowaddr = t["_rowaddr"].to_numpy()
        keys = np.array(sorted(frag_group), np.uint64)
        groups_of = np.array([frag_group[int(f)] for f in keys.tolist()], np.int64)
        fg = groups_of[np.searchsorted(keys, rowaddr >> np.uint64(32))]
        _write_parts(_spill_path(root, "c", bucket), _values(rowaddr, labels, best), fg, groups)
    return {
        "sizes": np.diff(np.r_[starts, len(order)]),
        "removed_at": {th: int((best >= th).sum()) for th in thresholds},
        "examples": [
            (ids[int(i)].as_py(), ids[int(keeper[i])].as_py(), float(best[i])) for i in top
        ],
        "removed": int(rm.sum()),
    }


def _write_task(
    cfg: SemDedupConfig, version: int, fragments: list[int], group: int, paths: list[str]
) -> list[tuple[str, list]]:
    """Write the stored columns of a group of fragments (one new column file each)."""
    ds = _open(cfg.table, cfg.storage_options, version)
    t = _read_part(paths, group) if paths else None
    if t is None:
        t = _values(np.zeros(0, np.uint64), np.zeros(0), np.zeros(0))
    frag_of = t["_rowaddr"].to_numpy() >> np.uint64(32)
    return [
        _write_fragment(ds, f, t.filter(pa.array(frag_of == f)), cfg.storage_options)
        for f in fragments
    ]


def _cfg_json(cfg: SemDedupConfig) -> dict:
    """``cfg`` as JSON, to travel in each work unit (its run options as a mapping)."""
    d = {k: getattr(cfg, k) for k in cfg.__dataclass_fields__}
    d["run"] = asdict(cfg.run)
    return d


def _cfg_of(unit: dict) -> SemDedupConfig:
    d = unit["cfg"]
    return SemDedupConfig(
        **{
            **d,
            "report_thresholds": tuple(d["report_thresholds"]),
            "run": RunOptions(**d["run"]),
        }
    )


def _count_unit(unit: dict) -> dict:
    sel, with_vec = _count_task(_cfg_of(unit), unit["version"], unit["fragment"])
    return {"i": unit["i"], "selected": sel, "with_vec": with_vec}


def _sample_unit(unit: dict) -> dict:
    vecs = _sample_task(_cfg_of(unit), unit["version"], unit["fragment"], np.array(unit["pos"]))
    path = os.path.join(unit["root"], f"s{unit['fragment']:08d}.npy")
    np.save(path, vecs, allow_pickle=False)
    return {"i": unit["i"], "path": path}


def _assign_unit(unit: dict) -> dict:
    c = unit["centroids"]
    centroids = np.load(c, allow_pickle=False) if c else None
    per = _assign_task(
        _cfg_of(unit),
        unit["version"],
        unit["fragment"],
        centroids,
        unit["k"],
        unit["buckets"],
        unit["root"],
    )
    return {"i": unit["i"], "per": [int(x) for x in per]}


def _bucket_unit(unit: dict) -> dict:
    keys, groups_of = np.load(unit["frag_group"], allow_pickle=False)
    frag_group = dict(zip(keys.tolist(), groups_of.tolist(), strict=True))
    s = _bucket_task(
        _cfg_of(unit), unit["bucket"], unit["paths"], unit["groups"], frag_group, unit["root"]
    )
    return {
        "sizes": [int(x) for x in s["sizes"]],
        "removed_at": [[float(t), int(r)] for t, r in s["removed_at"].items()],
        "examples": [[i, k, float(c)] for i, k, c in s["examples"]],
    }


def _write_unit(unit: dict) -> list:
    metas = _write_task(
        _cfg_of(unit), unit["version"], unit["fragments"], unit["group"], unit["paths"]
    )
    return [[m, [int(f) for f in fs]] for m, fs in metas]


def _run_ray(cfg: SemDedupConfig, ds, where) -> tuple[SemDedupReport, pa.Array]:
    """The ray engine on the one runner: each stage is :func:`map_units` over JSON units.

    What a stage's tasks share (the config, the centroids, the fragment groups) travels
    in each unit or in a file under the spill directory; what comes back is counts,
    summaries and paths of spilled files.
    """
    from prx_data.core.runtime import Resources, map_units
    from prx_data.skips.semdedup import normalise, train_centroids

    def run(fn, units: list[dict], desc: str) -> list:
        return list(
            map_units(fn, units, where, Resources(num_cpus=1), desc=desc, progress=cfg.run.progress)
        )

    def by_unit(results: list[dict]) -> list[dict]:  # Ray hands results back as they finish
        return sorted(results, key=lambda r: r["i"])

    version = ds.version
    frags = [f.fragment_id for f in ds.get_fragments()]
    job = {"cfg": _cfg_json(cfg), "version": version}
    root = cfg.spill_dir or tempfile.mkdtemp(prefix="semdedup-")
    own = cfg.spill_dir is None
    try:
        os.makedirs(root, exist_ok=True)
        units = [{**job, "i": i, "fragment": f} for i, f in enumerate(frags)]
        counts = by_unit(run(_count_unit, units, "semdedup count"))
        sel = np.array([c["selected"] for c in counts], np.int64)
        n = int(sel.sum())
        rows_without = ds.count_rows() - sum(c["with_vec"] for c in counts)
        # The same seeded sample over the same row order as the local engine.
        rng = np.random.default_rng(cfg.seed)
        k = max(1, round(n / cfg.cluster_size)) if n else 1
        centroids_path = None
        if n and k > 1:
            sample = np.sort(rng.choice(n, size=min(n, cfg.train_rows), replace=False))
            base = np.r_[0, np.cumsum(sel)]
            cut = np.searchsorted(sample, base)  # the sample is sorted: a slice per fragment
            units = [
                {
                    **job,
                    "i": i,
                    "fragment": frags[i],
                    "pos": (sample[cut[i] : cut[i + 1]] - base[i]).tolist(),
                    "root": root,
                }
                for i in range(len(frags))
                if cut[i + 1] > cut[i]
            ]
            parts = by_unit(run(_sample_unit, units, "semdedup sample"))
            vecs = np.concatenate([np.load(p["path"], allow_pickle=False) for p in parts])
            centroids = train_centroids(normalise(vecs), k, cfg.iters, cfg.seed)
            centroids_path = os.path.join(root, "centroids.npy")
            np.save(centroids_path, centroids, allow_pickle=False)
        buckets = max(1, min(k, -(-n // cfg.rows_per_task)))
        groups = max(1, min(len(frags), buckets))
        frag_group = {f: i * groups // max(1, len(frags)) for i, f in enumerate(frags)}
        units = [
            {**job, "i": i, "fragment": f, "centroids": centroids_path, "k": k}
            | {"buckets": buckets, "root": root}
            for i, f in enumerate(frags)
        ]
        per = [r["per"] for r in by_unit(run(_assign_unit, units, "semdedup assign"))]
        per_bucket = np.sum(per, axis=0) if per else np.zeros(buckets, np.int64)
        spills = [_spill_path(root, "a", f) for f in frags]
        fg_path = os.path.join(root, "fragment-groups.npy")
        np.save(fg_path, np.array([list(frag_group), list(frag_group.values())], np.int64))
        done_buckets = [b for b in range(buckets) if per_bucket[b]]
        units = [
            {
                **job,
                "bucket": b,
                "paths": [p for p, c in zip(spills, per, strict=True) if c[b]],
                "groups": groups,
                "frag_group": fg_path,
                "root": root,
            }
            for b in done_buckets
        ]
        sizes, examples = [], []
        removed_at = dict.fromkeys(_thresholds(cfg), 0)
        for s in run(_bucket_unit, units, "semdedup clusters"):
            sizes.append(np.array(s["sizes"], np.int64))
            found = [tuple(e) for e in s["examples"]]
            examples = sorted([*examples, *found], key=lambda e: (-e[2], e[0]))[:10]
            for t, r in s["removed_at"]:
                removed_at[t] += r
        rep = _report(
            cfg, n, np.concatenate(sizes) if sizes else np.zeros(0, np.int64), removed_at, examples
        )
        rep.rows_without_embedding = rows_without
        removed = [c for b in done_buckets for c in _read_ids(_spill_path(root, "r", b))]
        removed_ids = pa.concat_arrays(removed) if removed else pa.array([], pa.string())
        if cfg.store_columns:
            results = [_spill_path(root, "c", b) for b in done_buckets]
            by_group: dict[int, list[int]] = {}
            for f in frags:
                by_group.setdefault(frag_group[f], []).append(f)
            units = [
                {**job, "fragments": fs, "group": g, "paths": results} for g, fs in by_group.items()
            ]
            written = run(_write_unit, units, "semdedup columns")  # a list per group
            _commit(cfg, ds, [(m, fs) for group in written for m, fs in group])
    finally:
        if own:
            shutil.rmtree(root, ignore_errors=True)
    return rep, removed_ids


def _read_ids(path: str) -> list[pa.Array]:
    with pa.memory_map(path) as src:
        t = pa.ipc.open_file(src).read_all()
    return [c for c in t["id"].chunks if len(c)]
