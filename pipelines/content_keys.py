"""Fill the ``sha256`` column of rows written before ingest recorded it.

An opt-out follows its image through the corpus by content keys
(:mod:`prx_data.skips.content`): a byte-identical copy in any table is found by
its ``sha256``, and a later export leaves it out while writing
(:mod:`prx_data.export.removals`). Tables ingested before ingest and download
recorded ``sha256`` lack it, so their copies are only found by pHash, which a
byte-identical copy matches too, but which dedup may not have computed. This is
the backfill: a column job over the rows whose ``sha256`` is null and whose
image is present, hashing the bytes exactly as stored (what ingest hashes).

Graph (:mod:`prx_data.columns.runner`, like phash and quality)::

    read id, image of rows with an image and no sha256      one unit per fragment (or row range)
      -> hash_batch                                         sha256 of the stored bytes
      -> driver: each finished fragment's sha256 written once, checkpointed, committed

Only the new column's files are written (no image is rewritten); a killed run
resumes with the rows still missing.
"""

from __future__ import annotations

from dataclasses import dataclass

import pyarrow as pa

from prx_data.columns.runner import ColumnJob, Step, run_column_job
from prx_data.columns.writeback import ColumnReport
from prx_data.core import schema as S
from prx_data.core.errors import UsageError
from prx_data.core.keys import sha256_hex
from prx_data.core.runtime import RunOptions, run_field
from prx_data.table import lance_ops as T

__all__ = [
    "Sha256Config",
    "hash_batch",
    "run_sha256",
]


@dataclass(frozen=True)
class Sha256Config:
    """One backfill run over ``table``."""

    table: str
    #: engine, Ray cluster, CPUs, progress bar: the same for every job.
    run: RunOptions = run_field()
    batch_size: int = 256
    #: Fragments per commit (each finished fragment is checkpointed regardless).
    commit_every: int = 16
    storage_options: dict | None = None

    def __post_init__(self) -> None:
        if self.batch_size < 1 or self.commit_every < 1:
            raise UsageError("batch_size and commit_every must be >= 1")


def hash_batch(batch: pa.Table | pa.RecordBatch) -> pa.Table:
    """(id, image) -> (id, sha256 hex); a row without bytes keeps a null digest."""
    images = batch.column(S.IMAGE).to_pylist()
    digests = [sha256_hex(b) if b is not None else None for b in images]
    return pa.table({S.ID: batch.column(S.ID), S.SHA256: pa.array(digests, pa.string())})


def run_sha256(cfg: Sha256Config) -> ColumnReport:
    """Hash every stored image that has no ``sha256`` yet and write the column back.

    Args:
        cfg: the table and how to run (resumable: a second run finds nothing pending).

    Returns:
        The column job's report (rows pending, hashed, the versions read and left).
    """
    names = T.open_table(cfg.table, cfg.storage_options).schema.names
    if S.IMAGE not in names:
        raise UsageError(f"table {cfg.table!r} has no {S.IMAGE!r} column: nothing to hash")
    where = f"{S.IMAGE} IS NOT NULL"
    if S.SHA256 in names:
        where = f"{S.SHA256} IS NULL AND {where}"
    return run_column_job(
        ColumnJob(
            table=cfg.table,
            outputs=pa.schema([pa.field(S.SHA256, pa.string())]),
            read_columns=[S.ID, S.IMAGE],
            steps=[Step(hash_batch, batch_size=cfg.batch_size, zero_copy_batch=True)],
            where=where,
            run=cfg.run,
            batch_size=cfg.batch_size,
            commit_every=cfg.commit_every,
            storage_options=cfg.storage_options,
            desc="sha256",
        )
    )
