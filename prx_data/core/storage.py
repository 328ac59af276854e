"""Small-file I/O on local paths and object storage, for exports and sidecars.

Shards themselves move through Mosaic Streaming; this module handles the
files around them (manifests, skip lists, reports, indexes) with one API for
``/local/dir``, ``s3://bucket/prefix`` and ``gs://bucket/prefix``: the stores
listed in :data:`SUPPORTED_STORES`, where the project's lease (a conditional
write) works. Any other scheme (``az://``, ``abfs://``, ``hf://``, ...) is
refused in one line by :func:`check_store`. S3-compatible endpoints are taken
from ``S3_ENDPOINT_URL``, as Mosaic Streaming does; a GCS emulator from
``STORAGE_EMULATOR_HOST``, as google-cloud-storage and gcsfs do.

Every object-store call has a deadline, so a store that stops answering fails
the job with an error naming the endpoint and the setting to change, rather
than hanging it (a node leader fetching the catalog while its ranks wait at a
barrier, an exporter whose heartbeat keeps its lease alive).

* ``s3://``: reads, writes, listing, ``exists`` and deletes all go through one
  boto3 client with botocore's ``standard`` retry policy (5xx, throttling,
  resets and read timeouts are retried with backoff and jitter).
  ``S3_READ_TIMEOUT_S`` and ``S3_CONNECT_TIMEOUT_S`` (seconds; default 60
  and 10) bound one stalled request, ``S3_MAX_ATTEMPTS`` (default 5) the
  attempts. pyarrow's S3 client is kept for the few large streamed reads
  (ingest) and gets the same timeouts.
* ``gs://`` goes through pyarrow's ``GcsFileSystem`` (credentials as
  google-cloud-storage finds them; anonymous, over ``http``, at
  ``STORAGE_EMULATOR_HOST`` when that is set); each call runs under a
  deadline of ``STORAGE_DEADLINE_S`` seconds (default: the S3 settings' worst
  case, attempts x (connect + read timeout)). The lease on ``gs://`` uses
  google-cloud-storage's generation preconditions (:mod:`prx_data.core.lease`).
"""

from __future__ import annotations

import contextvars
import functools
import os
import posixpath
import threading
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Protocol, TypeVar
from urllib.parse import urlparse

import pyarrow.fs as pafs

from prx_data.core.errors import PrxDataError, UsageError

#: Environment variables that select object-storage endpoints, credentials and deadlines.
STORAGE_ENV_PREFIXES = ("S3_", "AWS_", "GOOGLE_", "GCS_", "AZURE_", "OCI_", "STORAGE_")

T = TypeVar("T")


class StorageTimeout(PrxDataError, TimeoutError):
    """An object store did not answer in time; the message names the endpoint and setting."""


class StorageUnreachable(PrxDataError, ConnectionError):
    """No connection to an object store could be made; the message names the endpoint."""


#: The stores every job supports: local paths (and ``file://``), ``s3://`` and ``gs://``.
SUPPORTED_STORES = ("file", "s3", "gs")


class UnsupportedStore(UsageError):
    """A URI on a store the toolkit does not support (no conditional write used there)."""


def storage_env() -> dict[str, str]:
    """The storage-related environment of this process, to forward to Ray workers.

    ``STORAGE_EMULATOR_HOST`` (a GCS emulator) and ``S3_ENDPOINT_URL`` are in it,
    so that workers, and streaming's uploader and downloader there, reach the
    same endpoints as the driver.
    """
    return {k: v for k, v in os.environ.items() if k.startswith(STORAGE_ENV_PREFIXES)}


def is_remote(path: str) -> bool:
    return "://" in path and not path.startswith("file://")


def scheme(path: str) -> str:
    """``file`` for a local path or ``file://`` URI, else the URI's scheme."""
    return urlparse(path).scheme if is_remote(path) else "file"


