"""A small job's work units on driver threads: the Ray path's export, without starting Ray.

``write_mds`` of a table of at most ``--driver-rows`` rows, where the job would
start a private local Ray runtime, runs its units and packs on threads of its
own process. Checked: the tree equals the Ray path's byte for byte (but for the
timings and the id index's random Lance file names, whose rows are equal); a
fresh CLI run of a tiny table never starts Ray; ``--driver-rows`` and every
case where a Ray runtime exists already (a cluster address, a live ``ray
start`` record, Ray up in the process) keep the Ray path.
"""

from __future__ import annotations

import io
import json
import os
import re
import shutil
import socket
import subprocess
import sys
import threading
import warnings

import lance
import prx_data.pipelines.write_mds as pipeline
import pytest
from PIL import Image

from prx_data.core import runtime
from prx_data.core.runtime import RunOptions
from prx_data.export.append import ROWS_RECORD, record_uri
from prx_data.export.idindex import index_uri
from prx_data.export.spec import ExportConfig
from tests.tablekit import make_table

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SHAPES = [(640, 480), (512, 512), (480, 640), (700, 520), (520, 520), (600, 450)]


def _jpeg(i: int, size: tuple[int, int]) -> bytes:
    buf = io.BytesIO()
    Image.new("RGB", size, (40 * i % 256, 120, 200 - 20 * i)).save(buf, "JPEG")
    return buf.getvalue()


@pytest.fixture()
def table(tmp_path) -> str:
    """Six photos in three buckets and one broken file, over two fragments."""
    rows = [(f"d/{i}", _jpeg(i, s), f"photo {i}") for i, s in enumerate(SHAPES)]
    rows.insert(3, ("d/broken", b"not an image", "broken"))
    uri = str(tmp_path / "t.lance")
    make_table(uri, rows, max_rows_per_file=4)
    return uri


def _tree(root: str) -> dict[str, object]:
    """Every file's bytes, the timings taken out; the id index and the row record (Lance
    tables: their files carry fresh uuids) as their rows."""
    got: dict[str, object] = {}
    for d, _, files in os.walk(root):
        for f in files:
            rel = os.path.relpath(os.path.join(d, f), root)
            if rel.startswith(("_ids.lance", ROWS_RECORD)):
                continue
            with open(os.path.join(d, f), "rb") as fh:
                data = fh.read()
            if rel == "report.json" or rel.endswith(".done"):
                data = {k: v for k, v in json.loads(data).items() if k != "seconds"}
            elif rel == "report.txt":
                data = re.sub(rb"units in [0-9.]+ s \([0-9.,]+ rows/s\)", b"", data)
            got[rel] = data
    ids = lance.dataset(index_uri(root)).to_table()
    got["_ids.lance rows"] = ids.sort_by([(n, "ascending") for n in ids.column_names])
    rows = lance.dataset(record_uri(root)).to_table()
    got["row record"] = rows.sort_by([(n, "ascending") for n in rows.column_names])
    return got


def _no_ray_stage(*a, **k):
    raise AssertionError("a Ray Data stage was built on the driver path")


@pytest.mark.ray
def test_driver_threads_write_the_ray_paths_export_byte_for_byte(
    table, tmp_path, ray_local, monkeypatch
):
    out, ray_tree = str(tmp_path / "out"), str(tmp_path / "ray")
    cfg = ExportConfig(table=table, out=out, tiers=(512,))  # the unit count is automatic
    ray_report = pipeline.run_export(cfg, RunOptions(progress=False, engine="ray"))
    shutil.move(out, ray_tree)
    # Small work on driver threads, Ray up or not: 2 CPUs, like the session's Ray runtime.
    cpus = int(ray_local.cluster_resources()["CPU"])
    monkeypatch.setattr(runtime, "_on_ray", _no_ray_stage)
    report = pipeline.run_export(cfg, RunOptions(progress=False, num_cpus=cpus))
    assert report.units == ray_report.units == len(SHAPES) + 1  # 8 per CPU, one row each
    assert report.samples_written == len(SHAPES) and report.dropped
    assert len(report.buckets) == 3
    assert _tree(out) == _tree(ray_tree)


@pytest.mark.ray
def test_driver_path_packs_on_threads_whatever_the_size(table, tmp_path, ray_local, monkeypatch):
    """Packs over DRIVER_PACK_BYTES would go to Ray tasks; a job without Ray keeps them."""
    monkeypatch.setattr(runtime, "_on_ray", _no_ray_stage)
    monkeypatch.setattr(pipeline, "DRIVER_PACK_BYTES", 0)
    cfg = ExportConfig(table=table, out=str(tmp_path / "out"), tiers=(512,), min_units=2)
    report = pipeline.run_export(cfg, RunOptions(progress=False, num_cpus=2))
    assert report.samples_written == len(SHAPES)


