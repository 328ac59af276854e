"""Every job has a --help that documents every option."""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import subprocess
import sys

import pytest

from prx_data.cli import JOBS
from prx_data.core.runtime import RunOptions


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


def _option_strings(parser: argparse.ArgumentParser) -> list[str]:
    return [
        s
        for a in parser._actions
        if a.help != argparse.SUPPRESS and not isinstance(a, argparse._HelpAction)
        for s in a.option_strings
    ]


@pytest.mark.parametrize("job", sorted(JOBS))
def test_every_job_has_one_shape_and_both_spellings(job, capsys):
    """``prx-data JOB --help`` lists the options of ``build_parser()``; the shim is the table's."""
    module = importlib.import_module(f"prx_data.cli.{job}")
    assert callable(getattr(module, "build_parser", None)), f"prx_data.cli.{job}: no build_parser"
    parser = module.build_parser()
    assert isinstance(parser, argparse.ArgumentParser)
    from prx_data.cli import main

    with pytest.raises(SystemExit) as e:
        main([job, "--help"])
    assert e.value.code == 0
    out = capsys.readouterr().out
    missing = [s for s in _option_strings(parser) if s not in out]
    assert not missing, f"prx-data {job} --help does not mention {missing}"
    # ``python -m prx_data.<job>`` is a shim over this same entry of the table.
    shim = importlib.import_module(f"prx_data.{job}")
    if hasattr(shim, "main"):
        assert shim.main is module.main
    else:  # a stage package: its __main__ shim runs the job
        assert importlib.util.find_spec(f"prx_data.{job}.__main__") is not None


def test_dispatcher_help_lists_every_job_with_its_summary(capsys):
    from prx_data.cli import main

    assert main(["--help"]) == 0
    out = capsys.readouterr().out
    for job in JOBS.values():
        assert any(
            line.split()[:1] == [job.name] and job.summary in line for line in out.splitlines()
        ), job.name


def test_cli_package_holds_only_jobs_and_helpers():
    """A module of ``prx_data/cli`` is a job of the table, or a helper that says so by name."""
    from pathlib import Path

    import prx_data.cli

    names = {p.stem for p in Path(prx_data.cli.__file__).parent.glob("*.py")}
    helpers = {"__init__", "reporting"} | {n for n in names if n.startswith("_")}
    assert names - helpers == set(JOBS)


def test_every_documented_python_m_spelling_is_a_job():
    import re
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    docs = [root / "README.md", *sorted((root / "docs").glob("*.md"))]
    found = {
        m.group(1)
        for doc in docs
        for m in re.finditer(r"python -m prx_data\.([A-Za-z_][A-Za-z0-9_.]*)", doc.read_text())
    }
    assert found, "no `python -m prx_data.<job>` in the docs: the pattern is stale"
    unknown = sorted(name for name in found if name.rstrip(".") not in JOBS)
    assert not unknown, f"documented spellings with no job in prx_data.cli.JOBS: {unknown}"


def test_a_user_error_a_job_did_not_catch_is_one_line_not_a_traceback(tmp_path, capsys):
    """The job table's net: a PrxDataError is `error: ...` and exit 2 (usage) or 1."""
    from prx_data.cli import JOBS

    missing = str(tmp_path / "nope.txt")
    rc = JOBS["optout"].main(["--export", str(tmp_path), "--name", "x", "--ids", missing])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2
    assert err == [
        f"error: {missing}: no such id file; give a text file of row ids (one per "
        "line) or a parquet file with an id column"
    ]


def test_demo_writes_the_id_file_its_optout_command_names(tmp_path):
    """Ids the demo's export holds, not rows it dropped (too narrow, unreadable)."""
    from prx_data.pipelines.write_mds import run_export

    from prx_data.cli.demo import _write_optout_ids
    from prx_data.export.spec import ExportConfig
    from prx_data.skips.optout import read_id_file
    from tests.ingest_data import jpeg
    from tests.tablekit import make_table

    table, out = str(tmp_path / "t.lance"), str(tmp_path / "export")
    items = [(f"demo/img_{i:04d}", jpeg(640, 480), "c") for i in (3, 1, 2)]
    dropped = [("demo/a_banner", jpeg(2400, 300), "c"), ("demo/a_broken", b"x", "c")]
    make_table(table, [*dropped, *items])
    run_export(ExportConfig(table=table, out=out, tiers=(512,)), RunOptions(progress=False))
    path = _write_optout_ids(str(tmp_path), out)
    assert read_id_file(path) == ["demo/img_0001", "demo/img_0002"]