def check_store(path: str) -> str:
    """``path``'s scheme if it is one of :data:`SUPPORTED_STORES`; else one line naming them."""
    got = scheme(path)
    if got not in SUPPORTED_STORES:
        raise UnsupportedStore(
            f"{path}: {got}:// is not a supported store; use a local path, s3:// (S3 or an "
            "S3-compatible store through S3_ENDPOINT_URL) or gs:// (Google Cloud Storage; "
            "an emulator through STORAGE_EMULATOR_HOST), and copy the data there"
        )
    return got


def join(base: str, *parts: str) -> str:
    if is_remote(base):
        return posixpath.join(base, *parts)
    return os.path.join(base, *parts)


@dataclass(frozen=True)
class S3Settings:
    """Timeouts and attempts of one S3 client, read from the environment by :meth:`from_env`."""

    endpoint: str | None = None
    read_timeout_s: float = 60.0
    connect_timeout_s: float = 10.0
    max_attempts: int = 5

    @classmethod
    def from_env(cls) -> S3Settings:
        env = os.environ.get
        return cls(
            env("S3_ENDPOINT_URL") or None,
            _env_number("S3_READ_TIMEOUT_S", 60.0),
            _env_number("S3_CONNECT_TIMEOUT_S", 10.0),
            int(_env_number("S3_MAX_ATTEMPTS", 5)),
        )

    @property
    def where(self) -> str:
        return self.endpoint or "the default AWS S3 endpoint"

    def worst_case_s(self) -> float:
        """Longest one call may take against a store that never answers."""
        return self.max_attempts * (self.connect_timeout_s + self.read_timeout_s)


def _env_number(name: str, default: float) -> float:
    raw = os.environ.get(name)
    if not raw:
        return default
    try:
        value = float(raw)
    except ValueError:
        raise UsageError(f"{name}={raw!r} is not a number of seconds/attempts") from None
    if value <= 0:
        raise UsageError(f"{name}={raw!r} must be positive")
    return value


def deadline_s() -> float:
    """Deadline of one pyarrow call on a remote store (``STORAGE_DEADLINE_S``)."""
    return _env_number("STORAGE_DEADLINE_S", S3Settings.from_env().worst_case_s())


def _s3fs() -> pafs.S3FileSystem:
    s = S3Settings.from_env()
    kwargs: dict = {}
    if s.endpoint:
        parsed = urlparse(s.endpoint)
        kwargs["endpoint_override"] = parsed.netloc or s.endpoint
        kwargs["scheme"] = parsed.scheme or "https"
    region = os.environ.get("AWS_REGION") or os.environ.get("AWS_DEFAULT_REGION")
    if region:
        kwargs["region"] = region
    kwargs["retry_strategy"] = pafs.AwsStandardS3RetryStrategy(max_attempts=s.max_attempts)
    kwargs["connect_timeout"] = s.connect_timeout_s
    kwargs["request_timeout"] = s.read_timeout_s
    return pafs.S3FileSystem(**kwargs)


def s3_client(settings: S3Settings | None = None):
    """A boto3 S3 client with botocore's standard retries (cached per settings).

    ``settings`` defaults to :meth:`S3Settings.from_env`; the export lease's
    heartbeat passes its own, shorter ones.
    """
    return _s3_client(settings or S3Settings.from_env())


@functools.lru_cache(maxsize=8)
def _s3_client(s: S3Settings):
    import boto3
    from botocore.config import Config

    config = Config(
        retries={"mode": "standard", "total_max_attempts": s.max_attempts},
        read_timeout=s.read_timeout_s,
        connect_timeout=s.connect_timeout_s,
    )
    return boto3.session.Session().client("s3", endpoint_url=s.endpoint, config=config)


