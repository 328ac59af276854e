"""Every job has a --help that documents every option."""

from __future__ import annotations

import argparse
import importlib
import subprocess
import sys

import pytest

from prx_data.cli import JOBS


@pytest.mark.parametrize("job", sorted(JOBS))
def test_help_runs_and_documents_every_option(job, monkeypatch):
    r = subprocess.run(
        [sys.executable, "-m", f"prx_data.{job}", "--help"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert r.returncode == 0, r.stderr[-2000:]
    assert "usage:" in r.stdout

    # Every option of every (sub)parser carries a help text.
    captured: list[argparse.ArgumentParser] = []
    original = argparse.ArgumentParser.parse_args

    def spy(self, args=None, namespace=None):
        captured.append(self)
        raise SystemExit(0)

    monkeypatch.setattr(argparse.ArgumentParser, "parse_args", spy)
    module = importlib.import_module(f"prx_data.cli.{job}")
    with pytest.raises(SystemExit):
        module.main(["--help"])
    monkeypatch.setattr(argparse.ArgumentParser, "parse_args", original)
    assert captured, f"prx_data.{job}.main does not use argparse"
    undocumented = []
    stack = list(captured)
    while stack:
        parser = stack.pop()
        for action in parser._actions:
            if isinstance(action, argparse._SubParsersAction):
                stack.extend(action.choices.values())
                continue
            if isinstance(action, argparse._HelpAction):
                continue
            if not (action.help and action.help.strip()):
                undocumented.append(
                    f"{parser.prog}: {'/'.join(action.option_strings) or action.dest}"
                )
    assert not undocumented, f"options without help: {undocumented}"


def test_dispatcher_lists_jobs(capsys):
    from prx_data.cli import main

    assert main([]) == 0
    out = capsys.readouterr().out
    assert all(job in out for job in JOBS)
    assert main(["no-such-job"]) == 2


def test_readme_lists_every_job_with_its_purpose():
    from pathlib import Path

    readme = (Path(__file__).resolve().parents[1] / "README.md").read_text(encoding="utf-8")
    rows = {
        line.split("`")[1]: line.split("|")[2].strip()
        for line in readme.splitlines()
        if line.startswith("| `python -m prx_data.")
    }
    assert set(rows) == {f"python -m prx_data.{job}" for job in JOBS}
    assert all(rows.values())  # each with its one line
