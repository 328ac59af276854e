"""VLM re-captioning as a streaming Ray Data job that writes columns back to Lance.

Graph::

    read_lance(rows whose <column>_status is null)      tasks, one per fragment
      -> map_batches(prepare_images)                     tasks: decode, fit pixel budget, JPEG
      -> map_batches(CaptionActor, ActorPoolStrategy)    one backend per actor (GPU)
      -> driver: ColumnWriter -> table.update_column     <column>, then <column>_status

Rows stream through; the driver writes results back in batches, so a killed
run loses at most one unflushed batch and a rerun picks up the rest. Every
row ends with a status: ``ok`` (caption stored), ``empty``, ``looping``,
``truncated`` or ``error`` (caption left null, reason counted).
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import pyarrow as pa

from prx_data.columns import checks
from prx_data.columns.backends import (
    BackendSpec,
    FailureGuard,
    GenerationConfig,
    Request,
    make_spec,
)
from prx_data.columns.images import DEFAULT_MAX_PIXELS, fit_image
from prx_data.columns.prompts import load_prompt
from prx_data.columns.writeback import ColumnReport, ColumnWriter, count_into, pending_filter
from prx_data.core import schema as S
from prx_data.core.runtime import ensure_ray

#: Internal column carrying why a row was flagged (counted, not stored).
REASON = "__reason"
_IMAGE_OK = "__image"


def status_column(column: str) -> str:
    return f"{column}_status"


@dataclass
class CaptionConfig:
    """One captioning run. ``backend_options`` go to the backend's constructor."""

    table: str
    backend: str
    model: str
    column: str = "caption_vlm"
    prompt_file: str | None = None
    max_pixels: int = DEFAULT_MAX_PIXELS
    limit: int | None = None
    generation: GenerationConfig = field(default_factory=GenerationConfig)
    backend_options: dict = field(default_factory=dict)
    replicas: int = 1
    batch_size: int | None = None
    #: Statuses to compute again (e.g. ``("error", "truncated")``).
    redo: tuple[str, ...] = ()
    flush_rows: int = 2000
    storage_options: dict | None = None
    progress: bool = True

    def __post_init__(self) -> None:
        if self.column in (S.ID, S.IMAGE, S.CAPTION):
            raise ValueError(f"refusing to write captions into the {self.column!r} column")
        bad = set(self.redo) - set(checks.STATUSES)
        if bad:
            raise ValueError(
                f"unknown status(es) to redo: {sorted(bad)}; choose from {checks.STATUSES}"
            )
        if self.max_pixels < 28 * 28:
            raise ValueError(f"max_pixels must be at least 784, got {self.max_pixels}")
        if self.limit is not None and self.limit < 0:
            raise ValueError(f"limit must be >= 0, got {self.limit}")


# --- Ray helpers shared with pipelines.classify ------------------------------


def read_pending(
    uri: str, columns: list[str], where: str | None, limit: int | None, storage_options=None
):
    """Ray dataset of the pending rows, plus how many there are (for the progress bar)."""
    import ray

    from prx_data.table.lance_ops import open_table

    ds_lance = open_table(uri, storage_options)
    total = ds_lance.count_rows(filter=where) if where else ds_lance.count_rows()
    if limit is not None:
        total = min(total, limit)
    kwargs = {"storage_options": storage_options} if storage_options else {}
    # Pin the version that was counted; the job's own write-backs add versions as it runs.
    ds = ray.data.read_lance(uri, version=ds_lance.version, columns=columns, filter=where, **kwargs)
    if limit is not None:
        ds = ds.limit(limit)
    return ds, total


def drive(
    results: Iterator[pa.Table],
    writer: ColumnWriter,
    report: ColumnReport,
    count_column: str,
    total: int,
    desc: str,
    progress: bool = True,
    on_batch: Callable[[pa.Table], None] | None = None,
) -> ColumnReport:
    """Consume result batches: write back, count, show progress; fill ``report``."""
    from tqdm.auto import tqdm

    counts: Counter = Counter()
    reasons: Counter = Counter()
    start = time.perf_counter()
    bar = tqdm(total=total, desc=desc, unit="row", disable=not progress, smoothing=0.1)
    try:
        for batch in results:
            if batch.num_rows == 0:
                continue
            if not report.first_rows:
                report.first_result_s = time.perf_counter() - start
                report.first_rows = batch.num_rows
            writer.add(batch)
            count_into(counts, batch[count_column])
            if batch[count_column].null_count:
                counts["error"] += batch[count_column].null_count
            if REASON in batch.column_names:
                count_into(reasons, batch[REASON])
            if on_batch:
                on_batch(batch)
            report.rows += batch.num_rows
            bar.update(batch.num_rows)
            bar.set_postfix({k: v for k, v in counts.most_common(4)}, refresh=False)
    finally:
        # Keep what is done even when the job stops (a failing backend, Ctrl-C).
        writer.flush()
        bar.close()
    report.seconds = time.perf_counter() - start
    report.counts = dict(counts)
    report.reasons = dict(reasons)
    report.written = writer.written
    return report