def s3_call(path: str, what: str, fn: Callable[[], T], settings: S3Settings | None = None) -> T:
    """Run one boto3 call; a timeout or refused connection becomes a one-line storage error."""
    from botocore.exceptions import (
        ConnectionClosedError,
        ConnectTimeoutError,
        EndpointConnectionError,
        ReadTimeoutError,
    )

    s = settings or S3Settings.from_env()
    try:
        return fn()
    except (ReadTimeoutError, ConnectTimeoutError) as e:
        raise StorageTimeout(
            f"{path}: {what} got no answer from the object store at {s.where} "
            f"({s.max_attempts} attempt(s), {s.connect_timeout_s:g} s to connect and "
            f"{s.read_timeout_s:g} s to read each; {type(e).__name__}). Check S3_ENDPOINT_URL, "
            "or raise S3_READ_TIMEOUT_S / S3_CONNECT_TIMEOUT_S / S3_MAX_ATTEMPTS"
        ) from None
    except (EndpointConnectionError, ConnectionClosedError) as e:
        raise StorageUnreachable(
            f"{path}: {what} failed: no usable connection to the object store at {s.where} "
            f"({s.max_attempts} attempt(s); {type(e).__name__}). Check S3_ENDPOINT_URL, or "
            "raise S3_MAX_ATTEMPTS"
        ) from None


def with_deadline(path: str, what: str, fn: Callable[[], T], limit_s: float | None = None) -> T:
    """Run a pyarrow call on a remote store; past ``limit_s`` (:func:`deadline_s`) raise.

    pyarrow calls cannot be cancelled: the call goes on in a daemon thread,
    and the job fails with a :class:`StorageTimeout` rather than waiting on it.
    """
    limit = deadline_s() if limit_s is None else limit_s
    box: dict = {}
    done = threading.Event()

    def run() -> None:
        try:
            box["value"] = fn()
        except BaseException as e:  # noqa: BLE001 - handed to the caller below
            box["error"] = e
        finally:
            done.set()

    threading.Thread(target=run, name=f"storage-{what}", daemon=True).start()
    if not done.wait(limit):
        raise StorageTimeout(
            f"{path}: {what} got no answer from {urlparse(path).scheme}://"
            f"{urlparse(path).netloc} within {limit:g} s. Check the store, or raise "
            "STORAGE_DEADLINE_S"
        )
    if "error" in box:
        raise box["error"]
    return box["value"]


def _bucket_key(path: str) -> tuple[str, str]:
    parsed = urlparse(path)
    return parsed.netloc, parsed.path.lstrip("/")


def gcs_emulator() -> str | None:
    """The GCS emulator's ``http://host:port`` from ``STORAGE_EMULATOR_HOST``, or None."""
    host = os.environ.get("STORAGE_EMULATOR_HOST", "").strip()
    if not host:
        return None
    return host if "://" in host else f"http://{host}"


def _gcsfs() -> pafs.GcsFileSystem:
    """pyarrow's GCS client; at ``STORAGE_EMULATOR_HOST`` anonymously when that is set."""
    import datetime

    kwargs: dict = {"retry_time_limit": datetime.timedelta(seconds=max(1.0, deadline_s()))}
    emulator = gcs_emulator()
    if emulator:
        parsed = urlparse(emulator)
        kwargs.update(anonymous=True, scheme=parsed.scheme or "http")
        kwargs["endpoint_override"] = parsed.netloc
    project = os.environ.get("GOOGLE_CLOUD_PROJECT")
    if project:
        kwargs["project_id"] = project
    return pafs.GcsFileSystem(**kwargs)


def filesystem(path: str) -> tuple[pafs.FileSystem, str]:
    """(pyarrow filesystem, path within it) for a local path or URI.

    For large streamed reads only (ingest); small files go through the
    functions below, which put a deadline on every remote call. A store
    outside :data:`SUPPORTED_STORES` is refused (:func:`check_store`).
    """
    if not is_remote(path):
        return pafs.LocalFileSystem(), os.path.abspath(path.removeprefix("file://"))
    got = check_store(path)
    parsed = urlparse(path)
    key = f"{parsed.netloc}{parsed.path}"
    if got == "s3":
        return _s3fs(), key
    return _gcsfs(), key.rstrip("/")


def _is_s3(path: str) -> bool:
    return path.startswith("s3://")


