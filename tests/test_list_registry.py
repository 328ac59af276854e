"""Skip lists survive every operation that makes a new tree, and concurrent updates all land.

A list is a set of row ids kept in the export's ``_lists/`` store and in the
corpus ledger beside the table (:mod:`prx_data.skips.ledger`); sidecars derive
from it. Each test runs the commands a user runs and checks what the loader
streams afterwards.
"""

from __future__ import annotations

import io
import json
import os
import subprocess
import sys

import pytest
from prx_data.pipelines.write_mds import run_export

from prx_data.cli import optout as optout_cli
from prx_data.cli import skips as skips_cli
from prx_data.cli import verify as verify_cli
from prx_data.cli import write_mds as write_mds_cli
from prx_data.core.runtime import RunOptions
from prx_data.export import layout, naming, safety
from prx_data.export.spec import ExportConfig
from prx_data.skips import sidecar as SL
from prx_data.skips.export_state import read_store_list, store_names
from prx_data.skips.ledger import Ledger
from prx_data.skips.ops import sync
from prx_data.stream.dataset import DatasetSpec
from tests.exportkit import make_export, run_rank, upload_tree
from tests.tablekit import make_table

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
B = "512/1.000"
N_ROWS = 8


def _jpeg(i: int) -> bytes:
    from PIL import Image

    buf = io.BytesIO()
    Image.new("RGB", (600, 600), (10 * i, 200 - 10 * i, 7)).save(buf, "JPEG")
    return buf.getvalue()


@pytest.fixture()
def table(tmp_path):
    """A fresh table per test: its list registry lives next to it."""
    uri = str(tmp_path / "t.lance")
    make_table(uri, [(f"s/{i}", _jpeg(i), f"cap {i}") for i in range(N_ROWS)])
    return uri


def _export(table: str, out: str, **kw) -> object:
    flags = {k: kw.pop(k) for k in ("overwrite", "resume") if k in kw}
    cfg = ExportConfig(table=table, out=out, tiers=(512,), min_units=2, **kw)
    return run_export(cfg, RunOptions(progress=False), **flags)


def _streamed(root: str) -> set[str]:
    run = run_rank(DatasetSpec(root), rank=0, world_size=1, batch_size=1, tier=512, shuffle=False)
    return {i for b in run.batches for i in b}


def _ids_file(tmp_path, name: str, ids) -> str:
    p = tmp_path / name
    p.write_text("".join(f"{i}\n" for i in ids))
    return str(p)


def _optout(export: str, ids_path: str, name: str = "optout") -> None:
    args = ["--export", export, "--name", name, "--ids", ids_path]
    assert optout_cli.main([*args, "--unmatched", f"{ids_path}.unmatched.txt"]) == 0


def _verify_clean(root: str, capsys) -> None:
    rc = verify_cli.main([root, "--deep", "--no-progress"])
    out = capsys.readouterr().out
    assert rc == 0, out


# --- every new tree carries every list ------------------------------------------------------


def test_rewrite_applying_dedup_keeps_the_optout_list(tmp_path, capsys):
    ex = make_export(str(tmp_path / "out"), {B: 24}, samples_per_part=8, samples_per_shard=3)
    ids = sorted(ex.all_ids())
    dups, opted = ids[:6], ids[10:13]
    assert skips_cli.main(["add", ex.root, "dedup", "--ids", _ids_file(tmp_path, "d", dups)]) == 0
    f = _ids_file(tmp_path, "o", opted)
    assert skips_cli.main(["add", ex.root, "optout", "--ids", f, "--reason", "ticket 7"]) == 0
    new = str(tmp_path / "clean")
    assert skips_cli.main(["rewrite", ex.root, new, "--name", "dedup"]) == 0
    capsys.readouterr()

    # The duplicates are gone from the shards, the opt-outs are still skipped.
    assert _streamed(new) == set(ids) - set(dups) - set(opted)
    # The applied list stays in the log (its samples are gone from the shards, so it skips none).
    assert store_names(new) == ["dedup", "optout"]
    assert SL.skip_stats(new, names=["dedup"]).get("dedup", []) == [] or all(
        r.skipped == 0 for r in SL.skip_stats(new, names=["dedup"])["dedup"]
    )
    kept = read_store_list(new, "optout")
    assert sorted(kept["id"].to_pylist()) == opted
    assert set(kept["reason"].to_pylist()) == {"ticket 7"}
    report = json.loads(open(os.path.join(new, "report.json")).read())
    assert report["lists"] == ["dedup"]
    carried = report["lists_carried"]["optout"]
    assert (carried["ids"], carried["samples"]) == (3, 3)
    _verify_clean(new, capsys)