@pytest.mark.ray
def test_driver_rows_and_table_size_pick_the_path(table, tmp_path, ray_local, monkeypatch):
    rows = len(SHAPES) + 1  # the table's rows
    three = RunOptions(num_cpus=3)
    cluster = RunOptions(num_cpus=3, ray_address="127.0.0.1:6379")
    with monkeypatch.context() as m:  # Ray is up in this process: size still decides
        m.delenv("RAY_ADDRESS", raising=False)
        assert pipeline.placement(rows, three, rows).threads == 3
        assert pipeline.placement(rows, three, rows - 1).on_ray  # a larger table: Ray
        assert pipeline.placement(rows, three, 0).on_ray  # --driver-rows 0: always Ray
        assert pipeline.placement(rows, cluster, rows).on_ray  # a named cluster
        local = RunOptions(num_cpus=3, engine="local")
        assert pipeline.placement(rows, local, 0).threads == 3
    # the flag reaches the job: 0 runs the units on Ray
    seen = []

    def spy(fn, units, where, *a, **k):
        seen.append((type(fn).__name__, where.on_ray))
        return runtime.map_units(fn, units, where, *a, **k)

    monkeypatch.setattr(pipeline, "map_units", spy)
    from prx_data.cli import write_mds as cli

    argv = ["--table", table, "--out", str(tmp_path / "o"), "--tiers", "512", "--no-progress"]
    assert cli.main([*argv, "--driver-rows", "0"]) == 0
    assert ("_ExportTask", True) in seen
    assert cli.build_parser().parse_args(argv).driver_rows == pipeline.DRIVER_UNIT_ROWS


@pytest.fixture()
def no_ray_here(monkeypatch, tmp_path):
    """As a fresh process sees it: Ray not initialised, no RAY_ADDRESS, a private record path."""
    import ray

    monkeypatch.setattr(ray, "is_initialized", lambda: False)
    monkeypatch.setenv("TMPDIR", str(tmp_path))
    for name in ("RAY_ADDRESS", "RAY_TMPDIR", "RAY_OVERRIDE_RESOURCES"):
        monkeypatch.delenv(name, raising=False)
    return os.path.join(str(tmp_path), "ray", "ray_current_cluster")


def _write_record(path: str, address: str) -> None:
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "w") as f:
        f.write(address)


def test_small_work_stays_here_beside_a_live_ray_start_record_and_a_stale_one(no_ray_here):
    with socket.socket() as head:  # something answers at the recorded address
        head.bind(("127.0.0.1", 0))
        head.listen()
        _write_record(no_ray_here, f"127.0.0.1:{head.getsockname()[1]}")
        assert runtime._record_state(warn=False) == "live"
        assert not runtime.place("auto", size=1, small=2).on_ray  # joined only for Ray work
        port = head.getsockname()[1]
    _write_record(no_ray_here, f"127.0.0.1:{port}")  # its head has stopped
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no Ray is started, so the record does not matter
        assert runtime._record_state(warn=False) == "stale"
        assert runtime.place("auto", size=1, small=2, num_cpus=2).threads == 2