def _client_error_code(e) -> tuple[str, int | None]:
    return (
        str(e.response.get("Error", {}).get("Code", "")),
        e.response.get("ResponseMetadata", {}).get("HTTPStatusCode"),
    )


def _not_found(e) -> bool:
    code, status = _client_error_code(e)
    return code in ("NoSuchKey", "404", "NotFound", "NoSuchBucket") or status == 404


def read_bytes(path: str, max_bytes: int | None = None) -> bytes:
    """The bytes of a file; with ``max_bytes``, at most ``max_bytes + 1`` of them are fetched.

    The cap is how a caller tells "too large" apart without reading all of it
    (a ranged GET on S3); files of an export go through :mod:`prx_data.core.confined`.
    """
    if _is_s3(path):
        from botocore.exceptions import ClientError

        bucket, key = _bucket_key(path)
        extra = {} if max_bytes is None else {"Range": f"bytes=0-{max_bytes}"}

        def get() -> bytes:
            body = s3_client().get_object(Bucket=bucket, Key=key, **extra)["Body"]
            return body.read() if max_bytes is None else body.read(max_bytes + 1)

        try:
            return s3_call(path, "read", get)
        except ClientError as e:
            if _not_found(e):
                raise FileNotFoundError(path) from None
            if max_bytes is not None and _client_error_code(e)[0] == "InvalidRange":
                return b""  # an empty object has no byte 0
            raise
    fs, p = filesystem(path)

    def read() -> bytes:
        with fs.open_input_stream(p) as f:
            return f.read() if max_bytes is None else f.read(max_bytes + 1)

    return with_deadline(path, "read", read) if is_remote(path) else read()


def _s3_prefix(path: str) -> tuple[str, str]:
    """(bucket, ``key/``) of a directory-like S3 path (``""`` for the bucket's root)."""
    bucket, key = _bucket_key(path)
    key = key.rstrip("/")
    return bucket, f"{key}/" if key else ""


def _s3_object_exists(path: str) -> bool:
    from botocore.exceptions import ClientError

    bucket, key = _bucket_key(path)
    if not key.rstrip("/"):
        return False
    try:
        s3_call(path, "exists", lambda: s3_client().head_object(Bucket=bucket, Key=key))
    except ClientError as e:
        if _not_found(e):
            return False
        raise
    return True


def _s3_has_children(path: str) -> bool:
    from botocore.exceptions import ClientError

    bucket, prefix = _s3_prefix(path)
    try:
        r = s3_call(
            path,
            "exists",
            lambda: s3_client().list_objects_v2(Bucket=bucket, Prefix=prefix, MaxKeys=1),
        )
    except ClientError as e:
        if _not_found(e):
            return False
        raise
    return bool(r.get("KeyCount") or r.get("Contents") or r.get("CommonPrefixes"))


def exists(path: str) -> bool:
    """Whether a file or a non-empty directory (prefix) is at ``path``."""
    if _is_s3(path):
        return _s3_object_exists(path) or _s3_has_children(path)
    fs, p = filesystem(path)

    def info() -> bool:
        return fs.get_file_info(p).type != pafs.FileType.NotFound

    return with_deadline(path, "exists", info) if is_remote(path) else info()


class Fence(Protocol):
    """What a held remote lease offers writes under its folder (``root``)."""

    root: str

    @property
    def active(self) -> bool:
        """False once the lease is released: the fence no longer applies."""

    def confirm(self) -> None:
        """Raise unless the store still holds the lease as ours (a conditional write)."""

    def refused(self, path: str) -> Exception:
        """The error for a write the store refused because ``path`` changed meanwhile."""


#: The fences of the remote leases this thread (context) holds, innermost last.
_FENCES: contextvars.ContextVar[tuple[Fence, ...]] = contextvars.ContextVar(
    "prx_storage_fences", default=()
)


def push_fence(fence: Fence) -> None:
    """Fence this context's writes under ``fence.root`` (a lease taken)."""
    _FENCES.set((*_FENCES.get(), fence))


