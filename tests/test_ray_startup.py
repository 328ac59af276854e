"""Ray start-up is bounded: a dead cluster address fails fast, a stale cluster record is skipped.

Every test keeps Ray's cluster record private: ``TMPDIR`` points at the test's
own folder (Ray reads ``$TMPDIR/ray/ray_current_cluster`` on Linux), so the
host's ``/tmp/ray`` is never read or written.
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
import tempfile

import pytest

from prx_data.core import runtime
from tests.test_pins import _jpeg, _photos

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _closed_port() -> int:
    """A loopback port nothing listens on (bound once, then released)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _record(tmp: str, address: str) -> str:
    path = os.path.join(tmp, "ray", "ray_current_cluster")
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "w") as f:
        f.write(address)
    return path


class _Stop(Exception):
    pass


@pytest.fixture
def fake_init(monkeypatch, tmp_path):
    """Private TMPDIR, no RAY_ADDRESS, and a ``ray.init`` that records its arguments and stops."""
    import ray

    monkeypatch.setenv("TMPDIR", str(tmp_path))
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    monkeypatch.delenv("RAY_TMPDIR", raising=False)
    monkeypatch.setattr(ray, "is_initialized", lambda: False)
    calls: list[dict] = []

    def init(*args, **kwargs):
        calls.append(kwargs)
        raise _Stop

    monkeypatch.setattr(ray, "init", init)
    return calls


def test_stale_cluster_record_starts_a_local_ray_with_a_warning(fake_init, tmp_path):
    path = _record(str(tmp_path), f"127.0.0.1:{_closed_port()}")
    with pytest.warns(UserWarning) as caught, pytest.raises(_Stop):
        runtime.ensure_ray(num_cpus=1)
    (kwargs,) = fake_init
    assert kwargs.get("address") == "local" and kwargs["num_cpus"] == 1  # not the dead record
    assert runtime.ray_record_path() == path
    (message,) = [str(w.message) for w in caught if "nothing answers" in str(w.message)]
    assert path in message and "ray stop" in message


def test_live_cluster_record_is_joined_and_named_in_one_line(fake_init, tmp_path, capsys):
    with socket.socket() as gcs:  # something that accepts connections, like a live head's GCS
        gcs.bind(("127.0.0.1", 0))
        gcs.listen()
        address = f"127.0.0.1:{gcs.getsockname()[1]}"
        _record(str(tmp_path), address)
        with pytest.raises(_Stop):
            runtime.ensure_ray()
    (kwargs,) = fake_init
    assert kwargs.get("address") is None  # Ray resolves the record itself, as before
    (line,) = capsys.readouterr().err.strip().splitlines()
    assert address in line and "--engine local" in line and "RAY_ADDRESS=local" in line


def test_live_cluster_record_with_sizes_is_joined_without_them(fake_init, tmp_path, capsys):
    """Ray refuses num_cpus when it joins the recorded cluster: join it as it is, and say so."""
    with socket.socket() as gcs:
        gcs.bind(("127.0.0.1", 0))
        gcs.listen()
        _record(str(tmp_path), f"127.0.0.1:{gcs.getsockname()[1]}")
        with pytest.raises(_Stop):
            runtime.ensure_ray(num_cpus=2, object_store_memory=2**28)
    (kwargs,) = fake_init
    assert "num_cpus" not in kwargs and "object_store_memory" not in kwargs
    assert "at its own size" in capsys.readouterr().err


def test_dead_ray_address_env_fails_within_the_timeout(fake_init, monkeypatch):
    port = _closed_port()
    monkeypatch.setenv("RAY_ADDRESS", f"127.0.0.1:{port}")
    monkeypatch.setenv(runtime.CONNECT_TIMEOUT_ENV, "0.5")
    with pytest.raises(runtime.RayStartError) as e:
        runtime.ensure_ray()
    assert fake_init == []  # never handed to ray.init, which would retry for minutes
    msg = str(e.value)
    assert "\n" not in msg and f"127.0.0.1:{port}" in msg
    assert "unset RAY_ADDRESS" in msg and "ray stop" in msg and runtime.CONNECT_TIMEOUT_ENV in msg


