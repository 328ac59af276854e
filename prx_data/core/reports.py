"""A job report's failure policy, so every CLI's exit status is read off the report.

What counts as a failure (a broken image, yes; a row filtered on purpose, no)
belongs to the job, not to its command line: a notebook calling ``run_x`` and
``prx-data x`` then judge a run the same way. A report mixes in
:class:`FailureCounts` and says ``failed``, ``total`` and where to look.
"""

from __future__ import annotations

import dataclasses

from prx_data.core.errors import ErrorRateExceeded, check_error_rate

__all__ = [
    "FailureCounts",
    "JobReport",
]


class FailureCounts:
    """Mixin for a job report: ``failed`` of ``total`` items, checked against ``--max-error-rate``.

    Subclasses override :attr:`failed`, :attr:`total` and, for the error line,
    :attr:`job_label`, :attr:`counted` and :meth:`failure_details`.
    """

    #: What :attr:`total` counts, for the error line ("rows", "work units").
    counted: str = "items"

    @property
    def job_label(self) -> str:
        return type(self).__name__.removesuffix("Report").lower() or "job"

    @property
    def failed(self) -> int:
        return 0

    @property
    def total(self) -> int:
        return 0

    @property
    def error_rate(self) -> float:
        return self.failed / self.total if self.total else 0.0

    def failure_details(self, report_json: str | None = None) -> str:
        """Where a user finds the failed items (``report_json``: where the report was written)."""
        return "the report above" + (f" and in {report_json}" if report_json else "")

    def check(self, max_error_rate: float, report_json: str | None = None) -> None:
        """Raise :class:`ErrorRateExceeded` when more than ``max_error_rate`` of the items failed."""
        check_error_rate(
            self.job_label,
            self.failed,
            self.total,
            max_error_rate,
            self.failure_details(report_json),
            self.counted,
        )

    def failure(self, max_error_rate: float | None, report_json: str | None = None) -> str | None:
        """The error line when the run failed by the rate (None: within it, or no limit)."""
        if max_error_rate is None:
            return None
        try:
            self.check(max_error_rate, report_json)
        except ErrorRateExceeded as err:
            return str(err)
        return None

    def status(self, max_error_rate: float | None, report_json: str | None = None) -> int:
        """The exit status the run earns: 0, or 1 past ``max_error_rate``."""
        return 0 if self.failure(max_error_rate, report_json) is None else 1


class JobReport(FailureCounts):
    """Base of a job's report (a dataclass): the failure policy of :class:`FailureCounts`,
    :meth:`to_dict` from the fields (nested reports included) plus ``failed``, ``total``
    and ``error_rate``, and a default :meth:`text`.

    A job that runs the column runner holds its :class:`ColumnReport` as a field
    rather than copying its counts.
    """

    def to_dict(self) -> dict:
        out = {}
        for f in dataclasses.fields(self):  # type: ignore[arg-type]
            value = getattr(self, f.name)
            if isinstance(value, float):
                value = round(value, 3)
            elif hasattr(value, "to_dict"):
                value = value.to_dict()
            elif dataclasses.is_dataclass(value):
                value = dataclasses.asdict(value)
            out[f.name] = value
        out.update(failed=self.failed, total=self.total, error_rate=round(self.error_rate, 6))
        return out

    def text(self) -> str:
        return (
            f"{self.job_label}: {self.total:,} {self.counted}, {self.failed:,} failed "
            f"({self.error_rate:.1%})"
        )
