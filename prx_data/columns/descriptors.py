"""The descriptor column job: fill ``pixel_descriptor`` for rows that lack it (resumable).

A row that cannot be described keeps a null descriptor and gets its reason
in ``pixel_descriptor_error`` (``decode_error``, ``missing_image``, ...).
"""

from __future__ import annotations

from collections import Counter

import pyarrow as pa

from prx_data.core.descriptor import COLUMN, VECTOR_TYPE, describe_many
from prx_data.core.runtime import RunOptions
from prx_data.core.schema import error_column


def describe_batch(batch: pa.Table, column: str = COLUMN) -> pa.Table:
    """(id, image) -> (id, descriptor, why it is null: ``missing_image`` or the decode error)."""
    from prx_data.core.imaging import ImageError, probe

    images = batch["image"].to_pylist()
    vectors = describe_many(images)
    errors: list[str | None] = []
    for data, ok in zip(images, vectors.is_valid().to_pylist(), strict=True):
        if ok:
            errors.append(None)
        elif data is None:
            errors.append("missing_image")
        else:
            try:
                probe(data)
                errors.append("decode_error")
            except ImageError as e:
                errors.append(e.reason)
    return pa.table(
        {
            "id": batch["id"],
            column: vectors,
            error_column(column): pa.array(errors, pa.string()),
        }
    )


def compute_descriptors(
    uri: str,
    *,
    column: str = COLUMN,
    chunk_rows: int = 4096,
    run: RunOptions = RunOptions(),
    storage_options: dict | None = None,
    errors: Counter | None = None,
) -> int:
    """Fill ``column`` for every row that lacks it; resumable. Returns rows written.

    A column job (:mod:`prx_data.columns.runner`): each fragment's rows
    whose ``column`` is null are described and the fragment's new values are
    written once (image files untouched), so an interrupted run continues
    where it stopped. A row whose image cannot be described keeps a null
    vector, with the reason in ``<column>_error``; it is tried again on the
    next run. ``run`` says where the decoding runs (``engine="auto"`` keeps a
    small table in this process and spreads a large one over Ray);
    ``chunk_rows`` is the rows per batch.
    ``errors``, when given, counts the rows without a descriptor by reason.
    """
    from prx_data.columns.runner import ColumnJob, Step, run_column_job
    from prx_data.columns.writeback import pending_filter
    from prx_data.table import lance_ops as T

    ds = T.open_table(uri, storage_options)
    where = pending_filter(ds.schema.names, column)
    report = run_column_job(
        ColumnJob(
            table=uri,
            outputs=pa.schema(
                [pa.field(column, VECTOR_TYPE), pa.field(error_column(column), pa.string())]
            ),
            read_columns=["id", "image"],
            steps=[Step(describe_batch, kwargs={"column": column}, batch_size=256)],
            where=where,
            run=run,
            batch_size=chunk_rows,
            reason_column=error_column(column),
            storage_options=storage_options,
            desc=f"descriptors -> {column}",
        )
    )
    if errors is not None:
        errors.update(report.reasons)
    return report.written
