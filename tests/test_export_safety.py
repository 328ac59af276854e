"""Export safety without Ray: the overwrite guard, the run lock, merge checks, completeness
checks in the loader, and ``python -m prx_data.verify`` on fabricated export trees."""

from __future__ import annotations

import io
import json
import os
import shutil
import signal
import subprocess
import sys
import time

import pytest
from prx_data.pipelines.write_mds import run_export

from prx_data.cli import verify as verify_cli
from prx_data.core.runtime import RunOptions
from prx_data.export import durable, layout, naming, safety
from prx_data.export.lock import ExportLock, ExportLocked
from prx_data.export.merge import done_parts, finalize
from prx_data.export.naming import ExportError
from prx_data.export.prepare import prepare_output
from prx_data.export.spec import ExportConfig
from prx_data.skips import sidecar as S
from prx_data.stream.dataset import BucketedDataset, DatasetSpec, load_sources
from tests.exportkit import make_export, skip_samples
from tests.tablekit import make_table

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
B = "512/1.000"


def _jpeg() -> bytes:
    from PIL import Image

    buf = io.BytesIO()
    Image.new("RGB", (600, 600), (9, 9, 9)).save(buf, "JPEG")
    return buf.getvalue()


@pytest.fixture(scope="module")
def table(tmp_path_factory):
    uri = str(tmp_path_factory.mktemp("t") / "t.lance")
    make_table(uri, [(f"s/{i}", _jpeg(), f"cap {i}") for i in range(3)])
    return uri


def _photo_folder(root) -> dict[str, bytes]:
    files = {}
    for year in ("2023", "2024"):
        os.makedirs(os.path.join(root, year))
        for i in range(2):
            rel = f"{year}/IMG_{i:04d}.jpg"
            files[rel] = _jpeg()
            with open(os.path.join(root, rel), "wb") as f:
                f.write(files[rel])
    return files


def _unchanged(root, files: dict[str, bytes]) -> bool:
    return all(open(os.path.join(root, rel), "rb").read() == data for rel, data in files.items())


# --- 1. overwrite and resume only what is provably ours -------------------------------------


@pytest.mark.parametrize("flag", ["overwrite", "resume"])
def test_photo_folder_with_year_dirs_is_never_touched(tmp_path, table, flag):
    root = str(tmp_path / "photos")
    files = _photo_folder(root)
    with pytest.raises(ExportError, match="not provably an export") as e:
        run_export(ExportConfig(table=table, out=root), RunOptions(progress=False), **{flag: True})
    assert "2023/IMG_0000.jpg" in str(e.value) and "export.marker" in str(e.value)
    assert _unchanged(root, files)
    assert sorted(os.listdir(root)) == ["2023", "2024"]  # not even a lock file is left


def test_export_with_foreign_files_inside_is_refused(tmp_path, table):
    root = str(tmp_path / "exp")
    make_export(root, {B: 4})
    os.makedirs(os.path.join(root, "2023"))
    open(os.path.join(root, "2023", "x.jpg"), "wb").write(b"mine")
    open(os.path.join(root, B, "notes.txt"), "w").write("mine")
    with pytest.raises(ExportError, match="not provably") as e:
        prepare_output(ExportConfig(table=table, out=root), overwrite=True)
    assert "2023/x.jpg" in str(e.value) and f"{B}/notes.txt" in str(e.value)
    assert os.path.exists(os.path.join(root, "2023", "x.jpg"))
    os.remove(os.path.join(root, "2023", "x.jpg"))
    os.rmdir(os.path.join(root, "2023"))
    os.remove(os.path.join(root, B, "notes.txt"))
    prepare_output(ExportConfig(table=table, out=root), overwrite=True)  # ours again: replaced
    assert not os.path.exists(os.path.join(root, B))
    assert os.path.exists(os.path.join(root, naming.MARKER_NAME))


def test_wide_part_names_are_ours_and_unknown_shard_suffixes_are_not(tmp_path):
    """Fragment ids past 999,999 widen the part name (part_name pads, never truncates); the
    overwrite guard and verify must both still recognise it. A shard file with a suffix
    that streaming never writes is somebody else's file."""

    root = str(tmp_path / "exp")
    make_export(root, {B: 4})
    wide = naming.part_name(1_234_567, 10**10)
    assert wide == "f1234567-10000000000"
    pdir = os.path.join(root, B, wide)
    os.makedirs(pdir)
    for f in ("shard.00000.mds", "shard.00001.mds.zstd", "index.json", "shard.00000.mds.d.skip"):
        open(os.path.join(pdir, f), "wb").close()
    assert safety.foreign_entries(root) == []
    assert naming.PART_SHARD_RE.fullmatch(f"{wide}/shard.00000.mds")
    open(os.path.join(pdir, "shard.00002.mds.exe"), "wb").close()
    assert safety.foreign_entries(root) == [f"{B}/{wide}/shard.00002.mds.exe"]


