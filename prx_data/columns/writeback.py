"""Row selection and the run report shared by the column jobs.

The jobs are resumable because each row gets a status (or a label) that is
written back with its value, by fragment (:mod:`prx_data.columns.runner`):
a rerun selects only rows whose status is still null, plus any statuses
named in ``redo`` (or only those, with ``include_missing=False``).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field

import pyarrow as pa

from prx_data.columns.checks import ERROR
from prx_data.core.reports import FailureCounts


def sql_string(value: str) -> str:
    return "'" + value.replace("'", "''") + "'"


def pending_filter(
    existing: Sequence[str],
    status_column: str,
    value_column: str | None = None,
    redo: Sequence[str] = (),
    require: Sequence[str] = (),
    include_missing: bool = True,
    *,
    redo_where: Sequence[str] = (),
    match: Sequence[str] = (),
) -> str | None:
    """Lance SQL selecting rows still to do, given the table's ``existing`` columns.

    The one builder of every column job's pending rows. A row is pending when
    its ``status_column`` is null or in ``redo`` (or meets one of the SQL
    conditions ``redo_where``, e.g. an error pattern), and (when given) its
    ``value_column`` is null, so values written by other means are never
    overwritten. ``require`` columns must be non-null, and every condition in
    ``match`` must hold. With ``include_missing=False`` only the rows to redo
    are selected (never-processed rows are left for a normal run).
    """
    from prx_data.table.lance_ops import quote

    if not include_missing and not redo and not redo_where:
        # the jobs pass include_missing=False only with --only's (checked, non-empty) values
        raise ValueError("include_missing=False needs statuses to redo")
    clauses = []
    if value_column and value_column != status_column and value_column in existing:
        clauses.append(f"{quote(value_column)} IS NULL")
    again = [f"{quote(status_column)} IN ({', '.join(sql_string(r) for r in redo)})"] * bool(redo)
    again += list(redo_where)
    if not include_missing:
        either = again[0] if len(again) == 1 else f"({' OR '.join(again)})"
        clauses.append(either if status_column in existing else "false")
    elif status_column in existing:
        clauses.append(
            f"({' OR '.join([f'{quote(status_column)} IS NULL', *again])})"
            if again
            else f"{quote(status_column)} IS NULL"
        )
    for col in require:
        clauses.append(f"{quote(col)} IS NOT NULL")
    clauses.extend(match)
    return " AND ".join(clauses) or None


@dataclass
class ColumnReport(FailureCounts):
    """What a column job did: rows, a count per status/label, reasons, speed."""

    table: str
    columns: list[str]
    #: Rows the job planned (pending at the pinned version, within the limit) and processed.
    pending: int = 0
    rows: int = 0
    counts: dict[str, int] = field(default_factory=dict)
    #: Why rows failed (error details, truncated), for the summary.
    reasons: dict[str, int] = field(default_factory=dict)
    seconds: float = 0.0
    written: int = 0
    #: Seconds until the first results arrived (actor start-up, model load).
    first_result_s: float = 0.0
    first_rows: int = 0
    #: The table version the job read (pinned), and the one it left.
    table_version: int = 0
    final_version: int = 0
    #: Fragments with pending rows, work units, fragments written and commits.
    fragments: int = 0
    units: int = 0
    fragments_written: int = 0
    commits: int = 0
    #: Bytes of the new data files (the output columns only).
    bytes_written: int = 0
    #: Fragments a killed run had finished, committed at start without recomputing.
    recovered_fragments: int = 0
    recovered_rows: int = 0
    #: Why the run did what it did when that is not plain (a no-op: the column it read, how
    #: many rows had a value, what to pass instead); printed under the counts.
    notes: list[str] = field(default_factory=list)

    counted = "rows"

    @property
    def job_label(self) -> str:
        return f"column job ({', '.join(self.columns)})"

    @property
    def failed(self) -> int:
        """Rows processed in this run whose status is 'error'."""
        return self.counts.get(ERROR, 0)

    @property
    def total(self) -> int:
        return self.rows

    def failure_details(self, report_json: str | None = None) -> str:
        return (
            "the reasons above"
            + (f" and in {report_json}" if report_json else "")
            + f"; rows with status '{ERROR}' in {', '.join(self.columns)} of {self.table}"
        )

    def text(self) -> str:
        return self.summary()

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
        ]
        if counts or not any(n.startswith("nothing to do") for n in self.notes):
            lines.append(f"  {counts or 'nothing to do'}")  # a note saying why is said once
        for reason, n in sorted(self.reasons.items(), key=lambda kv: -kv[1])[:10]:
            lines.append(f"  {n:,} x {reason}")
        lines.extend(f"  {note}" for note in self.notes)
        if self.recovered_fragments:
            lines.append(
                f"  {self.recovered_fragments:,} fragment(s) ({self.recovered_rows:,} rows) "
                "finished by an earlier run were committed without recomputing"
            )
        if self.fragments_written:
            lines.append(
                f"  read version {self.table_version}: {self.fragments_written:,} fragment(s) "
                f"written in {self.commits:,} commit(s), {self.bytes_written / 1e6:,.1f} MB"
            )
        return "\n".join(lines)

    def to_dict(self) -> dict:
        return {
            "table": self.table,
            "columns": self.columns,
            "pending": self.pending,
            "rows": self.rows,
            "counts": self.counts,
            "reasons": self.reasons,
            "seconds": round(self.seconds, 3),
            "rows_per_s": round(self.rows_per_s, 2),
            "steady_rows_per_s": round(self.steady_rows_per_s, 2),
            "first_result_s": round(self.first_result_s, 3),
            "written": self.written,
            "table_version": self.table_version,
            "final_version": self.final_version,
            "fragments": self.fragments,
            "units": self.units,
            "fragments_written": self.fragments_written,
            "commits": self.commits,
            "bytes_written": self.bytes_written,
            "recovered_fragments": self.recovered_fragments,
            "recovered_rows": self.recovered_rows,
        }


def count_into(counter: Counter, values: pa.Array | pa.ChunkedArray) -> None:
    """Add the value counts of an Arrow column to ``counter`` (nulls ignored)."""
    import pyarrow.compute as pc

    for item in pc.value_counts(values).to_pylist():
        if item["values"] is not None:
            counter[item["values"]] += item["counts"]
