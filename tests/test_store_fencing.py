"""gs:// as a store beside s3:// (fake-gcs-server on loopback), the lease on both, and fenced
writes: a writer that lost its lease while paused is refused by the store itself, not by its
own clock. Local lock files are never opened through a symbolic link."""

from __future__ import annotations

import json
import os
import threading

import pytest

from prx_data.core import storage
from prx_data.core.lease import Lease, LeaseHeld, LeaseUnsupported, LockFileUnsafe
from prx_data.export import naming
from prx_data.export.lock import ExportLock, ExportLocked

TTL = 1.0
#: For a holder that must be seen alive: its beats (every ttl/4) must land within one TTL even
#: on a loaded test machine.
LIVE_TTL = 4.0


@pytest.fixture(params=["s3", "gs"])
def remote_root(request):
    """A fresh folder on moto ``s3://`` or on the GCS emulator ``gs://``."""
    if request.param == "s3":
        bucket = request.getfixturevalue("s3_bucket")
    else:
        bucket = request.getfixturevalue("gs_bucket")
    return f"{request.param}://{bucket}/ex"


# --- gs:// storage ------------------------------------------------------------------------------


@pytest.mark.remote
def test_gs_storage_round_trip(gs_bucket):
    root = f"gs://{gs_bucket}/ex"
    assert not storage.exists(root)
    storage.write_bytes_atomic(f"{root}/512/1.000/index.json", b'{"shards": []}')
    storage.write_bytes_atomic(f"{root}/report.json", b"{}")
    assert storage.read_bytes(f"{root}/512/1.000/index.json") == b'{"shards": []}'
    assert storage.read_bytes(f"{root}/512/1.000/index.json", max_bytes=3) == b'{"sh'
    assert storage.exists(root) and storage.exists(f"{root}/report.json")
    assert storage.list_files(root) == ["512/1.000/index.json", "report.json"]
    assert storage.list_files(root, recursive=False) == ["report.json"]
    assert storage.list_dirs(root) == ["512"]  # no "dir/" marker objects needed
    assert storage.list_dirs(f"{root}/512") == ["1.000"]
    assert storage.file_sizes(root) == {"512/1.000/index.json": 14, "report.json": 2}
    v = storage.file_version(f"{root}/report.json")
    assert v is not None and v.size == 2 and v.tag
    assert storage.file_version(f"{root}/missing") is None
    with pytest.raises(FileNotFoundError):
        storage.read_bytes(f"{root}/missing")
    storage.delete(f"{root}/512")
    assert storage.list_files(root) == ["report.json"]
    with pytest.raises(storage.UsageError, match="whole bucket"):
        storage.delete(f"gs://{gs_bucket}")


@pytest.mark.remote
def test_gs_reads_go_to_the_emulator_named_by_storage_emulator_host(gs_bucket, monkeypatch):
    storage.write_bytes_atomic(f"gs://{gs_bucket}/x", b"1")
    monkeypatch.setenv("STORAGE_EMULATOR_HOST", "http://127.0.0.1:9")  # nothing listens there
    monkeypatch.setenv("STORAGE_DEADLINE_S", "3")
    with pytest.raises((OSError, storage.StorageTimeout)):
        storage.read_bytes(f"gs://{gs_bucket}/x")


def test_storage_env_carries_the_gcs_emulator(monkeypatch):
    monkeypatch.setenv("STORAGE_EMULATOR_HOST", "http://127.0.0.1:4443")
    assert storage.storage_env()["STORAGE_EMULATOR_HOST"] == "http://127.0.0.1:4443"


@pytest.mark.parametrize("uri", ["az://c/x", "abfs://c@a/x", "hf://datasets/x", "ftp://h/x"])
def test_other_stores_are_refused_in_one_line_naming_the_supported_ones(uri):
    for call in (
        lambda: storage.read_bytes(uri),
        lambda: storage.write_bytes_atomic(f"{uri}/f", b""),
        lambda: storage.list_files(uri),
    ):
        with pytest.raises(storage.UnsupportedStore) as e:
            call()
        msg = str(e.value)
        assert "\n" not in msg and "local path" in msg and "s3://" in msg and "gs://" in msg
    with pytest.raises(LeaseUnsupported, match=r"s3://.*gs://"):
        Lease(f"{uri}/.lease").acquire()


