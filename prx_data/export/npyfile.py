"""Fixed-shape tensors beside an export as ``.npy`` files: storage dtypes and the checked map.

Two kinds of bound files (:mod:`prx_data.export.bound`) hold one tensor per
sample of a shard, ``[samples, *shape]``: precomputed VAE latents
(:mod:`prx_data.export.latents`) and computed attached columns such as text
embeddings and their attention masks (:mod:`prx_data.export.attached`). Both
are ``.npy`` (no pickle) so that a loader serving one sample maps the file and
reads that sample's row, never the whole file: a shard of T5-XXL embeddings is
gigabytes.

numpy has no bfloat16: a bfloat16 tensor is stored as its bits in ``uint16``
(rounded to nearest even) and read back as float32 (:func:`to_stored`,
:func:`from_stored`).

The file is data, whoever wrote it: :func:`open_npy` opens it confined to its
folder (no link out, no FIFO or device), checks its size against the record's
byte count, its header (parsed without pickle) against the record's dtype and
shape, and its length against the header; finiteness is checked per served row
by the caller (a whole-file check would read every shard at start).
"""

from __future__ import annotations

import contextlib
import io
import math
import os
from collections.abc import Iterator, Sequence
from typing import BinaryIO

import numpy as np

from prx_data.core import confined
from prx_data.core.errors import PrxDataError

#: Memory maps a loader process keeps open per kind (latents, computed columns). Each holds
#: a file descriptor and, on a remote export, the disk space of a cached file that the
#: node cache may since have evicted; reopening one costs a header read (under a ms).
MAPS_KEPT = 32
#: Storage dtypes of floating tensors (float32 for exact comparisons in tests).
DTYPES = ("float16", "bfloat16", "float32")
#: The numpy dtype each storage dtype is written as (bfloat16: its bits as ``uint16``;
#: ``uint8``: attention masks).
STORED_DTYPES = {
    "float16": np.dtype("<f2"),
    "bfloat16": np.dtype("<u2"),
    "float32": np.dtype("<f4"),
    "uint8": np.dtype("|u1"),
}


def to_stored(x: np.ndarray, dtype: str, error: type[PrxDataError]) -> np.ndarray:
    """float32 values -> the array written for ``dtype`` (bfloat16: its bits as ``uint16``,
    rounded to nearest even, as torch rounds)."""
    f = np.ascontiguousarray(x, dtype=np.float32)
    if dtype == "bfloat16":
        u = f.view(np.uint32).astype(np.uint64)
        rounded = ((u + 0x7FFF + ((u >> 16) & 1)) >> 16).astype(np.uint16)
        # A NaN stays a NaN (a quiet one, as torch keeps it): rounding its low bits could
        # carry into the exponent or wrap to zero, and the loader would serve a number.
        nan = np.isnan(f)
        if nan.any():
            rounded[nan] = ((u[nan] >> 16) | 0x40).astype(np.uint16)
        return rounded
    if dtype not in DTYPES:
        raise error(f"storage dtype {dtype!r}: one of {', '.join(DTYPES)}")
    return f.astype(np.dtype(dtype))


def from_stored(stored: np.ndarray, dtype: str) -> np.ndarray:
    """What :func:`to_stored` wrote -> float32 (a copy: a stored array is a read-only map)."""
    if dtype == "bfloat16":
        bits = np.asarray(stored, dtype=np.uint16).astype(np.uint32)
        bits <<= 16  # in place: one copy of a row, not two
        return bits.view(np.float32)
    return np.array(stored, dtype=np.float32)


def allocate(shape: Sequence[int], dtype: str) -> tuple[np.ndarray, np.ndarray]:
    """An empty tensor of ``shape`` in the stored ``dtype``, laid inside the bytes of its own
    ``.npy`` file, and those bytes (``uint8``): a producer fills the tensor and writes the
    file as it is, never holding a second copy of a shard of gigabytes."""
    stored = STORED_DTYPES[dtype]
    head = io.BytesIO()
    info = {"descr": np.lib.format.dtype_to_descr(stored), "fortran_order": False}
    np.lib.format.write_array_header_1_0(head, {**info, "shape": tuple(int(x) for x in shape)})
    at = head.tell()  # numpy pads the header to a multiple of 64: the tensor is aligned
    buf = np.empty(at + int(np.prod(shape)) * stored.itemsize, np.uint8)
    buf[:at] = np.frombuffer(head.getvalue(), np.uint8)
    return buf[at:].view(stored).reshape(tuple(shape)), buf


