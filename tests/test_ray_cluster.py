"""A real two-node Ray cluster on loopback runs ingest, the export and a column job.

The head and a worker are started with ``ray start`` (as on a real cluster, with
token authentication: ``RAY_AUTH_MODE=token`` and a private ``RAY_AUTH_TOKEN``
for every process) and the jobs run as subprocesses through ``RAY_ADDRESS``.
Each result must equal a local run's: the table's rows, the export's bytes (a
pinned unit plan over the same table) and the ``phash`` / ``dup_of`` columns.

Every process of the cluster gets a private ``TMPDIR`` and ``HOME``, so Ray's
session directories and ``/tmp/ray/ray_current_cluster`` belong to this test
alone, and ports are picked free on 127.0.0.1. The cluster is torn down by
process id, never with ``ray stop``, which kills every Ray process on the host.
"""

from __future__ import annotations

import contextlib
import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time

import pytest

from prx_data.core.sample_data import make_sample_collection
from prx_data.export import layout
from tests.exportkit import pinned_cli_args

pytestmark = [pytest.mark.slow, pytest.mark.ray]

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
JOB_TIMEOUT_S = 600


def _free_ports(n: int) -> list[int]:
    socks, ports = [], []
    try:
        for _ in range(n):
            s = socket.socket()
            s.bind(("127.0.0.1", 0))
            socks.append(s)
            ports.append(s.getsockname()[1])
    finally:
        for s in socks:
            s.close()
    return ports


