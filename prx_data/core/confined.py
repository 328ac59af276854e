"""Read and write files of a received export (or table folder) without trusting its tree.

An export someone else made is data, and so is its directory tree: a part
directory may be a symbolic link to somewhere else, a sidecar may be a FIFO
(an ``open`` that blocks for ever) or a link to ``/dev/zero`` (a read without
end). Every file read from, or written into, such a tree goes through here:

* **Containment.** The path is resolved (every symbolic link followed) and
  must stay inside the tree's root; the last component is opened with
  ``O_NOFOLLOW``, so a link swapped in after the check is not followed
  either. On object stores there are no links: the key must lie under the
  root's prefix and have no ``..`` or empty segment.
* **Regular files only.** The file is opened with ``O_NONBLOCK`` (a FIFO
  opens at once instead of waiting for a writer) and ``fstat``-ed on the
  open descriptor, so a FIFO, device or socket is refused, not read.
* **A size cap.** What the index declares (a shard's bytes), or a fixed cap
  for small files (:data:`SMALL_MAX_BYTES`, :data:`INDEX_MAX_BYTES`, ...).
  At most ``cap + 1`` bytes are ever read, even from a file that grows.

A refusal is an :class:`UnsafeFileError` that names the path; a missing file
stays a ``FileNotFoundError`` (callers treat absence as a state, not an attack).
Resolved directories are cached per :class:`Confined` root, so reading 10^5
sidecars costs one ``open`` + ``fstat`` each.
"""

from __future__ import annotations

import errno
import os
import stat
import threading
import uuid
from dataclasses import dataclass, field
from typing import BinaryIO

from prx_data.core import storage
from prx_data.core.errors import PrxDataError

#: Progress markers, reports, configs, registry references: JSON text of a few KB.
SMALL_MAX_BYTES = 16 << 20
#: A merged bucket index: ~500 bytes per shard, so 256 MiB is ~500k shards in one bucket.
INDEX_MAX_BYTES = 256 << 20
#: One part's ``ids.parquet`` (or an adopted bucket's manifest, or a skip-list file).
MANIFEST_MAX_BYTES = 1 << 30
#: A sidecar's header (JSON, bounded by the list and shard names) on top of its indices.
SIDECAR_HEADER_MAX_BYTES = 64 << 10


class UnsafeFileError(PrxDataError, ValueError):
    """A file of a tree that is not a plain file inside it (a link out, a FIFO, too large)."""


def sidecar_max_bytes(samples: int) -> int:
    """The largest sidecar a shard of ``samples`` samples can have (every index listed)."""
    return SIDECAR_HEADER_MAX_BYTES + 4 * max(0, int(samples))


def _real(path: str) -> str:
    return os.path.realpath(os.path.abspath(path))