def test_content_part_names_are_ours_and_near_misses_are_not(tmp_path):
    """Parts and packs named by their ids (``u``/``p`` + 16 lower-case hex digits) are part
    folders of ours, beside the fragment-range names of older exports; a name that only
    looks like one (short, long, upper case, a suffix, a newline) is somebody else's."""
    root = str(tmp_path / "exp")
    make_export(root, {B: 4})
    digest = naming.ids_digest(["a", "b"])
    ours = [naming.content_part_name(digest), naming.content_pack_name(digest)]
    near = ["u" + "0" * 15, "u" + "0" * 17, "u" + "A" * 16, "p" + "0" * 16 + "-x", "q" + "0" * 16]
    for name in ours + near:
        os.makedirs(os.path.join(root, B, name))
        open(os.path.join(root, B, name, "shard.00000.mds"), "wb").close()
    assert all(naming.PART_RE.fullmatch(n) for n in ours)
    assert not any(naming.PART_RE.fullmatch(n) for n in [*near, ours[0] + "\n"])
    assert sorted(safety.foreign_entries(root)) == sorted(f"{B}/{n}" for n in near)


def test_out_that_is_a_file_and_table_without_images_are_clean_errors(tmp_path, table):
    f = tmp_path / "file.bin"
    f.write_bytes(b"x")
    with pytest.raises(ExportError, match="is a file"):
        run_export(ExportConfig(table=table, out=str(f)), RunOptions(progress=False))
    with pytest.raises(ExportError, match="is a file"):
        run_export(ExportConfig(table=table, out=str(f / "sub")), RunOptions(progress=False))
    import lance
    import pyarrow as pa

    uri = str(tmp_path / "noimg.lance")
    lance.write_dataset(pa.table({"id": ["a"], "caption": ["c"]}), uri)
    out = str(tmp_path / "o")
    with pytest.raises(ExportError, match="no 'image', 'width', 'height' column"):
        run_export(ExportConfig(table=uri, out=out), RunOptions(progress=False))
    assert not os.path.exists(out)


# --- 2. the run lock ------------------------------------------------------------------------

HOLD = """
import sys
from prx_data.export.lock import ExportLock
lock = ExportLock(sys.argv[1]); lock.acquire()
print("held", flush=True)
sys.stdin.read()
lock.release()
"""


