"""One lease for the project: a single writer per export, per skip-list registry, per anything.

Every writer that must be alone (an export run on ``--out``, a skip-list
update of one export, an append to a table's list registry) holds a
:class:`Lease` on one path from before it reads the state it changes until
its last write. The protocol is chosen by the store:

* **Local paths**: an exclusive ``flock`` on the lock file, which records the
  holder's pid, host and start time for error messages. The lock file is
  opened with ``O_NOFOLLOW`` and must be a regular file: a lock file that is
  a symbolic link (say, one shipped inside a received export) is refused, so
  taking a lock never truncates the file a link points at. The kernel drops the
  lock when the holder dies (``kill -9`` included), so a lock file left by a
  killed run is stale exactly when ``flock`` succeeds; the next run takes it
  over and says whose it was. The holder unlinks the file while still holding
  it; an acquirer re-checks that the file it locked is still the one at the
  path. Nobody else ever deletes a lock file. On NFS, ``flock`` is emulated
  with byte-range locks (Linux >= 2.6.12), which needs a working lock manager.
* **``s3://`` and ``gs://``**: a small JSON lease object (owner, host, pid,
  TTL) created with a conditional write (S3 ``If-None-Match: *``, GCS
  ``ifGenerationMatch=0``) and refreshed by a heartbeat thread every
  ``ttl/4`` with ``If-Match: <etag>`` (GCS: ``ifGenerationMatch=<generation
  seen>``), through its own client (short timeouts, two attempts). The ETag or
  generation is the lease's *tag* below. Only this host's monotonic clock is
  trusted: the lease is ours for ``ttl - margin`` after the last heartbeat
  that landed was sent, and :meth:`Lease.check` (called before every commit)
  fails after that. A run that finds a lease watches its tag: a change means
  a live holder (refused, or waited for); the same tag for a full TTL means a
  dead one, taken over with a write conditional on that tag, so two runs
  cannot both take it. A 409/412 answer to a heartbeat is resolved by reading
  the lease back. The release deletes the lease only on the tag it read
  (GCS; S3 where the store honours ``If-Match`` on deletes). Wall-clock times
  in the body are for people only.
* **Other stores** (``az://``, ``abfs://``, ``hf://``, ...): refused with
  :class:`LeaseUnsupported`, naming the supported ones. Without a conditional
  write two runs could both believe they hold the lease, and a lost opt-out
  or a half-deleted export would look complete.

**Fenced writes.** :meth:`Lease.check` is a look at this host's clock; a
process paused (``SIGSTOP``, a long GC, a suspended VM) right after it would
still write when it resumes. So while a remote lease is held, every small
file written through :func:`prx_data.core.storage.write_bytes_atomic` under
the lease's folder, by the thread that took it, is a *fenced write*
(:func:`prx_data.core.storage.write_bytes_fenced`): it reads the target's tag,
confirms the lease with a write conditional on the lease's own tag (refused
by the store once another run took it over), then writes the target with a
precondition on the tag it read. A writer paused before the confirmation is
refused there; one paused between the confirmation and the write is refused
by the target's precondition if the new holder has written that file since,
and otherwise its file is replaced by the new holder's own fenced write of it
(which is conditional on what it read, the stale file). No store offers a
write conditional on another object, so this is the strongest guarantee an
S3 or GCS bucket gives without tokens in every key. The shards that units
and packs upload are create-only writes instead
(:func:`prx_data.export.durable.create_only_uploads`; docs/EXPORT.md).

``wait_s`` makes an acquirer wait (with jittered backoff) for a live holder
instead of refusing at once: list updates wait for each other, export runs
refuse.
"""

from __future__ import annotations

import errno
import json
import logging
import os
import posixpath
import random
import socket
import threading
import time
import uuid
from urllib.parse import urlparse

from prx_data.core import storage
from prx_data.core.errors import PrxDataError

#: The object stores with a lease object (conditional writes): see the module docstring.
REMOTE_LEASE_STORES = ("s3", "gs")

#: Seconds a remote lease stays valid without a heartbeat.
DEFAULT_LEASE_TTL_S = 120.0

#: Share of the TTL by which a holder stops writing before a watcher may take over
#: (covers the time between a check and the start of the write, and clock-rate drift).
LEASE_MARGIN = 0.25

