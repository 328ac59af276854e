"""The exporter under faults: dropped-row reports, caption warnings, temp files on resume,
kill -9 at random points, concurrent runs, bit flips, and object-storage faults (moto)."""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import lance
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from prx_data.pipelines.write_mds import run_export

from prx_data.cli import verify as verify_cli
from prx_data.core.runtime import RunOptions
from prx_data.export import layout, naming
from prx_data.export.layout import content_digest, is_complete
from prx_data.export.spec import ExportConfig
from tests import badinputs
from tests.exportkit import finalize_reference, pinned_cli_args, spawn_cli
from tests.s3proxy import relay, send_error

pytestmark = pytest.mark.ray
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture(scope="module")
def photo_ref(photo_table, tmp_path_factory, ray_local):
    out = str(tmp_path_factory.mktemp("ref") / "ref")
    run_export(
        ExportConfig(table=photo_table, out=out, rows_per_task=2, min_units=1),
        RunOptions(progress=False),
    )
    return out


def test_dropped_rows_are_listed_with_reason_and_hashes_recorded(bad_table, tmp_path, ray_local):
    uri, cases = bad_table
    out = str(tmp_path / "o")
    report = run_export(
        ExportConfig(table=uri, out=out, rows_per_task=5), RunOptions(progress=False)
    )
    dropped = pq.read_table(os.path.join(out, naming.DROPPED_NAME)).to_pylist()
    assert sorted((r["id"], r["reason"]) for r in dropped) == sorted(
        (i, reason) for i, _, _, reason in cases if reason
    )
    assert len(dropped) == sum(report.dropped.values())
    assert all(isinstance(r["detail"], str) for r in dropped)
    for bucket in report.buckets:
        for shard in json.load(open(os.path.join(out, bucket, "index.json")))["shards"]:
            assert set(shard["raw_data"]["hashes"]) == {"xxh64"}
    assert verify_cli.main([out, "--deep", "--no-progress"]) == 0


def test_caption_problems_are_warned_and_reported(tmp_path, ray_local):
    data = badinputs.good_jpeg()
    rows = {
        "id": ["a", "b"],
        "image": [data, data],
        "width": [640, 640],
        "height": [480, 480],
        "caption": pa.array([None, None], pa.string()),
    }
    uri = str(tmp_path / "nullcap.lance")
    lance.write_dataset(pa.table(rows), uri)
    with pytest.warns(UserWarning, match="null or empty in every exported sample"):
        report = run_export(
            ExportConfig(table=uri, out=str(tmp_path / "o1")), RunOptions(progress=False)
        )
    assert report.samples_written == 2
    on_disk = json.load(open(tmp_path / "o1" / "report.json"))
    assert any("'caption' is null or empty" in w for w in on_disk["warnings"])
    rows.pop("caption")
    uri2 = str(tmp_path / "nocap.lance")
    lance.write_dataset(pa.table(rows), uri2)
    with pytest.warns(UserWarning, match="has no caption column"):
        report = run_export(
            ExportConfig(table=uri2, out=str(tmp_path / "o2")), RunOptions(progress=False)
        )
    assert any("no caption column" in w for w in report.warnings)
    assert "warnings:" in (tmp_path / "o2" / "report.txt").read_text()


def test_resume_removes_temp_files_and_finishes(photo_table, photo_ref, tmp_path, ray_local):
    out = str(tmp_path / "o")
    run_export(
        ExportConfig(table=photo_table, out=out, rows_per_task=2, min_units=1),
        RunOptions(progress=False),
    )
    # Make it look like a run killed at its end: no report, one unit unfinished, temp files.
    os.remove(os.path.join(out, "report.json"))
    last = sorted(layout.list_markers(out))[-1]
    os.remove(last)
    bucket = layout.list_buckets(out)[0]
    bdir = os.path.join(out, bucket)
    part = sorted(p for p in os.listdir(bdir) if os.path.isdir(os.path.join(bdir, p)))[0]
    temps = [
        os.path.join(bdir, "index.json.tmp-deadbeef"),
        os.path.join(out, "_progress", "f000000-000000000.done.tmp-0badf00d"),
        os.path.join(bdir, part, "ids.parquet.tmp-12345678"),
    ]
    for t in temps:
        open(t, "wb").write(b"half")
    run_export(
        ExportConfig(table=photo_table, out=out, rows_per_task=2, min_units=1),
        RunOptions(progress=False),
        resume=True,
    )
    assert [t for t in temps if os.path.exists(t)] == []
    assert is_complete(out) and content_digest(out) == content_digest(photo_ref)


