"""The README's job table and scripts/try_offline.sh stay in step.

The script runs the table's offline commands in order after the demo; this
check fails when a job or a command is added to the table and not to the
script, so "every command in the README runs offline" stays checkable.
"""

from __future__ import annotations

import re
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def _table_rows() -> list[list[str]]:
    text = (REPO / "README.md").read_text(encoding="utf-8")
    start = text.index("| command | what it is for | offline on CPU")
    rows = []
    for line in text[start:].splitlines()[2:]:
        if not line.startswith("|"):
            break
        rows.append([c.strip() for c in line.strip("|").split("|")])
    return rows


def _script_commands() -> list[str]:
    script = (REPO / "scripts" / "try_offline.sh").read_text(encoding="utf-8")
    return [m.group(1) for m in re.finditer(r"^step (.+)$", script, re.M)]


def test_every_job_and_offline_command_of_the_table_is_tried_by_the_script():
    rows = _table_rows()
    steps = _script_commands()
    assert len(rows) >= 20 and steps
    for first, _, offline in rows:
        job = re.fullmatch(r"`(python -m prx_data\.\w+)`", first)
        assert job, first
        assert any(s.startswith(job.group(1)) for s in steps), f"{job.group(1)} is not tried"
        for cmd in re.findall(r"`(python -m prx_data\.[^`]+)`", offline):
            assert any(s.startswith(cmd) for s in steps), f"README command not tried: {cmd}"
    assert any(s.startswith("composer -n 2 -m prx_data.train") for s in steps)
