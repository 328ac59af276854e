"""The README's job table is the one copy of its offline commands.

scripts/try_offline.sh runs what scripts/readme_jobs.py reads from the table,
so the two cannot drift apart; these checks keep the table readable by it
(every job has a full command, no command the script would skip), keep the
script free of a copy of its own, keep the demo's "next" hints rows of the
table, and (marked slow) run the script as written after a fresh demo.
"""

from __future__ import annotations

import importlib.util
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent


def _readme_jobs():
    spec = importlib.util.spec_from_file_location("readme_jobs", REPO / "scripts/readme_jobs.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_every_job_of_the_table_has_full_commands_the_script_will_run():
    jobs = _readme_jobs()
    rows = jobs.table_rows()
    assert len(rows) >= 20
    for first, _, offline in rows:
        job = re.fullmatch(r"`python -m (prx_data\.\w+)`", first)
        assert job, first
        cmds = jobs.commands(f"{jobs.TABLE_HEADER} |\n|---|\n|{first}|x|{offline}|\n")
        own = [c for c in cmds if re.match(rf"(python -m|composer -n \d+ -m) {job[1]}\b", c)]
        assert own, f"{job[1]}: no full command in the third column"
    commands = jobs.commands()
    assert len(commands) == len(set(commands)), "a command twice: the second run differs"
    assert any(c.startswith("composer -n 2 -m prx_data.train") for c in commands)
    # Training twice under one run name only says "already finished" the second time.
    names = [c for c in commands if "prx_data.train configs/train/smoke_cpu.yaml" in c]
    assert len(names) == 2 and "variables.run_name=" in names[1]


def test_the_script_reads_the_table_and_holds_no_copy_of_it():
    script = (REPO / "scripts" / "try_offline.sh").read_text(encoding="utf-8")
    assert "readme_jobs.py" in script
    code = [ln for ln in script.splitlines() if not ln.lstrip().startswith("#")]
    assert not any("python -m prx_data." in ln for ln in code)


def test_the_demo_suggests_rows_of_the_table():
    from prx_data.cli.demo import next_steps

    commands = _readme_jobs().commands()
    for step in next_steps("demo_out", "demo_out/table.lance", "demo_out/export"):
        assert step in commands, step


@pytest.mark.slow
def test_the_table_runs_as_written_after_a_fresh_demo(tmp_path):
    """Every command of the table, as written, exits 0 (minutes: the demo, the jobs, training)."""
    os.symlink(REPO / "configs", tmp_path / "configs")
    env = {
        **os.environ,
        "TRY_DIR": str(tmp_path),
        "VIRTUAL_ENV": sys.prefix,
        "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}",
        "PYTHONPATH": str(REPO),
    }
    demo = subprocess.run(
        [sys.executable, "-m", "prx_data.demo"], cwd=tmp_path, env=env, capture_output=True
    )
    assert demo.returncode == 0, demo.stderr[-2000:]
    res = subprocess.run(
        ["bash", str(REPO / "scripts" / "try_offline.sh")],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=3600,
    )
    assert res.returncode == 0, res.stdout[-4000:]
    shutil.rmtree(tmp_path / "runs", ignore_errors=True)