def test_connect_timeout_setting_is_checked(monkeypatch):
    monkeypatch.setenv(runtime.CONNECT_TIMEOUT_ENV, "soon")
    with pytest.raises(runtime.RayStartError, match="not a number of seconds"):
        runtime.connect_timeout_s()
    assert runtime.connect_timeout_s(3) == 3.0
    monkeypatch.delenv(runtime.CONNECT_TIMEOUT_ENV)
    assert runtime.connect_timeout_s() == runtime.DEFAULT_CONNECT_TIMEOUT_S


def _env(tmp: str, **extra: str) -> dict:
    env = {k: v for k, v in os.environ.items() if k not in ("RAY_ADDRESS", "RAY_TMPDIR")}
    return {**env, "PYTHONPATH": REPO, "TMPDIR": tmp, **extra}


@pytest.mark.faults
def test_write_mds_with_a_dead_ray_address_fails_with_one_line(tmp_path):
    table = _photos(str(tmp_path / "t.lance"))
    out = str(tmp_path / "out")
    port = _closed_port()
    r = subprocess.run(
        [sys.executable, "-m", "prx_data.write_mds", "--table", table, "--out", out]
        + ["--ray-address", f"127.0.0.1:{port}", "--no-progress"],
        env=_env(str(tmp_path), **{runtime.CONNECT_TIMEOUT_ENV: "1"}),
        capture_output=True,
        text=True,
        timeout=240,  # Ray's own retries ran past this before
    )
    assert r.returncode == 2, r.stderr[-2000:]
    assert "Traceback" not in r.stderr
    last = r.stderr.strip().splitlines()[-1]
    assert last.startswith(f"error: no Ray cluster answers at 127.0.0.1:{port}")
    assert "--ray-address" in last and "ray stop" in last
    assert not os.path.exists(out)  # a refused run leaves no trace


@pytest.fixture
def short_tmp():
    """A private TMPDIR with a short path: Ray's socket paths under it must fit AF_UNIX's 107 bytes."""
    path = tempfile.mkdtemp(prefix="prx-ray-")
    yield path
    shutil.rmtree(path, ignore_errors=True)


@pytest.mark.slow
@pytest.mark.ray
def test_write_mds_with_a_stale_cluster_record_exports_on_a_local_ray(tmp_path, short_tmp):
    table = _photos(str(tmp_path / "t.lance"))
    out = str(tmp_path / "out")
    record = _record(short_tmp, f"127.0.0.1:{_closed_port()}")
    r = subprocess.run(
        [sys.executable, "-m", "prx_data.write_mds", "--table", table, "--out", out]
        + ["--tiers", "512", "--num-cpus", "1", "--no-progress", "--driver-rows", "0"],
        env=_env(short_tmp),
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert r.returncode == 0, r.stderr[-2000:]
    assert record in r.stderr and "starting a local Ray" in r.stderr
    assert os.path.exists(os.path.join(out, "report.json"))


def test_ingest_with_a_dead_ray_address_says_so_in_one_line(
    fake_init, monkeypatch, tmp_path, capsys
):
    from prx_data.cli import ingest as ingest_cli

    src = tmp_path / "src"
    src.mkdir()
    (src / "a.jpg").write_bytes(_jpeg(0))
    port = _closed_port()
    monkeypatch.setenv("RAY_ADDRESS", f"127.0.0.1:{port}")
    monkeypatch.setenv(runtime.CONNECT_TIMEOUT_ENV, "0")
    assert ingest_cli.main([str(src), "--table", str(tmp_path / "t.lance"), "--no-progress"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith(
        f"error: no Ray cluster answers at 127.0.0.1:{port} (from RAY_ADDRESS)"
    )
    assert fake_init == []