def pop_fence(fence: Fence) -> None:
    """Undo :func:`push_fence` (the lease released; leases may end in any order)."""
    _FENCES.set(tuple(f for f in _FENCES.get() if f is not fence))


def active_fence(path: str) -> Fence | None:
    """The innermost fence held by this context whose folder holds ``path``."""
    if not is_remote(path):
        return None
    for fence in reversed(_FENCES.get()):
        root = fence.root.rstrip("/") + "/"
        if fence.active and path.startswith(root):
            return fence
    return None


def write_bytes_fenced(path: str, data: bytes, fence: Fence) -> None:
    """Write ``path`` (``s3://``/``gs://``) only while ``fence``'s lease is ours, as far as
    the store can check it (see :mod:`prx_data.core.lease`, "Fenced writes").

    1. read the target's tag (ETag / generation; none: absent);
    2. ``fence.confirm()``: a write conditional on the lease object's own tag;
    3. write the target conditional on the tag read in 1.

    A writer paused past its lease is refused at 2 (the new holder's lease
    object has another tag) or at 3 (the new holder wrote the target since 1).
    """
    tag = object_tag(path)
    fence.confirm()
    if put_if(path, data, tag) is None:
        raise fence.refused(path)


def write_bytes_atomic(path: str, data: bytes) -> None:
    """Write so that readers see either nothing or the whole file.

    Locally: temp file + fsync + rename. On object storage a PUT is atomic;
    under a remote lease held by this context, a fenced write
    (:func:`write_bytes_fenced`).
    """
    fence = active_fence(path)
    if fence is not None:
        write_bytes_fenced(path, data, fence)
        return
    if _is_s3(path):
        bucket, key = _bucket_key(path)
        s3_call(path, "write", lambda: s3_client().put_object(Bucket=bucket, Key=key, Body=data))
        return
    if is_remote(path):
        fs, p = filesystem(path)

        def put() -> None:
            with fs.open_output_stream(p) as f:
                f.write(data)

        with_deadline(path, "write", put)
        return
    path = os.path.abspath(path)
    os.makedirs(os.path.dirname(path), exist_ok=True)
    tmp = f"{path}.tmp-{uuid.uuid4().hex[:8]}"
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def gcs_client():
    """A google-cloud-storage client (cached): anonymous at ``STORAGE_EMULATOR_HOST`` when set.

    pyarrow has no generation preconditions, so the conditional writes (the
    lease and :func:`put_if`) on ``gs://`` go through this client.
    """
    return _gcs_client(gcs_emulator(), os.getpid())  # a forked child makes its own


def new_gcs_client():
    """An uncached :func:`gcs_client` (for a library that keeps its own, per process)."""
    return _gcs_client.__wrapped__(gcs_emulator(), os.getpid())


@functools.lru_cache(maxsize=4)
def _gcs_client(emulator: str | None, pid: int):
    try:
        from google.cloud import storage as gcs
    except ImportError:
        raise UsageError(
            "gs:// needs google-cloud-storage: `pip install google-cloud-storage`"
        ) from None
    if emulator:
        from google.auth.credentials import AnonymousCredentials

        project = os.environ.get("GOOGLE_CLOUD_PROJECT") or "prx-data"
        return gcs.Client(project=project, credentials=AnonymousCredentials())
    return gcs.Client()


def gcs_call(path: str, what: str, fn: Callable[[], T], timeout_s: float | None = None) -> T:
    """Run one google-cloud-storage call; a timeout or refused connection is one line."""
    import requests

    where = gcs_emulator() or "Google Cloud Storage"
    try:
        return fn()
    except requests.Timeout as e:
        limit = f" within {timeout_s:g} s" if timeout_s else ""
        raise StorageTimeout(
            f"{path}: {what} got no answer from {where}{limit} ({type(e).__name__}). Check "
            "STORAGE_EMULATOR_HOST, or raise STORAGE_DEADLINE_S"
        ) from None
    except requests.ConnectionError as e:
        raise StorageUnreachable(
            f"{path}: {what} failed: no usable connection to {where} ({type(e).__name__}). "
            "Check STORAGE_EMULATOR_HOST and the network"
        ) from None


