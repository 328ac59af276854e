"""The image-quality column job: fill ``image_quality`` (std, entropy, flat) where it is missing.

A thin loop over :func:`prx_data.table.lance_ops.rows_missing` and
:func:`prx_data.table.lance_ops.update_column`: only the new column's files
are written, and a killed run resumes with the rows still missing.
"""

from __future__ import annotations

import pyarrow as pa

from prx_data.core import quality
from prx_data.core import schema as S
from prx_data.table import lance_ops as T


def compute_quality(
    uri: str,
    *,
    column: str = quality.COLUMN,
    chunk_rows: int = 2048,
    progress: bool = True,
    storage_options: dict | None = None,
) -> dict[str, int]:
    """Measure every row that lacks ``column``; returns counts by outcome.

    ``written``: rows measured; ``unreadable``: rows whose bytes are missing
    or not an image (left null, so they are counted, not measured, and stay
    visible to ``rows_missing`` for a later run with a fixed decoder);
    ``low_information``: measured rows under the blank thresholds.
    """
    from tqdm import tqdm

    ds = T.open_table(uri, storage_options)
    if column in ds.schema.names:
        todo = ds.count_rows(f"{T.quote(column)} IS NULL")
    else:
        todo = ds.count_rows()
    counts = {"written": 0, "unreadable": 0, "low_information": 0}
    if todo == 0:
        return counts
    bar = tqdm(total=todo, desc=f"image quality -> {column}", unit="img", disable=not progress)
    # Read everything missing up front as a lazy scan of the pinned version, so rows left
    # null (unreadable) are not read again within this run.
    batches = T.rows_missing(
        uri, column, [S.ID, S.IMAGE], batch_size=chunk_rows, storage_options=storage_options
    )
    for batch in batches:
        values = quality.measure_many(batch[S.IMAGE].to_pylist())
        measured = values.is_valid()
        counts["unreadable"] += batch.num_rows - int(pa.compute.sum(measured).as_py() or 0)
        ok = pa.table({S.ID: batch[S.ID], column: values}).filter(measured)
        if ok.num_rows:
            q = ok[column].combine_chunks()
            low = quality.is_low_information(
                q.field("std").to_numpy(zero_copy_only=False),
                q.field("entropy").to_numpy(zero_copy_only=False),
                q.field("flat").to_numpy(zero_copy_only=False),
            )
            counts["low_information"] += int(low.sum())
            counts["written"] += T.update_column(uri, column, ok, storage_options=storage_options)
        bar.update(batch.num_rows)
    bar.close()
    return counts
