"""What the README and docs say about Ray, checked against the code.

A job "can start Ray" when it takes the run options that place work (``--engine``,
``--ray-address``, ``--num-cpus``): its ``--help`` prose and its row of the README's
job table must say so. Which pipelines touch Ray outside the one runner
(:func:`prx_data.core.runtime.map_units`) is read from their source and must be
what docs/ARCHITECTURE.md names; no doc may claim that no job starts Ray.
"""

from __future__ import annotations

import argparse
import ast
import re
from pathlib import Path

from prx_data.cli import JOBS

REPO = Path(__file__).resolve().parent.parent
PLACING = {"--engine", "--ray-address", "--num-cpus"}
#: What starts Ray or uses it directly, outside ``core.runtime`` (which every job reaches
#: through ``map_units``): importing ray, ``ensure_ray``, ``placement_cpus``.
RAY_NAMES = {"ensure_ray", "placement_cpus"}


def _options(p: argparse.ArgumentParser) -> set[str]:
    found: set[str] = set()
    for a in p._actions:
        found.update(a.option_strings)
        if isinstance(a, argparse._SubParsersAction):
            for sub in a.choices.values():
                found |= _options(sub)
    return found


def _prose(p: argparse.ArgumentParser) -> str:
    """The parser's description and epilog (not its flags' help), subcommands' included."""
    text = f"{p.description or ''}\n{p.epilog or ''}"
    for a in p._actions:
        if isinstance(a, argparse._SubParsersAction):
            text += "".join(_prose(sub) for sub in a.choices.values())
    return text


def _can_start_ray() -> dict[str, bool]:
    return {name: bool(_options(job.load().build_parser()) & PLACING) for name, job in JOBS.items()}


def _readme_rows() -> dict[str, str]:
    text = (REPO / "README.md").read_text(encoding="utf-8")
    start = text.index("| command | what it is for | offline on CPU")
    rows = {}
    for line in text[start:].splitlines()[2:]:
        if not line.startswith("|"):
            break
        first, what = [c.strip() for c in line.strip("|").split("|")][:2]
        rows[re.fullmatch(r"`python -m prx_data\.(\w+)`", first).group(1)] = what
    return rows


def test_every_job_that_can_start_ray_says_so_in_its_help_and_the_readme():
    can = _can_start_ray()
    assert can["write_mds"] and can["latents"] and can["download"] and not can["verify"]
    rows = _readme_rows()
    for name, starts in can.items():
        if not starts:
            continue
        assert re.search(r"\bRay\b", _prose(JOBS[name].load().build_parser())), (
            f"python -m prx_data.{name} --help does not say it can start Ray"
        )
        assert name in rows, f"{name} has no row in the README's job table"
        assert "Ray" in rows[name], f"the README's row for {name} does not say it can start Ray"
    for name, what in rows.items():  # and no row claims Ray for a job that cannot start it
        assert "Ray" not in what or can.get(name), f"the README's row for {name} mentions Ray"


def _touches_ray(path: Path) -> bool:
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import) and any(a.name.split(".")[0] == "ray" for a in node.names):
            return True
        if isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == "ray":
            return True
        if isinstance(node, ast.Name) and node.id in RAY_NAMES:
            return True
        if isinstance(node, ast.alias) and node.name in RAY_NAMES:
            return True
    return False


def test_the_pipelines_that_use_ray_outside_the_runner_are_the_ones_the_architecture_names():
    runtime = REPO / "prx_data" / "core" / "runtime.py"
    library = [p for p in (REPO / "prx_data").rglob("*.py") if p != runtime]
    outside = {p for p in library if _touches_ray(p)}
    assert not outside, f"Ray used outside pipelines/ and core.runtime: {sorted(outside)}"
    found = {p.stem for p in (REPO / "pipelines").glob("*.py") if _touches_ray(p)}
    assert {"write_mds", "download", "latents"} <= found
    text = (REPO / "docs" / "ARCHITECTURE.md").read_text(encoding="utf-8")
    sentence = re.search(r"Ray outside the runner[^.]*\.", text)
    assert sentence, "docs/ARCHITECTURE.md no longer names the jobs that use Ray directly"
    words = re.findall(r"`(\w+)`", sentence.group(0))
    named = {w for w in words if (REPO / "pipelines" / f"{w}.py").exists()}
    assert named == found, f"ARCHITECTURE.md names {sorted(named)}; the code: {sorted(found)}"


def test_no_doc_claims_that_no_job_starts_ray():
    docs = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
    false = re.compile(r"\b(no job|none|no stage) (ever )?(starts|start) Ray\b", re.I)
    for path in docs:
        text = " ".join(path.read_text(encoding="utf-8").split())
        m = false.search(text)
        assert not m, f"{path.name}: {text[max(0, m.start() - 80) : m.end() + 40]!r}"
