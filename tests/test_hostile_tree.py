"""A received export's tree is data: links out, FIFOs and devices are refused, never followed.

Each case crafts a tree in ``tmp_path`` (a part directory linked outside the
export, a FIFO sidecar or index, a sidecar linked to ``/dev/zero``, a sidecar
far larger than its shard allows) and checks that every entry point refuses
it in one line naming the path, that nothing outside the export is written
or read, and that ``verify`` reports it. Each test has a timeout: a FIFO that
is opened for reading blocks for ever, so a regression fails instead of hanging.
"""

from __future__ import annotations

import hashlib
import os
import shutil

import pytest

from prx_data.core import confined
from prx_data.core.errors import PrxDataError
from prx_data.export import layout, naming, safety
from prx_data.skips import sidecar as S
from tests.exportkit import make_export, skip_samples

B = "512/1.000"
PART = naming.part_name(0, 8)  # the second part of the bucket


@pytest.fixture(scope="module")
def template(tmp_path_factory):
    root = str(tmp_path_factory.mktemp("tpl") / "ex")
    return make_export(root, {B: 16}, samples_per_part=8)


@pytest.fixture
def ex(template, tmp_path):
    root = str(tmp_path / "ex")
    shutil.copytree(template.root, root)
    confined.forget()
    return root


def _snapshot(d) -> dict[str, str]:
    out = {}
    for dirpath, _dirs, files in os.walk(d):
        for f in files:
            p = os.path.join(dirpath, f)
            out[p] = hashlib.sha1(open(p, "rb").read()).hexdigest()
    return out


def _ids(root: str, tmp_path, ids) -> str:
    path = str(tmp_path / "ids.txt")
    with open(path, "w") as f:
        f.write("".join(f"{i}\n" for i in ids))
    return path


def _shard(root: str, part: str = PART) -> str:
    return next(s.basename for s in layout.read_index(root, B) if s.basename.startswith(part))


def _verify_lines(root: str, capsys, *extra: str) -> tuple[int, str]:
    from prx_data.cli.verify import main

    rc = main([root, *extra])
    return rc, capsys.readouterr().out


# --- a part directory linked outside the export ----------------------------------------------


@pytest.fixture
def linked_part(ex, tmp_path):
    """The bucket's second part moved outside the export, a symbolic link left in its place."""
    outside = tmp_path / "outside"
    outside.mkdir()
    real = os.path.join(ex, B, PART)
    shutil.move(real, outside / PART)
    os.symlink(outside / PART, real)
    return ex, str(outside)