def test_a_tiny_export_in_a_fresh_process_never_starts_ray(table, tmp_path):
    out = str(tmp_path / "out")
    code = (
        "import sys\n"
        "from prx_data.cli.write_mds import main\n"
        "rc = main(sys.argv[1:])\n"
        "assert 'ray' not in sys.modules or not sys.modules['ray'].is_initialized()\n"
        "assert 'ray.data' not in sys.modules, 'Ray Data was imported'\n"
        "sys.exit(rc)\n"
    )
    env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_")}
    env.update(PYTHONPATH=REPO, TMPDIR=str(tmp_path))
    r = subprocess.run(
        [sys.executable, "-c", code, "--table", table, "--out", out]
        + ["--tiers", "512", "--num-cpus", "2", "--no-progress"],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert r.returncode == 0, r.stderr[-2000:]
    assert "samples written           6" in r.stdout


# --- ensure_ray: worker settings reach a local runtime by inheritance ------------------------


class _Stop(Exception):
    pass


def test_a_local_runtime_gets_worker_settings_by_inheritance(no_ray_here, monkeypatch):
    """A job runtime_env would keep Ray from using the workers it prestarts; a local
    runtime inherits the variable instead, and the driver's environment is restored."""
    import ray

    seen: list[tuple[dict, str | None]] = []

    def init(*args, **kwargs):
        seen.append((kwargs, os.environ.get("LANCE_CPU_THREADS")))
        raise _Stop

    monkeypatch.setattr(ray, "init", init)
    monkeypatch.delenv("LANCE_CPU_THREADS", raising=False)
    with pytest.raises(_Stop):
        runtime.ensure_ray(num_cpus=1)
    kwargs, during = seen.pop()
    assert during == "1" and "runtime_env" not in kwargs and kwargs["num_cpus"] == 1
    assert "LANCE_CPU_THREADS" not in os.environ
    monkeypatch.setenv("LANCE_CPU_THREADS", "3")  # the user's own setting is passed on
    with pytest.raises(_Stop):
        runtime.ensure_ray(num_cpus=1)
    assert seen.pop()[1] == "3" and os.environ["LANCE_CPU_THREADS"] == "3"
    # a cluster's workers do not inherit this process's environment: a runtime_env
    monkeypatch.setattr(runtime, "_check_address", lambda *a: None)
    with pytest.raises(_Stop):
        runtime.ensure_ray("127.0.0.1:6379")
    kwargs, _ = seen.pop()
    assert kwargs["runtime_env"]["env_vars"]["LANCE_CPU_THREADS"] == "3"


@pytest.mark.ray
def test_workers_of_the_session_runtime_use_one_lance_thread(ray_local):
    @ray_local.remote
    def lance_threads() -> str | None:
        return os.environ.get("LANCE_CPU_THREADS")

    assert ray_local.get(lance_threads.remote()) == (os.environ.get("LANCE_CPU_THREADS") or "1")


@pytest.mark.remote
@pytest.mark.ray
def test_driver_threads_export_to_object_storage(
    table, s3_bucket, tmp_path, ray_local, monkeypatch
):
    """Units on two driver threads share the process's store clients; the tree is complete."""
    from prx_data.cli import verify as verify_cli
    from prx_data.export.layout import is_complete

    monkeypatch.setattr(runtime, "_on_ray", _no_ray_stage)
    out = f"s3://{s3_bucket}/exports/driver"
    cfg = ExportConfig(table=table, out=out, tiers=(512,), min_units=4)
    report = pipeline.run_export(cfg, RunOptions(progress=False, num_cpus=2))
    assert report.units >= 4 and report.samples_written == len(SHAPES)
    assert is_complete(out)
    assert verify_cli.main([out, "--deep", "--no-progress"]) == 0


@pytest.mark.ray
def test_a_ray_export_loads_the_pack_writer_here_while_its_units_run(
    table, tmp_path, ray_local, monkeypatch
):
    """The packs of a small Ray export run on this process's threads; streaming's writer
    (seconds of torch import) is loaded while the units run, not after them."""
    events = []

    def spy_preload():
        events.append("preload")
        return threading.Thread(target=lambda: None)

    def spy_map(fn, units, where, *a, **k):
        events.append((type(fn).__name__, where.on_ray))
        return runtime.map_units(fn, units, where, *a, **k)

    monkeypatch.setattr(pipeline, "preload_pack_writer", spy_preload)
    monkeypatch.setattr(pipeline, "map_units", spy_map)
    cfg = ExportConfig(table=table, out=str(tmp_path / "ray"), tiers=(512,), min_units=2)
    pipeline.run_export(cfg, RunOptions(progress=False), driver_rows=0)
    assert events[:2] == ["preload", ("_ExportTask", True)]
    events.clear()  # on driver threads the writer is imported before the units, in the foreground
    cfg = ExportConfig(table=table, out=str(tmp_path / "here"), tiers=(512,), min_units=2)
    pipeline.run_export(cfg, RunOptions(progress=False, num_cpus=2))
    assert events[0] == ("_ExportTask", False) and "preload" not in events


def test_the_pack_writer_preload_runs_elsewhere_and_leaves_a_failure_to_the_packs(monkeypatch):
    from prx_data.core import streaming_compat
    from prx_data.export import pack

    pack._encoded_writer.cache_clear()
    pack.preload_writer().join(30)
    assert pack._encoded_writer.cache_info().currsize == 1  # loaded, for the packs to reuse

    def broken():
        raise ImportError("no module named streaming")

    pack._encoded_writer.cache_clear()
    monkeypatch.setattr(streaming_compat, "mds_writer", broken)
    hooked: list = []
    monkeypatch.setattr(threading, "excepthook", hooked.append)
    t = pack.preload_writer()
    t.join(30)
    assert not t.is_alive() and hooked == []  # no thread traceback
    with pytest.raises(ImportError, match="no module named streaming"):
        pack._encoded_writer()  # the packs' own call raises it where it is reported
    monkeypatch.undo()
    pack._encoded_writer.cache_clear()