@dataclass
class Confined:
    """One tree's root, and the checks every path under it goes through.

    ``root`` is a local directory or an object-store URI. Local paths given to
    the methods may be absolute (under ``root``), relative to the working directory
    (built from a relative ``root``), or relative to ``root``.
    """

    root: str
    _real_root: str = field(init=False, repr=False)
    _dirs: dict[str, str] = field(init=False, repr=False, default_factory=dict)
    _lock: threading.Lock = field(init=False, repr=False, default_factory=threading.Lock)

    def __post_init__(self) -> None:
        self.remote = storage.is_remote(self.root)
        if self.remote:
            self._real_root = self.root.rstrip("/")
        else:
            self._real_root = _real(self.root.removeprefix("file://"))

    # -- containment -------------------------------------------------------------------------

    def _inside(self, real: str) -> bool:
        root = self._real_root
        return real == root or real.startswith(root.rstrip(os.sep) + os.sep)

    def _local(self, path: str) -> str:
        path = path.removeprefix("file://")
        if os.path.isabs(path):
            return path
        # Callers build paths from the root as they spelled it (storage.join(root, ...)): a
        # relative path under a relative root is relative to the working directory, as the
        # root is; any other relative path is relative to the root.
        here = os.path.abspath(path)
        top = os.path.abspath(self.root.removeprefix("file://")).rstrip(os.sep) + os.sep
        return here if here.startswith(top) else os.path.join(self.root, path)

    def _real_dir(self, directory: str) -> str:
        """``directory`` resolved and checked to be inside the root (cached)."""
        with self._lock:
            got = self._dirs.get(directory)
        if got is not None:
            return got
        real = _real(directory)
        if not self._inside(real):
            lexical = os.path.normpath(os.path.abspath(directory))
            top = os.path.normpath(os.path.abspath(self.root.removeprefix("file://")))
            if lexical != top and not lexical.startswith(top.rstrip(os.sep) + os.sep):
                raise UnsafeFileError(f"{directory}: not inside {self.root}; refusing it")
            raise UnsafeFileError(
                f"{directory}: leads out of {self.root} (to {real}) through a symbolic link; "
                "refusing to read or write there. Replace the link with the directory itself"
            )
        with self._lock:
            if len(self._dirs) > 65536:  # a long walk over many parts: keep the cache bounded
                self._dirs.clear()
            self._dirs[directory] = real
        return real

    def check_key(self, path: str) -> str:
        """An object-store path: under the root's prefix, no ``..`` or empty segment."""
        root = self._real_root
        rel = path[len(root) + 1 :] if path.startswith(root + "/") else None
        if not rel or any(seg in ("", ".", "..") for seg in rel.split("/")) or "\\" in rel:
            raise UnsafeFileError(f"{path}: not a key under {root}/; refusing it")
        return path

    def resolve(self, path: str) -> str:
        """The real path of ``path`` (local), checked to stay inside the root; keys as they are.

        The last component may be missing (a file about to be written) but not
        a symbolic link that leads out of the root.
        """
        if self.remote:
            return self.check_key(path)
        local = os.path.normpath(self._local(path))
        head, tail = os.path.split(local)
        real = os.path.join(self._real_dir(head), tail)
        if os.path.islink(real):
            target = _real(real)
            if not self._inside(target):
                raise UnsafeFileError(
                    f"{path}: a symbolic link out of {self.root} (to {target}); refusing it"
                )
            return target
        if not self._inside(real) and real != self._real_root:
            raise UnsafeFileError(f"{path}: not inside {self.root}; refusing it")
        return real

    # -- reading -----------------------------------------------------------------------------

    def _open(self, path: str, max_bytes: int) -> tuple[int, os.stat_result]:
        """A descriptor of the regular local file ``path`` inside the root, no larger than
        ``max_bytes``, and its ``fstat`` (the caller closes it)."""
        local = os.path.normpath(self._local(path))
        head, tail = os.path.split(local)
        real = os.path.join(self._real_dir(head), tail)
        flags = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC
        try:
            try:
                fd = os.open(real, flags)
            except OSError as e:
                if e.errno != errno.ELOOP:
                    raise
                # The last component is a link: followed only when it stays inside the root.
                fd = os.open(self.resolve(path), flags)
        except OSError as e:
            if e.errno == errno.ELOOP:  # swapped for another link since resolve()
                raise UnsafeFileError(f"{path}: a symbolic link; refusing it") from None
            if e.errno in (errno.ENXIO, errno.EISDIR):
                raise UnsafeFileError(f"{path}: not a regular file; refusing it") from None
            raise
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode):
                raise UnsafeFileError(
                    f"{path}: not a regular file ({_kind(st.st_mode)}); refusing to read it"
                )
            if st.st_size > max_bytes:
                raise UnsafeFileError(
                    f"{path}: {st.st_size} bytes, more than the {max_bytes} this file may have; "
                    "refusing to read it"
                )
            os.set_blocking(fd, True)
        except BaseException:
            os.close(fd)
            raise
        return fd, st

    def open(self, path: str, max_bytes: int) -> BinaryIO:
        """A regular local file inside the root, opened for reading (checked as :meth:`read`
        checks it), for a caller that maps it instead of reading it whole: a tensor file of
        gigabytes served a row at a time, or hashed without a copy."""
        if self.remote:
            raise UnsafeFileError(f"{path}: an object, not a local file to open")
        fd, _ = self._open(path, max_bytes)
        return os.fdopen(fd, "rb")

    def read(self, path: str, max_bytes: int) -> bytes:
        """The bytes of a regular file inside the root, at most ``max_bytes`` of them.

        Raises ``FileNotFoundError`` when there is none, :class:`UnsafeFileError`
        when it is not a regular file inside the root, or is larger than the cap.
        """
        if self.remote:
            return _read_remote(self.check_key(path), max_bytes)
        fd, _ = self._open(path, max_bytes)
        try:
            chunks, got = [], 0
            while got <= max_bytes:
                chunk = os.read(fd, min(max_bytes + 1 - got, 1 << 24))
                if not chunk:
                    break
                chunks.append(chunk)
                got += len(chunk)
            if got > max_bytes:
                raise UnsafeFileError(
                    f"{path}: grew past the {max_bytes} bytes this file may have while it was "
                    "read; refusing it"
                )
            return b"".join(chunks)
        finally:
            os.close(fd)

    # -- writing -----------------------------------------------------------------------------

    def write_atomic(self, path: str, data: bytes) -> None:
        """:func:`storage.write_bytes_atomic`, into a directory that is inside the root."""
        if self.remote:
            storage.write_bytes_atomic(self.check_key(path), data)
            return
        local = os.path.normpath(self._local(path))
        head, tail = os.path.split(local)
        os.makedirs(head, exist_ok=True)
        real = os.path.join(self._real_dir(head), tail)
        if os.path.islink(real):
            raise UnsafeFileError(f"{path}: a symbolic link; refusing to write through it")
        tmp = f"{real}.tmp-{uuid.uuid4().hex[:8]}"
        fd = os.open(
            tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644
        )
        try:
            with os.fdopen(fd, "wb") as f:
                f.write(data)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, real)
        except BaseException:
            if os.path.lexists(tmp):
                os.unlink(tmp)
            raise

    def delete(self, path: str) -> None:
        """Delete one file inside the root (a link is unlinked, never its target)."""
        if self.remote:
            storage.delete(self.check_key(path))
            return
        local = os.path.normpath(self._local(path))
        head, tail = os.path.split(local)
        real = os.path.join(self._real_dir(head), tail)
        try:
            os.unlink(real)
        except FileNotFoundError:
            pass