def iter_results(ds) -> Iterator[pa.Table]:
    yield from ds.iter_batches(batch_format="pyarrow", batch_size=None)


# --- the caption graph --------------------------------------------------------


def prepare_images(batch: pa.Table, max_pixels: int) -> pa.Table:
    """Decode and fit each image to the pixel budget; bad bytes get a reason instead."""
    from prx_data.core.imaging import ImageError

    images: list[bytes | None] = []
    reasons: list[str | None] = []
    for data in batch[S.IMAGE].to_pylist():
        try:
            if data is None:
                raise ImageError("no_image")
            images.append(fit_image(data, max_pixels)[0])
            reasons.append(None)
        except ImageError as e:
            images.append(None)
            reasons.append(f"image: {e.reason}")
    return pa.table(
        {
            S.ID: batch[S.ID],
            _IMAGE_OK: pa.array(images, pa.large_binary()),
            REASON: pa.array(reasons, pa.string()),
        }
    )


class CaptionActor:
    """Holds one backend; captions a batch and applies the output checks."""

    def __init__(self, spec: BackendSpec, prompt: str, column: str, limits: checks.LoopLimits):
        self.backend = spec.build()
        self.prompt = prompt
        self.column = column
        self.status = status_column(column)
        self.limits = limits
        self.guard = FailureGuard()

    def __call__(self, batch: pa.Table) -> pa.Table:
        images = batch[_IMAGE_OK].to_pylist()
        reasons = batch[REASON].to_pylist()
        todo = [i for i, im in enumerate(images) if im is not None]
        gens = self.backend([Request(self.prompt, images[i]) for i in todo])
        self.guard.update(gens)
        captions: list[str | None] = [None] * len(images)
        statuses = [checks.ERROR] * len(images)
        for i, g in zip(todo, gens, strict=True):
            status, text = checks.check(g.text, g.finish_reason, g.error, self.limits)
            statuses[i], captions[i] = status, text
            if status == checks.ERROR:
                reasons[i] = f"backend: {g.error}"[:120]
            elif status != checks.OK:
                reasons[i] = f"flagged: {status}"
        return pa.table(
            {
                S.ID: batch[S.ID],
                self.column: pa.array(captions, pa.string()),
                self.status: pa.array(statuses, pa.string()),
                REASON: pa.array(reasons, pa.string()),
            }
        )

    def __del__(self):
        backend = getattr(self, "backend", None)
        if backend is not None:
            backend.close()


def build_graph(cfg: CaptionConfig, spec: BackendSpec, prompt: str, limits: checks.LoopLimits):
    """The Ray Data graph of pending rows -> caption results, plus the row count."""
    import ray

    from prx_data.table.lance_ops import open_table

    existing = open_table(cfg.table, cfg.storage_options).schema.names
    where = pending_filter(existing, status_column(cfg.column), cfg.column, cfg.redo)
    ds, total = read_pending(cfg.table, [S.ID, S.IMAGE], where, cfg.limit, cfg.storage_options)
    ds = ds.map_batches(
        prepare_images,
        fn_kwargs={"max_pixels": cfg.max_pixels},
        batch_format="pyarrow",
        batch_size=spec.batch_size,
        zero_copy_batch=True,
    )
    ds = ds.map_batches(
        CaptionActor,
        fn_constructor_args=(spec, prompt, cfg.column, limits),
        batch_format="pyarrow",
        batch_size=spec.batch_size,
        compute=ray.data.ActorPoolStrategy(size=spec.replicas),
        num_cpus=spec.num_cpus,
        num_gpus=spec.num_gpus,
    )
    return ds, total


def run_caption(
    cfg: CaptionConfig,
    spec: BackendSpec | None = None,
    limits: checks.LoopLimits | None = None,
) -> ColumnReport:
    """Caption the rows of ``cfg.table`` that lack ``cfg.column``; returns the report.

    ``spec`` overrides the backend named in ``cfg`` (any :class:`Backend`
    subclass works, e.g. for benchmarks).
    """
    prompt = load_prompt(cfg.prompt_file)
    if spec is None:
        spec = make_spec(
            cfg.backend,
            cfg.model,
            cfg.generation,
            cfg.backend_options,
            replicas=cfg.replicas,
            batch_size=cfg.batch_size,
        )
    ensure_ray()
    ds, total = build_graph(cfg, spec, prompt, limits or checks.LoopLimits())
    st = status_column(cfg.column)
    report = ColumnReport(cfg.table, [cfg.column, st])
    if total == 0:
        return report
    writer = ColumnWriter(
        cfg.table, [cfg.column, st], flush_rows=cfg.flush_rows, storage_options=cfg.storage_options
    )
    return drive(iter_results(ds), writer, report, st, total, f"caption {cfg.column}", cfg.progress)
