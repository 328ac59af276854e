"""Precomputed VAE latents beside an export: where they live, their record, their digests.

The shards are never rewritten. Each MDS shard ``<tier>/<ar>/<part>/shard.NNNNN.mds``
gets one numpy file ``_latents/<tier>/<ar>/<part>/shard.NNNNN.npy`` holding
``[samples, C, H/f, W/f]`` in the shard's sample order, already shifted and
scaled as :meth:`prx_data.train.vae.LatentCodec.encode` returns them. The
``.npy`` format (no pickle) was chosen over a new MDS column because a
latent set belongs to one VAE: another VAE is another folder's worth of
files, and the export, its skip lists and its id index stay as they are.

``_latents/record.json`` names the VAE (class, factors, posterior,
compression, channels, and the sha256 of its weight files) and the storage dtype, and per shard the xxh64 of its
``.npy`` bytes and the shard it was computed from (bytes, samples, hashes), so
a re-export or a changed shard is never served stale latents. The job
(:mod:`prx_data.pipelines.latents`) writes it; the loader and the trainer
read it.
"""

from __future__ import annotations

import io
import os
from collections.abc import Iterable, Mapping
from typing import Any

import numpy as np

from prx_data.core import confined, storage
from prx_data.core.errors import PrxDataError
from prx_data.export import bound
from prx_data.export.layout import ShardInfo
from prx_data.export.naming import LATENTS_DIR

RECORD_NAME = f"{LATENTS_DIR}/record.json"
#: The latents job's own lease: one run per export, without blocking the export's skip-list
#: updates (shards that change under a run are caught by the record's binding instead).
LOCK_NAME = f"{LATENTS_DIR}/.lock"
RECORD_FORMAT = "prx-data latents"
RECORD_VERSION = 1
#: Storage dtypes of the ``.npy`` files (float32 is for exact comparisons in tests).
DTYPES = ("float16", "bfloat16", "float32")
#: The VAE settings a trainer's codec must agree with, in the record's ``vae``.
VAE_KEYS = (
    "class",
    "scaling_factor",
    "shift_factor",
    "posterior",
    "compression",
    "latent_channels",
    # sha256 of the VAE's weight files: another VAE of the same class and config is another
    # VAE (a record without it, from an older version, vouches for none).
    "weights",
)
#: Largest record read back (a million shards at ~300 bytes each).
MAX_RECORD_BYTES = 1 << 30
#: The attached column the latents are served as (PRX's name): ``extra_columns: [img_latent]``
#: gives each sample's stored latent, the value ``vae.source: precomputed`` trains on. The
#: latents job is that column's producer; its files stay in ``_latents/``.
COLUMN = "img_latent"


class LatentsError(PrxDataError, ValueError):
    """Latents that are missing, stale or made with another VAE; one line says what to do."""


def shard_key(bucket: str, basename: str) -> str:
    """``<tier>/<ar>/<part>/shard.NNNNN.mds``: a shard's key in the record."""
    return bound.shard_key(bucket, basename, LatentsError)


def check_key(key: object) -> str:
    """A key read from a record, checked as :func:`shard_key` checks the ones it makes
    (:func:`prx_data.export.bound.check_key`)."""
    return bound.check_key(key, LatentsError)


def delete_npy(root: str, key: str) -> None:
    """Delete a shard's ``.npy`` (a checked key), confined to ``_latents`` (no link followed)."""
    base = storage.join(root, LATENTS_DIR)
    confined.confined(base).delete(npy_path(root, check_key(key)))


def npy_rel(key: str) -> str:
    """Path of a shard's latents relative to the export root (``_latents/.../shard.NNNNN.npy``)."""
    return bound.file_rel(LATENTS_DIR, key, "npy")


def npy_path(root: str, key: str) -> str:
    return storage.join(root, *npy_rel(key).split("/"))


xxh64 = bound.xxh64


def encode_npy(array: np.ndarray) -> bytes:
    """The ``.npy`` bytes of ``array`` (no pickle: object arrays are refused by numpy)."""
    buf = io.BytesIO()
    np.save(buf, np.ascontiguousarray(array), allow_pickle=False)
    return buf.getvalue()


def write_npy(root: str, key: str, array: np.ndarray) -> tuple[str, int]:
    """Write a shard's latents atomically (temp file, fsync, rename, folder fsync).

    Returns ``(xxh64, bytes)`` of what was written.
    """
    return bound.write_file(root, npy_path(root, key), encode_npy(array))


