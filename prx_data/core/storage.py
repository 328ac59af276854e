"""Small-file I/O on local paths and object storage, for exports and sidecars.

Shards themselves move through Mosaic Streaming; this module handles the
files around them (manifests, skip lists, reports, indexes) with one API for
``/local/dir`` and ``s3://bucket/prefix`` (plus ``gs://``). S3-compatible
endpoints are taken from ``S3_ENDPOINT_URL``, as Mosaic Streaming does.
"""

from __future__ import annotations

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
