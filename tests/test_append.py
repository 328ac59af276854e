"""``write_mds --append``: an export follows its table (new, deleted and changed rows)
without touching a byte of its old shards, and streams every row once."""

from __future__ import annotations

import hashlib
import logging
import os

import lance
import pyarrow.parquet as pq
import pytest
from prx_data.pipelines.append import run_append
from prx_data.pipelines.write_mds import run_export

from prx_data.cli import verify as verify_cli
from prx_data.cli import write_mds as cli
from prx_data.core.runtime import RunOptions
from prx_data.export import naming
from prx_data.export.append import AppendError
from prx_data.export.idindex import open_index
from prx_data.export.layout import is_complete
from prx_data.export.spec import ExportConfig
from prx_data.pipelines import append as P
from prx_data.skips.ops import list_ids
from prx_data.stream.dataset import DatasetSpec
from tests.badinputs import good_jpeg
from tests.exportkit import run_rank
from tests.tablekit import make_table

logging.getLogger("streaming").setLevel(logging.ERROR)
RUN = RunOptions(progress=False)
#: Sizes that land in three buckets of tier 512 (1.000, 1.333, 0.750).
SIZES = ((640, 640), (800, 600), (600, 800))


def _items(names: list[str], seed: int = 0, size: tuple[int, int] | None = None):
    out = []
    for k, name in enumerate(names):
        w, h = size or SIZES[(k + seed) % len(SIZES)]
        out.append((name, good_jpeg(w, h, seed=hash((name, seed)) % 1000), f"caption {name}"))
    return out


def _cfg(table: str, out: str, **kw) -> ExportConfig:
    settings = {"tiers": (512,), "rows_per_task": 3, "min_units": 2, **kw}
    return ExportConfig(table=table, out=out, **settings)


@pytest.fixture
def exported(tmp_path):
    table, out = str(tmp_path / "t.lance"), str(tmp_path / "out")
    make_table(table, _items([f"r{i:02d}" for i in range(9)]), max_rows_per_file=4)
    run_export(_cfg(table, out), RUN)
    return table, out


def _shards(out: str) -> dict[str, str]:
    """sha256 of every shard file of the export, by path."""
    found = {}
    for dirpath, _dirs, files in os.walk(out):
        for f in files:
            if naming.SHARD_FILE_RE.fullmatch(f):
                path = os.path.join(dirpath, f)
                found[os.path.relpath(path, out)] = hashlib.sha256(
                    open(path, "rb").read()
                ).hexdigest()
    return found


def _streamed(out: str) -> tuple[list[str], dict[str, tuple]]:
    run = run_rank(DatasetSpec(out), rank=0, world_size=1, batch_size=1, tier=512, shuffle=False)
    ids = [i for b in run.batches for i in b]
    return ids, {b[0]: s for b, s in zip(run.batches, run.shapes, strict=True)}


def _ids(table: str) -> list[str]:
    return sorted(lance.dataset(table).to_table(columns=["id"])["id"].to_pylist())


def test_append_adds_new_rows_as_new_parts_and_leaves_old_shards_byte_identical(
    exported, monkeypatch
):
    table, out = exported
    before = _shards(out)
    make_table(table, _items(["n1", "n2", "n3", "n4"], seed=1), mode="append")
    with monkeypatch.context() as m:  # the id index gains the new rows: never rebuilt whole
        m.setattr(P, "write_id_index", lambda *a, **k: pytest.fail("id index rebuilt"))
        report = run_append(_cfg(table, out, append=True), RUN)
    after = _shards(out)
    assert {p: after[p] for p in before} == before  # every old shard, byte for byte
    assert len(after) > len(before)
    assert report.append["counts"]["new"] == 4 and report.samples_written == 13
    assert report.table_version == lance.dataset(table).version
    ids, _ = _streamed(out)
    assert sorted(ids) == _ids(table)  # old and new, each exactly once
    index, why = open_index(out)
    assert index is not None and index.rows == 13, why
    assert verify_cli.main([out, "--deep", "--no-progress"]) == 0
    assert not os.path.exists(os.path.join(out, *naming.PROGRESS_DIR.split("/"), "append"))


