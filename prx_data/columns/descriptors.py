"""The descriptor column job: fill ``pixel_descriptor`` for rows that lack it (resumable).

A row that cannot be described keeps a null descriptor and gets its reason
in ``pixel_descriptor_error`` (``decode_error``, ``missing_image``, ...).
"""

from __future__ import annotations

from collections import Counter

import pyarrow as pa

from prx_data.core.descriptor import COLUMN, describe_many


def _describe_batch(batch, column: str) -> pa.Table:
    reasons: list[str | None] = []
    vectors = describe_many(batch["image"].to_pylist(), reasons)
    return pa.table(
        {"id": batch["id"], column: vectors, f"{column}_error": pa.array(reasons, pa.string())}
    )


def compute_descriptors(
    uri: str,
    *,
    column: str = COLUMN,
    chunk_rows: int = 4096,
    use_ray: bool = False,
    num_cpus: int | None = None,
    progress: bool = True,
    storage_options: dict | None = None,
    errors: Counter | None = None,
) -> int:
    """Fill ``column`` for every row that lacks it; resumable. Returns rows written.

    Rows that cannot be described stay null and get their reason in
    ``<column>_error``; ``errors``, when given, counts them by reason.

    Rows are read with :func:`prx_data.table.lance_ops.rows_missing` and written in
    chunks with :func:`prx_data.table.lance_ops.update_column` (image files untouched),
    so an interrupted run continues where it stopped. ``use_ray`` spreads the
    decoding over a Ray Data pipeline (local Ray or ``RAY_ADDRESS``).
    """
    from tqdm import tqdm

    from prx_data.table import lance_ops as T

    ds = T.open_table(uri, storage_options)
    if column in ds.schema.names:
        todo = ds.count_rows(f"{T.quote(column)} IS NULL")
    else:
        todo = ds.count_rows()
    if todo == 0:
        return 0
    written = 0
    bar = tqdm(total=todo, desc=f"descriptors -> {column}", unit="img", disable=not progress)
    if use_ray:
        batches = _ray_batches(uri, column, chunk_rows, num_cpus, storage_options)
    else:
        batches = (
            _describe_batch(b, column)
            for b in T.rows_missing(
                uri, column, ["id", "image"], batch_size=chunk_rows, storage_options=storage_options
            )
        )
    err_col = f"{column}_error"
    has_err_col = err_col in ds.schema.names
    for chunk in batches:
        written += T.update_column(
            uri, column, chunk.select(["id", column]), storage_options=storage_options
        )
        failed = chunk[err_col].drop_null()
        if len(failed) or has_err_col:  # also clears the reason of a row that now succeeded
            T.update_column(
                uri, err_col, chunk.select(["id", err_col]), storage_options=storage_options
            )
            has_err_col = True
        if errors is not None:
            errors.update(failed.to_pylist())
        bar.update(chunk.num_rows)
    bar.close()
    return written


def _ray_batches(uri, column, chunk_rows, num_cpus, storage_options):
    import ray
    from lance_ray import read_lance

    from prx_data.core.runtime import ensure_ray
    from prx_data.table import lance_ops as T

    started = not ray.is_initialized()
    ensure_ray(num_cpus=num_cpus)
    try:
        ds = T.open_table(uri, storage_options)
        where = f"{T.quote(column)} IS NULL" if column in ds.schema.names else None
        rd = read_lance(uri, columns=["id", "image"], filter=where, storage_options=storage_options)

        def fn(batch: pa.Table) -> pa.Table:
            return _describe_batch(batch, column)

        rd = rd.map_batches(fn, batch_format="pyarrow", batch_size=256)
        yield from rd.iter_batches(batch_size=chunk_rows, batch_format="pyarrow")
    finally:
        if started:
            ray.shutdown()
