"""One writer per export: a run lock on ``--out`` (local) or a lease with a heartbeat (S3).

Two runs on the same output, or a run and a ``--resume``, would delete and
rewrite each other's parts. Every export run (plain, ``--overwrite`` or
``--resume``) holds this lock from before it looks at ``--out`` until the
report is written.

* **Local** (``OUT/.prx-export.lock``): an exclusive ``flock`` on the file,
  which records the holder's pid, host and start time for error messages.
  The kernel drops the lock when the holder dies (``kill -9`` included), so a
  lock file left by a killed run is stale exactly when ``flock`` succeeds;
  the next run takes it over and says whose it was. The holder unlinks the
  file while still holding it; an acquirer re-checks that the file it locked
  is still the one at the path. On NFS, ``flock`` is emulated with
  byte-range locks (Linux >= 2.6.12), which needs a working lock manager.
* **Object storage** (``OUT/.prx-export.lease``): a small JSON lease (owner,
  host, pid, expiry) created with a conditional PUT (``If-None-Match: *``),
  refreshed by a heartbeat thread every ``ttl/3`` seconds with
  ``If-Match: <etag>``, and deleted at the end. A lease whose expiry has
  passed belongs to a dead run and is taken over with ``If-Match`` on the
  expired lease's ETag, so two runs cannot both take it. A store that
  ignores conditional headers leaves a race window between the read and the
  write (milliseconds); the run reads the lease back after writing it and
  refuses if someone else's is there. Other stores (``gs://``, ...) go through
  pyarrow without conditions, with that same window. A run whose heartbeat fails (lost lease)
  stops before it writes any index or report.
"""

from __future__ import annotations

import errno
import json
import os
import socket
import threading
import time
import uuid
from urllib.parse import urlparse

from prx_data.core import storage
from prx_data.export.layout import LEASE_NAME, LOCK_NAME, ExportError

#: Seconds a remote lease stays valid without a heartbeat.
DEFAULT_LEASE_TTL_S = 120.0


class ExportLocked(ExportError):
    """Another run holds the lock on this output."""


def _holder_text(info: dict) -> str:
    started = time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(info.get("started", 0)))
    return f"pid {info.get('pid')} on host {info.get('host')}, started {started}"


def _me() -> dict:
    return {"pid": os.getpid(), "host": socket.gethostname(), "started": time.time()}


class ExportLock:
    """Exclusive lock on an export output; a context manager.

    ``took_over`` describes the stale lock this run replaced (None if there was none).
    """

    def __init__(self, out: str, *, ttl_s: float = DEFAULT_LEASE_TTL_S):
        self.out = out
        self.ttl_s = ttl_s
        self.took_over: str | None = None
        self._fd: int | None = None
        self._path: str | None = None
        self._lease = None

    def __enter__(self) -> ExportLock:
        self.acquire()
        return self

    def __exit__(self, *exc) -> None:
        self.release()

    def acquire(self) -> None:
        if storage.is_remote(self.out):
            self._lease = _Lease(self.out, self.ttl_s)
            self.took_over = self._lease.acquire()
        else:
            self._acquire_local()

    def check(self) -> None:
        """Raise if the lease was lost (remote); call before writing indexes or the report."""
        if self._lease is not None:
            self._lease.check()

    def release(self) -> None:
        if self._lease is not None:
            self._lease.release()
            self._lease = None
        if self._fd is not None:
            try:
                os.unlink(self._path)  # still held: nobody can lock this inode in between
            except FileNotFoundError:
                pass
            os.close(self._fd)
            self._fd = None

    def _acquire_local(self) -> None:
        import fcntl

        os.makedirs(self.out, exist_ok=True)
        path = os.path.join(self.out, LOCK_NAME)
        while True:
            fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError as e:
                os.close(fd)
                if e.errno not in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
                    raise
                raise ExportLocked(
                    f"another export run holds the lock on {self.out} "
                    f"({_holder_text(_read_json(path))}); wait for it to finish, or stop it first"
                ) from None
            try:
                same = os.stat(path).st_ino == os.fstat(fd).st_ino
            except FileNotFoundError:
                same = False
            if same:
                break
            os.close(fd)  # the holder unlinked it as we locked it: lock the new one
        previous = _read_fd_json(fd)
        if previous:
            self.took_over = f"a stale lock left by a run that died ({_holder_text(previous)})"
        os.ftruncate(fd, 0)
        os.pwrite(fd, json.dumps(_me(), sort_keys=True).encode(), 0)
        self._fd, self._path = fd, path


def _read_json(path: str) -> dict:
    try:
        with open(path, "rb") as f:
            return json.loads(f.read() or b"{}")
    except (OSError, ValueError):
        return {}


def _read_fd_json(fd: int) -> dict:
    try:
        data = os.pread(fd, 65536, 0)
        return json.loads(data) if data else {}
    except (OSError, ValueError):
        return {}


# --- object storage -------------------------------------------------------------------------


