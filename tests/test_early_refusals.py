"""Refusals come before the slow work: no Ray start, no table scan, for a wrong flag or path."""

from __future__ import annotations

import time

import prx_data.pipelines.write_mds as W
import pytest

from prx_data.cli import ingest as ingest_cli
from prx_data.cli import write_mds as write_mds_cli


@pytest.fixture
def no_work(monkeypatch):
    """Fail the test if the export places its work (the step that starts Ray) or opens the table."""

    def refuse(*a, **k):
        raise AssertionError("the export started work before refusing")

    monkeypatch.setattr(W, "placement", refuse)
    monkeypatch.setattr(W.ExportSink, "on_write_start", refuse)


@pytest.mark.parametrize(
    ("entry", "flags", "says"),
    [
        ("report.json", [], "holds a complete export; pass --overwrite"),
        ("notes.txt", [], "choose an empty directory"),
        ("notes.txt", ["--overwrite"], "not provably an export"),
        ("notes.txt", ["--resume"], "not provably an export"),
    ],
)
def test_a_refused_out_answers_before_ray_or_the_table(
    tmp_path, capsys, no_work, entry, flags, says
):
    out = tmp_path / "out"
    out.mkdir()
    (out / entry).write_text("{}")
    table = tmp_path / "t.lance"
    table.mkdir()  # not read: the output is checked first
    t0 = time.perf_counter()
    rc = write_mds_cli.main(["--table", str(table), "--out", str(out), *flags])
    assert rc == 2 and time.perf_counter() - t0 < 5
    err = capsys.readouterr().err
    assert says in err and len(err.strip().splitlines()) == 1
    assert sorted(p.name for p in out.iterdir()) == [entry]  # nothing touched


def test_a_tier_nothing_trains_on_is_refused_with_the_valid_ones(tmp_path, capsys, no_work):
    argv = [
        "--table",
        str(tmp_path / "t.lance"),
        "--out",
        str(tmp_path / "o"),
        "--tiers",
        "512,768",
    ]
    assert write_mds_cli.main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert "--tiers 768" in err and "valid tiers: 512,1024,2048,4096" in err
    assert not (tmp_path / "o").exists()


def test_a_missing_table_is_refused_before_ray(tmp_path, capsys, no_work):
    argv = ["--table", str(tmp_path / "photos.lance"), "--out", str(tmp_path / "o")]
    assert write_mds_cli.main(argv) == 2
    assert "photos.lance does not exist" in capsys.readouterr().err


def test_a_missing_source_says_it_does_not_exist(tmp_path, capsys):
    rc = ingest_cli.main([str(tmp_path / "photoss"), "--table", str(tmp_path / "t.lance")])
    err = capsys.readouterr().err.strip()
    assert rc == 2 and "does not exist" in err and "photoss" in err and "--format" not in err