def _kind(mode: int) -> str:
    for test, name in (
        (stat.S_ISFIFO, "a FIFO"),
        (stat.S_ISCHR, "a character device"),
        (stat.S_ISBLK, "a block device"),
        (stat.S_ISSOCK, "a socket"),
        (stat.S_ISDIR, "a directory"),
        (stat.S_ISLNK, "a symbolic link"),
    ):
        if test(mode):
            return name
    return "not a plain file"


def _read_remote(path: str, max_bytes: int) -> bytes:
    """At most ``max_bytes`` of an object; a larger one is refused (a ranged read past the cap)."""
    data = storage.read_bytes(path, max_bytes=max_bytes)
    if len(data) > max_bytes:
        raise UnsafeFileError(
            f"{path}: more than the {max_bytes} bytes this file may have; refusing to read it"
        )
    return data


_ROOTS: dict[str, Confined] = {}
_ROOTS_LOCK = threading.Lock()


def confined(root: str) -> Confined:
    """The :class:`Confined` of ``root`` (shared per process, so resolved directories are reused).

    A root that is itself a symbolic link is resolved once, here: the tree's
    root is where the user pointed, the checks are about what lies below it.
    """
    key = root.rstrip("/") if storage.is_remote(root) else os.path.abspath(root)
    with _ROOTS_LOCK:
        got = _ROOTS.get(key)
        if got is None or not got.remote and got._real_root != _real(key):
            if len(_ROOTS) > 256:
                _ROOTS.clear()
            got = _ROOTS[key] = Confined(key)
        return got


def forget(root: str | None = None) -> None:
    """Drop cached roots (tests that rebuild a tree at the same path)."""
    with _ROOTS_LOCK:
        if root is None:
            _ROOTS.clear()
        else:
            _ROOTS.pop(os.path.abspath(root) if not storage.is_remote(root) else root, None)


def read(root: str, path: str, max_bytes: int) -> bytes:
    """:meth:`Confined.read` of ``path`` under ``root``."""
    return confined(root).read(path, max_bytes)


def write_atomic(root: str, path: str, data: bytes) -> None:
    """:meth:`Confined.write_atomic` of ``path`` under ``root``."""
    confined(root).write_atomic(path, data)


@dataclass(frozen=True)
class Entry:
    """One thing found by :func:`walk`: a regular file with its size, or a problem."""

    rel: str
    size: int | None
    problem: str | None = None


def walk(directory: str, file_suffixes: tuple[str, ...] = ()) -> list[Entry]:
    """Every entry under a local ``directory`` (``/``-separated, sorted), links not followed.

    Regular files come with their size; symbolic links (whatever they point
    at), FIFOs, devices and sockets come with a problem instead, so an audit
    reports them rather than reading them; so does a directory whose name ends
    in one of ``file_suffixes`` (where a file of that kind belongs: an empty one
    would otherwise pass unseen). Object stores list keys: every object is a
    file there.
    """
    if storage.is_remote(directory):
        return [Entry(r, s) for r, s in sorted(storage.file_sizes(directory).items())]
    out: list[Entry] = []
    base = directory.rstrip(os.sep)
    for dirpath, dirs, files in os.walk(base):
        rel_dir = os.path.relpath(dirpath, base).replace(os.sep, "/")
        for name in sorted(dirs + files):
            rel = name if rel_dir == "." else f"{rel_dir}/{name}"
            try:
                st = os.lstat(os.path.join(dirpath, name))
            except FileNotFoundError:  # removed while we walked
                continue
            if stat.S_ISLNK(st.st_mode):
                target = os.path.realpath(os.path.join(dirpath, name))
                out.append(
                    Entry(rel, None, f"a symbolic link (to {target}); refusing to follow it")
                )
            elif stat.S_ISDIR(st.st_mode):
                if file_suffixes and name.endswith(file_suffixes):
                    out.append(
                        Entry(
                            rel,
                            None,
                            "a directory named like a file (*" + "/*".join(file_suffixes) + ")",
                        )
                    )
                continue
            elif not stat.S_ISREG(st.st_mode):
                out.append(Entry(rel, None, f"{_kind(st.st_mode)}, not a regular file"))
            else:
                out.append(Entry(rel, st.st_size))
    return sorted(out, key=lambda e: e.rel)
