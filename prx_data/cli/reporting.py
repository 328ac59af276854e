"""Output steps the report-printing jobs share: one-line errors and the ``--report-json`` file."""

from __future__ import annotations

import json
import sys
from typing import Any


def print_error(e: BaseException) -> None:
    """Print ``error: <first line>`` to stderr (the exception's type when it has no message)."""
    print(f"error: {str(e).splitlines()[0] if str(e) else type(e).__name__}", file=sys.stderr)


def emit_report(report: Any, json_path: str | None) -> None:
    """Print ``report.text()``; with ``json_path``, also write ``report.to_dict()`` there."""
    print(report.text())
    if json_path:
        with open(json_path, "w", encoding="utf-8") as f:
            json.dump(report.to_dict(), f, indent=2)