def npy_digest(root: str, key: str, max_bytes: int) -> str | None:
    """xxh64 of a shard's ``.npy`` as it is on disk, or None when there is none."""
    return bound.file_digest(root, npy_path(root, key), max_bytes)


def move_npy(root: str, old: str, new: str) -> bool:
    """Move a shard's ``.npy`` to another shard's key, inside ``_latents`` (no link followed).

    Returns False when there is no regular file to move.
    """
    import stat

    base = confined.confined(storage.join(root, LATENTS_DIR))
    src = base.resolve(npy_path(root, check_key(old)))
    try:
        if not stat.S_ISREG(os.lstat(src).st_mode):
            return False
    except FileNotFoundError:
        return False
    dst_path = npy_path(root, check_key(new))
    os.makedirs(os.path.dirname(dst_path), exist_ok=True)
    dst = base.resolve(dst_path)
    os.replace(src, dst)
    bound.fsync_dir(os.path.dirname(dst))
    return True


#: The numpy dtype each storage dtype is written as (bfloat16: its bits as ``uint16``).
STORED_DTYPES = {
    "float16": np.dtype("<f2"),
    "bfloat16": np.dtype("<u2"),
    "float32": np.dtype("<f4"),
}


def load_npy(
    root: str,
    key: str,
    dtype: str,
    shape: tuple[int, ...] | None = None,
    *,
    cached: tuple[str, str] | None = None,
) -> np.ndarray:
    """A shard's latents, memory-mapped, after checking what the file is and holds.

    The ``.npy`` must be a regular file inside ``<root>/_latents`` (a link out of
    it, a FIFO, a device are refused: the file is opened ``O_NONBLOCK`` and
    ``fstat``-ed, so a FIFO never blocks), its header must parse without pickle
    and give the record's storage ``dtype`` and, when given, ``shape``
    (``[samples, C, H/f, W/f]``). Finiteness is checked per sample by the loader
    (:func:`sample_latent`): a whole-file check would read every shard at start.
    ``cached`` reads the copy of a remote export's file that the loader fetched with its
    shard, ``(folder it must stay inside, its path)``, instead.
    """
    import errno
    import stat

    path = npy_path(root, check_key(key))
    base = storage.join(root, LATENTS_DIR)
    if cached is not None:  # (folder, path in it): a node's cache of a remote export's file
        base, path = cached
    try:
        real = confined.confined(base).resolve(path)
    except confined.UnsafeFileError as e:
        raise LatentsError(f"{e}; run python -m prx_data.latents {root} --vae VAE") from None
    try:
        fd = os.open(real, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError as e:
        if e.errno == errno.ENOENT:
            raise LatentsError(
                f"{path}: missing; run python -m prx_data.latents {root} --vae VAE"
            ) from None
        raise LatentsError(f"{path}: cannot be opened as a latents file ({e.strerror})") from None
    with os.fdopen(fd, "rb") as f:
        mode = os.fstat(f.fileno()).st_mode
        if not stat.S_ISREG(mode):
            raise LatentsError(f"{path}: not a regular file; refusing to read it")
        try:
            version = np.lib.format.read_magic(f)
            if version == (1, 0):
                got_shape, fortran, got = np.lib.format.read_array_header_1_0(f)
            else:
                got_shape, fortran, got = np.lib.format.read_array_header_2_0(f)
        except ValueError as e:
            raise LatentsError(f"{path}: not a .npy file ({e})") from None
        want = STORED_DTYPES.get(dtype)
        if want is None or got != want or got.hasobject:
            raise LatentsError(
                f"{path}: holds {got}, the latents record says {dtype}; run python -m "
                f"prx_data.latents {root} --vae VAE again"
            )
        if shape is not None and tuple(got_shape) != tuple(shape):
            raise LatentsError(
                f"{path}: shape {list(got_shape)}, the record and the shard say {list(shape)}; "
                f"run python -m prx_data.latents {root} --vae VAE again"
            )
        offset = f.tell()
        if os.fstat(f.fileno()).st_size < offset + int(np.prod(got_shape)) * got.itemsize:
            raise LatentsError(f"{path}: shorter than its header says; run the latents job again")
        if not int(np.prod(got_shape)):
            return np.zeros(got_shape, got)
        return np.memmap(
            f, got, mode="r", offset=offset, shape=tuple(got_shape), order="F" if fortran else "C"
        )


def sample_latent(stored: np.ndarray, dtype: str, where: str) -> np.ndarray:
    """One stored latent as float32 (:func:`from_stored`), refused when not finite."""
    out = from_stored(stored, dtype)
    if not np.isfinite(out).all():
        raise LatentsError(
            f"{where}: a latent holds NaN or infinity; run python -m prx_data.latents with "
            "--replace (or vae.source: encode)"
        )
    return out


def _record_args() -> dict[str, Any]:
    return {
        "fmt": RECORD_FORMAT,
        "version": RECORD_VERSION,
        "error": LatentsError,
        "job": "python -m prx_data.latents",
        "args": "--vae VAE",
    }


def read_record(root: str) -> dict[str, Any] | None:
    """The export's latents record, or None when it has none."""
    return bound.read_record(root, RECORD_NAME, max_bytes=MAX_RECORD_BYTES, **_record_args())


def parse_record(raw: bytes, root: str) -> dict[str, Any]:
    """A latents record's bytes read elsewhere (a node's cache of a remote export), checked
    as :func:`read_record` checks them."""
    return bound.parse_record(raw, root, RECORD_NAME, **_record_args())


def cache_rel(key: str, digest: str) -> str:
    """Where a remote export's latents of shard ``key`` lie in the node's cache, relative to
    the cached bucket folder; named by the file's digest, so a re-encoded file is another
    file, never a stale copy."""
    import re

    stem = check_key(key).split("/", 2)[2].split(".mds", 1)[0]
    if not re.fullmatch(r"[0-9a-f]{1,32}", str(digest)):
        raise LatentsError(f"{digest!r}: not an xxh64 digest of a latents file")
    return f"{LATENTS_DIR}/{stem}.{digest}.npy"


def no_latents(root: str) -> LatentsError:
    """The one line for an export without latents."""
    return LatentsError(
        f"{root}: no precomputed latents (no {RECORD_NAME}); run python -m prx_data.latents "
        f"{root} --vae VAE, or set vae.source: encode"
    )


def require_record(root: str) -> dict[str, Any]:
    """:func:`read_record`, refusing an export without latents in one line."""
    record = read_record(root)
    if record is None:
        raise no_latents(root)
    return record


def write_record(root: str, vae: Mapping[str, Any], dtype: str, shards: Mapping[str, dict]) -> None:
    """Write ``_latents/record.json`` atomically, shards sorted by key."""
    body = {"format": RECORD_FORMAT, "version": RECORD_VERSION, "vae": dict(vae), "dtype": dtype}
    bound.write_record(root, RECORD_NAME, {**body, "shards": shards})


shard_binding = bound.shard_binding


def vae_differences(recorded: Mapping[str, Any], wanted: Mapping[str, Any]) -> list[str]:
    """``key recorded -> wanted`` for each of :data:`VAE_KEYS` that differs."""
    out = []
    for k in VAE_KEYS:
        a, b = recorded.get(k), wanted.get(k)
        if isinstance(a, float) or isinstance(b, float):
            same = (
                a is not None
                and b is not None
                and abs(float(a) - float(b)) <= 1e-6 * max(1.0, abs(float(b)))
            )
        else:
            same = a == b
        if not same:
            if k == "weights":  # sha256 of the files: the first 12 digits tell them apart
                a, b = (x[:12] + "..." if isinstance(x, str) else x for x in (a, b))
            out.append(f"{k} {a!r} -> {b!r}")
    return out


def stale_shards(record: Mapping[str, Any], bucket: str, shards: Iterable[ShardInfo]) -> list[str]:
    """Shards of ``bucket`` (as its merged index lists them) whose latents are missing from
    ``record`` or were made from other data (samples, bytes or hashes differ)."""
    return bound.stale_shards(record.get("shards") or {}, bucket, shards, LatentsError)


def to_stored(latents: np.ndarray, dtype: str) -> np.ndarray:
    """float32 latents -> the array written for ``dtype`` (bfloat16: its bits as ``uint16``,
    rounded to nearest even, since numpy has no bfloat16)."""
    x = np.ascontiguousarray(latents, dtype=np.float32)
    if dtype == "bfloat16":
        u = x.view(np.uint32).astype(np.uint64)
        return ((u + 0x7FFF + ((u >> 16) & 1)) >> 16).astype(np.uint16)
    if dtype not in DTYPES:
        raise LatentsError(f"latent dtype {dtype!r}: one of {', '.join(DTYPES)}")
    return x.astype(np.dtype(dtype))


def from_stored(stored: np.ndarray, dtype: str) -> np.ndarray:
    """What :func:`to_stored` wrote -> float32 latents."""
    if dtype == "bfloat16":
        return (np.asarray(stored, dtype=np.uint16).astype(np.uint32) << 16).view(np.float32)
    return np.array(stored, dtype=np.float32)  # a copy: the stored array is a read-only map