def object_tag(path: str) -> str | None:
    """What a conditional write of ``path`` is conditioned on: its ETag on ``s3://``, its
    generation on ``gs://``; None when there is no object (local paths: always None)."""
    got = scheme(path)
    if got == "s3":
        v = file_version(path)
        return None if v is None else v.tag
    if got == "gs":
        from google.api_core import exceptions as gexc

        bucket, key = _bucket_key(path)
        blob = gcs_client().bucket(bucket).blob(key)
        try:
            gcs_call(path, "stat", lambda: blob.reload(timeout=deadline_s()))
        except gexc.NotFound:
            return None
        return str(blob.generation)
    return None


def put_if(path: str, data: bytes, tag: str | None) -> str | None:
    """Write ``path`` only if it is still what ``tag`` says (None: no object); the store
    checks it (``If-Match`` / ``If-None-Match: *`` on S3, ``ifGenerationMatch`` on GCS).

    Returns the new tag, or None when the store refused the write (someone else
    wrote or deleted ``path`` since ``tag`` was seen).
    """
    got = check_store(path)
    bucket, key = _bucket_key(path)
    if got == "s3":
        from botocore.exceptions import ClientError

        cond = {"IfNoneMatch": "*"} if tag is None else {"IfMatch": tag}

        def put() -> str:
            return s3_client().put_object(Bucket=bucket, Key=key, Body=data, **cond)["ETag"]

        try:
            return s3_call(path, "conditional write", put)
        except ClientError as e:
            code, status = _client_error_code(e)
            if status in (409, 412) or code in (
                "PreconditionFailed",
                "ConditionalRequestConflict",
                "NoSuchKey",
            ):
                return None
            raise
    if got == "gs":
        from google.api_core import exceptions as gexc

        blob = gcs_client().bucket(bucket).blob(key)
        gen = 0 if tag is None else int(tag)

        def upload() -> str:
            blob.upload_from_string(data, if_generation_match=gen, timeout=deadline_s())
            return str(blob.generation)

        try:
            return gcs_call(path, "conditional write", upload)
        except (gexc.PreconditionFailed, gexc.NotFound, gexc.Conflict):
            return None
    raise UsageError(f"{path}: conditional writes are for s3:// and gs:// objects")


class StoreConflict(PrxDataError):
    """Another writer put an object where this one expected none (a conditional create refused)."""


def write_new(path: str, data: bytes) -> None:
    """Create ``path`` (``s3://``/``gs://``) only if no object is there, checked by the store
    (``If-None-Match: *``; ``ifGenerationMatch=0``). The same bytes already there (a retried
    request whose first answer was lost) count as written; other bytes raise
    :class:`StoreConflict` and are left as they are.
    """
    if put_if(path, data, None) is not None:
        return
    try:
        if read_bytes(path) == data:
            return
    except FileNotFoundError:
        pass
    raise StoreConflict(
        f"{path}: another process wrote this object after this one cleared its folder (a "
        "run that lost its lease while paused, or two runs on one output); nothing was "
        "overwritten. Make sure one run writes there, then run it again"
    )