def test_append_of_nothing_says_so_and_writes_nothing(exported):
    table, out = exported
    mtimes = {
        os.path.join(d, f): os.stat(os.path.join(d, f)).st_mtime_ns
        for d, _, fs in os.walk(out)
        for f in fs
        if f != naming.LOCK_NAME
    }
    report = run_append(_cfg(table, out, append=True), RUN)
    assert any("nothing to append" in w for w in report.warnings)
    assert report.samples_written == 9
    after = {
        os.path.join(d, f): os.stat(os.path.join(d, f)).st_mtime_ns
        for d, _, fs in os.walk(out)
        for f in fs
        if f != naming.LOCK_NAME
    }
    assert after == mtimes


def test_deleted_rows_go_to_the_deleted_list_and_do_not_stream(exported):
    table, out = exported
    # New rows in one fragment, one of them deleted before the append: the others are
    # taken by their offsets among the fragment's live rows.
    make_table(table, _items(["n1", "n2", "n3", "n4"], seed=1), mode="append")
    lance.dataset(table).delete("id IN ('r01', 'r05', 'n2')")
    report = run_append(_cfg(table, out, append=True), RUN)
    assert report.append["counts"]["deleted"] == 2 and report.append["counts"]["new"] == 3
    assert sorted(list_ids(out, "deleted").to_pylist()) == ["r01", "r05"]
    ids, _ = _streamed(out)
    assert sorted(ids) == _ids(table)
    # An --overwrite writes the table afresh: the tree's own lists do not follow it.
    report = run_export(_cfg(table, out), RUN, overwrite=True)
    assert "deleted" not in report.lists and sorted(_streamed(out)[0]) == _ids(table)


def test_a_changed_image_is_exported_again_and_its_old_sample_skipped(exported):
    table, out = exported
    ds = lance.dataset(table)
    shape_of = dict(_streamed(out)[1])
    # r00 was 640x640 (square); it becomes 800x600 (landscape), under the same id.
    ds.delete("id = 'r00'")
    make_table(table, _items(["r00"], seed=7, size=(800, 600)), mode="append")
    report = run_append(_cfg(table, out, append=True), RUN)
    assert report.append["counts"]["changed"] == 1
    assert list_ids(out, "replaced").to_pylist() == ["r00"]
    ids, shapes = _streamed(out)
    assert sorted(ids) == _ids(table)
    assert shapes["r00"] != shape_of["r00"]  # the new image streams, the old one not
    # Deleted, then added again: its old sample is replaced, and it leaves `deleted`.
    lance.dataset(table).delete("id = 'r02'")
    run_append(_cfg(table, out, append=True), RUN)
    assert list_ids(out, "deleted").to_pylist() == ["r02"]
    make_table(table, _items(["r02"], seed=3, size=(600, 800)), mode="append")
    report = run_append(_cfg(table, out, append=True), RUN)
    assert report.append["counts"]["re_added"] == 1
    assert list_ids(out, "deleted").to_pylist() == []
    ids, shapes = _streamed(out)
    assert sorted(ids) == _ids(table)
    assert verify_cli.main([out, "--deep", "--no-progress"]) == 0


def test_the_ledgers_opt_outs_are_left_out_while_appending(exported):
    from prx_data.skips.optout import add_optout

    table, out = exported
    make_table(table, _items(["n1", "n2"], seed=1), mode="append")
    add_optout(out, "optout", ["n2"], table=table)
    report = run_append(_cfg(table, out, append=True), RUN)
    assert report.dropped.get("opted_out") == 1
    dropped = pq.read_table(os.path.join(out, naming.DROPPED_NAME)).to_pylist()
    assert {(r["id"], r["reason"]) for r in dropped} == {("n2", "opted_out")}
    ids, _ = _streamed(out)
    assert sorted(ids) == sorted(set(_ids(table)) - {"n2"})


class _Crash(RuntimeError):
    pass


@pytest.mark.parametrize("where", ["unit", "index", "record"])
def test_a_crashed_append_never_looks_complete_and_resume_finishes_it(exported, monkeypatch, where):
    table, out = exported
    before = _shards(out)
    make_table(table, _items([f"n{i}" for i in range(7)], seed=1), mode="append")
    lance.dataset(table).delete("id = 'r03'")
    cfg = _cfg(table, out, append=True)
    with monkeypatch.context() as m:
        if where == "unit":
            calls = []
            real = P._AppendTask.__call__

            def once(self, row):
                calls.append(1)
                if len(calls) == 2:
                    raise _Crash("killed")
                return real(self, row)

            m.setattr(P._AppendTask, "__call__", once)
        elif where == "index":
            m.setattr(P, "extend_id_index", lambda *a, **k: (_ for _ in ()).throw(_Crash()))
        else:
            m.setattr(P.A, "write_record", lambda *a, **k: (_ for _ in ()).throw(_Crash()))
        with pytest.raises(_Crash):
            run_append(cfg, RUN)
    if where != "unit":  # the indexes changed: the tree says it is unfinished
        assert not is_complete(out)
    with pytest.raises(AppendError, match="--append --resume"):
        run_append(cfg, RUN)
    with pytest.raises(Exception, match="--append --resume"):
        run_export(_cfg(table, out), RUN, resume=True)
    report = run_append(cfg, RUN, resume=True)
    assert is_complete(out) and report.samples_written == 16
    after = _shards(out)
    assert {p: after[p] for p in before} == before
    ids, _ = _streamed(out)
    assert sorted(ids) == _ids(table)
    assert verify_cli.main([out, "--deep", "--no-progress"]) == 0


