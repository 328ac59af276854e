"""End-to-end export: Lance -> bucketed MDS through the Ray Data job."""

from __future__ import annotations

import io
import json
import os
import signal
import subprocess
import sys
import time

import lance
import numpy as np
import pytest
from PIL import Image
from prx_data.pipelines.write_mds import run_export
from streaming import LocalDataset, StreamingDataset

from prx_data.core.buckets import parse_bucket_name
from prx_data.core.runtime import RunOptions
from prx_data.export.layout import content_digest, is_complete
from prx_data.export.naming import ExportError
from prx_data.export.spec import ExportConfig
from tests import badinputs
from tests.exportkit import pinned_cli_args, spawn_cli

pytestmark = pytest.mark.ray
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _q92_tables():
    buf = io.BytesIO()
    Image.new("RGB", (64, 64), (1, 2, 3)).save(buf, "JPEG", quality=92)
    return Image.open(buf).quantization


def _read_bucket(root: str, bucket: str) -> list[dict]:
    # LocalDataset reads the MDS index and shards directly; a StreamingDataset per
    # bucket would hold hundreds of shared-memory handles each for the whole session.
    ds = LocalDataset(local=os.path.join(root, bucket))
    return [ds[i] for i in range(len(ds))]


def _all_buckets(root: str) -> list[str]:
    out = []
    for tier in sorted(os.listdir(root)):
        if tier.isdigit():
            for ar in sorted(os.listdir(os.path.join(root, tier))):
                if os.path.exists(os.path.join(root, tier, ar, "index.json")):
                    out.append(f"{tier}/{ar}")
    return out


@pytest.fixture(scope="module")
def bad_export(bad_table, tmp_path_factory, ray_local):
    uri, cases = bad_table
    out = str(tmp_path_factory.mktemp("bad_out") / "out")
    report = run_export(
        ExportConfig(table=uri, out=out, rows_per_task=5), RunOptions(progress=False)
    )
    return out, report, cases


def test_bad_inputs_counted_and_good_rows_written(bad_export):
    out, report, cases = bad_export
    expected_drops = {}
    for _, _, _, reason in cases:
        if reason:
            expected_drops[reason] = expected_drops.get(reason, 0) + 1
    assert report.dropped == expected_drops
    good = {i for i, _, _, reason in cases if reason is None}
    assert report.rows_read == len(cases)
    assert report.samples_written == len(good)
    written = set()
    for b in _all_buckets(out):
        written |= {s["id"] for s in _read_bucket(out, b)}
    assert written == good
    assert report.notes == {
        "caption_missing": 1,
        "caption_empty": 1,
        "caption_truncated": 1,
    }
    on_disk = json.load(open(os.path.join(out, "report.json")))
    assert on_disk["dropped"] == expected_drops and on_disk["samples_written"] == len(good)


def test_samples_decode_to_bucket_shape_at_q92(bad_export):
    out, _, _ = bad_export
    q92 = _q92_tables()
    n = 0
    for b in _all_buckets(out):
        bucket = parse_bucket_name(b)
        for s in _read_bucket(out, b):
            im = Image.open(io.BytesIO(s["image"]))
            assert im.format == "JPEG" and im.mode == "RGB"
            assert im.size == (bucket.width, bucket.height)
            assert im.quantization == q92
            assert s["bucket"] == b and s["tier"] == bucket.tier
            left, top, right, bottom = (
                s["crop_left"],
                s["crop_top"],
                s["crop_right"],
                s["crop_bottom"],
            )
            assert (
                0 <= left < right <= s["width"] + 1e-3 and 0 <= top < bottom <= s["height"] + 1e-3
            )
            assert np.isclose(
                (right - left) / (bottom - top), bucket.width / bucket.height, rtol=1e-3
            )
            n += 1
    assert n > 0