def _holder(out: str) -> subprocess.Popen:
    p = subprocess.Popen(
        [sys.executable, "-c", HOLD, out],
        env={**os.environ, "PYTHONPATH": REPO},
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    assert p.stdout.readline().strip() == "held"
    return p


def test_second_run_and_resume_are_refused_while_a_run_holds_the_lock(tmp_path, table):
    out = str(tmp_path / "o")
    os.makedirs(out)
    holder = _holder(out)
    try:
        for kw in ({}, {"resume": True}, {"overwrite": True}):
            with pytest.raises(ExportLocked, match=f"pid {holder.pid}"):
                run_export(ExportConfig(table=table, out=out), RunOptions(progress=False), **kw)
        assert os.listdir(out) == [naming.LOCK_NAME]
    finally:
        holder.stdin.close()
        holder.wait()
    assert os.listdir(out) == []  # released and removed
    with ExportLock(out) as lock:
        assert lock.took_over is None


def test_lock_of_a_killed_run_is_taken_over(tmp_path):
    out = str(tmp_path / "o")
    holder = _holder(out)
    os.kill(holder.pid, signal.SIGKILL)
    holder.wait()
    assert os.path.exists(os.path.join(out, naming.LOCK_NAME))  # left behind
    with ExportLock(out) as lock:
        assert f"pid {holder.pid}" in lock.took_over
        with pytest.raises(ExportLocked):
            ExportLock(out).acquire()


@pytest.mark.remote
def test_remote_lease_refuses_heartbeats_and_expires(s3_bucket):
    out = f"s3://{s3_bucket}/exp"
    with ExportLock(out, ttl_s=1.5) as lock:
        time.sleep(2.5)  # longer than the ttl: only the heartbeat keeps it
        with pytest.raises(ExportLocked, match="holds the lease"):
            ExportLock(out).acquire()
        lock.check()
    with ExportLock(out) as again:  # released: free
        assert again.took_over is None
    dead = ExportLock(out, ttl_s=1.0)
    dead.acquire()
    dead._lease._stop.set()  # a run that died: no heartbeat, lease never deleted
    time.sleep(1.5)
    with ExportLock(out) as lock:
        assert "stopped refreshing" in lock.took_over
        assert dead._lease._refresh() is False  # the dead run, woken up, cannot refresh
        assert "another run took it over" in dead._lease.lost


# --- merged counts are checked before the index is written --------------------------------


def test_merge_refuses_a_part_changed_by_another_run(tmp_path):
    root = str(tmp_path / "exp")
    make_export(root, {B: 40}, samples_per_part=16)
    results = done_parts(root)
    index = os.path.join(root, B, naming.INDEX_NAME)
    os.remove(index)
    part = sorted(results)[1]
    results[part].buckets[B] -= 3  # the unit wrote 13, the part on disk holds 16
    cfg = ExportConfig(table="t", out=root, caption_columns=("caption",))
    with pytest.raises(ExportError, match=f"{part}.*16 samples but its work unit wrote 13"):
        finalize(cfg, results, 0.0)
    assert not os.path.exists(index)


# --- 3. the loader refuses an incomplete export -----------------------------------------------


def test_loader_refuses_incomplete_exports_unless_allowed(tmp_path):
    root = str(tmp_path / "exp")
    make_export(root, {B: 40}, samples_per_part=16)
    assert [b.bucket for b in load_sources(DatasetSpec(root), [512])] == [B]
    report = os.path.join(root, "report.json")
    saved = open(report).read()
    os.remove(report)
    with pytest.raises(layout.IncompleteExport, match="no report.json"):
        BucketedDataset(root, tier=512, batch_size=4)
    assert load_sources(DatasetSpec(root, allow_incomplete=True), [512])[0].samples == 40
    open(report, "w").write(saved)
    marker = layout.list_markers(root)[0]
    os.rename(marker, marker + ".bak")
    with pytest.raises(layout.IncompleteExport, match="3 work units but _progress/ holds 2"):
        load_sources(DatasetSpec(root), [512])
    os.rename(marker + ".bak", marker)
    obj = json.loads(saved)
    obj["buckets"][B] = 41
    open(report, "w").write(json.dumps(obj))
    with pytest.raises(layout.IncompleteExport, match="index holds 40 samples"):
        load_sources(DatasetSpec(root), [512])


# --- 4. hashes and verify ---------------------------------------------------------------------


def _verify(root: str, *args: str, capsys) -> tuple[int, str]:
    rc = verify_cli.main([root, "--no-progress", *args])
    return rc, capsys.readouterr().out


@pytest.fixture
def export_with_list(tmp_path):
    root = str(tmp_path / "exp")
    fake = make_export(root, {B: 40, "512/0.500": 8}, samples_per_part=16, hashes=("xxh64",))
    skip_samples(root, "dedup", ids=sorted(fake.ids[B])[:5])
    return root


def test_verify_passes_a_good_export(export_with_list, capsys):
    assert _verify(export_with_list, "--deep", capsys=capsys) == (0, "")


def _shard(root: str) -> str:
    shard = layout.read_index(root, B)[0]
    return os.path.join(root, B, shard.basename)


def test_same_size_bit_flip_is_caught_by_deep_verify(export_with_list, capsys):
    path = _shard(export_with_list)
    data = bytearray(open(path, "rb").read())
    data[len(data) // 2] ^= 0x01
    open(path, "wb").write(bytes(data))
    assert _verify(export_with_list, capsys=capsys)[0] == 0  # same size: only --deep sees it
    rc, out = _verify(export_with_list, "--deep", capsys=capsys)
    assert rc == 1 and f"{path}: xxh64 is" in out and "bytes changed" in out


def test_append_and_missing_shard_are_caught(export_with_list, capsys):
    path = _shard(export_with_list)
    with open(path, "ab") as f:
        f.write(b"more")
    rc, out = _verify(export_with_list, capsys=capsys)
    assert rc == 1 and f"{path}: " in out and "bytes, the index records" in out
    os.remove(path)
    rc, out = _verify(export_with_list, capsys=capsys)
    assert rc == 1 and f"{path}: shard listed in the index is missing" in out


def test_rewritten_shard_unbinds_its_sidecars(export_with_list, capsys):
    """A shard rewritten at the same size (new bytes, new hash in the index) keeps no list."""
    root = export_with_list
    index_path = os.path.join(root, B, naming.INDEX_NAME)
    index = json.load(open(index_path))
    index["shards"][0]["raw_data"]["hashes"]["xxh64"] = "0" * 16
    open(index_path, "w").write(json.dumps(index))
    shards = layout.read_index(root, B)
    with pytest.raises(S.SkipListError, match="xxh64"):
        S.load_skips(root, B, shards)
    rc, out = _verify(root, capsys=capsys)
    assert rc == 1 and ".dedup.skip: sidecar does not match its shard" in out


def test_renamed_orphan_and_bad_sidecars_are_listed(export_with_list, capsys):
    root = export_with_list
    bdir = os.path.join(root, B)
    [rel] = [r for r in layout.list_suffix(bdir, ".skip")][:1]
    side = os.path.join(bdir, rel)
    renamed = side.replace(".dedup.skip", ".keep.skip")
    shutil.copy(side, renamed)
    orphan = os.path.join(bdir, os.path.dirname(rel), "shard.00009.mds.dedup.skip")
    shutil.copy(side, orphan)
    upper = side.replace(".dedup.skip", ".Dedup.skip")
    shutil.copy(side, upper)
    broken = side.replace(".dedup.skip", ".broken.skip")
    open(broken, "wb").write(b"PRXSKIP1garbage")
    rc, out = _verify(root, capsys=capsys)
    assert rc == 1
    assert f"{renamed}: header names list 'dedup' but the file is named for 'keep'" in out
    assert f"{orphan}: orphan sidecar" in out
    assert f"{upper}: sidecar name 'Dedup' is not a valid skip-list name" in out
    assert f"{broken}: truncated header" in out


def test_manifest_report_and_traversal_problems_are_listed(export_with_list, tmp_path, capsys):
    import pyarrow.parquet as pq

    root = export_with_list
    bdir = os.path.join(root, B)
    part = sorted(d for d in os.listdir(bdir) if os.path.isdir(os.path.join(bdir, d)))[0]
    mpath = os.path.join(bdir, part, "ids.parquet")
    t = pq.read_table(mpath)
    pq.write_table(t.slice(0, t.num_rows - 1), mpath)
    report = json.load(open(os.path.join(root, "report.json")))
    report["buckets"]["512/0.500"] = 9
    json.dump(report, open(os.path.join(root, "report.json"), "w"))
    victim = tmp_path / "victim"
    victim.mkdir()
    other = os.path.join(root, "512", "2.000")
    os.makedirs(other)
    json.dump(
        {
            "version": 2,
            "shards": [
                {
                    "raw_data": {"basename": "../../../victim/shard.00000.mds", "bytes": 1},
                    "samples": 1,
                }
            ],
        },
        open(os.path.join(other, "index.json"), "w"),
    )
    rc, out = _verify(root, capsys=capsys)
    assert rc == 1
    assert f"{mpath}: 15 rows for {part}/shard.00000.mds, the index records 16" in out
    assert "index holds 8 samples, report.json counts 9" in out
    assert "'../../../victim/shard.00000.mds' is not a <part>/shard.NNNNN.mds path" in out
    assert "512/2.000: bucket is not in report.json" in out
    os.remove(os.path.join(root, "report.json"))
    rc, out = _verify(root, capsys=capsys)
    assert "report.json: missing" in out


def test_dropped_rows_are_merged_in_part_order_and_gaps_reported(tmp_path):
    import pyarrow.parquet as pq

    root = str(tmp_path / "exp")
    make_export(root, {B: 40}, samples_per_part=16)
    results = done_parts(root)
    first, second, third = sorted(results)
    for part, rows in ((third, [("c", "too_small", "10x10")]), (first, [("a", "truncated", "")])):
        results[part].dropped = {rows[0][1]: 1, "filtered": 5}
        path = os.path.join(root, naming.DROPPED_DIR, f"{part}.parquet")
        durable.write_dropped_rows(path, rows)
    results[second].dropped = {"decode_error": 1}  # a unit whose list was never written
    cfg = ExportConfig(table="t", out=root, caption_columns=("caption",))
    with pytest.warns(UserWarning, match="lacks the dropped rows of 1 unit"):
        report = finalize(cfg, results, 0.0)
    got = pq.read_table(os.path.join(root, naming.DROPPED_NAME)).to_pylist()
    assert [(r["id"], r["reason"]) for r in got] == [("a", "truncated"), ("c", "too_small")]
    assert any(second in w for w in report.warnings)
