"""Crash safety of the export tree without Ray: destructive steps are ordered so that a kill
part-way never looks complete, unit data is durable before its marker, and deletes never
follow a symbolic link out of the tree."""

from __future__ import annotations

import io
import os
import shutil

import pytest

from prx_data.cli import verify as verify_cli
from prx_data.core import storage
from prx_data.export import layout, naming, safety
from prx_data.export.merge import done_parts
from prx_data.export.naming import ExportError
from prx_data.export.prepare import plan_units, prepare_output
from prx_data.export.spec import ExportConfig
from prx_data.export.unit import export_unit
from prx_data.skips.rewrite import rewrite_export
from prx_data.stream.dataset import DatasetSpec, load_sources
from tests.exportkit import make_export
from tests.tablekit import make_table

B = "512/1.000"


def _jpeg(size: tuple[int, int]) -> bytes:
    from PIL import Image

    buf = io.BytesIO()
    Image.new("RGB", size, (9, 9, 9)).save(buf, "JPEG")
    return buf.getvalue()


@pytest.fixture(scope="module")
def table(tmp_path_factory):
    """Four rows over two buckets, so a unit writes more than one part."""
    uri = str(tmp_path_factory.mktemp("t") / "t.lance")
    sizes = [(600, 600), (600, 600), (1200, 600), (600, 600)]
    make_table(uri, [(f"s/{i}", _jpeg(s), f"cap {i}") for i, s in enumerate(sizes)])
    return uri


def _files(root) -> dict[str, bytes]:
    out = {}
    for dirpath, _dirs, files in os.walk(root):
        for f in files:
            path = os.path.join(dirpath, f)
            out[os.path.relpath(path, root)] = open(path, "rb").read()
    return out


class Killed(BaseException):
    """Stands for SIGKILL: nothing after it runs, no ``except Exception`` catches it."""


def _kill_at_first_tier_delete(monkeypatch, root: str) -> None:
    """Every way the code deletes: the first deletion of anything under a tier dies."""

    def under_tier(path) -> bool:
        rel = os.path.relpath(os.fspath(path), root)
        return not rel.startswith("..") and rel.split(os.sep)[0].isdigit()

    for owner, name in ((storage, "delete"), (shutil, "rmtree"), (os, "remove"), (os, "unlink")):
        real = getattr(owner, name)

        def wrapped(path, *a, _real=real, **k):
            if under_tier(path):
                raise Killed(path)
            return _real(path, *a, **k)

        monkeypatch.setattr(owner, name, wrapped)


def _looks_unfinished(root: str, capsys) -> None:
    assert not layout.is_complete(root)
    with pytest.raises(layout.IncompleteExport, match="did not finish"):
        load_sources(DatasetSpec(root), [512])
    capsys.readouterr()
    assert verify_cli.main([root, "--no-progress"]) == 1
    assert "report.json: missing" in capsys.readouterr().out


# --- issue 19.4: destructive steps in a safe order ---------------------------------------------


def test_overwrite_killed_while_deleting_tiers_leaves_an_unfinished_tree(
    tmp_path, table, monkeypatch, capsys
):
    root = str(tmp_path / "exp")
    make_export(root, {B: 20, "512/0.500": 4}, samples_per_part=8)
    _kill_at_first_tier_delete(monkeypatch, root)
    with pytest.raises(Killed):
        prepare_output(ExportConfig(table=table, out=root), overwrite=True)
    monkeypatch.undo()
    assert os.path.exists(os.path.join(root, B, naming.INDEX_NAME))  # the kill came in time
    _looks_unfinished(root, capsys)
    assert layout.list_markers(root) == []  # no marker vouches for a deleted part
    with pytest.raises(
        ExportError, match="no interrupted export to resume.*again with --overwrite"
    ):
        prepare_output(ExportConfig(table=table, out=root), resume=True)
    prepare_output(ExportConfig(table=table, out=root), overwrite=True)  # still provably ours
    assert sorted(os.listdir(root)) == [naming.PROGRESS_DIR]