def test_ids_map_back_to_lance_rows(bad_export, bad_table):
    out, _, _ = bad_export
    uri, _ = bad_table
    table = lance.dataset(uri).to_table(columns=["id", "caption", "width", "height"]).to_pylist()
    rows = {r["id"]: r for r in table}
    for b in _all_buckets(out):
        for s in _read_bucket(out, b):
            row = rows[s["id"]]
            assert (s["width"], s["height"]) == (row["width"], row["height"])
            cap = (row["caption"] or "").strip() and row["caption"]
            assert s["caption"] == (cap or "")[:20000]
    # the per-part manifests agree with the shards
    import pyarrow.parquet as pq

    for b in _all_buckets(out):
        samples = _read_bucket(out, b)
        ids = []
        bdir = os.path.join(out, b)
        for part in sorted(p for p in os.listdir(bdir) if os.path.isdir(os.path.join(bdir, p))):
            ids += pq.read_table(os.path.join(bdir, part, "ids.parquet")).column("id").to_pylist()
        assert ids == [s["id"] for s in samples]


def test_png_option_is_lossless_format(bad_table, tmp_path, ray_local):
    uri, _ = bad_table
    out = str(tmp_path / "png")
    run_export(
        ExportConfig(table=uri, out=out, image_format="png", filter="id = 'bad/good'"),
        RunOptions(progress=False),
    )
    [b] = _all_buckets(out)
    [s] = _read_bucket(out, b)
    assert Image.open(io.BytesIO(s["image"])).format == "PNG"
    report = json.load(open(os.path.join(out, "report.json")))
    assert report["dropped"]["filtered"] == len(badinputs.all_cases()) - 1


def test_rerun_gives_identical_bytes_and_output_guard(photo_table, tmp_path, ray_local):
    a, b = str(tmp_path / "a"), str(tmp_path / "b")
    cfg = ExportConfig(table=photo_table, out=a, rows_per_task=4)
    r1 = run_export(cfg, RunOptions(progress=False))
    run_export(ExportConfig(table=photo_table, out=b, rows_per_task=4), RunOptions(progress=False))
    assert content_digest(a) == content_digest(b)
    with pytest.raises(ExportError, match="--overwrite"):
        run_export(cfg, RunOptions(progress=False))
    r2 = run_export(cfg, RunOptions(progress=False), overwrite=True)
    assert content_digest(a) == content_digest(b) and r2.buckets == r1.buckets
    # a directory that is not an export is never deleted
    foreign = tmp_path / "foreign"
    foreign.mkdir()
    (foreign / "notes.txt").write_text("mine")
    with pytest.raises(ExportError, match="not provably an export"):
        run_export(
            ExportConfig(table=photo_table, out=str(foreign)),
            RunOptions(progress=False),
            overwrite=True,
        )
    assert (foreign / "notes.txt").exists()


def _cli(*args: str) -> list[str]:
    return [sys.executable, "-m", "prx_data.write_mds", *args]


def test_kill_and_resume_gives_complete_valid_output(photo_table, tmp_path, ray_local):
    ref = str(tmp_path / "ref")
    run_export(
        ExportConfig(table=photo_table, out=ref, rows_per_task=2, min_units=1),
        RunOptions(progress=False),
    )
    out = str(tmp_path / "killed")
    env = {**os.environ, "PYTHONPATH": REPO}
    args = pinned_cli_args(photo_table, out)
    proc = spawn_cli(["prx_data.write_mds", *args], env)
    progress = os.path.join(out, "_progress")
    deadline = time.time() + 240
    while time.time() < deadline:
        done = (
            [f for f in os.listdir(progress) if f.endswith(".done")]
            if os.path.isdir(progress)
            else []
        )
        if len(done) >= 2:
            break
        assert proc.poll() is None, "export finished before it could be killed"
        time.sleep(0.2)
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    # nothing looks complete
    assert not is_complete(out)
    assert _all_buckets(out) == []
    # a plain rerun refuses and says how to continue
    r = subprocess.run(_cli(*args), env=env, capture_output=True, text=True)
    assert r.returncode == 2 and "--resume" in r.stderr
    r = subprocess.run(_cli(*args, "--resume"), env=env, capture_output=True, text=True)
    assert r.returncode == 0, r.stderr[-2000:]
    assert is_complete(out)
    assert content_digest(out) == content_digest(ref)
    for b in _all_buckets(ref):
        assert [s["id"] for s in _read_bucket(out, b)] == [s["id"] for s in _read_bucket(ref, b)]