def test_one_run_at_a_time_holds_the_exports_lease(exported):
    from prx_data.export.lock import ExportLock, ExportLocked

    table, out = exported
    make_table(table, _items(["n1"], seed=1), mode="append")
    with ExportLock(out), pytest.raises(ExportLocked):
        run_append(_cfg(table, out, append=True), RUN)
    assert run_append(_cfg(table, out, append=True), RUN).append["counts"]["new"] == 1


def test_settings_that_differ_and_overwrite_are_refused_in_one_line(exported, capsys):
    table, out = exported
    make_table(table, _items(["n1"], seed=1), mode="append")
    with pytest.raises(AppendError, match="settings differ.*quality"):
        run_append(_cfg(table, out, append=True, quality=80), RUN)
    with pytest.raises(AppendError, match="settings differ.*tiers"):
        run_append(_cfg(table, out, append=True, tiers=(512, 1024)), RUN)
    base = ["--table", table, "--out", out, "--tiers", "512", "--no-progress"]
    assert cli.main([*base, "--append", "--overwrite"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "--append and --overwrite cannot be combined" in err
    assert cli.main([*base, "--append", "--format", "png"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "settings differ" in err and "image_format" in err
    assert not os.path.exists(os.path.join(out, *naming.PROGRESS_DIR.split("/"), "append"))


def test_the_plan_cuts_units_by_fragment_into_runs_of_offsets():
    import pyarrow as pa

    from prx_data.export.append import TODO_SCHEMA, plan_units

    todo = pa.table(
        {
            "fragment_id": [3, 3, 3, 3, 3, 7, 7],
            "offset": [0, 1, 2, 5, 6, 10, 11],
            "id": list("abcdefg"),
        },
        schema=TODO_SCHEMA,
    )
    units = plan_units(todo, rows_per_task=4, version=9)
    assert [(u.fragment_id, u.runs) for u in units] == [
        (3, ((0, 3), (5, 6))),
        (3, ((6, 7),)),
        (7, ((10, 12),)),
    ]
    assert units[0].part == "a000009-f000003-000000000" and units[0].offsets() == [0, 1, 2, 5]
    # A small append is cut into about min_units units (every core busy): ceil(7 / 3) rows each.
    small = plan_units(todo, rows_per_task=1000, version=9, min_units=3)
    assert [u.count for u in small] == [3, 2, 2]


@pytest.mark.remote
def test_append_on_object_storage_with_a_crash_and_resume(s3_bucket, tmp_path, monkeypatch):
    from prx_data.core import storage
    from prx_data.export import layout

    table, out = str(tmp_path / "t.lance"), f"s3://{s3_bucket}/exports/e"
    make_table(table, _items([f"r{i:02d}" for i in range(6)]), max_rows_per_file=4)
    run_export(_cfg(table, out), RUN)
    old = {b: [s.basename for s in layout.read_index(out, b)] for b in layout.list_buckets(out)}
    make_table(table, _items(["n1", "n2", "n3"], seed=1), mode="append")
    lance.dataset(table).delete("id = 'r02'")
    with monkeypatch.context() as m:
        m.setattr(P.A, "write_record", lambda *a, **k: (_ for _ in ()).throw(_Crash()))
        with pytest.raises(_Crash):
            run_append(_cfg(table, out, append=True), RUN)
    assert not is_complete(out)
    report = run_append(_cfg(table, out, append=True), RUN, resume=True)
    assert is_complete(out) and report.append["counts"] == {
        "new": 3,
        "changed": 0,
        "deleted": 1,
        "filtered": 0,
        "no_digest": 0,
        "re_added": 0,
    }
    for b, names in old.items():  # old entries first, in their order; new ones after
        assert [s.basename for s in layout.read_index(out, b)][: len(names)] == names
    assert list_ids(out, "deleted").to_pylist() == ["r02"]
    assert not storage.exists(f"{out}/_progress/append/plan")
    index, why = open_index(out)
    assert index is not None and index.rows == 9, why


@pytest.mark.faults
def test_kill_9_mid_append_then_append_resume_finishes_it(exported):
    import random
    import signal
    import subprocess
    import sys
    import time

    from tests.exportkit import spawn_cli

    table, out = exported
    before = _shards(out)
    make_table(table, _items([f"n{i:02d}" for i in range(24)], seed=1), mode="append")
    repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = {**os.environ, "PYTHONPATH": repo}
    args = ["--table", table, "--out", out, "--tiers", "512", "--rows-per-task", "3"]
    args += ["--min-units", "2", "--num-cpus", "1", "--no-progress", "--append"]
    proc = spawn_cli(["prx_data.write_mds", *args], env)
    plan = os.path.join(out, "_progress", "append", "plan")
    try:
        deadline = time.time() + 120
        while not os.path.exists(plan) and proc.poll() is None:
            assert time.time() < deadline, "the append did not start"
            time.sleep(0.02)
        time.sleep(random.Random(0).uniform(0.0, 1.5))
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    cli_ = [sys.executable, "-m", "prx_data.write_mds", *args]
    r = subprocess.run([*cli_, "--resume"], env=env, capture_output=True, text=True)
    if r.returncode != 0:  # the kill came after the append finished: said in one line
        assert "no interrupted append" in r.stderr, r.stderr[-2000:]
    assert is_complete(out)
    after = _shards(out)
    assert {p: after[p] for p in before} == before
    assert sorted(_streamed(out)[0]) == _ids(table)
    assert verify_cli.main([out, "--deep", "--no-progress"]) == 0


def test_an_export_without_a_row_record_compares_with_its_version_or_else_its_ids(exported):
    import datetime as dt
    import shutil

    from prx_data.export.append import record_uri

    table, out = exported
    shutil.rmtree(record_uri(out))  # an export written before the record existed
    lance.dataset(table).delete("id = 'r00'")
    make_table(table, _items(["r00"], seed=7, size=(800, 600)), mode="append")
    report = run_append(_cfg(table, out, append=True), RUN)
    assert report.append["baseline"].startswith("table@")
    assert report.append["counts"]["changed"] == 1
    # Its version cleaned up too: only the id index says what it holds, with no digest. A
    # changed image cannot be seen then: taken as unchanged, counted, and recorded from now on.
    shutil.rmtree(record_uri(out))
    lance.dataset(table).delete("id = 'r01'")
    make_table(table, _items(["r01", "n1"], seed=8, size=(800, 600)), mode="append")
    lance.dataset(table).cleanup_old_versions(older_than=dt.timedelta(0))
    report = run_append(_cfg(table, out, append=True), RUN)
    assert report.append["baseline"] == "id-index"
    assert report.append["counts"]["changed"] == 0 and report.append["counts"]["new"] == 1
    assert report.append["counts"]["no_digest"] == 9
    assert sorted(_streamed(out)[0]) == _ids(table)


@pytest.mark.parametrize("compact", [None, "64M"], ids=["lists", "compact"])
def test_a_rewrite_of_other_lists_still_leaves_out_deleted_and_replaced_samples(
    exported, tmp_path, compact
):
    """``deleted`` and ``replaced`` are the export's own lists and never carried: a rewrite
    that names other lists (or only compacts) must still leave their samples out."""
    from prx_data.skips.log import Provenance
    from prx_data.skips.ops import update_list
    from prx_data.skips.rewrite import rewrite_export

    table, out = exported
    ds = lance.dataset(table)
    ds.delete("id IN ('r00', 'r03')")
    make_table(table, _items(["r00"], seed=7, size=(800, 600)), mode="append")  # changed
    run_append(_cfg(table, out, append=True), RUN)
    update_list(out, "mine", ["r04"], Provenance("test", ""), export_only=True)
    new = str(tmp_path / "new")
    rewrite_export(out, new, names=["mine"], force=True, progress=False, compact=compact)
    ids, shapes = _streamed(new)
    assert sorted(ids) == sorted(set(_ids(table)) - {"r04"})  # r03 deleted, r00 once
    assert shapes["r00"] == _streamed(out)[1]["r00"]  # the new image, not the old one
