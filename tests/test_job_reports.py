"""Every job's report carries its own failure policy; every CLI ends through one finish step."""

from __future__ import annotations

import dataclasses
import json

import pytest

from prx_data.cli.reporting import finish
from prx_data.core.errors import ErrorRateExceeded
from prx_data.core.runtime import RunOptions


def _export_report(**dropped: int):
    from prx_data.export.merge import ExportReport

    return ExportReport(
        table="t.lance",
        out="exp/",
        table_version=3,
        rows_read=10,
        samples_written=10 - sum(dropped.values()),
        buckets={},
        tiers={},
        dropped=dropped,
        notes={},
        units=1,
        seconds=1.0,
    )


def test_export_report_counts_only_broken_images_as_failed():
    report = _export_report(filtered=5, too_small=2, empty_file=1, decode_error=2)
    assert (report.failed, report.total) == (3, 10)  # choices (filter, size) are not failures
    assert report.status(0.3) == 0 and report.status(0.2) == 1
    with pytest.raises(ErrorRateExceeded, match=r"dropped counts by reason in exp/report\.json"):
        report.check(0.2)
    assert report.text() == report.table_text()


def test_dedup_ingest_column_and_score_reports_say_what_failed():
    from prx_data.pipelines.dedup import DedupReport
    from prx_data.pipelines.ingest import IngestReport
    from prx_data.pipelines.score import ScoreReport

    from prx_data.columns.writeback import ColumnReport

    dedup = DedupReport(
        table="t", table_version=1, radius=0, rows=4, hashed=1,
        unhashed={"not_hashed": 2, "decode_error": 1}, clusters=0, rows_in_clusters=0,
        removed=0, largest_cluster=0, clusters_spanning_tiers=0, grouped_by="table",
    )  # fmt: skip
    assert (dedup.failed, dedup.total) == (1, 4)  # never tried (--no-compute) is no failure
    ingest = IngestReport("t", "append", ["s"], units=4, failures=[{"unit": 0}] * 3)
    assert (ingest.failed, ingest.total, ingest.status(0.5)) == (3, 4, 1)
    col = ColumnReport("t", ["caption_vlm"], rows=10, counts={"ok": 9, "error": 1})
    assert (col.failed, col.total, col.status(0.05), col.status(0.2)) == (1, 10, 1, 0)
    assert "caption_vlm" in col.failure(0.05, "r.json") and "r.json" in col.failure(0.05, "r.json")
    run = ColumnReport("t", ["clip_error"], rows=5, reasons={"decode_error": 5})
    score = ScoreReport("t", "clip", ["clip_error"], run)
    assert (score.rows, score.seconds, score.failures) == (5, 0.0, {"decode_error": 5})
    # Unreadable images are drops, not model failures: --max-error-rate does not count them.
    d = score.to_dict()
    assert (d["rows"], d["failed"], d["unreadable"], d["scored"]) == (5, 0, 5, 0)
    assert score.status(0.0) == 0
    run = ColumnReport("t", ["clip_error"], rows=5, reasons={"model_error: oom": 2, "empty": 1})
    score = ScoreReport("t", "clip", ["clip_error"], run)
    assert (score.failed, score.unreadable, score.scored) == (2, 1, 2)
    assert score.failure(0.2).startswith("score clip: 2 of 5 rows failed")
    assert score.status(None) == 0  # no limit given: never fails


def test_finish_prints_writes_json_and_returns_the_reports_status(tmp_path, capsys):
    report = _export_report(decode_error=5)
    path = tmp_path / "r.json"
    assert finish(report, report_json=str(path), max_error_rate=0.2, footer="done") == 1
    out, err = capsys.readouterr()
    assert out.startswith(report.text()) and out.rstrip().endswith("done")
    assert err.count("\n") == 1 and err.startswith("error: write_mds: 5 of 10 rows failed")
    assert json.loads(path.read_text())["dropped"] == {"decode_error": 5}
    assert finish(report, max_error_rate=0.6) == 0


def test_quality_job_has_the_shape_of_every_job(tmp_path):
    from prx_data.pipelines.quality import QualityConfig, QualityReport, run_quality

    from tests.tablekit import make_table

    with pytest.raises(dataclasses.FrozenInstanceError):
        QualityConfig("t").table = "u"  # type: ignore[misc]
    with pytest.raises(ValueError, match="engine"):
        QualityConfig(
            "t",
            run=RunOptions(engine="spark"),
        )
    uri = str(tmp_path / "t.lance")
    make_table(uri, [("a/0", b"not an image", "x"), ("a/1", b"", "y")])
    report = run_quality(
        QualityConfig(
            uri,
            run=RunOptions(progress=False),
        )
    )
    assert isinstance(report, QualityReport)
    assert (report.written, report.failed, report.total) == (0, 2, 2)
    assert report.status(0.5) == 1 and "2 unreadable" in report.text()
    assert json.loads(json.dumps(report.to_dict()))["unreadable"] == 2