class _S3Store:
    """The lease object on S3 (or an S3-compatible store), written with conditional PUTs."""

    conditional = True

    def __init__(self, out: str):
        parsed = urlparse(out)
        self.bucket = parsed.netloc
        self.key = f"{parsed.path.strip('/')}/{LEASE_NAME}".lstrip("/")
        self.url = f"s3://{self.bucket}/{self.key}"
        self.client = storage.s3_client()

    def put(self, body: bytes, **cond) -> str | None:
        """PUT with ``IfNoneMatch``/``IfMatch``; the new ETag, or None if the condition failed."""
        from botocore.exceptions import ClientError

        try:
            r = self.client.put_object(Bucket=self.bucket, Key=self.key, Body=body, **cond)
        except ClientError as e:
            code = e.response.get("Error", {}).get("Code", "")
            status = e.response.get("ResponseMetadata", {}).get("HTTPStatusCode")
            if status in (409, 412) or code in ("PreconditionFailed", "ConditionalRequestConflict"):
                return None
            raise
        return r["ETag"]

    def get(self) -> tuple[bytes, str] | None:
        from botocore.exceptions import ClientError

        try:
            r = self.client.get_object(Bucket=self.bucket, Key=self.key)
        except ClientError as e:
            if e.response.get("Error", {}).get("Code") in ("NoSuchKey", "404"):
                return None
            raise
        return r["Body"].read(), r["ETag"]

    def delete(self) -> None:
        self.client.delete_object(Bucket=self.bucket, Key=self.key)


class _PlainStore:
    """Other object stores (gs://, ...) through pyarrow: no conditional writes.

    The conditions are checked by reading first, which leaves a race window
    between the read and the write; the read-back after acquiring narrows it.
    """

    conditional = False

    def __init__(self, out: str):
        self.url = storage.join(out, LEASE_NAME)

    def put(self, body: bytes, IfNoneMatch: str | None = None, IfMatch: str | None = None):  # noqa: N803
        current = self.get()
        if (IfNoneMatch and current is not None) or (
            IfMatch and (current is None or current[1] != IfMatch)
        ):
            return None
        storage.write_bytes_atomic(self.url, body)
        return _tag(body)

    def get(self) -> tuple[bytes, str] | None:
        try:
            data = storage.read_bytes(self.url)
        except FileNotFoundError:
            return None
        return data, _tag(data)

    def delete(self) -> None:
        storage.delete(self.url)


def _tag(data: bytes) -> str:
    import hashlib

    return hashlib.sha256(data).hexdigest()


class _Lease:
    def __init__(self, out: str, ttl_s: float):
        self.store = _S3Store(out) if urlparse(out).scheme == "s3" else _PlainStore(out)
        self.ttl_s = ttl_s
        self.owner = uuid.uuid4().hex
        self.etag: str | None = None
        self.lost: str | None = None
        self._last_beat = time.time()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def _body(self) -> bytes:
        info = {**_me(), "owner": self.owner, "expires": time.time() + self.ttl_s}
        return json.dumps(info, sort_keys=True).encode()

    def _put(self, **cond) -> str | None:
        return self.store.put(self._body(), **cond)

    def _get(self) -> tuple[dict, str] | None:
        got = self.store.get()
        if got is None:
            return None
        try:
            info = json.loads(got[0])
        except ValueError:
            info = {}
        return (info if isinstance(info, dict) else {}), got[1]

    def acquire(self) -> str | None:
        took_over = None
        current = self._get()
        if current is None:
            etag = self._put(IfNoneMatch="*")
        else:
            info, etag_now = current
            if info.get("expires", 0) > time.time():
                raise self._locked(info)
            took_over = f"an expired lease left by a run that died ({_holder_text(info)})"
            etag = self._put(IfMatch=etag_now)
        if etag is None:
            got = self._get()
            raise self._locked(got[0] if got else {})
        # A store that ignores the conditions would let a racing run overwrite us: read back.
        got = self._get()
        if got is None or got[0].get("owner") != self.owner:
            raise self._locked(got[0] if got else {})
        self.etag = got[1]
        self._last_beat = time.time()
        self._thread = threading.Thread(target=self._beat, name="export-lease", daemon=True)
        self._thread.start()
        return took_over

    def _locked(self, info: dict) -> ExportLocked:
        return ExportLocked(
            f"another export run holds the lease on {self.store.url} "
            f"({_holder_text(info)}, expires in {info.get('expires', 0) - time.time():.0f} s); "
            "wait for it to finish, or for the lease to expire if that run died"
        )

    def _beat(self) -> None:
        while not self._stop.wait(self.ttl_s / 3):
            try:
                etag = self._put(IfMatch=self.etag)
            except Exception as e:  # noqa: BLE001 - a transient failure: retry next beat
                if time.time() - self._last_beat > self.ttl_s:
                    self.lost = f"heartbeat failed until the lease expired ({e})"
                    return
                continue
            if etag is None:
                self.lost = "another run replaced the lease"
                return
            self.etag = etag
            self._last_beat = time.time()

    def check(self) -> None:
        if self.lost:
            raise ExportLocked(f"lost the lease on {self.store.url}: {self.lost}")

    def release(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=10)
        got = self._get()
        if got is not None and got[0].get("owner") == self.owner:
            self.store.delete()