@pytest.mark.timeout(60)
def test_linked_part_refused_by_skips_add(linked_part, template, tmp_path, capsys):
    from prx_data.cli.skips import main

    root, outside = linked_part
    before = _snapshot(outside)
    ids = _ids(root, tmp_path, template.ids[B][8:10])
    assert main(["add", root, "dedup", "--ids", ids]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and PART in err and "symlink" in err
    assert _snapshot(outside) == before  # no sidecar written through the link
    # The library call is refused the same way, and so is a write aimed at the link itself.
    with pytest.raises(safety.UnsafeIndexError, match=PART):
        skip_samples(root, "dedup", {(B, f"{PART}/shard.00000.mds"): [0]})
    with pytest.raises(confined.UnsafeFileError, match="leads out of"):
        confined.write_atomic(root, os.path.join(root, B, PART, "x.skip"), b"x")
    assert _snapshot(outside) == before


@pytest.mark.timeout(120)
def test_linked_part_refused_by_rewrite(linked_part, tmp_path):
    from prx_data.skips.rewrite import rewrite_export

    root, outside = linked_part
    out = tmp_path / "rewritten"
    with pytest.raises(safety.UnsafeIndexError, match=PART):
        rewrite_export(root, str(out), force=True)
    assert not out.exists() or not list(out.rglob("*.mds"))  # no outside shard copied in


@pytest.mark.timeout(60)
def test_linked_part_reported_by_verify_deep(linked_part, capsys):
    root, _outside = linked_part
    rc, out = _verify_lines(root, capsys, "--deep")
    assert rc == 1
    lines = [ln for ln in out.splitlines() if PART in ln]
    assert len(lines) == 1 and "symbolic link" in lines[0], out
    assert os.path.join(root, B, PART) in lines[0]


@pytest.mark.timeout(60)
def test_linked_part_refused_by_skips_remove_and_loader(linked_part, capsys):
    """A sidecar outside (made before the fix, or by hand) is neither read nor deleted."""
    from prx_data.cli.skips import main
    from prx_data.stream.dataset import DatasetSpec, load_sources

    root, outside = linked_part
    planted = os.path.join(outside, PART, "shard.00000.mds.dedup.skip")
    with open(planted, "wb") as f:
        f.write(b"PRXSKIP1")
    before = _snapshot(outside)
    assert main(["remove", root, "dedup"]) == 2
    assert PART in capsys.readouterr().err
    for call in (
        S.list_skip_lists,
        S.skip_stats,
        lambda r: skip_samples(r, "dedup", remove=True).removed,
    ):
        with pytest.raises(safety.UnsafeIndexError, match=PART):
            call(root)
    with pytest.raises(safety.UnsafeIndexError, match=PART):
        load_sources(DatasetSpec(root), [512])
    assert _snapshot(outside) == before


# --- FIFOs ------------------------------------------------------------------------------------


@pytest.mark.timeout(30)
def test_fifo_sidecar_refused_by_list_and_loader_reported_by_verify(ex, capsys):
    from prx_data.cli.skips import main
    from prx_data.stream.dataset import DatasetSpec, load_sources

    fifo = os.path.join(ex, B, f"{_shard(ex)}.dedup.skip")
    os.mkfifo(fifo)
    assert main(["list", ex]) in (0, 1)
    out = capsys.readouterr().out
    assert f"{fifo}: not a regular file (a FIFO)" in out
    with pytest.raises(S.SkipListError, match="FIFO") as e:
        load_sources(DatasetSpec(root=ex), [512])
    assert fifo in str(e.value)
    rc, out = _verify_lines(ex, capsys)
    assert rc == 1
    assert [ln for ln in out.splitlines() if "dedup.skip" in ln] == [
        f"{fifo}: a FIFO, not a regular file"
    ]


@pytest.mark.timeout(30)
def test_fifo_index_refused_by_stats_reported_by_verify(ex, capsys):
    from prx_data.cli.skips import main

    index = os.path.join(ex, B, naming.INDEX_NAME)
    os.remove(index)
    os.mkfifo(index)
    assert main(["stats", ex]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and index in err and "FIFO" in err
    rc, out = _verify_lines(ex, capsys, "--deep")
    assert rc == 1
    assert [ln for ln in out.splitlines() if ln.startswith(index)] == [
        f"{index}: a FIFO, not a regular file"
    ]


@pytest.mark.timeout(30)
def test_fifo_report_refused_by_loader(ex):
    from prx_data.stream.dataset import DatasetSpec, load_sources

    report = os.path.join(ex, "report.json")
    os.remove(report)
    os.mkfifo(report)
    with pytest.raises(confined.UnsafeFileError, match="FIFO"):
        load_sources(DatasetSpec(root=ex), [512])


# --- reads without bound -------------------------------------------------------------------


@pytest.mark.timeout(30)
def test_sidecar_linked_to_dev_zero(ex, capsys):
    from prx_data.cli.skips import main
    from prx_data.stream.dataset import DatasetSpec, load_sources

    link = os.path.join(ex, B, f"{_shard(ex)}.dedup.skip")
    os.symlink("/dev/zero", link)
    assert main(["list", ex]) in (0, 1)
    out = capsys.readouterr().out
    assert f"{link}: a symbolic link out of {ex}" in out
    with pytest.raises(S.SkipListError, match="symbolic link"):
        load_sources(DatasetSpec(root=ex), [512])
    rc, out = _verify_lines(ex, capsys)
    assert rc == 1 and f"{link}: a symbolic link (to /dev/zero)" in out


@pytest.mark.timeout(30)
def test_sidecar_larger_than_its_shard_allows_is_not_read(ex):
    shard = next(s for s in layout.read_index(ex, B) if s.basename.startswith(PART))
    path = os.path.join(ex, B, f"{shard.basename}.dedup.skip")
    with open(path, "wb") as f:  # sparse: 1 GiB on paper, nothing on disk
        f.truncate(1 << 30)
    with pytest.raises(S.SkipListError, match="more than the"):
        S.read_sidecar(ex, B, shard, "dedup")
    problems = S.sidecar_problems(ex)
    assert [p.path for p in problems] == [path]


@pytest.mark.timeout(30)
def test_confined_read_rules(tmp_path):
    root = tmp_path / "root"
    (root / "d").mkdir(parents=True)
    (root / "d" / "f").write_bytes(b"abc")
    os.symlink(root / "d" / "f", root / "inside-link")
    (tmp_path / "secret").write_bytes(b"s")
    os.symlink(tmp_path / "secret", root / "out-link")
    box = confined.Confined(str(root))
    assert box.read(str(root / "d" / "f"), 3) == b"abc"
    assert box.read("inside-link", 3) == b"abc"  # a link that stays inside is fine
    with pytest.raises(confined.UnsafeFileError, match="more than the 2"):
        box.read("d/f", 2)
    with pytest.raises(confined.UnsafeFileError, match="out of"):
        box.read("out-link", 10)
    with pytest.raises(confined.UnsafeFileError, match="not inside"):
        box.read(str(tmp_path / "secret"), 10)
    with pytest.raises(FileNotFoundError):
        box.read("d/missing", 10)
    with pytest.raises(confined.UnsafeFileError, match="directory"):
        box.read("d", 10)
    with pytest.raises(confined.UnsafeFileError, match="symbolic link"):
        box.write_atomic("out-link", b"x")
    assert (tmp_path / "secret").read_bytes() == b"s"
    box.write_atomic("d/new", b"n")
    assert (root / "d" / "new").read_bytes() == b"n"
    remote = confined.Confined("s3://bucket/export")
    for bad in ("s3://bucket/export/../x", "s3://bucket/other/x", "s3://bucket/export//x"):
        with pytest.raises(confined.UnsafeFileError, match="not a key under"):
            remote.check_key(bad)
    assert remote.check_key("s3://bucket/export/512/1.000/index.json")


@pytest.mark.timeout(60)
def test_fifo_shard_refused_by_loader_and_rewrite_reported_by_verify(ex, tmp_path, capsys):
    from prx_data.skips.rewrite import rewrite_export
    from prx_data.stream.dataset import DatasetSpec, load_sources

    shard = os.path.join(ex, B, _shard(ex))
    os.remove(shard)
    os.mkfifo(shard)
    for call in (
        lambda: load_sources(DatasetSpec(root=ex), [512]),
        lambda: rewrite_export(ex, str(tmp_path / "out"), force=True),
    ):
        with pytest.raises(safety.UnsafeIndexError, match="not a regular file") as e:
            call()
        assert shard in str(e.value)
    rc, out = _verify_lines(ex, capsys, "--deep")
    assert rc == 1
    assert [ln for ln in out.splitlines() if ln.startswith(shard)] == [
        f"{shard}: a FIFO, not a regular file"
    ]


@pytest.mark.timeout(60)
def test_object_store_reads_are_capped_and_keys_confined(s3_bucket):
    from prx_data.core import storage

    root = f"s3://{s3_bucket}/ex"
    storage.write_bytes_atomic(f"{root}/{B}/big.skip", b"x" * 5000)
    storage.write_bytes_atomic(f"{root}/{B}/empty", b"")
    box = confined.Confined(root)
    assert box.read(f"{root}/{B}/big.skip", 5000) == b"x" * 5000
    with pytest.raises(confined.UnsafeFileError, match="more than the 4999"):
        box.read(f"{root}/{B}/big.skip", 4999)
    assert box.read(f"{root}/{B}/empty", 10) == b""
    with pytest.raises(FileNotFoundError):
        box.read(f"{root}/{B}/missing", 10)
    with pytest.raises(confined.UnsafeFileError, match="not a key under"):
        box.read(f"s3://{s3_bucket}/other/x", 10)


@pytest.mark.timeout(30)
def test_fifo_adoption_record_refused_by_verify_and_loader(ex, capsys):
    from prx_data.cli.verify import main
    from prx_data.stream.dataset import DatasetSpec, load_sources

    record = os.path.join(ex, *naming.ADOPTION_NAME.split("/"))
    os.makedirs(os.path.dirname(record))
    os.mkfifo(record)
    assert main([ex]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and record in err and "FIFO" in err
    with pytest.raises(PrxDataError, match="FIFO"):
        load_sources(DatasetSpec(root=ex), [512])


@pytest.mark.timeout(30)
def test_a_relative_root_reads_and_writes_its_own_files(tmp_path, monkeypatch):
    """Paths are built from the root as spelled: with a relative root they are relative to
    the working directory, not to the root a second time."""
    monkeypatch.chdir(tmp_path)
    os.makedirs("out/512/1.000")
    path = os.path.join("out", "512/1.000", "index.json")
    confined.write_atomic("out", path, b"{}")
    assert confined.read("out", path, 16) == b"{}"
    assert (tmp_path / "out/512/1.000/index.json").read_bytes() == b"{}"
    (tmp_path / "elsewhere").write_bytes(b"s")
    with pytest.raises(confined.UnsafeFileError, match="not inside"):
        confined.read("out", str(tmp_path / "elsewhere"), 16)