def test_rewrite_refuses_a_list_it_cannot_carry_unless_dropped(tmp_path, capsys):
    ex = make_export(str(tmp_path / "out"), {B: 24}, samples_per_part=8, samples_per_shard=3)
    ids = sorted(ex.all_ids())
    assert (
        skips_cli.main(["add", ex.root, "dedup", "--ids", _ids_file(tmp_path, "d", ids[:6])]) == 0
    )
    # A list that exists only as a sidecar (no ids anywhere), and that sidecar is corrupt.
    bucket, shard, _ = ex.where[ids[20]]
    path = os.path.join(ex.root, bucket, SL.sidecar_basename(shard, "legacy"))
    with open(path, "wb") as f:
        f.write(b"PRXSKIP1 garbage")
    new = str(tmp_path / "clean")
    assert skips_cli.main(["rewrite", ex.root, new, "--name", "dedup"]) == 2
    err = capsys.readouterr().err
    assert "cannot carry skip list(s) 'legacy'" in err and "--drop-lists legacy" in err
    assert not os.path.exists(new)
    args = ["rewrite", ex.root, new, "--name", "dedup", "--drop-lists", "legacy"]
    assert skips_cli.main(args) == 0
    assert json.loads(open(os.path.join(new, "report.json")).read())["lists_dropped"] == ["legacy"]


def test_overwrite_keeps_lists_and_reports_them(table, tmp_path, ray_local, capsys):
    out = str(tmp_path / "out")
    _export(table, out)
    _optout(out, _ids_file(tmp_path, "o", ["s/1", "s/6"]))
    capsys.readouterr()
    # A re-export after re-captioning.
    report = _export(table, out, overwrite=True)
    got = report.lists["optout"]
    assert list(report.lists) == ["optout"]
    # The opted-out images are not written again: the list keeps its ids, skips nothing.
    assert (got["ids"], got["samples"], got["source"]) == (2, 0, "registry")
    assert report.dropped["opted_out"] == 2
    assert not {"s/1", "s/6"} & set(layout.read_manifests(out)["id"].to_pylist())
    assert _streamed(out) == {f"s/{i}" for i in range(N_ROWS)} - {"s/1", "s/6"}
    _verify_clean(out, capsys)


def test_fresh_export_of_the_same_table_gets_the_optout(table, tmp_path, ray_local):
    first, second = str(tmp_path / "first"), str(tmp_path / "second")
    _export(table, first)
    _optout(first, _ids_file(tmp_path, "o", ["s/2"]))
    report = _export(table, second)
    assert report.dropped["opted_out"] == 1  # never written, so no sample to skip
    assert report.lists["optout"]["samples"] == 0
    assert "s/2" not in set(layout.read_manifests(second)["id"].to_pylist())
    assert "s/2" not in _streamed(second)
    assert read_store_list(second, "optout")["command"].to_pylist() == ["optout"]


def test_drop_list_unregisters_a_trial_list_and_keeps_the_others(table, tmp_path, ray_local):
    first, second = str(tmp_path / "first"), str(tmp_path / "second")
    _export(table, first)
    _optout(first, _ids_file(tmp_path, "t", ["s/2"]), name="trial")
    _optout(first, _ids_file(tmp_path, "o", ["s/5"]))
    args = ["--table", table, "--out", second, "--tiers", "512", "--min-units", "2"]
    assert write_mds_cli.main([*args, "--no-progress", "--drop-list", "trial"]) == 0
    assert "trial" not in Ledger.for_table(table).state()
    streamed = _streamed(second)
    assert "s/2" in streamed and "s/5" not in streamed
    assert store_names(second) == ["optout"]