log = logging.getLogger(__name__)


class LeaseHeld(PrxDataError):
    """Another process holds the lease (or it was lost while we wrote)."""


class LeaseUnsupported(PrxDataError):
    """The store has no conditional writes, so a lease cannot be made safe there."""


class LockFileUnsafe(PrxDataError):
    """A local lock file is a symbolic link or not a regular file: never opened through."""


def _me() -> dict:
    return {"pid": os.getpid(), "host": socket.gethostname(), "started": time.time()}


class Lease:
    """An exclusive lease on ``path`` (a lock file locally, a lease object on ``s3://``).

    A context manager. ``took_over`` describes the stale lease this holder
    replaced (None if there was none). ``what`` names the holder in messages
    ("export run", "skip-list update"); ``error`` is the exception class raised
    when the lease is held or lost (a subclass of :class:`LeaseHeld`).

    Args:
        path: the lock file (local) or the lease object's URL (``s3://``).
        what: what a holder is, for messages.
        wait_s: how long to wait for a live holder before refusing (0: refuse at once).
        ttl_s: remote lease lifetime without a heartbeat.
        error: the exception class for a held or lost lease.
    """

    def __init__(
        self,
        path: str,
        *,
        what: str = "writer",
        wait_s: float = 0.0,
        ttl_s: float = DEFAULT_LEASE_TTL_S,
        error: type[LeaseHeld] = LeaseHeld,
    ):
        self.path = path
        self.what = what
        self.wait_s = wait_s
        self.ttl_s = ttl_s
        self.error = error
        self.took_over: str | None = None
        self._fd: int | None = None
        self._lease: _Lease | None = None
        self._fence: _LeaseFence | None = None

    def __enter__(self) -> Lease:
        self.acquire()
        return self

    def __exit__(self, *exc) -> None:
        self.release()

    @property
    def held(self) -> bool:
        return self._fd is not None or self._lease is not None

    def acquire(self) -> None:
        deadline = time.monotonic() + self.wait_s
        delay = 0.02
        while True:
            try:
                self._acquire_once()
                return
            except LeaseHeld as e:
                if time.monotonic() + delay > deadline:
                    raise self.error(str(e)) from None
            time.sleep(delay * (0.5 + random.random()))
            delay = min(delay * 2, 1.0)

    def _acquire_once(self) -> None:
        scheme = storage.scheme(self.path)
        if scheme == "file":
            self._acquire_local()
        elif scheme in REMOTE_LEASE_STORES:
            lease = _Lease(self.path, self.ttl_s, self.what)
            self.took_over = lease.acquire()
            self._lease = lease
            self._fence = _LeaseFence(self)
            storage.push_fence(self._fence)
        else:
            raise LeaseUnsupported(
                f"{self.path}: {scheme}:// has no conditional writes that this toolkit uses, so "
                f"a {self.what} cannot be made exclusive there; use a local path, s3:// "
                "(S3-compatible endpoints through S3_ENDPOINT_URL) or gs:// (an emulator "
                "through STORAGE_EMULATOR_HOST), and copy the result"
            )

    def confirm(self) -> None:
        """Prove with the store that the lease is still ours: a write conditional on the
        lease's tag (remote; refused once another run took it over). Local locks are held
        by the kernel until this process ends, so there is nothing to confirm."""
        if self._lease is not None:
            try:
                self._lease.confirm()
            except LeaseHeld as e:
                raise self.error(str(e)) from None

    def check(self) -> None:
        """Raise if the lease was lost (remote); call before every commit."""
        if self._lease is not None:
            try:
                self._lease.check()
            except LeaseHeld as e:
                raise self.error(str(e)) from None

    def release(self) -> None:
        if self._fence is not None:
            storage.pop_fence(self._fence)  # in this context; others skip it once released
            self._fence = None
        if self._lease is not None:
            self._lease.release()
            self._lease = None
        if self._fd is not None:
            try:
                os.unlink(self.path)  # still held: nobody can lock this inode in between
            except FileNotFoundError:
                pass
            os.close(self._fd)
            self._fd = None

    def _acquire_local(self) -> None:
        import fcntl

        path = self.path.removeprefix("file://")
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        while True:
            fd = _open_lock_file(path)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError as e:
                os.close(fd)
                if e.errno not in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
                    raise
                raise LeaseHeld(
                    f"another {self.what} holds the lock {path} "
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
        self._fd = fd
        self.path = path


def _open_lock_file(path: str) -> int:
    """Open (or create) a lock file, never through a symbolic link and only if it is a
    regular file: the holder truncates and rewrites it, which must not reach a link's
    target (a lock file shipped inside a received export could point anywhere)."""
    import stat

    flags = os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC
    try:
        fd = os.open(path, flags, 0o644)
    except OSError as e:
        if e.errno == errno.ELOOP:
            raise LockFileUnsafe(
                f"{path}: the lock file is a symbolic link, which is never followed; remove "
                "the link (it may have come with a copied or received tree) and run again"
            ) from None
        raise
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise LockFileUnsafe(
            f"{path}: the lock file is not a regular file; remove it and run again"
        )
    return fd


def _holder_text(info: dict) -> str:
    started = time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(info.get("started", 0)))
    return f"pid {info.get('pid')} on host {info.get('host')}, started {started}"


