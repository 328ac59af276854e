"""The per-batch part of the image-quality column job (run by :mod:`prx_data.pipelines.quality`).

:func:`measure_batch` turns ``(id, image)`` rows into the ``image_quality``
struct (std, entropy, flat) and an outcome per row, so the one column runner
(:mod:`prx_data.columns.runner`) can write, checkpoint and resume it like
caption, classify, phash and descriptors.
"""

from __future__ import annotations

import numpy as np
import pyarrow as pa

from prx_data.core import quality
from prx_data.core import schema as S

#: A column the step returns for the report only (never written): ok, low_information, unreadable.
OUTCOME = "__quality_outcome"
OK, LOW, UNREADABLE = "ok", "low_information", "unreadable"


def measure_batch(batch: pa.Table, column: str = quality.COLUMN) -> pa.Table:
    """(id, image) -> (id, ``column``, outcome): unreadable rows keep a null value.

    A null value keeps the row pending, so a later run (with a fixed decoder)
    measures it again; it is counted as ``unreadable`` each run.
    """
    values = quality.measure_many(batch[S.IMAGE].to_pylist())
    measured = np.asarray(values.is_valid().to_numpy(zero_copy_only=False), bool)
    outcome = np.where(measured, OK, UNREADABLE).astype(object)
    if measured.any():
        # Fields of null rows are masked out by ``measured``.
        low = quality.is_low_information(
            *(values.field(f).to_numpy(zero_copy_only=False) for f in ("std", "entropy", "flat"))
        )
        outcome[measured & np.asarray(low, bool)] = LOW
    return pa.table(
        {S.ID: batch[S.ID], column: values, OUTCOME: pa.array(outcome.tolist(), pa.string())}
    )