def delete(path: str) -> None:
    """Delete a file, or a directory (prefix) with everything under it; nothing there is fine."""
    if _is_s3(path):
        bucket, key = _bucket_key(path)
        if _s3_object_exists(path):
            s3_call(path, "delete", lambda: s3_client().delete_object(Bucket=bucket, Key=key))
            return
        _, prefix = _s3_prefix(path)
        if not prefix:
            raise UsageError(f"{path}: refusing to delete a whole bucket")
        batch: list[dict] = []
        for rel, _ in _s3_walk(path, recursive=True, keep_markers=True):
            batch.append({"Key": prefix + rel})
            if len(batch) == 1000:  # deleted page by page: no whole listing in memory
                _s3_delete_batch(path, bucket, batch)
                batch = []
        if batch:
            _s3_delete_batch(path, bucket, batch)
        return
    fs, p = filesystem(path)
    if is_remote(path) and "/" not in p.strip("/"):
        raise UsageError(f"{path}: refusing to delete a whole bucket")

    def rm() -> None:
        info = fs.get_file_info(p)
        if info.type == pafs.FileType.Directory:
            if not is_remote(path):
                fs.delete_dir(p)
                return
            # GCS: a prefix may have no "dir/" marker object, which delete_dir also deletes.
            fs.delete_dir_contents(p, missing_dir_ok=True)
            try:
                fs.delete_dir(p)
            except OSError:  # no marker: the prefix is gone with its last object
                pass
        elif info.type != pafs.FileType.NotFound:
            fs.delete_file(p)

    with_deadline(path, "delete", rm) if is_remote(path) else rm()


def _s3_delete_batch(path: str, bucket: str, objects: list[dict]) -> None:
    delete = {"Objects": objects, "Quiet": True}
    r = s3_call(path, "delete", lambda: s3_client().delete_objects(Bucket=bucket, Delete=delete))
    if r.get("Errors"):
        err = r["Errors"][0]
        raise OSError(f"{path}: could not delete {err.get('Key')}: {err.get('Message')}")


def _s3_walk(root: str, recursive: bool, keep_markers: bool = False) -> Iterator[tuple[str, int]]:
    """(path relative to ``root``, size) of every object under an S3 prefix, page by page."""
    for rel, obj in _s3_objects(root, recursive, keep_markers):
        yield rel, int(obj.get("Size", 0))


def _s3_objects(
    root: str, recursive: bool, keep_markers: bool = False
) -> Iterator[tuple[str, dict]]:
    """(path relative to ``root``, listing entry) of every object under an S3 prefix."""
    from botocore.exceptions import ClientError

    bucket, prefix = _s3_prefix(root)
    kwargs: dict = {"Bucket": bucket, "Prefix": prefix}
    if not recursive:
        kwargs["Delimiter"] = "/"
    while True:
        try:
            page = s3_call(root, "list", lambda: s3_client().list_objects_v2(**kwargs))
        except ClientError as e:
            if _not_found(e):
                return
            raise
        for obj in page.get("Contents", ()):
            rel = obj["Key"][len(prefix) :]
            if keep_markers or (rel and not rel.endswith("/")):  # "dir/" markers are no files
                yield rel, obj
        if not page.get("IsTruncated"):
            return
        kwargs["ContinuationToken"] = page["NextContinuationToken"]


def _walk(root: str, recursive: bool) -> list[tuple[str, int]]:
    """(relative path, size) of the files under ``root``."""
    if _is_s3(root):
        return list(_s3_walk(root, recursive))
    fs, p = filesystem(root)

    def infos() -> list:
        return fs.get_file_info(pafs.FileSelector(p, recursive=recursive, allow_not_found=True))

    rel = posixpath.relpath if is_remote(root) else os.path.relpath
    got = with_deadline(root, "list", infos) if is_remote(root) else infos()
    return [(rel(i.path, p), i.size) for i in got if i.type == pafs.FileType.File]


def list_files(root: str, suffix: str = "", recursive: bool = True) -> list[str]:
    """Paths relative to ``root`` of files under it (sorted)."""
    return sorted(r for r, _ in _walk(root, recursive) if r.endswith(suffix))


def file_sizes(root: str) -> dict[str, int]:
    """{``/``-separated path relative to ``root``: size} of every file under it."""
    return {r.replace("\\", "/"): size for r, size in _walk(root, recursive=True)}


@dataclass(frozen=True)
class FileVersion:
    """What a listing says about one file: its size and a tag that changes with its bytes.

    ``tag`` is the S3 ETag, or the modification time elsewhere; None when the
    store gives neither (the file must then be read to tell).
    """

    size: int
    tag: str | None