def _read_json(path: str) -> dict:
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError:
        return {}
    try:
        return _read_fd_json(fd)
    finally:
        os.close(fd)


def _read_fd_json(fd: int) -> dict:
    try:
        data = os.pread(fd, 65536, 0)
        return json.loads(data) if data else {}
    except (OSError, ValueError):
        return {}


# --- object storage -------------------------------------------------------------------------


def _beat_settings(ttl_s: float) -> storage.S3Settings:
    """The heartbeat's own client: short timeouts and two attempts, so that one stalled PUT
    cannot outlast the lease (the shared client may wait minutes on one)."""
    base = storage.S3Settings.from_env()
    return storage.S3Settings(
        endpoint=base.endpoint,
        read_timeout_s=max(0.5, ttl_s / 10),
        connect_timeout_s=max(0.2, ttl_s / 20),
        max_attempts=2,
    )


class S3LeaseStore:
    """The lease object on S3 (or an S3-compatible store), written with conditional PUTs."""

    conditional = True

    def __init__(self, url: str, ttl_s: float):
        parsed = urlparse(url)
        self.bucket = parsed.netloc
        self.key = parsed.path.strip("/")
        self.url = f"s3://{self.bucket}/{self.key}"
        self.settings = storage.S3Settings.from_env()
        self.beat_settings = _beat_settings(ttl_s)

    def _call(self, what: str, beat: bool, fn):
        s = self.beat_settings if beat else self.settings
        return storage.s3_call(self.url, f"lease {what}", lambda: fn(storage.s3_client(s)), s)

    def put(self, body: bytes, *, beat: bool = False, **cond) -> str | None:
        """PUT with ``IfNoneMatch``/``IfMatch``; the new ETag, or None if the condition failed
        (412) or met a conflicting write (409)."""
        from botocore.exceptions import ClientError

        def put(c):
            return c.put_object(Bucket=self.bucket, Key=self.key, Body=body, **cond)

        try:
            r = self._call("write", beat, put)
        except ClientError as e:
            code = e.response.get("Error", {}).get("Code", "")
            status = e.response.get("ResponseMetadata", {}).get("HTTPStatusCode")
            if status in (409, 412) or code in (
                "PreconditionFailed",
                "ConditionalRequestConflict",
                "NoSuchKey",  # If-Match on a deleted lease
            ):
                return None
            raise
        return r["ETag"]

    def get(self, *, beat: bool = False) -> tuple[bytes, str] | None:
        from botocore.exceptions import ClientError

        def get(c):
            r = c.get_object(Bucket=self.bucket, Key=self.key)
            return r["Body"].read(), r["ETag"]

        try:
            return self._call("read", beat, get)
        except ClientError as e:
            if e.response.get("Error", {}).get("Code") in ("NoSuchKey", "404"):
                return None
            raise

    def delete(self, *, beat: bool = False, tag: str | None = None) -> None:
        """Delete the lease; with ``tag``, only while it is at that ETag (stores that do not
        honour ``If-Match`` on deletes delete it anyway)."""
        from botocore.exceptions import ClientError

        cond = {} if tag is None else {"IfMatch": tag}
        try:
            self._call(
                "delete", beat, lambda c: c.delete_object(Bucket=self.bucket, Key=self.key, **cond)
            )
        except ClientError as e:
            status = e.response.get("ResponseMetadata", {}).get("HTTPStatusCode")
            if status not in (404, 409, 412):
                raise


