"""The image-quality column job: fill ``image_quality`` (std, entropy, flat) where it is missing.

Graph (:mod:`prx_data.columns.runner`, like caption, classify, phash and descriptors)::

    read id, image of rows whose image_quality is null      one unit per fragment (or row range)
      -> measure_batch                                      decode, flatten alpha on white, measure
      -> driver: each finished fragment's image_quality written once, checkpointed, committed

Only the new column's files are written; a killed run resumes with the rows
still missing. Unreadable rows keep a null value (counted, and measured
again by a later run). ``engine="local"`` (the default) runs in this
process; ``"ray"`` spreads the decoding over Ray Data tasks.
"""

from __future__ import annotations

from dataclasses import dataclass

import pyarrow as pa

from prx_data.columns.quality import LOW, OK, OUTCOME, UNREADABLE, measure_batch
from prx_data.columns.runner import ColumnJob, Step, run_column_job
from prx_data.columns.writeback import ColumnReport, pending_filter
from prx_data.core import quality
from prx_data.core import schema as S
from prx_data.core.errors import UsageError
from prx_data.core.flags import REQUIRED, flag
from prx_data.core.reports import JobReport
from prx_data.core.runtime import RunOptions, run_field
from prx_data.table import lance_ops as T

__all__ = [
    "QualityConfig",
    "run_quality",
]


@dataclass(frozen=True)
class QualityConfig:
    """One measuring run over ``table``."""

    table: str = flag(REQUIRED, "--table", help="Lance table URI")
    column: str = quality.COLUMN
    chunk_rows: int = flag(
        2048,
        "--chunk-rows",
        type=int,
        help="rows measured per write to the table (default: %(default)s)",
    )
    #: engine, Ray cluster, CPUs, progress bar: the same for every job (``--engine``, ...).
    run: RunOptions = run_field()
    #: Fragments per commit (each finished fragment is checkpointed regardless).
    commit_every: int = 16
    storage_options: dict | None = None

    def __post_init__(self) -> None:
        if self.chunk_rows < 1:
            raise UsageError(f"chunk_rows must be >= 1, got {self.chunk_rows}")
        if self.column in (S.ID, S.IMAGE, S.CAPTION):
            raise UsageError(f"refusing to write image quality into the {self.column!r} column")


@dataclass
class QualityReport(JobReport):
    """Rows measured, unreadable (left null) and low-information: the column runner's
    report (``run``) read by outcome."""

    table: str
    column: str
    run: ColumnReport | None = None

    job_label = "quality"
    counted = "rows"

    def __post_init__(self) -> None:
        if self.run is None:
            self.run = ColumnReport(self.table, [self.column])

    @property
    def low_information(self) -> int:
        return self.run.counts.get(LOW, 0)

    @property
    def written(self) -> int:
        return self.run.counts.get(OK, 0) + self.low_information

    @property
    def unreadable(self) -> int:
        return self.run.counts.get(UNREADABLE, 0)

    @property
    def seconds(self) -> float:
        return self.run.seconds

    @property
    def failed(self) -> int:
        return self.unreadable

    @property
    def total(self) -> int:
        return self.written + self.unreadable

    def counts(self) -> dict[str, int]:
        return {
            "written": self.written,
            "unreadable": self.unreadable,
            "low_information": self.low_information,
        }

    def text(self) -> str:
        return (
            f"measured {self.written:,} rows; {self.unreadable:,} unreadable (left empty); "
            f"{self.low_information:,} low-information\n"
            f'low-information filter: "{quality.LOW_INFORMATION_SQL}"'
        )

    def to_dict(self) -> dict:
        return {**super().to_dict(), **self.counts()}


def run_quality(cfg: QualityConfig) -> QualityReport:
    """Measure every row of ``cfg.table`` that lacks ``cfg.column``; resumable."""
    ds = T.open_table(cfg.table, cfg.storage_options)
    where = pending_filter(ds.schema.names, cfg.column)
    job = ColumnJob(
        table=cfg.table,
        outputs=pa.schema([pa.field(cfg.column, quality.QUALITY_TYPE)]),
        read_columns=[S.ID, S.IMAGE],
        steps=[Step(measure_batch, kwargs={"column": cfg.column}, batch_size=cfg.chunk_rows)],
        where=where,
        run=cfg.run,
        batch_size=cfg.chunk_rows,
        commit_every=cfg.commit_every,
        count_column=OUTCOME,
        null_as=None,
        storage_options=cfg.storage_options,
        desc=f"image quality -> {cfg.column}",
    )
    return QualityReport(cfg.table, cfg.column, run_column_job(job))


def compute_quality(
    uri: str,
    *,
    column: str = quality.COLUMN,
    chunk_rows: int = 2048,
    run: RunOptions = RunOptions(),
    storage_options: dict | None = None,
) -> dict[str, int]:
    """:func:`run_quality` as counts: ``written`` (measured), ``unreadable``, ``low_information``."""
    cfg = QualityConfig(
        table=uri,
        column=column,
        chunk_rows=chunk_rows,
        run=run,
        storage_options=storage_options,
    )
    return run_quality(cfg).counts()