# --- the lease on s3:// and gs:// -----------------------------------------------------------------


def _pause(lock: Lease) -> None:
    """What SIGSTOP does to a holder: its heartbeat stops (the thread is ended here)."""
    lock._lease._stop.set()
    lock._lease._thread.join()


@pytest.mark.remote
@pytest.mark.faults
def test_lease_acquire_contention_takeover(remote_root):
    first = ExportLock(remote_root, ttl_s=LIVE_TTL)
    first.acquire()
    assert first.took_over is None
    with pytest.raises(ExportLocked, match="holds the lease"):
        ExportLock(remote_root, ttl_s=LIVE_TTL).acquire()  # live: its tag keeps changing
    _pause(first)
    with ExportLock(remote_root, ttl_s=TTL) as second:  # waits the holder's declared TTL
        assert "stopped refreshing" in second.took_over
        with pytest.raises(ExportLocked, match="lost the lease"):
            first.confirm()  # refused by the store: the lease object has another tag
        first.release()  # leaves the new holder's lease alone
        second.confirm()
        body = json.loads(storage.read_bytes(f"{remote_root}/{naming.LEASE_NAME}"))
        assert body["owner"] == second._lease.owner
    assert not storage.exists(f"{remote_root}/{naming.LEASE_NAME}")
    with ExportLock(remote_root, ttl_s=TTL) as third:  # released: free at once
        assert third.took_over is None


@pytest.mark.remote
@pytest.mark.faults
def test_a_paused_writer_past_its_lease_cannot_write(remote_root, monkeypatch):
    """The holder pauses right after its clock check passed: when it resumes, the new
    holder's file must stay, whatever the old holder's clock says."""
    target = f"{remote_root}/512/1.000/index.json"
    old = ExportLock(remote_root, ttl_s=TTL)
    old.acquire()
    storage.write_bytes_atomic(target, b"old run")  # fenced: the lease is ours
    _pause(old)
    monkeypatch.setattr(old._lease, "check", lambda: None)  # its clock never noticed
    new = ExportLock(remote_root, ttl_s=TTL)
    t = threading.Thread(target=new.acquire)  # another context: its fence is its own
    t.start()
    t.join()
    assert new.held and new.took_over
    storage.write_bytes_fenced(target, b"new run", _fence(new))
    with pytest.raises(ExportLocked, match="lost the lease"):
        storage.write_bytes_atomic(target, b"old run, resumed")  # under old's fence
    assert storage.read_bytes(target) == b"new run"
    new.release()
    old.release()


def _fence(lock: Lease):
    """The fence ``lock`` put on the context that took it (here, another thread's)."""
    assert lock._fence is not None
    return lock._fence


@pytest.mark.remote
@pytest.mark.faults
def test_a_writer_paused_between_its_confirmation_and_its_write_is_refused(
    remote_root, monkeypatch
):
    """The pause falls after the store confirmed the old lease: the target's own
    precondition (the tag the old writer read) refuses the write."""
    target = f"{remote_root}/report.json"
    old = ExportLock(remote_root, ttl_s=TTL)
    old.acquire()
    storage.write_bytes_atomic(target, b"old run")
    confirm = old.confirm
    new = ExportLock(remote_root, ttl_s=TTL)

    def confirm_then_pause() -> None:
        confirm()  # the store says the lease is still ours ...
        _pause(old)  # ... then the process stops, and another run takes over and writes
        t = threading.Thread(target=new.acquire)
        t.start()
        t.join()
        storage.write_bytes_fenced(target, b"new run", _fence(new))

    monkeypatch.setattr(old, "confirm", confirm_then_pause)
    with pytest.raises(ExportLocked, match="changed under the lease"):
        storage.write_bytes_atomic(target, b"old run, resumed")
    assert storage.read_bytes(target) == b"new run"
    new.release()
    old.release()


