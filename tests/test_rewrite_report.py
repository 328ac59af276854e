"""``skips rewrite`` reports like the export, leaves no empty bucket and keeps streaming quiet."""

from __future__ import annotations

import json
import logging
import os

import pytest

from prx_data.cli.skips import main
from prx_data.export import layout
from prx_data.skips import rewrite as R
from tests.exportkit import make_export, skip_samples

B1, B2 = "512/1.000", "512/0.500"


@pytest.fixture()
def export(tmp_path):
    ex = make_export(str(tmp_path / "ex"), {B1: 8, B2: 4}, samples_per_part=4)
    # Every sample of B2 and the whole first part of B1 are skipped.
    skip_samples(ex.root, "dedup", ids=[f"ds/{B2}/{i}" for i in range(4)])
    skip_samples(ex.root, "nsfw", ids=[f"ds/{B1}/{i}" for i in range(4)] + [f"ds/{B1}/5"])
    return ex


def test_fully_skipped_bucket_and_part_are_left_out(export, tmp_path):
    out = str(tmp_path / "out")
    r = R.rewrite_export(export.root, out, force=True)
    assert layout.list_buckets(out) == [B1]
    assert not os.path.exists(os.path.join(out, B2))
    assert r.buckets_dropped == [B2] and r.buckets == 1
    index = json.load(open(os.path.join(out, B1, "index.json")))
    assert index["shards"] and all(s["samples"] for s in index["shards"])
    assert sorted(os.listdir(os.path.join(out, B1))) == ["f000000-000000004", "index.json"]
    from streaming import LocalDataset  # streaming's own reader accepts every bucket written

    assert [LocalDataset(os.path.join(out, b))[0]["id"] for b in layout.list_buckets(out)] == [
        f"ds/{B1}/4"
    ]


def test_report_json_like_the_export(export, tmp_path, capsys):
    out = str(tmp_path / "out")
    assert main(["rewrite", export.root, out, "--force"]) == 0
    printed = capsys.readouterr().out
    assert "left out (every sample skipped): 512/0.500" in printed
    assert f"{out}/report.json" in printed
    rep = json.load(open(os.path.join(out, "report.json")))
    assert rep["samples_in"] == 12 and rep["samples_out"] == 3 and rep["skipped"] == 9
    assert rep["bucket_samples"] == {B1: 3}
    assert rep["buckets_dropped"] == [B2]
    assert rep["lists"] == ["dedup", "nsfw"] and rep["source"] == export.root
    assert "dropped" in open(os.path.join(out, "report.txt")).read()
    assert layout.is_complete(out)


def test_streaming_log_warnings_stay_off_the_terminal(export, tmp_path, monkeypatch, capfd):
    """Streaming warns per writer in some set-ups; a rewrite opens one writer per part.

    A test double stands in for that warning: MDSWriter's constructor is wrapped to log
    one on streaming's own logger, as streaming's writer does.
    """
    from prx_data.core.streaming_compat import mds_writer

    writer = mds_writer()  # what the pack writer builds on
    real = writer.__init__
    log = logging.getLogger("streaming.base.format.base.writer")

    def loud_init(self, *a, **kw):  # test double: the real writer plus one streaming log line
        log.warning("Directory %s exists and is not empty", kw.get("out"))
        real(self, *a, **kw)

    monkeypatch.setattr(writer, "__init__", loud_init)
    # Other tests may have quietened streaming's loggers; this one needs the record created.
    monkeypatch.setattr(log, "level", log.level)  # restored on undo
    log.setLevel(logging.WARNING)  # setLevel also clears the logging cache
    monkeypatch.setattr(logging.root.manager, "disable", 0)
    logging.basicConfig()  # a root handler that would print streaming's records to stderr
    out = str(tmp_path / "out")
    r = R.rewrite_export(export.root, out, force=True)
    err = capfd.readouterr().err
    assert "exists and is not empty" not in err
    assert sum(r.warnings.values()) == 1  # one part written; the fully skipped ones open none
    rep = json.load(open(os.path.join(out, "report.json")))
    assert sum(rep["warnings"].values()) == 1
    assert logging.getLogger("streaming").propagate  # restored after the run