def encode(array: np.ndarray) -> bytes:
    """The ``.npy`` bytes of ``array`` (no pickle: object arrays are refused by numpy)."""
    buf = io.BytesIO()
    np.save(buf, np.ascontiguousarray(array), allow_pickle=False)
    return buf.getvalue()


@contextlib.contextmanager
def _opened(
    base: str, path: str, nbytes: int | None, *, error: type[PrxDataError], what: str, redo: str
) -> Iterator[BinaryIO]:
    """``path`` opened for reading (:meth:`prx_data.core.confined.Confined.open`: a regular
    file inside ``base``), of exactly ``nbytes`` bytes when given."""
    try:
        f = confined.confined(base).open(path, nbytes if nbytes is not None else 1 << 62)
    except FileNotFoundError:
        raise error(f"{path}: missing; run {redo}") from None
    except confined.UnsafeFileError as e:
        if nbytes is not None and "bytes, more than" in str(e):
            e = confined.UnsafeFileError(f"{path}: more bytes than its record names ({nbytes})")
        raise error(f"{e}; run {redo} --replace") from None
    except OSError as e:
        raise error(f"{path}: cannot be opened as a {what} ({e.strerror})") from None
    with f:
        size = os.fstat(f.fileno()).st_size
        if nbytes is not None and size != nbytes:
            raise error(
                f"{path}: {size} bytes, its record names {nbytes} (a truncated, foreign "
                f"or changed {what}); run {redo} --replace"
            )
        yield f


def open_npy(
    base: str,
    path: str,
    dtype: str,
    shape: Sequence[int] | None = None,
    *,
    nbytes: int | None = None,
    error: type[PrxDataError],
    what: str,
    redo: str,
) -> np.ndarray:
    """The tensor at ``path``, memory-mapped (rows are read when served), after checking it.

    ``path`` must be a regular file inside ``base`` (a link out of it, a FIFO, a
    device are refused: the file is opened ``O_NONBLOCK`` and ``fstat``-ed, so a
    FIFO never blocks), of ``nbytes`` bytes when given (the record's count: the
    only size cap, so a shard of gigabytes is served as one of kilobytes). Its
    header must parse without pickle and give the stored ``dtype``
    (:data:`STORED_DTYPES`) and, when given, ``shape``; the file must hold every
    element the header names. ``what`` names the file and ``redo`` the command
    that makes it again, for the one-line errors.
    """
    with _opened(base, path, nbytes, error=error, what=what, redo=redo) as f:
        st = os.fstat(f.fileno())
        try:
            version = np.lib.format.read_magic(f)
            if version == (1, 0):
                got_shape, fortran, got = np.lib.format.read_array_header_1_0(f)
            else:
                got_shape, fortran, got = np.lib.format.read_array_header_2_0(f)
        except ValueError as e:
            raise error(f"{path}: not a .npy file ({e}); run {redo} --replace") from None
        want = STORED_DTYPES.get(dtype)
        if want is None or got != want or got.hasobject:
            raise error(f"{path}: holds {got}, the {what} record says {dtype}; run {redo} again")
        if shape is not None and tuple(got_shape) != tuple(shape):
            raise error(
                f"{path}: shape {list(got_shape)}, the record and the shard say {list(shape)}; "
                f"run {redo} again"
            )
        offset = f.tell()
        if any(int(d) < 0 for d in got_shape):
            raise error(f"{path}: a negative size in its header; run {redo} --replace")
        if st.st_size < offset + math.prod(int(d) for d in got_shape) * got.itemsize:
            raise error(f"{path}: shorter than its header says; run {redo} again")
        if not math.prod(int(d) for d in got_shape):
            return np.zeros(got_shape, got)
        try:
            return np.memmap(
                f,
                got,
                mode="r",
                offset=offset,
                shape=tuple(got_shape),
                order="F" if fortran else "C",
            )
        except (ValueError, OSError):  # truncated since the size check
            raise error(f"{path}: changed while it was opened; run {redo} again") from None