def file_versions(root: str) -> dict[str, FileVersion]:
    """{``/``-separated path relative to ``root``: version} of every file under it (one listing)."""
    if _is_s3(root):
        return {
            rel: FileVersion(int(obj.get("Size", 0)), obj.get("ETag"))
            for rel, obj in _s3_objects(root, recursive=True)
        }
    fs, p = filesystem(root)

    def infos() -> list:
        return fs.get_file_info(pafs.FileSelector(p, recursive=True, allow_not_found=True))

    rel = posixpath.relpath if is_remote(root) else os.path.relpath
    got = with_deadline(root, "list", infos) if is_remote(root) else infos()
    return {
        rel(i.path, p).replace("\\", "/"): FileVersion(
            int(i.size), None if i.mtime_ns is None else str(i.mtime_ns)
        )
        for i in got
        if i.type == pafs.FileType.File
    }


def file_version(path: str) -> FileVersion | None:
    """The version of one file (a HEAD on S3), or None when there is none."""
    if _is_s3(path):
        from botocore.exceptions import ClientError

        bucket, key = _bucket_key(path)
        if not key.rstrip("/"):
            return None
        try:
            r = s3_call(path, "stat", lambda: s3_client().head_object(Bucket=bucket, Key=key))
        except ClientError as e:
            if _not_found(e):
                return None
            raise
        return FileVersion(int(r.get("ContentLength", 0)), r.get("ETag"))
    fs, p = filesystem(path)

    def info():
        return fs.get_file_info(p)

    i = with_deadline(path, "stat", info) if is_remote(path) else info()
    if i.type != pafs.FileType.File:
        return None
    return FileVersion(int(i.size), None if i.mtime_ns is None else str(i.mtime_ns))


def list_dirs(root: str) -> list[str]:
    """Names of the directories (prefixes) directly under ``root`` (sorted)."""
    if _is_s3(root):
        from botocore.exceptions import ClientError

        bucket, prefix = _s3_prefix(root)
        kwargs: dict = {"Bucket": bucket, "Prefix": prefix, "Delimiter": "/"}
        out = []
        while True:
            try:
                page = s3_call(root, "list", lambda: s3_client().list_objects_v2(**kwargs))
            except ClientError as e:
                if _not_found(e):
                    break
                raise
            for cp in page.get("CommonPrefixes", ()):
                name = cp["Prefix"][len(prefix) :].rstrip("/")
                if name:
                    out.append(name)
            if not page.get("IsTruncated"):
                break
            kwargs["ContinuationToken"] = page["NextContinuationToken"]
        return sorted(out)
    if scheme(root) == "gs":
        return _gcs_list_dirs(root)
    fs, p = filesystem(root)

    def infos() -> list:
        return fs.get_file_info(pafs.FileSelector(p, allow_not_found=True))

    got = with_deadline(root, "list", infos) if is_remote(root) else infos()
    return sorted(
        posixpath.basename(i.path.replace("\\", "/").rstrip("/"))
        for i in got
        if i.type == pafs.FileType.Directory
    )


def _gcs_list_dirs(root: str) -> list[str]:
    """Prefixes directly under a ``gs://`` folder. pyarrow's GCS listing reports a folder
    only where a ``dir/`` marker object exists, which objects written by other tools (and
    by pyarrow's own output streams) do not leave: the delimiter listing does."""
    bucket, key = _bucket_key(root)
    prefix = key.rstrip("/") + "/" if key.strip("/") else ""

    def prefixes() -> list[str]:
        pages = gcs_client().list_blobs(bucket, prefix=prefix, delimiter="/", timeout=deadline_s())
        for _ in pages:  # the prefixes fill in as the pages are read
            pass
        return list(pages.prefixes)

    from google.api_core import exceptions as gexc

    try:
        got = gcs_call(root, "list", prefixes)
    except gexc.NotFound:
        return []
    return sorted(n for n in (p[len(prefix) :].rstrip("/") for p in got) if n)
