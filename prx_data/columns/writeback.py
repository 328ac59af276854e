"""Row selection, batched write-back and the run report shared by the column jobs.

The jobs are resumable because each row gets a status (or a label) that is
written back in batches: a rerun selects only rows whose status is still
null, plus any statuses named in ``redo``. Within a batch the value columns
are written before the status column, so a crash between the two writes
leaves the row selected for the next run rather than half-done.
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field

import pyarrow as pa

from prx_data.core import schema as S


def sql_string(value: str) -> str:
    return "'" + value.replace("'", "''") + "'"


def pending_filter(
    existing: Sequence[str],
    status_column: str,
    value_column: str | None = None,
    redo: Sequence[str] = (),
    require: Sequence[str] = (),
) -> str | None:
    """Lance SQL selecting rows still to do, given the table's ``existing`` columns.

    A row is pending when its ``status_column`` is null or in ``redo``, and
    (when given) its ``value_column`` is null, so values written by other
    means are never overwritten. ``require`` columns must be non-null.
    """
    from prx_data.table.lance_ops import quote

    clauses = []
    if value_column and value_column != status_column and value_column in existing:
        clauses.append(f"{quote(value_column)} IS NULL")
    if status_column in existing:
        st = f"{quote(status_column)} IS NULL"
        if redo:
            st = f"({st} OR {quote(status_column)} IN ({', '.join(sql_string(r) for r in redo)}))"
        clauses.append(st)
    for col in require:
        clauses.append(f"{quote(col)} IS NOT NULL")
    return " AND ".join(clauses) or None


@dataclass
class ColumnReport:
    """What a column job did: rows, a count per status/label, reasons, speed."""

    table: str
    columns: list[str]
    rows: int = 0
    counts: dict[str, int] = field(default_factory=dict)
    #: Why rows failed (error details, truncated), for the summary.
    reasons: dict[str, int] = field(default_factory=dict)
    seconds: float = 0.0
    written: int = 0
    #: Seconds until the first results arrived (actor start-up, model load).
    first_result_s: float = 0.0
    first_rows: int = 0

    @property
    def rows_per_s(self) -> float:
        return self.rows / self.seconds if self.seconds > 0 else 0.0

    @property
    def steady_rows_per_s(self) -> float:
        """Throughput after the first results: what a long run converges to."""
        dt = self.seconds - self.first_result_s
        return (self.rows - self.first_rows) / dt if dt > 0 and self.rows > self.first_rows else 0.0

    def summary(self) -> str:
        counts = ", ".join(
            f"{k} {v:,}" for k, v in sorted(self.counts.items(), key=lambda kv: -kv[1])
        )
        lines = [
            f"{self.rows:,} rows in {self.seconds:.1f} s ({self.rows_per_s:,.1f} rows/s; "
            f"{self.steady_rows_per_s:,.1f} rows/s after {self.first_result_s:.1f} s start-up) "
            f"-> {', '.join(self.columns)} of {self.table}",
            f"  {counts or 'nothing to do'}",
        ]
        for reason, n in sorted(self.reasons.items(), key=lambda kv: -kv[1])[:10]:
            lines.append(f"  {n:,} x {reason}")
        return "\n".join(lines)

    def to_dict(self) -> dict:
        return {
            "table": self.table,
            "columns": self.columns,
            "rows": self.rows,
            "counts": self.counts,
            "reasons": self.reasons,
            "seconds": round(self.seconds, 3),
            "rows_per_s": round(self.rows_per_s, 2),
            "steady_rows_per_s": round(self.steady_rows_per_s, 2),
            "first_result_s": round(self.first_result_s, 3),
        }


class ColumnWriter:
    """Buffers result batches and writes them back with ``table.update_column``.

    ``columns`` are written in order (put the status column last). Each
    flush rewrites only those columns' data files; larger flushes amortise
    the per-commit cost (``update_column`` scans the key column once).
    """

    def __init__(
        self,
        uri: str,
        columns: Sequence[str],
        *,
        key: str = S.ID,
        flush_rows: int = 2000,
        flush_seconds: float = 120.0,
        storage_options: dict | None = None,
    ):
        self.uri = uri
        self.columns = list(columns)
        self.key = key
        self.flush_rows = flush_rows
        self.flush_seconds = flush_seconds
        self.storage_options = storage_options
        self._pending: list[pa.Table] = []
        self._n = 0
        self._last = time.monotonic()
        self.written = 0

    def add(self, batch: pa.Table) -> None:
        if batch.num_rows == 0:
            return
        self._pending.append(batch.select([self.key, *self.columns]))
        self._n += batch.num_rows
        if self._n >= self.flush_rows or time.monotonic() - self._last >= self.flush_seconds:
            self.flush()

    def flush(self) -> None:
        from prx_data.table.lance_ops import update_column

        self._last = time.monotonic()
        if not self._pending:
            return
        values = pa.concat_tables(self._pending)
        self._pending, self._n = [], 0
        for col in self.columns:
            update_column(
                self.uri,
                col,
                values.select([self.key, col]),
                key=self.key,
                storage_options=self.storage_options,
            )
        self.written += values.num_rows


def count_into(counter: Counter, values: pa.Array | pa.ChunkedArray) -> None:
    """Add the value counts of an Arrow column to ``counter`` (nulls ignored)."""
    import pyarrow.compute as pc

    for item in pc.value_counts(values).to_pylist():
        if item["values"] is not None:
            counter[item["values"]] += item["counts"]