def test_resume_cleanup_killed_part_way_leaves_an_unfinished_tree(tmp_path, monkeypatch, capsys):
    """--resume of an export that lost a marker deletes merged indexes and that part: the
    report must be gone before any of them."""
    root = str(tmp_path / "exp")
    make_export(root, {B: 20}, samples_per_part=8)
    keep = set(done_parts(root))
    keep.discard(sorted(keep)[-1])
    _kill_at_first_tier_delete(monkeypatch, root)
    with pytest.raises(Killed):
        safety.remove_stale_parts(root, keep, (512,))
    monkeypatch.undo()
    _looks_unfinished(root, capsys)


def test_rewrite_into_a_folder_holding_another_export_is_refused_untouched(tmp_path):
    """A report left in the destination would make a rewrite killed part-way look complete."""
    src = make_export(str(tmp_path / "src"), {B: 8})
    dest = str(tmp_path / "dest")
    make_export(dest, {"1024/1.000": 4})  # an older export with other buckets
    before = _files(dest)
    with pytest.raises(FileExistsError, match="not empty .*an export.*choose an empty"):
        rewrite_export(src.root, dest, force=True)
    assert _files(dest) == before
    stray = tmp_path / "stray"
    stray.mkdir()
    (stray / "notes.txt").write_text("mine")
    with pytest.raises(FileExistsError, match="notes.txt"):
        rewrite_export(src.root, str(stray), force=True)
    empty = tmp_path / "empty"
    empty.mkdir()
    assert rewrite_export(src.root, str(empty), force=True).samples_out == 8


# --- issue 20.6: durable before marked -------------------------------------------------------


def test_unit_files_and_folders_are_fsynced_before_its_marker(tmp_path, table, monkeypatch):
    out = str(tmp_path / "o")
    cfg = prepare_output(ExportConfig(table=table, out=out, rows_per_task=2, min_units=1)).cfg
    synced: set[tuple[int, int]] = set()
    at_marker: dict[str, set[tuple[int, int]]] = {}
    real_fsync, real_write = os.fsync, storage.write_bytes_atomic

    def fsync(fd):
        st = os.fstat(fd)
        synced.add((st.st_dev, st.st_ino))  # inodes: a rename keeps them
        return real_fsync(fd)

    def write(path, data):
        if path.endswith(".done"):
            at_marker[os.path.basename(path)[: -len(".done")]] = set(synced)
        return real_write(path, data)

    monkeypatch.setattr(os, "fsync", fsync)
    monkeypatch.setattr(storage, "write_bytes_atomic", write)
    for unit in plan_units(cfg):
        export_unit(cfg, unit)
    monkeypatch.undo()
    results = done_parts(out)
    assert (
        sorted(at_marker) == sorted(results) and sum(len(r.buckets) for r in results.values()) > 2
    )
    for part, r in results.items():
        for bucket in r.buckets:
            pdir = os.path.join(out, bucket, r.part_in(bucket))
            paths = [os.path.join(out, bucket), pdir]
            paths += [os.path.join(pdir, f) for f in os.listdir(pdir)]
            assert {"index.json", "ids.parquet", "shard.00000.mds"} <= set(os.listdir(pdir))
            for path in paths:
                st = os.stat(path)
                assert (st.st_dev, st.st_ino) in at_marker[part], f"{path} not fsynced"


# --- issue 20.7: never follow a symbolic link when deleting ----------------------------------


def test_stale_part_cleanup_never_follows_a_symlinked_tier(tmp_path, table):
    victim = str(tmp_path / "victim")
    make_export(victim, {"1024/1.000": 4, B: 4})  # a folder with part-shaped directories
    before = _files(victim)
    root = str(tmp_path / "exp")
    make_export(root, {B: 8})
    os.symlink(os.path.join(victim, "1024"), os.path.join(root, "1024"))
    safety.remove_stale_parts(root, set(), (512, 1024))  # nothing kept: all of ours is stale
    assert _files(victim) == before
    assert os.path.islink(os.path.join(root, "1024"))
    assert [p for p in os.listdir(os.path.join(root, B)) if p.startswith("f")] == []
    # --overwrite and --resume refuse a tree with a link in it, naming it
    for kw in ({"overwrite": True}, {"resume": True}):
        with pytest.raises(ExportError, match=r"not provably .*1024 \(a symbolic link\)"):
            prepare_output(ExportConfig(table=table, out=root), **kw)
    assert _files(victim) == before