class GcsLeaseStore:
    """The lease object on Google Cloud Storage, written with generation preconditions.

    The same interface as :class:`S3LeaseStore`: ``IfNoneMatch="*"`` becomes
    ``ifGenerationMatch=0`` (create only if absent) and ``IfMatch=<generation>``
    ``ifGenerationMatch=<generation>``; the tag handed back is the new generation.
    The heartbeat's calls get short timeouts, as on S3.
    """

    conditional = True

    def __init__(self, url: str, ttl_s: float):
        parsed = urlparse(url)
        self.bucket = parsed.netloc
        self.key = parsed.path.strip("/")
        self.url = f"gs://{self.bucket}/{self.key}"
        self.timeout_s = storage.deadline_s()
        self.beat_timeout_s = max(0.5, ttl_s / 10)

    def _blob(self):
        return storage.gcs_client().bucket(self.bucket).blob(self.key)

    def _call(self, what: str, beat: bool, fn):
        timeout = self.beat_timeout_s if beat else self.timeout_s
        return storage.gcs_call(self.url, f"lease {what}", lambda: fn(timeout), timeout)

    def put(
        self,
        body: bytes,
        *,
        beat: bool = False,
        IfNoneMatch: str | None = None,  # noqa: N803 - the S3 store's names
        IfMatch: str | None = None,  # noqa: N803
    ) -> str | None:
        from google.api_core import exceptions as gexc

        if IfNoneMatch == "*":
            generation = 0
        elif IfMatch is not None:
            generation = int(IfMatch)
        else:
            raise ValueError("a lease write is always conditional")
        blob = self._blob()

        def put(timeout: float) -> str:
            blob.upload_from_string(
                body,
                content_type="application/json",
                if_generation_match=generation,
                timeout=timeout,
            )
            return str(blob.generation)

        try:
            return self._call("write", beat, put)
        except (gexc.PreconditionFailed, gexc.NotFound, gexc.Conflict):
            return None

    def get(self, *, beat: bool = False) -> tuple[bytes, str] | None:
        from google.api_core import exceptions as gexc

        blob = self._blob()

        def get(timeout: float) -> tuple[bytes, str]:
            data = blob.download_as_bytes(timeout=timeout)
            return data, str(blob.generation)

        try:
            return self._call("read", beat, get)
        except gexc.NotFound:
            return None

    def delete(self, *, beat: bool = False, tag: str | None = None) -> None:
        from google.api_core import exceptions as gexc

        blob = self._blob()
        gen = None if tag is None else int(tag)
        try:
            self._call("delete", beat, lambda t: blob.delete(if_generation_match=gen, timeout=t))
        except (gexc.NotFound, gexc.PreconditionFailed):
            pass


def lease_store(url: str, ttl_s: float) -> S3LeaseStore | GcsLeaseStore:
    """The lease object's store for ``url`` (``s3://`` or ``gs://``)."""
    if storage.scheme(url) == "gs":
        return GcsLeaseStore(url, ttl_s)
    return S3LeaseStore(url, ttl_s)


def _parse(data: bytes) -> dict:
    try:
        info = json.loads(data)
    except ValueError:
        return {}
    return info if isinstance(info, dict) else {}


def _declared_ttl(info: dict) -> float | None:
    ttl = info.get("ttl_s")
    return float(ttl) if isinstance(ttl, int | float) and ttl > 0 else None


