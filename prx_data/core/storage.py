"""Small-file I/O on local paths and object storage, for exports and sidecars.

Shards themselves move through Mosaic Streaming; this module handles the
files around them (manifests, skip lists, reports, indexes) with one API for
``/local/dir`` and ``s3://bucket/prefix`` (plus ``gs://``). S3-compatible
endpoints are taken from ``S3_ENDPOINT_URL``, as Mosaic Streaming does.

Whole-object reads and writes on ``s3://`` go through boto3 with botocore's
``standard`` retry policy (5xx, throttling, connection resets and read
timeouts are retried with backoff and jitter): pyarrow's S3 client gives up
on a stalled upload after one low-speed timeout. ``S3_READ_TIMEOUT_S`` and
``S3_CONNECT_TIMEOUT_S`` (seconds; default 60 and 10) bound a stalled request,
``S3_MAX_ATTEMPTS`` (default 5) the attempts.
"""

from __future__ import annotations

import functools
import os
import posixpath
import uuid
from urllib.parse import urlparse

import pyarrow.fs as pafs

#: Environment variables that select object-storage endpoints and credentials.
STORAGE_ENV_PREFIXES = ("S3_", "AWS_", "GOOGLE_", "GCS_", "AZURE_", "OCI_")


def storage_env() -> dict[str, str]:
    """The storage-related environment of this process, to forward to Ray workers."""
    return {k: v for k, v in os.environ.items() if k.startswith(STORAGE_ENV_PREFIXES)}


def is_remote(path: str) -> bool:
    return "://" in path and not path.startswith("file://")


def join(base: str, *parts: str) -> str:
    if is_remote(base):
        return posixpath.join(base, *parts)
    return os.path.join(base, *parts)


def _s3fs() -> pafs.S3FileSystem:
    endpoint = os.environ.get("S3_ENDPOINT_URL")
    kwargs: dict = {}
    if endpoint:
        parsed = urlparse(endpoint)
        kwargs["endpoint_override"] = parsed.netloc or endpoint
        kwargs["scheme"] = parsed.scheme or "https"
    region = os.environ.get("AWS_REGION") or os.environ.get("AWS_DEFAULT_REGION")
    if region:
        kwargs["region"] = region
    kwargs["retry_strategy"] = pafs.AwsStandardS3RetryStrategy(max_attempts=5)
    return pafs.S3FileSystem(**kwargs)


def s3_client():
    """A boto3 S3 client for ``S3_ENDPOINT_URL`` with botocore's standard retries (cached)."""
    env = os.environ.get
    return _s3_client(
        env("S3_ENDPOINT_URL") or None,
        float(env("S3_READ_TIMEOUT_S") or 60),
        float(env("S3_CONNECT_TIMEOUT_S") or 10),
        int(env("S3_MAX_ATTEMPTS") or 5),
    )


@functools.lru_cache(maxsize=8)
def _s3_client(endpoint: str | None, read_timeout: float, connect_timeout: float, attempts: int):
    import boto3
    from botocore.config import Config

    config = Config(
        retries={"mode": "standard", "max_attempts": attempts},
        read_timeout=read_timeout,
        connect_timeout=connect_timeout,
    )
    return boto3.session.Session().client("s3", endpoint_url=endpoint, config=config)


def _bucket_key(path: str) -> tuple[str, str]:
    parsed = urlparse(path)
    return parsed.netloc, parsed.path.lstrip("/")


def filesystem(path: str) -> tuple[pafs.FileSystem, str]:
    """(pyarrow filesystem, path within it) for a local path or URI."""
    if not is_remote(path):
        return pafs.LocalFileSystem(), os.path.abspath(path.removeprefix("file://"))
    parsed = urlparse(path)
    key = f"{parsed.netloc}{parsed.path}"
    if parsed.scheme == "s3":
        return _s3fs(), key
    fs, inner = pafs.FileSystem.from_uri(path)
    return fs, inner


def read_bytes(path: str) -> bytes:
    if path.startswith("s3://"):
        from botocore.exceptions import ClientError

        bucket, key = _bucket_key(path)
        try:
            return s3_client().get_object(Bucket=bucket, Key=key)["Body"].read()
        except ClientError as e:
            if e.response.get("Error", {}).get("Code") in ("NoSuchKey", "404", "NoSuchBucket"):
                raise FileNotFoundError(path) from None
            raise
    fs, p = filesystem(path)
    with fs.open_input_stream(p) as f:
        return f.read()


def exists(path: str) -> bool:
    fs, p = filesystem(path)
    return fs.get_file_info(p).type != pafs.FileType.NotFound


def write_bytes_atomic(path: str, data: bytes) -> None:
    """Write so that readers see either nothing or the whole file.

    Locally: temp file + fsync + rename. On object storage a PUT is atomic.
    """
    if path.startswith("s3://"):
        bucket, key = _bucket_key(path)
        s3_client().put_object(Bucket=bucket, Key=key, Body=data)
        return
    if is_remote(path):
        fs, p = filesystem(path)
        with fs.open_output_stream(p) as f:
            f.write(data)
        return
    path = os.path.abspath(path)
    os.makedirs(os.path.dirname(path), exist_ok=True)
    tmp = f"{path}.tmp-{uuid.uuid4().hex[:8]}"
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def delete(path: str) -> None:
    fs, p = filesystem(path)
    info = fs.get_file_info(p)
    if info.type == pafs.FileType.Directory:
        fs.delete_dir(p)
    elif info.type != pafs.FileType.NotFound:
        fs.delete_file(p)


def list_files(root: str, suffix: str = "", recursive: bool = True) -> list[str]:
    """Paths relative to ``root`` of files under it (sorted)."""
    fs, p = filesystem(root)
    sel = pafs.FileSelector(p, recursive=recursive, allow_not_found=True)
    out = []
    for info in fs.get_file_info(sel):
        if info.type == pafs.FileType.File and info.path.endswith(suffix):
            out.append(
                posixpath.relpath(info.path, p)
                if is_remote(root)
                else os.path.relpath(info.path, p)
            )
    return sorted(out)