# --- fault injection ----------------------------------------------------------------------


def _cli(*args: str) -> list[str]:
    return [sys.executable, "-m", "prx_data.write_mds", *args]


@pytest.mark.faults
# A second kill point runs with -m slow: the default suite keeps one (its 15-minute budget).
@pytest.mark.parametrize("seed", [1, pytest.param(2, marks=pytest.mark.slow)])
def test_kill_at_random_point_then_resume_and_concurrent_runs(
    seed, photo_table, photo_ref, tmp_path
):
    out = str(tmp_path / "killed")
    env = {**os.environ, "PYTHONPATH": REPO}
    # On Ray whatever the table's size: the small-job driver path would finish before the
    # rival runs arrive, and the kill is aimed at a run with Ray workers.
    args = [*pinned_cli_args(photo_table, out), "--driver-rows", "0"]
    proc = spawn_cli(["prx_data.write_mds", *args], env)
    try:
        deadline = time.time() + 240
        while not os.path.exists(os.path.join(out, naming.CONFIG_NAME)):
            assert proc.poll() is None and time.time() < deadline, "the run did not start"
            time.sleep(0.05)
        # While it runs, a second run and a --resume are refused by the lock.
        for extra in ([], ["--resume"], ["--overwrite"]):
            r = subprocess.run(_cli(*args, *extra), env=env, capture_output=True, text=True)
            assert r.returncode == 2 and "holds the lock" in r.stderr, r.stderr[-2000:]
        time.sleep(random.Random(seed).uniform(0.0, 8.0))
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    r = subprocess.run(_cli(*args, "--resume"), env=env, capture_output=True, text=True)
    if r.returncode != 0:  # the kill came before there was anything to resume: said clearly
        assert r.returncode == 2 and "error:" in r.stderr, r.stderr[-2000:]
        r = subprocess.run(_cli(*args, "--overwrite"), env=env, capture_output=True, text=True)
    assert r.returncode == 0, r.stderr[-2000:]
    assert is_complete(out) and content_digest(out) == content_digest(photo_ref)
    assert verify_cli.main([out, "--deep", "--no-progress"]) == 0


@pytest.mark.faults
def test_bit_flip_in_a_real_export_is_caught_by_deep_verify(photo_ref, tmp_path, capsys):
    import shutil

    out = str(tmp_path / "copy")
    shutil.copytree(photo_ref, out)
    bucket = layout.list_buckets(out)[0]
    shard = layout.read_index(out, bucket)[0]
    path = os.path.join(out, bucket, shard.basename)
    data = bytearray(open(path, "rb").read())
    data[-10] ^= 0x80
    open(path, "wb").write(bytes(data))
    assert verify_cli.main([out, "--deep", "--no-progress"]) == 1
    assert f"{path}: xxh64 is" in capsys.readouterr().out


class FaultProxy(ThreadingHTTPServer):
    """Forwards to moto; the first request of each kind of object meets one fault."""

    daemon_threads = True

    def __init__(self, upstream: int):
        self.upstream = upstream
        self.seen: set[tuple[str, str]] = set()
        self.injected: dict[str, int] = {"5xx": 0, "timeout": 0, "partial": 0}
        self.lock = threading.Lock()
        super().__init__(("127.0.0.1", 0), _FaultHandler)

    def fault_for(self, method: str, path: str) -> str | None:
        rules = {
            ("PUT", ".mds"): "5xx",  # shards (streaming's boto3 uploader)
            ("PUT", ".done"): "timeout",  # unit markers (pyarrow)
            ("PUT", "ids.parquet"): "partial",  # manifests (pyarrow)
            ("GET", "index.json"): "5xx",  # part indexes read back by the merge
        }
        for (m, suffix), fault in rules.items():
            if method == m and path.endswith(suffix):
                # 5xx once per object; a stall or a cut upload once per run (each costs seconds)
                key = (method, path) if fault == "5xx" else fault
                with self.lock:
                    if key in self.seen:
                        return None
                    self.seen.add(key)
                    self.injected[fault] += 1
                return fault
        return None