@pytest.mark.remote
@pytest.mark.faults
def test_a_stale_write_that_lands_first_is_replaced_by_the_new_holders_write(
    remote_root, monkeypatch
):
    """Paused between confirmation and write, and the new holder has not written the file
    yet: the stale file lands, and the new holder's fenced write (on the tag it reads)
    replaces it; nothing of the old run survives the new run's write."""
    target = f"{remote_root}/dropped.parquet"
    old = ExportLock(remote_root, ttl_s=TTL)
    old.acquire()
    confirm = old.confirm
    new = ExportLock(remote_root, ttl_s=TTL)

    def confirm_then_pause() -> None:
        confirm()
        _pause(old)
        t = threading.Thread(target=new.acquire)
        t.start()
        t.join()

    monkeypatch.setattr(old, "confirm", confirm_then_pause)
    storage.write_bytes_atomic(target, b"stale")
    assert new.held
    storage.write_bytes_fenced(target, b"new run", _fence(new))
    assert storage.read_bytes(target) == b"new run"
    new.release()
    old.release()


@pytest.mark.remote
def test_writes_outside_the_lease_folder_and_after_release_are_not_fenced(remote_root):
    with ExportLock(remote_root, ttl_s=30) as lock:
        assert storage.active_fence(f"{remote_root}/a/b") is not None
        assert storage.active_fence(f"{remote_root}-other/a") is None
        assert storage.active_fence("/local/a") is None
        calls = []
        confirm = lock.confirm
        lock.confirm = lambda: (calls.append(1), confirm())[1]  # type: ignore[method-assign]
        storage.write_bytes_atomic(f"{remote_root}/a/b", b"x")
        assert calls == [1]
    assert storage.active_fence(f"{remote_root}/a/b") is None


@pytest.mark.remote
def test_gs_lease_release_only_deletes_its_own_generation(gs_bucket, monkeypatch):
    """A release reads the lease and deletes that generation only: a takeover between the
    read and the delete keeps the new holder's lease."""
    root = f"gs://{gs_bucket}/rel"
    lock = Lease(f"{root}/.lease", ttl_s=30)
    lock.acquire()
    store = lock._lease.store
    seen = []
    delete = store.delete

    def spy(*, beat=False, tag=None):
        seen.append(tag)
        delete(beat=beat, tag=tag)

    monkeypatch.setattr(store, "delete", spy)
    lock.release()
    assert seen and seen[0] is not None  # conditional on the generation read
    assert not storage.exists(f"{root}/.lease")


_PAUSED_WRITER = """
import os, signal, sys
from prx_data.core import storage
from prx_data.export.lock import ExportLock
out, target = sys.argv[1], sys.argv[2]
lock = ExportLock(out, ttl_s=float(sys.argv[3]))
lock.acquire()
storage.write_bytes_atomic(target, b"old run")
lock.check()
print("checked", flush=True)
os.kill(os.getpid(), signal.SIGSTOP)  # paused between its check and its write
storage.write_bytes_atomic(target, b"old run, resumed")
print("wrote", flush=True)
"""


def _stopped(pid: int) -> bool:
    with open(f"/proc/{pid}/stat") as f:
        return f.read().rsplit(")", 1)[1].split()[0] == "T"


