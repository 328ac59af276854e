"""The offline commands of the README's job table, in order: one source for the
table and for scripts/try_offline.sh.

The script runs what this prints, so the README's third column is the only
place those commands are written; tests/test_readme_jobs.py checks the table's
shape and (marked slow) runs the script. A command is every code span of the
third column that starts with ``python -m `` or ``composer ``; one that ends
with `` &`` is a server the later commands use (the script starts it in the
background). Everything else in that column is prose.

    python scripts/readme_jobs.py          # one command per line
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

README = Path(__file__).resolve().parent.parent / "README.md"
TABLE_HEADER = "| command | what it is for | offline on CPU"
_COMMAND = re.compile(r"`((?:python -m |composer )[^`]+)`")


def _cells(line: str) -> list[str]:
    """A table row's cells; ``\\|`` inside a cell is a literal bar, not a border."""
    cells = re.split(r"(?<!\\)\|", line.strip().strip("|"))
    return [c.strip().replace("\\|", "|") for c in cells]


def table_rows(text: str | None = None) -> list[list[str]]:
    """The job table's rows below its header, each as its three cells."""
    text = README.read_text(encoding="utf-8") if text is None else text
    start = text.index(TABLE_HEADER)
    rows = []
    for line in text[start:].splitlines()[2:]:
        if not line.startswith("|"):
            break
        rows.append(_cells(line))
    return rows


def commands(text: str | None = None) -> list[str]:
    """Every command of the third column, in table order."""
    return [c for row in table_rows(text) for c in _COMMAND.findall(row[2])]


if __name__ == "__main__":
    sys.stdout.write("".join(f"{c}\n" for c in commands()))