class _FaultHandler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"

    def log_message(self, *args):
        pass

    def _forward(self):
        srv: FaultProxy = self.server  # type: ignore[assignment]
        path = self.path.split("?", 1)[0]
        n = int(self.headers.get("Content-Length") or 0)
        fault = srv.fault_for(self.command, path)
        if fault == "partial":  # take half the upload, then drop the connection
            self.rfile.read(n // 2)
            self.close_connection = True
            self.connection.close()
            return
        body = self.rfile.read(n) if n else None
        if fault == "timeout":  # never answer within the client's timeout
            time.sleep(12)
            self.close_connection = True
            return
        if fault == "5xx":
            send_error(self, 500, "InternalError")
            return
        relay(self, srv.upstream, body)

    do_GET = do_PUT = do_POST = do_HEAD = do_DELETE = _forward


@pytest.mark.faults
@pytest.mark.remote
def test_object_storage_faults_are_absorbed_by_retries(
    photo_table, photo_ref, s3_bucket, moto_server, monkeypatch, ray_local
):
    port = int(moto_server.rsplit(":", 1)[1])
    proxy = FaultProxy(port)
    threading.Thread(target=proxy.serve_forever, daemon=True).start()
    try:
        monkeypatch.setenv("S3_ENDPOINT_URL", f"http://127.0.0.1:{proxy.server_address[1]}")
        monkeypatch.setenv("S3_READ_TIMEOUT_S", "4")  # the stalled request times out and is retried
        out = f"s3://{s3_bucket}/faulty"
        run_export(
            ExportConfig(table=photo_table, out=out, rows_per_task=2, min_units=1),
            RunOptions(progress=False),
        )
    finally:
        proxy.shutdown()
        proxy.server_close()
    assert all(proxy.injected.values()), proxy.injected
    monkeypatch.setenv("S3_ENDPOINT_URL", moto_server)
    assert is_complete(out) and content_digest(out) == content_digest(photo_ref)
    assert verify_cli.main([out, "--deep", "--no-progress"]) == 0


def _jpeg(size: tuple[int, int]) -> bytes:
    import io

    from PIL import Image

    buf = io.BytesIO()
    Image.new("RGB", size, (40, 90, 160)).save(buf, "JPEG")
    return buf.getvalue()


@pytest.mark.faults
def test_unit_retried_after_its_worker_died_finishes_with_identical_bytes(
    tmp_path, monkeypatch, ray_local
):
    """A Ray worker dies mid-unit; Ray runs the unit again, and the retry meets what the
    first attempt left: shards and part indexes with no manifest yet in one unit, every
    file of its parts but no marker in another. The export still finishes, byte-identical
    to an undisturbed run of the same plan."""
    from prx_data.export.prepare import plan_units, prepare_output
    from prx_data.export.unit import export_unit
    from prx_data.pipelines import write_mds
    from tests.tablekit import make_table

    table = str(tmp_path / "t.lance")
    sizes = [(600, 600), (1200, 600), (600, 600), (600, 1200)]
    make_table(table, [(f"s/{i}", _jpeg(s), f"cap {i}") for i, s in enumerate(sizes)])
    ref = prepare_output(ExportConfig(table=table, out=str(tmp_path / "ref"), rows_per_task=2)).cfg
    finalize_reference(ref, {u.part: export_unit(ref, u) for u in plan_units(ref)})  # undisturbed
    first, second = sorted(u.part for u in plan_units(ref))
    crashes = {first: "write_manifest", second: "marker_path"}
    flags = str(tmp_path / "died")
    os.makedirs(flags)

    class DieOnce(write_mds._ExportTask):  # local class: cloudpickle ships it by value
        def __call__(self, row: dict) -> dict:
            from prx_data.export import unit as U

            part = naming.part_name(int(row["fragment_id"]), int(row["start"]))
            point = crashes.get(part)
            if point:
                try:
                    os.close(os.open(os.path.join(flags, part), os.O_CREAT | os.O_EXCL))
                except FileExistsError:
                    point = None  # the retry: run as usual
            if point:
                setattr(U, point, lambda *a, **k: os._exit(1))  # the worker dies right there
            return super().__call__(row)

    monkeypatch.setattr(write_mds, "_ExportTask", DieOnce)
    out = str(tmp_path / "o")
    run_export(
        ExportConfig(table=table, out=out, rows_per_task=2, min_units=1),
        RunOptions(progress=False, engine="ray"),
    )
    assert sorted(os.listdir(flags)) == sorted(crashes)  # both workers did die
    assert is_complete(out) and content_digest(out) == content_digest(ref.out)
    assert not os.path.exists(os.path.join(out, naming.WRITING_DIR))
    assert verify_cli.main([out, "--deep", "--no-progress"]) == 0