class _Lease:
    """The remote lease protocol (see the module docstring).

    Validity is measured on this host's monotonic clock only: from the moment
    the last PUT known to have landed was *sent*, the lease is ours for
    ``ttl - margin``. A watcher takes the lease over only after it has seen the
    same ETag for a full ``ttl`` on its own monotonic clock, and only with
    ``If-Match`` on that ETag. Wall-clock times in the body are for people
    (and for older versions, which compare ``expires``).
    """

    def __init__(self, url: str, ttl_s: float, what: str = "writer"):
        self.store = lease_store(url, ttl_s)
        self.what = what
        self.ttl_s = ttl_s
        self.margin_s = ttl_s * LEASE_MARGIN
        self.owner = uuid.uuid4().hex
        self.etag: str | None = None
        self.lost: str | None = None
        self._valid_from = time.monotonic()
        self._sent: dict[bytes, float] = {}  # recent bodies -> when they were sent
        self._seq = 0
        self._last_error: str | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._io = threading.Lock()  # one conditional lease write at a time (beat or confirm)
        self._me = _me()

    def _body(self) -> bytes:
        self._seq += 1
        now = time.time()
        info = {
            **self._me,
            "owner": self.owner,
            "beat": self._seq,
            "ttl_s": self.ttl_s,
            "written": now,
            "expires": now + self.ttl_s,
        }
        return json.dumps(info, sort_keys=True).encode()

    def _put(self, *, beat: bool = False, **cond) -> tuple[str | None, bytes]:
        """(new ETag or None if the condition failed, the body sent)."""
        body = self._body()
        self._sent[body] = time.monotonic()
        while len(self._sent) > 8:
            self._sent.pop(next(iter(self._sent)))
        return self.store.put(body, beat=beat, **cond), body

    def _get(self, *, beat: bool = False) -> tuple[dict, bytes, str] | None:
        got = self.store.get(beat=beat)
        return None if got is None else (_parse(got[0]), got[0], got[1])

    def _confirm(self, etag: str, sent: float) -> None:
        self.etag = etag
        self._valid_from = max(self._valid_from, sent)

    def _adopt(self, got: tuple[dict, bytes, str] | None) -> bytes | None:
        """The body of ours that the lease holds (then its ETag and send time are ours), else
        None. After a failed condition this finds a write that landed though its answer was
        lost, so that botocore's retry met our own ETag."""
        if got is None or got[0].get("owner") != self.owner:
            return None
        sent = self._sent.get(got[1])
        if sent is None:
            return None
        self._confirm(got[2], sent)
        return got[1]

    def acquire(self) -> str | None:
        took_over = None
        self._valid_from = float("-inf")
        while True:
            current = self._get()
            if current is None:
                if self._put(IfNoneMatch="*")[0] is not None or self._adopt(self._get()):
                    break
                continue  # another run created it in between: watch that one
            if self._watch(current):
                took_over = (
                    "a lease whose run stopped refreshing it "
                    f"({_holder_text(current[0])}; unchanged for a full "
                    f"{_declared_ttl(current[0]) or self.ttl_s:g} s)"
                )
                if self._put(IfMatch=current[2])[0] is not None or self._adopt(self._get()):
                    break
                got = self._get()
                raise self._locked(got[0] if got else {})
        # A store that ignores the conditions would let a racing run overwrite us: read back.
        got = self._get()
        if self._adopt(got) is None:
            raise self._locked(got[0] if got else {})
        self._thread = threading.Thread(target=self._beat, name="prx-lease", daemon=True)
        self._thread.start()
        return took_over

    def _watch(self, current: tuple[dict, bytes, str]) -> bool:
        """Wait until ``current`` has gone unchanged for its run's full TTL (True: take it
        over) or disappeared (False); refuse as soon as its ETag changes (its run is alive)."""
        info, _, etag = current
        ttl = _declared_ttl(info) or self.ttl_s
        first_seen = time.monotonic()  # after the read returned: the holder wrote it before
        log.warning(
            "%s: held by %s; waiting until it has gone unchanged for %g s "
            "(a live run refreshes it every %g s)",
            self.store.url,
            _holder_text(info),
            ttl,
            ttl / 4,
        )
        poll = max(0.05, min(2.0, ttl / 20))
        while True:
            left = first_seen + ttl - time.monotonic()
            if left <= 0:
                return True
            time.sleep(min(poll, left))
            got = self._get()
            if got is None:
                return False
            if got[2] != etag:
                raise self._locked(got[0])

    def _locked(self, info: dict) -> LeaseHeld:
        return LeaseHeld(
            f"another {self.what} holds the lease {self.store.url} "
            f"({_holder_text(info)}); wait for it to finish, or stop it first (a lease that "
            f"goes unrefreshed for {_declared_ttl(info) or self.ttl_s:g} s is taken over)"
        )

    def _beat(self) -> None:
        interval = self.ttl_s / 4
        next_at = self._valid_from + interval
        while not self._stop.wait(max(0.0, next_at - time.monotonic())):
            started = time.monotonic()
            try:
                with self._io:
                    ok = self._refresh()
            except Exception as e:  # noqa: BLE001 - a transient failure: try again soon
                self._last_error = f"{type(e).__name__}: {e}"
                ok = False
            if self.lost:
                return
            # After a failure, try again at once (paced): the margin is spent by the clock.
            next_at = started + interval if ok else time.monotonic() + self.ttl_s / 40

    def _refresh(self, beat: bool = True) -> bool:
        """One heartbeat; True if it landed. Sets ``lost`` if someone else holds the lease."""
        etag, body = self._put(beat=beat, IfMatch=self.etag)
        if etag is not None:
            self._confirm(etag, self._sent[body])
            return True
        # 409 (a conflicting write in flight) or 412 (the ETag moved): read it and decide.
        got = self._get(beat=beat)
        if got is None:
            self.lost = "the lease was deleted by someone else"
            return False
        if got[0].get("owner") != self.owner:
            self.lost = f"another run took it over ({_holder_text(got[0])})"
            return False
        adopted = self._adopt(got)
        if adopted == body:
            return True  # this beat landed; its answer was lost
        if adopted is None:
            self.etag = got[2]  # ours, from a beat too old to remember: retry on its ETag
        self._last_error = "the conditional heartbeat did not apply (409/412); retrying"
        return False

    def confirm(self, attempts: int = 3) -> None:
        """A heartbeat now, on this thread: the store accepts it only while the lease object
        is still at the tag this holder last wrote, so a holder that another run replaced
        (however long it was paused) is refused by the store, not by its own clock."""
        self.check()
        for _ in range(attempts):
            with self._io:
                if self.lost is None and self._refresh(beat=False):
                    return
            if self.lost:
                break
        self.check()  # sets nothing new: say why below
        raise LeaseHeld(
            f"lost the lease on {self.store.url}: "
            + (self.lost or f"the store did not confirm it ({self._last_error})")
            + ". Stopped before writing more; make sure no other process writes there, "
            "then run it again"
        )

    def check(self) -> None:
        if self.lost is None:
            age = time.monotonic() - self._valid_from
            if age >= self.ttl_s - self.margin_s:
                self.lost = (
                    f"no heartbeat has landed for {age:.1f} s of its {self.ttl_s:g} s "
                    "(another run may take it over)"
                    + (f"; last error: {self._last_error}" if self._last_error else "")
                )
                self._stop.set()
        if self.lost:
            raise LeaseHeld(
                f"lost the lease on {self.store.url}: {self.lost}. Stopped before writing "
                "more; make sure no other process writes there, then run it again"
            )

    def release(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=self.ttl_s)
        try:
            got = self._get(beat=True)
            if got is not None and got[0].get("owner") == self.owner:
                self.store.delete(beat=True, tag=got[2])  # not if it moved since this read
        except Exception as e:  # noqa: BLE001 - the lease then lapses on its own
            log.warning(
                "%s: could not delete the lease (%s); the next run takes it over after %g s",
                self.store.url,
                e,
                self.ttl_s,
            )


class _LeaseFence:
    """The fence a held remote lease puts on writes under its folder (see the module
    docstring): :func:`prx_data.core.storage.write_bytes_fenced` calls :meth:`confirm`
    between reading a file's tag and writing it on that tag."""

    def __init__(self, lease: Lease):
        self.lease = lease
        self.root = posixpath.dirname(lease.path.rstrip("/"))

    @property
    def active(self) -> bool:
        return self.lease._fence is self

    def confirm(self) -> None:
        self.lease.confirm()

    def refused(self, path: str) -> PrxDataError:
        return self.lease.error(
            f"{path} changed under the lease on {self.lease.path} since this {self.lease.what} "
            "read it: another process wrote it (this one may have lost its lease while "
            "paused). Stopped before overwriting it; make sure no other process writes "
            "there, then run it again"
        )
