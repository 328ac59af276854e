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

import os
from collections.abc import Iterable, Mapping
from typing import Any

import numpy as np

from prx_data.core import confined, storage
from prx_data.core.errors import PrxDataError
from prx_data.export import bound, npyfile
from prx_data.export.layout import ShardInfo
from prx_data.export.naming import LATENTS_DIR

RECORD_NAME = f"{LATENTS_DIR}/record.json"
#: The latents job's own lease: one run per export, without blocking the export's skip-list
#: updates (shards that change under a run are caught by the record's binding instead).
LOCK_NAME = f"{LATENTS_DIR}/.lock"
RECORD_FORMAT = "prx-data latents"
RECORD_VERSION = 1
#: Storage dtypes of the ``.npy`` files (float32 is for exact comparisons in tests).
DTYPES = npyfile.DTYPES
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


encode_npy = npyfile.encode


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


STORED_DTYPES = npyfile.STORED_DTYPES


def load_npy(
    root: str,
    key: str,
    dtype: str,
    shape: tuple[int, ...] | None = None,
    *,
    cached: tuple[str, str] | None = None,
) -> np.ndarray:
    """A shard's latents, memory-mapped, after checking what the file is and holds
    (:func:`prx_data.export.npyfile.open_npy`: a regular file inside ``<root>/_latents``,
    the record's storage ``dtype`` and, when given, ``shape`` ``[samples, C, H/f, W/f]``).
    Finiteness is checked per sample by the loader (:func:`sample_latent`).
    ``cached`` reads the copy of a remote export's file that the loader fetched with its
    shard, ``(folder it must stay inside, its path)``, instead.
    """
    path = npy_path(root, check_key(key))
    base = storage.join(root, LATENTS_DIR)
    if cached is not None:  # (folder, path in it): a node's cache of a remote export's file
        base, path = cached
    return npyfile.open_npy(
        base,
        path,
        dtype,
        shape,
        error=LatentsError,
        what="latents file",
        redo=f"python -m prx_data.latents {root} --vae VAE",
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
    """float32 latents -> the array written for ``dtype`` (:func:`npyfile.to_stored`)."""
    return npyfile.to_stored(latents, dtype, LatentsError)


from_stored = npyfile.from_stored