def _env(private: str, **extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_")}
    tmp, home = os.path.join(private, "t"), os.path.join(private, "h")
    os.makedirs(tmp, exist_ok=True)
    os.makedirs(home, exist_ok=True)
    env.update(
        TMPDIR=tmp,
        HOME=home,
        PYTHONPATH=REPO,
        RAY_ENABLE_UV_RUN_RUNTIME_ENV="0",
        RAY_USAGE_STATS_ENABLED="0",
        HF_HUB_OFFLINE="1",
        **extra,
    )
    return env


def _ray_bin() -> str:
    return os.path.join(os.path.dirname(sys.executable), "ray")


def _node_args(ports: list[int]) -> list[str]:
    """Every port a node would otherwise take from a fixed default, given explicitly."""
    nm, om, metrics, agent, agent_grpc, rt_env = ports
    return [
        *("--node-ip-address", "127.0.0.1", "--num-cpus", "1"),
        *("--object-store-memory", str(100 * 1024 * 1024)),
        *("--node-manager-port", str(nm), "--object-manager-port", str(om)),
        *("--metrics-export-port", str(metrics), "--dashboard-agent-listen-port", str(agent)),
        *("--dashboard-agent-grpc-port", str(agent_grpc), "--runtime-env-agent-port", str(rt_env)),
        "--disable-usage-stats",
        "--block",
    ]


def _kill_own(procs: list[subprocess.Popen], marker: str) -> None:
    """End the ``ray start --block`` process groups, then any process still naming ``marker``."""
    import psutil

    for p in procs:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(p.pid, signal.SIGTERM)
    for p in procs:
        try:
            p.wait(20)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(p.pid, signal.SIGKILL)
    # Daemons that left the group (Ray's own subprocesses) still carry our private dir.
    me = os.getpid()
    for proc in psutil.process_iter(["pid", "cmdline"]):
        cmd = " ".join(proc.info["cmdline"] or [])
        if proc.info["pid"] != me and marker in cmd:
            with contextlib.suppress(psutil.Error):
                proc.kill()


@contextlib.contextmanager
def loopback_cluster(private: str):
    """A head and one worker node (1 CPU each) on 127.0.0.1; yields the jobs' environment."""
    token = secrets.token_hex(32)
    env = _env(private, RAY_AUTH_MODE="token", RAY_AUTH_TOKEN=token)
    gcs, *rest = _free_ports(13)
    log = os.path.join(private, "ray-start.log")
    logs = open(log, "ab")  # noqa: SIM115 - closed below
    procs: list[subprocess.Popen] = []
    try:
        head = [_ray_bin(), "start", "--head", "--port", str(gcs), *_node_args(rest[:6])]
        head += ["--include-dashboard", "false"]
        procs.append(
            subprocess.Popen(head, env=env, stdout=logs, stderr=logs, start_new_session=True)
        )
        address = f"127.0.0.1:{gcs}"
        job_env = dict(env, RAY_ADDRESS=address)
        _wait_for_nodes(job_env, 1, procs, log)
        worker = [_ray_bin(), "start", "--address", address, *_node_args(rest[6:12])]
        procs.append(
            subprocess.Popen(worker, env=env, stdout=logs, stderr=logs, start_new_session=True)
        )
        _wait_for_nodes(job_env, 2, procs, log)
        yield job_env
    finally:
        _kill_own(procs, private)
        logs.close()


def _log_tail(path: str) -> str:
    with open(path, "rb") as f:
        return f.read()[-3000:].decode(errors="replace")


def _wait_for_nodes(
    env: dict, n: int, procs: list[subprocess.Popen], log: str, timeout: float = 300
) -> None:
    code = (
        "import ray; ray.init(logging_level='ERROR'); "
        "print(sum(1 for x in ray.nodes() if x['Alive']), int(ray.cluster_resources()['CPU']))"
    )
    deadline = time.monotonic() + timeout
    host, port = env["RAY_ADDRESS"].split(":")
    while True:  # ray.init on a port nobody listens on yet retries for minutes: wait for the GCS
        for p in procs:
            if p.poll() is not None:
                raise AssertionError(f"ray start exited with {p.returncode}:\n{_log_tail(log)}")
        with contextlib.suppress(OSError), socket.create_connection((host, int(port)), 2):
            break
        assert time.monotonic() < deadline, "the head's GCS never listened"
        time.sleep(1)
    last = ""
    while time.monotonic() < deadline:
        out = subprocess.run(
            [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=timeout
        )
        last = out.stdout.strip() or out.stderr[-500:]
        if out.returncode == 0 and out.stdout.split()[:1] == [str(n)]:
            assert out.stdout.split()[1] == str(n)  # one CPU per node
            return
        time.sleep(2)
    raise AssertionError(f"the cluster did not reach {n} nodes: {last}")


def _job(env: dict, *argv: str) -> str:
    out = subprocess.run(
        [sys.executable, "-m", *argv],
        env=env,
        capture_output=True,
        text=True,
        timeout=JOB_TIMEOUT_S,
        cwd=REPO,
    )
    assert out.returncode == 0, f"{argv[0]} failed:\n{out.stdout[-2000:]}\n{out.stderr[-4000:]}"
    return out.stdout


def _rows(uri: str, columns: list[str]) -> list[tuple]:
    import lance

    t = lance.dataset(uri).to_table(columns=columns)
    return sorted(zip(*(t[c].to_pylist() for c in columns), strict=True))


@pytest.fixture
def short_dir():
    """A private directory with a short path: Ray's socket paths must fit in 107 bytes."""
    path = tempfile.mkdtemp(prefix="prx-ray-", dir="/tmp")
    yield path
    shutil.rmtree(path, ignore_errors=True)


def test_two_node_cluster_gives_the_local_results(tmp_path, short_dir):
    src = str(tmp_path / "src")
    make_sample_collection(src, repeats=2)
    local_table, cluster_table = str(tmp_path / "local.lance"), str(tmp_path / "cluster.lance")
    # The local reference: a private Ray runtime inside each job (no RAY_ADDRESS).
    local_env = _env(os.path.join(short_dir, "l"), RAY_AUTH_MODE="disabled")
    _job(local_env, "prx_data.ingest", src, "--table", local_table, "--num-cpus", "1")
    _job(local_env, "prx_data.dedup", "--table", local_table, "--report", "", "--num-cpus", "1")

    with loopback_cluster(os.path.join(short_dir, "c")) as env:
        _job(env, "prx_data.ingest", src, "--table", cluster_table, "--no-progress")
        _job(env, "prx_data.write_mds", *pinned_cli_args(cluster_table, str(tmp_path / "c-out")))
        _job(env, "prx_data.dedup", "--table", cluster_table, "--report", "", "--no-progress")
    # the same export plan over the same table, locally
    _job(local_env, "prx_data.write_mds", *pinned_cli_args(cluster_table, str(tmp_path / "l-out")))

    content = ["id", "caption", "width", "height"]
    assert _rows(cluster_table, content) == _rows(local_table, content)
    assert layout.content_digest(str(tmp_path / "c-out")) == layout.content_digest(
        str(tmp_path / "l-out")
    )
    hashed = ["id", "phash", "dup_of"]
    got, want = _rows(cluster_table, hashed), _rows(local_table, hashed)
    assert got == want and all(r[1] is not None for r in got)


def test_two_node_download_keeps_the_per_host_limit_across_nodes(tmp_path, short_dir):
    """Fetch tasks on both nodes share one per-host budget (``--per-host 2``), not one each."""
    from tests.downloadkit import ImageServer, url_table

    uri = str(tmp_path / "urls.lance")
    with ImageServer() as srv:
        url_table(uri, [srv.url(f"/slow/{i}") for i in range(48)], rows_per_file=6)
        with loopback_cluster(os.path.join(short_dir, "d")) as env:
            _job(
                env,
                *("prx_data.download", "--table", uri, "--allow-private", srv.allow[0]),
                *("--per-host", "2", "--batch-size", "6", "--retries", "0", "--no-progress"),
            )
        peak = srv.max_inflight
    assert _rows(uri, ["download_status"]) == [("ok",)] * 48
    assert peak <= 2