def test_id_opted_out_before_it_was_exported_stays_out(table, tmp_path, ray_local, capsys):
    out = str(tmp_path / "out")
    _export(table, out, filter="id != 's/3'")
    _optout(out, _ids_file(tmp_path, "o", ["s/3"]))
    assert "matched nothing: s/3" in capsys.readouterr().out
    # The filter is lifted: s/3 is exported now, and skipped.
    _export(table, out, overwrite=True)
    assert _streamed(out) == {f"s/{i}" for i in range(N_ROWS)} - {"s/3"}
    # Removing it explicitly lets the next export stream it again.
    assert (
        skips_cli.main(["remove", out, "optout", "--ids", _ids_file(tmp_path, "r", ["s/3"])]) == 0
    )
    report = _export(table, str(tmp_path / "again"))
    assert report.lists == {}
    assert "s/3" in _streamed(str(tmp_path / "again"))


def test_overwrite_refuses_an_uncarriable_list_by_name(table, tmp_path, ray_local, capsys):
    out = str(tmp_path / "out")
    _export(table, out)
    bucket = layout.list_buckets(out)[0]
    shard = layout.read_index(out, bucket)[0]
    # A corrupt sidecar of a list that has no ids anywhere else.
    path = os.path.join(out, bucket, SL.sidecar_basename(shard.basename, "nsfw"))
    with open(path, "wb") as f:
        f.write(b"PRXSKIP1 garbage")
    args = ["--table", table, "--out", out, "--tiers", "512", "--min-units", "2", "--no-progress"]
    assert write_mds_cli.main([*args, "--overwrite"]) == 2
    err = capsys.readouterr().err
    assert "'nsfw'" in err and "--drop-lists nsfw" in err
    assert os.path.exists(path) and layout.is_complete(out)  # nothing was deleted
    assert write_mds_cli.main([*args, "--overwrite", "--drop-lists", "nsfw"]) == 0
    assert not os.path.exists(path)


# --- concurrent updates all land -----------------------------------------------------------


def _concurrent_adds(root: str, registry_table: str, tmp_path, env: dict) -> None:
    """N processes add one id each to the same shard's list (skips add and optout alternating)."""
    procs = []
    for k in range(1, 5):
        f = _ids_file(tmp_path, f"c{k}", [f"ds/{B}/{2 * k - 1}"])
        if k % 2:
            cmd = ["-m", "prx_data.skips", "add", root, "optout", "--ids", f]
        else:
            cmd = ["-m", "prx_data.optout", "--export", root, "--name", "optout", "--ids", f]
        procs.append(subprocess.Popen([sys.executable, *cmd], cwd=str(tmp_path), env=env))
    assert [p.wait(timeout=300) for p in procs] == [0] * 4


# The s3 variant runs with -m slow (the default suite's 15-minute budget); the store's
# fencing of concurrent appends is covered by tests/test_store_fencing.py by default.
@pytest.mark.parametrize("where", ["local", pytest.param("s3", marks=pytest.mark.slow)])
def test_concurrent_adds_all_land(where, tmp_path, request):
    # One shard holds samples 0-7: every update rewrites the same sidecar.
    ex = make_export(str(tmp_path / "out"), {B: 16}, samples_per_part=8)
    registry_table = str(tmp_path / "t.lance")
    root = ex.root
    if where == "s3":  # the export and the table's registry both on the S3 test server
        bucket = request.getfixturevalue("s3_bucket")
        root, registry_table = f"s3://{bucket}/exports/out", f"s3://{bucket}/t.lance"
        upload_tree(ex.root, root)
        local_table = str(tmp_path / "t.lance")
        make_table(local_table, [("s/0", _jpeg(0), "c")])
        upload_tree(local_table, registry_table)
    else:
        make_table(registry_table, [("s/0", _jpeg(0), "c")])
    sync(root, registry_table)  # bound to the table, as write_mds leaves it
    first = _ids_file(tmp_path, "c0", [f"ds/{B}/0"])
    assert skips_cli.main(["add", root, "optout", "--ids", first]) == 0
    env = {**os.environ, "PYTHONPATH": REPO + os.pathsep + os.environ.get("PYTHONPATH", "")}
    _concurrent_adds(root, registry_table, tmp_path, env)

    want = sorted(f"ds/{B}/{i}" for i in (0, 1, 3, 5, 7))
    assert sorted(read_store_list(root, "optout")["id"].to_pylist()) == want
    assert sorted(Ledger.for_table(registry_table).state()["optout"]["id"].to_pylist()) == want
    shards = layout.read_index(root, B)
    skipped = SL.load_skips(root, B, shards, ["optout"])
    where_of = {sid: (s, i) for sid, (_, s, i) in ex.where.items()}
    got = sorted(sid for sid, (s, i) in where_of.items() if s in skipped and i in skipped[s])
    assert got == want


