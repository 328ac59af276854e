"""Versions in use are pinned: `table compact --cleanup` keeps what paused and running jobs read."""

from __future__ import annotations

import io
import json
import os
import subprocess
import sys
import textwrap

import lance
import pytest
from PIL import Image
from prx_data.pipelines.write_mds import run_export

from prx_data.cli import table as table_cli
from prx_data.columns import runner as R
from prx_data.core.runtime import RunOptions
from prx_data.export.layout import content_digest, is_complete
from prx_data.export.prepare import plan_units, prepare_output
from prx_data.export.spec import ExportConfig
from prx_data.export.unit import export_unit
from prx_data.table import pins
from tests import test_column_runner as C
from tests.tablekit import make_table

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _jpeg(i: int) -> bytes:
    buf = io.BytesIO()
    Image.new("RGB", (512 + 16 * (i % 3), 512), (30 * i % 256, 90, 160)).save(buf, "JPEG")
    return buf.getvalue()


def _photos(uri: str) -> str:
    """Eight small photos in four fragments (so a compaction makes a new version)."""
    make_table(uri, [(f"p/{i}", _jpeg(i), f"photo {i}") for i in range(8)], max_rows_per_file=2)
    return uri


def _cfg(table: str, out: str) -> ExportConfig:
    return ExportConfig(table=table, out=out, tiers=(512,), rows_per_task=2, min_units=1)


def _tags(uri: str) -> dict[str, int]:
    return {name: t["version"] for name, t in lance.dataset(uri).tags.list().items()}


def _compact_cleanup(uri: str, capsys, *extra: str) -> tuple[dict, str]:
    assert table_cli.main(["compact", uri, "--cleanup", *extra]) == 0
    captured = capsys.readouterr()
    return json.loads(captured.out), captured.err


@pytest.mark.ray
def test_paused_export_survives_compact_cleanup_and_resumes(tmp_path, ray_local, capsys):
    table = _photos(str(tmp_path / "t.lance"))
    ref = str(tmp_path / "ref")
    run_export(_cfg(table, ref), RunOptions(progress=False))
    assert _tags(table) == {}  # a finished export leaves no tag

    # An export stopped after its first unit: the version it read is tagged after its --out.
    out = str(tmp_path / "paused")
    cfg = prepare_output(_cfg(table, out)).cfg
    export_unit(cfg, plan_units(cfg)[0])
    tag = pins.export_pin(out)
    assert _tags(table) == {tag: cfg.table_version}

    result, err = _compact_cleanup(table, capsys)
    assert result["fragments_after"] < result["fragments_before"]  # a new version on top
    assert result["old_versions_removed"] >= 1
    assert result["kept_tags"] == {tag: cfg.table_version}
    assert tag in err and "untag" in err and out in err  # says which tags it kept, and why
    assert lance.dataset(table, version=cfg.table_version).count_rows() == 8

    report = run_export(_cfg(table, out), RunOptions(progress=False), resume=True)
    assert report.table_version == cfg.table_version
    assert is_complete(out) and content_digest(out) == content_digest(ref)
    assert _tags(table) == {}  # the resumed export removed the tag it reused

    result, err = _compact_cleanup(table, capsys)
    assert result["kept_tags"] == {} and "kept" not in err
    assert [v["version"] for v in lance.dataset(table).versions()] == [lance.dataset(table).version]


def test_running_column_job_survives_compact_cleanup(tmp_path, capsys):
    uri = C.make_table(str(tmp_path / "t.lance"))
    seen: dict = {}

    def cleanup_meanwhile(fragment: int, done: int) -> None:
        if done == 2:  # one commit is in: the version the job reads is no longer the latest
            seen["tags"] = _tags(uri)
            # the fragments are compact already, so this is the cleanup alone
            seen["result"], seen["err"] = _compact_cleanup(
                uri, capsys, "--target-rows", str(C.PER_FRAGMENT)
            )

    report = R.run_column_job(C.job(uri, commit_every=1, on_fragment=cleanup_meanwhile))
    tag = pins.column_pin("size")
    assert seen["tags"] == {tag: report.table_version}
    assert seen["result"]["old_versions_removed"] >= 1
    assert seen["result"]["kept_tags"] == {tag: report.table_version}
    assert tag in seen["err"]
    assert report.written == C.ROWS
    assert C.values(uri) == {f"t/{i:04d}": C.expected(i) for i in range(C.ROWS)}
    assert _tags(uri) == {}  # the finished job removed its tag


KILL_SCRIPT = textwrap.dedent(
    """
    import os, sys
    sys.path.insert(0, {root!r})
    from tests import test_column_runner as T
    from prx_data.columns import runner as R

    def kill(fragment, done):
        if done == 3:
            os._exit(9)  # like SIGKILL: nothing runs on the way out

    R.run_column_job(T.job({uri!r}, commit_every=1, on_fragment=kill))
    """
)


def test_killed_column_job_leaves_its_tag_and_the_rerun_removes_it(tmp_path, capsys):
    uri = C.make_table(str(tmp_path / "t.lance"))
    script = KILL_SCRIPT.format(root=REPO, uri=uri)
    r = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert r.returncode == 9, r.stderr[-2000:]
    tag = pins.column_pin("size")
    assert list(_tags(uri)) == [tag]

    assert table_cli.main(["tags", uri]) == 0
    listed = capsys.readouterr().out
    assert tag in listed and "column job size" in listed

    result, _ = _compact_cleanup(uri, capsys, "--target-rows", str(C.PER_FRAGMENT))
    assert list(result["kept_tags"]) == [tag]

    report = R.run_column_job(C.job(uri))
    assert report.recovered_fragments == 1  # the checkpoint of the commit it never made
    assert C.values(uri) == {f"t/{i:04d}": C.expected(i) for i in range(C.ROWS)}
    assert _tags(uri) == {}  # the rerun reused the tag and removed it


def test_tags_lists_and_untag_removes_stale_pins(tmp_path, capsys):
    uri = C.make_table(str(tmp_path / "t.lance"))
    ds = lance.dataset(uri)
    out = str(tmp_path / "gone")
    name = pins.export_pin(out)
    pins.pin(ds, name, ds.version, job="export", out=out)
    pins.pin(ds, name, ds.version, job="export", out=out)  # a resume reuses it
    assert pins.export_pin(out + "/") == pins.export_pin(os.path.relpath(out)) == name

    assert table_cli.main(["tags", uri, "--json"]) == 0
    (tag,) = json.loads(capsys.readouterr().out)
    assert tag["name"] == name and tag["version"] == ds.version
    assert tag["metadata"]["out"] == out and tag["metadata"]["job"] == "export"

    assert table_cli.main(["untag", uri, "prx-export-nope", name]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "prx-export-nope" in err and "nothing was removed" in err
    assert _tags(uri) == {name: ds.version}

    assert table_cli.main(["untag", uri, name]) == 0
    assert _tags(uri) == {}
    assert table_cli.main(["tags", uri]) == 0
    assert "no tags" in capsys.readouterr().out


def test_column_pin_names_are_valid_lance_tags(tmp_path):
    uri = C.make_table(str(tmp_path / "t.lance"), n=8)
    ds = lance.dataset(uri)
    names = {pins.column_pin(n) for n in ("caption vlm/v2", "caption_vlm_v2", "é" * 80)}
    assert len(names) == 3  # the hash keeps names apart that sanitising would merge
    for n in names:
        pins.pin(ds, n, ds.version, job="column job")
    assert set(_tags(uri)) == names