@pytest.mark.remote
@pytest.mark.faults
def test_an_exporter_stopped_with_sigstop_past_its_lease_cannot_overwrite(remote_root):
    """The issue's scenario, with a real process: SIGSTOP between its lease check and its
    write, another run takes the lease over and writes, SIGCONT: the old writer is refused
    and the new run's file stays."""
    import signal
    import subprocess
    import sys
    import time

    target = f"{remote_root}/512/1.000/index.json"
    repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = {**os.environ, "PYTHONPATH": repo + os.pathsep + os.environ.get("PYTHONPATH", "")}
    child = subprocess.Popen(
        [sys.executable, "-c", _PAUSED_WRITER, remote_root, target, str(TTL)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        env=env,
        text=True,
    )
    try:
        assert child.stdout.readline().strip() == "checked"
        end = time.monotonic() + 30
        while not _stopped(child.pid):
            assert time.monotonic() < end, "the writer did not stop"
            time.sleep(0.02)
        with ExportLock(remote_root, ttl_s=TTL) as new:
            assert "stopped refreshing" in new.took_over
            storage.write_bytes_atomic(target, b"new run")  # fenced by the new lease
            child.send_signal(signal.SIGCONT)
            out, err = child.communicate(timeout=60)
            assert child.returncode != 0 and "wrote" not in out
            assert "lost the lease" in err
            assert storage.read_bytes(target) == b"new run"
            new.confirm()  # the old holder's resumption left the new lease alone
    finally:
        if child.poll() is None:
            child.send_signal(signal.SIGCONT)
            child.kill()
            child.wait()


@pytest.mark.remote
@pytest.mark.faults
def test_a_release_racing_a_takeover_leaves_the_new_lease(s3_bucket, monkeypatch):
    """The release reads the lease (still ours), another run takes it over, then the delete
    comes: conditional on the ETag read, it is refused and the new holder keeps its lease
    (moto honours If-Match on deletes; fake-gcs-server ignores ifGenerationMatch there)."""
    root = f"s3://{s3_bucket}/race"
    old = ExportLock(root, ttl_s=TTL)
    old.acquire()
    store = old._lease.store
    new = ExportLock(root, ttl_s=TTL)
    delete = store.delete

    def takeover_then_delete(*, beat=False, tag=None):
        _pause(old)
        t = threading.Thread(target=new.acquire)
        t.start()
        t.join()
        delete(beat=beat, tag=tag)

    monkeypatch.setattr(store, "delete", takeover_then_delete)
    old.release()
    assert new.held
    body = json.loads(storage.read_bytes(f"{root}/{naming.LEASE_NAME}"))
    assert body["owner"] == new._lease.owner
    new.confirm()
    new.release()


def _foreign_lease(store, expires: float, ttl: float = TTL, **cond) -> str:
    """Write a lease of another host (``owner`` elsewhere) with the store's conditions."""
    import time

    body = {"owner": "elsewhere", "pid": 1, "host": "skewed", "started": 0.0}
    body.update(expires=expires, ttl_s=ttl, written=time.time())
    tag = store.put(json.dumps(body).encode(), **cond)
    assert tag is not None
    return tag


@pytest.mark.remote
@pytest.mark.faults
def test_takeover_ignores_the_wall_clocks_of_other_hosts(remote_root):
    """As tests/test_export_lease.py checks on s3://, on both stores: only this host's
    monotonic clock and the lease's tag decide."""
    import time

    from prx_data.core.lease import lease_store

    ahead = f"{remote_root}-ahead"
    store = lease_store(f"{ahead}/{naming.LEASE_NAME}", TTL)
    _foreign_lease(store, time.time() + 3600, IfNoneMatch="*")  # dead, clock an hour ahead
    t0 = time.monotonic()
    with ExportLock(ahead, ttl_s=TTL) as lock:
        assert "stopped refreshing" in lock.took_over
        assert time.monotonic() - t0 >= TTL
    behind = f"{remote_root}-behind"
    store = lease_store(f"{behind}/{naming.LEASE_NAME}", TTL)
    tag = _foreign_lease(store, time.time() - 3600, LIVE_TTL, IfNoneMatch="*")  # live, behind
    stop = threading.Event()

    def beat(tag=tag):
        while not stop.wait(TTL / 8):
            tag = _foreign_lease(store, time.time() - 3600, LIVE_TTL, IfMatch=tag)

    t = threading.Thread(target=beat, daemon=True)
    t.start()
    try:
        with pytest.raises(ExportLocked, match="holds the lease"):
            ExportLock(behind, ttl_s=TTL).acquire()
    finally:
        stop.set()
        t.join()
    assert json.loads(store.get()[0])["owner"] == "elsewhere"


@pytest.mark.remote
def test_write_new_creates_once_and_takes_a_retry_of_the_same_bytes(remote_root):
    path = f"{remote_root}/512/1.000/f0-0/shard.00000.mds"
    storage.write_new(path, b"ours")
    storage.write_new(path, b"ours")  # a retried request whose first answer was lost
    with pytest.raises(storage.StoreConflict, match="nothing was overwritten"):
        storage.write_new(path, b"a stale writer's")
    assert storage.read_bytes(path) == b"ours"


@pytest.mark.remote
@pytest.mark.faults
def test_a_units_shards_never_overwrite_what_another_run_wrote_there(remote_root, tmp_path):
    """A unit (or pack) clears its folder and then only creates objects: a shard that a run
    which took the lease over wrote meanwhile is kept, and the unit fails in one line."""
    from prx_data.core.streaming_compat import mds_writer
    from prx_data.export.durable import create_only_uploads, refused_upload

    part = f"{remote_root}/512/1.000/f0-0"
    theirs = f"{part}/shard.00001.mds"
    storage.write_bytes_atomic(theirs, b"the new run's shard")
    writer = mds_writer()(out=part, columns={"id": "str", "n": "int"}, size_limit=1 << 10)
    create_only_uploads(writer)
    with pytest.raises(Exception):  # noqa: B017 - streaming's own wording, then ours below
        for i in range(200):
            writer.write({"id": f"s/{i}", "n": i})
        writer.finish()
    refused = refused_upload([writer])
    assert isinstance(refused, storage.StoreConflict) and theirs in str(refused)
    assert storage.read_bytes(theirs) == b"the new run's shard"
    assert storage.exists(f"{part}/shard.00000.mds")  # its first shard was new: written


# --- local lock files ----------------------------------------------------------------------------


def test_a_symlinked_lock_file_is_refused_and_its_target_untouched(tmp_path):
    victim = tmp_path / "precious.txt"
    victim.write_text("keep me")
    out = tmp_path / "received-export"
    out.mkdir()
    os.symlink(victim, out / naming.LOCK_NAME)
    with pytest.raises(LockFileUnsafe, match="symbolic link"):
        ExportLock(str(out)).acquire()
    dangling = tmp_path / "other"
    dangling.mkdir()
    os.symlink(tmp_path / "nowhere", dangling / naming.LOCK_NAME)
    with pytest.raises(LockFileUnsafe, match="symbolic link"):
        ExportLock(str(dangling)).acquire()
    assert victim.read_text() == "keep me"
    assert not (tmp_path / "nowhere").exists()
    fifo = tmp_path / "fifo.lock"
    os.mkfifo(fifo)
    with pytest.raises(LockFileUnsafe, match="not a regular file"):
        Lease(str(fifo)).acquire()
    assert not issubclass(LockFileUnsafe, LeaseHeld)  # refused at once, never waited on


def test_a_list_command_on_an_export_with_a_symlinked_lock_leaves_the_target(tmp_path):
    from prx_data.skips.log import Provenance
    from prx_data.skips.ops import update_list
    from tests.exportkit import make_export

    victim = tmp_path / "precious.txt"
    victim.write_text("keep me")
    ex = make_export(str(tmp_path / "e"), {"512/1.000": 8}, samples_per_part=4)
    os.symlink(victim, os.path.join(ex.root, naming.LOCK_NAME))
    with pytest.raises(LockFileUnsafe):
        update_list(ex.root, "optout", ["ds/512/1.000/1"], Provenance("test"))
    assert victim.read_text() == "keep me"


def test_write_mds_refuses_an_unsupported_store_in_one_line(tmp_path, capsys):
    from prx_data.cli.write_mds import main

    rc = main(["--table", str(tmp_path / "t.lance"), "--out", "az://container/ex"])
    err = capsys.readouterr().err.strip()
    assert rc != 0
    assert len(err.splitlines()) == 1, err
    assert "az:// is not a supported store" in err and "s3://" in err and "gs://" in err
    assert not (tmp_path / "t.lance").exists()