def test_registry_appends_from_many_processes_all_land(tmp_path):
    """The first writers of a registry race to create it: every one lands (lease + retries)."""
    reg_table = str(tmp_path / "t.lance")
    make_table(reg_table, [("s/0", _jpeg(0), "c")])
    code = (
        "import sys; import pyarrow as pa; from prx_data.skips.ledger import Ledger; "
        "from prx_data.skips.log import Provenance, log_rows; "
        "r = Ledger.for_table(sys.argv[1]); "
        "r.append(lambda seq: log_rows('x', pa.array([sys.argv[2]]), 'add', "
        "Provenance('test'), seq=seq, base=seq, kind=0, export='e'))"
    )
    env = {**os.environ, "PYTHONPATH": REPO + os.pathsep + os.environ.get("PYTHONPATH", "")}
    procs = [
        subprocess.Popen([sys.executable, "-c", code, reg_table, f"id{k}"], env=env)
        for k in range(5)
    ]
    assert [p.wait(timeout=300) for p in procs] == [0] * 5
    got = Ledger.for_table(reg_table).state()["x"]["id"].to_pylist()
    assert sorted(got) == [f"id{k}" for k in range(5)]


def test_verify_and_the_overwrite_guard_know_the_list_store(tmp_path, capsys):
    ex = make_export(str(tmp_path / "out"), {B: 8}, samples_per_part=8)
    assert (
        skips_cli.main(["add", ex.root, "optout", "--ids", _ids_file(tmp_path, "o", [f"ds/{B}/1"])])
        == 0
    )
    assert skips_cli.main(["list", ex.root]) == 0
    assert "optout: 512/1.000 (1 shards); 1 ids" in capsys.readouterr().out
    _verify_clean(ex.root, capsys)
    assert safety.foreign_entries(ex.root) == []
    junk = os.path.join(ex.root, naming.LISTS_DIR, "notes.txt")
    open(junk, "w").write("mine")
    assert safety.foreign_entries(ex.root) == ["_lists/notes.txt"]
    assert verify_cli.main([ex.root, "--no-progress"]) == 1
    assert "notes.txt: not a file of the skip-list store" in capsys.readouterr().out


def test_sync_gives_another_export_of_the_table_its_lists(tmp_path, capsys):
    t = str(tmp_path / "t.lance")
    make_table(t, [("s/0", _jpeg(0), "c")])
    a = make_export(str(tmp_path / "a"), {B: 8}, samples_per_part=8)
    b = make_export(str(tmp_path / "b"), {B: 8}, samples_per_part=4)
    for ex in (a, b):
        sync(ex.root, t)  # two exports of one table, as write_mds leaves them
    _optout(a.root, _ids_file(tmp_path, "o", [f"ds/{B}/2", f"ds/{B}/5"]))
    assert skips_cli.main(["sync", b.root]) == 0
    assert "optout: 2 ids, 2 samples skipped" in capsys.readouterr().out
    assert _streamed(b.root) == b.all_ids() - {f"ds/{B}/2", f"ds/{B}/5"}