def test_resume_refuses_changed_options(photo_table, tmp_path, ray_local):
    out = str(tmp_path / "o")
    cfg = ExportConfig(table=photo_table, out=out, rows_per_task=4)
    from prx_data.export.prepare import prepare_output

    prepare_output(cfg)
    with pytest.raises(ExportError, match="options differ") as e:
        run_export(
            ExportConfig(table=photo_table, out=out, rows_per_task=4, quality=80),
            RunOptions(),
            resume=True,
        )
    assert "(here: --quality 92)" in str(e.value)
    # An export begun under the previous default codec names the flag that resumes it.
    old = str(tmp_path / "old")
    prepare_output(ExportConfig(table=photo_table, out=old, rows_per_task=4, codec="pillow"))
    with pytest.raises(ExportError, match="here: --codec pillow"):
        run_export(
            ExportConfig(table=photo_table, out=old, rows_per_task=4), RunOptions(), resume=True
        )


TWO_NODE_SCRIPT = r"""
import json, sys
import ray
from ray.cluster_utils import Cluster
cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 1})
cluster.add_node(num_cpus=1)
ray.init(address=cluster.address)
from prx_data.pipelines.write_mds import run_export
from prx_data.core.runtime import RunOptions
from prx_data.export.unit import ExportConfig
report = run_export(ExportConfig(table=sys.argv[1], out=sys.argv[2], rows_per_task=2, min_units=1), RunOptions(progress=False))
nodes = [n for n in ray.nodes() if n["Alive"]]
print(json.dumps({"nodes": len(nodes), "written": report.samples_written, "rows": report.rows_read}))
ray.shutdown()
cluster.shutdown()
"""


def test_runs_on_two_node_ray_cluster(photo_table, tmp_path):
    out = str(tmp_path / "cluster")
    env = {**os.environ, "PYTHONPATH": REPO}
    env.pop("RAY_ADDRESS", None)
    r = subprocess.run(
        [sys.executable, "-c", TWO_NODE_SCRIPT, photo_table, out],
        env=env,
        capture_output=True,
        text=True,
        timeout=400,
    )
    assert r.returncode == 0, r.stderr[-3000:]
    res = json.loads(r.stdout.strip().splitlines()[-1])
    assert res["nodes"] == 2 and res["written"] == res["rows"] > 0
    assert is_complete(out)


@pytest.mark.remote
def test_export_to_object_storage(photo_table, s3_bucket, tmp_path, ray_local):
    out = f"s3://{s3_bucket}/exports/run1"
    report = run_export(
        ExportConfig(table=photo_table, out=out, rows_per_task=8), RunOptions(progress=False)
    )
    assert is_complete(out)
    bucket = next(iter(report.buckets))
    ds = StreamingDataset(
        remote=f"{out}/{bucket}", local=str(tmp_path / "cache"), shuffle=False, batch_size=1
    )
    ids = [ds[i]["id"] for i in range(ds.num_samples)]
    assert len(ids) == report.buckets[bucket]
    assert all(i.startswith("sample/") for i in ids)


def test_vips_codec_counts_the_same_drops(bad_table, tmp_path, ray_local):
    uri, cases = bad_table
    out = str(tmp_path / "vips")
    report = run_export(
        ExportConfig(table=uri, out=out, rows_per_task=9, codec="vips"), RunOptions(progress=False)
    )
    expected = {}
    for _, _, _, reason in cases:
        if reason:
            expected[reason] = expected.get(reason, 0) + 1
    assert report.dropped == expected
    q92 = _q92_tables()
    for b in _all_buckets(out):
        bucket = parse_bucket_name(b)
        for s in _read_bucket(out, b):
            im = Image.open(io.BytesIO(s["image"]))
            assert im.size == (bucket.width, bucket.height) and im.quantization == q92
