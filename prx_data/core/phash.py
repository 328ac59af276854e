"""DCT perceptual hash (pHash) of encoded images, as 64-bit unsigned integers.

The definition is the standard one (Zauner; ``imagehash.phash``): grayscale,
Lanczos (antialiased) resize to 32x32, 2-D type-II DCT (rows, then columns),
keep the low-frequency top-left 8x8 block (DC included), and set a bit for
every coefficient strictly above the block's median. The 64 bits are packed
row-major with the first coefficient in the most significant bit, so
``to_hex(h)`` equals ``str(imagehash.phash(im))``.

Two ways to get the grayscale pixels:

* ``exact=True`` decodes the whole image with Pillow, exactly like
  ``imagehash.phash(ImageOps.exif_transpose(Image.open(f)))``: same bits.
* the default fast path asks libjpeg (through OpenCV) for a 1/2, 1/4 or 1/8
  scaled grayscale decode, done in the DCT domain, so most of the inverse
  DCT and all the colour work is skipped. The reduction is the largest that
  keeps the short side at or above :data:`MIN_DECODE_SIDE` pixels. The
  resize applies Pillow's Lanczos weights as two small matrix products over
  the exact image extent (``width / k``), so the partial last block does
  not stretch the picture. Hashes may differ from the reference in a few
  bits near the median threshold; ``tests/test_phash.py`` bounds how many
  and docs/DEDUP.md gives the measured figures.

EXIF orientation is applied on both paths, so a rotated-by-tag copy and a
physically rotated copy hash alike. Alpha is ignored, as in ``imagehash``.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from functools import lru_cache

import numpy as np
import scipy.fftpack
from PIL import Image, ImageOps

from prx_data.core.imaging import ImageError, decode_errors
from prx_data.core.imaging import open_image as _open

__all__ = [
    "hamming",
    "phash_bytes",
    "phash_many",
    "to_hex",
]

HASH_SIZE = 8
IMG_SIZE = 32  # HASH_SIZE * highfreq_factor (4), as in imagehash
#: The reduced JPEG decode keeps at least this many pixels on the short side.
#: 64 (2x the hash input) keeps the scaled IDCT's block averaging well above
#: the Lanczos cut-off; 32 costs a little agreement, 128 gains a little and
#: decodes slower (measured while choosing it; see docs/DEDUP.md).
MIN_DECODE_SIDE = 64

_JPEG_SOI = b"\xff\xd8"
#: libjpeg scale denominator -> OpenCV flag name (cv2 is imported lazily; 1 = full decode).
_REDUCED = {
    2: "IMREAD_REDUCED_GRAYSCALE_2",
    4: "IMREAD_REDUCED_GRAYSCALE_4",
    8: "IMREAD_REDUCED_GRAYSCALE_8",
}
#: 2 ** (63 - i) for bit i of the row-major 8x8 block.
_WEIGHTS = np.left_shift(np.uint64(1), np.arange(63, -1, -1, dtype=np.uint64))


@dataclass
class PhashResult:
    """Hashes of a batch: ``hashes[i]`` is valid where ``errors[i] is None``."""

    hashes: np.ndarray  # uint64, 0 where the image failed
    errors: list[str | None] = field(default_factory=list)

    @property
    def ok(self) -> np.ndarray:
        return np.array([e is None for e in self.errors], dtype=bool)

    def error_counts(self) -> dict[str, int]:
        return dict(Counter(e for e in self.errors if e is not None))


# --- bits --------------------------------------------------------------------


def hash_from_pixels(pixels: np.ndarray) -> np.ndarray:
    """pHash of 32x32 grayscale blocks: ``(32, 32)`` -> uint64 scalar array, ``(N, 32, 32)`` -> ``(N,)``.

    Uses ``scipy.fftpack.dct`` on axis 0 then axis 1 of each block, like the
    reference, so identical pixels give identical bits.
    """
    x = np.asarray(pixels)
    single = x.ndim == 2
    if single:
        x = x[None]
    if x.ndim != 3 or x.shape[1:] != (IMG_SIZE, IMG_SIZE):
        raise ValueError(f"expected (N, {IMG_SIZE}, {IMG_SIZE}) pixels, got {x.shape}")
    # uint8 -> float like numpy does inside scipy for the reference
    d = scipy.fftpack.dct(scipy.fftpack.dct(x.astype(np.float64), axis=1), axis=2)
    low = d[:, :HASH_SIZE, :HASH_SIZE].reshape(len(x), -1)
    med = np.median(low, axis=1, keepdims=True)
    bits = low > med
    out = (bits.astype(np.uint64) * _WEIGHTS).sum(axis=1, dtype=np.uint64)
    return out[0] if single else out


def to_hex(h: int | np.integer) -> str:
    """16 hex digits, the same string as ``str(imagehash.ImageHash)``."""
    return f"{int(h):016x}"


def to_bits(h: int | np.integer) -> np.ndarray:
    """The 8x8 boolean block (row-major, like ``imagehash.ImageHash.hash``)."""
    return ((np.uint64(h) & _WEIGHTS) != 0).reshape(HASH_SIZE, HASH_SIZE)


# --- Hamming distance ----------------------------------------------------------

_BYTE_POPCOUNT = np.array([bin(i).count("1") for i in range(256)], dtype=np.uint8)


def popcount_table(x: np.ndarray) -> np.ndarray:
    """Set bits per uint64 element via a byte lookup table (numpy < 2 has no popcount)."""
    x = np.ascontiguousarray(x, dtype=np.uint64)
    as_bytes = x.reshape(-1).view(np.uint8).reshape(-1, 8)
    return _BYTE_POPCOUNT[as_bytes].sum(axis=1, dtype=np.uint8).reshape(x.shape)


def popcount64(x: np.ndarray) -> np.ndarray:
    """Set bits per uint64 element (``np.bitwise_count`` when numpy has it)."""
    x = np.asarray(x, dtype=np.uint64)
    if hasattr(np, "bitwise_count"):
        return np.bitwise_count(x).astype(np.uint8)
    return popcount_table(x)


def hamming(a: np.ndarray | int, b: np.ndarray | int) -> np.ndarray:
    """Hamming distance between uint64 hashes, with numpy broadcasting."""
    return popcount64(np.bitwise_xor(np.asarray(a, np.uint64), np.asarray(b, np.uint64)))


# --- from images ----------------------------------------------------------------


def _pil_gray32(
    im: Image.Image, box: tuple[float, float, float, float] | None = None
) -> np.ndarray:
    return np.asarray(im.resize((IMG_SIZE, IMG_SIZE), Image.Resampling.LANCZOS, box=box))


def _lanczos(x: np.ndarray) -> np.ndarray:
    return np.where(np.abs(x) < 3.0, np.sinc(x) * np.sinc(x / 3.0), 0.0)


@lru_cache(maxsize=4096)
def _lanczos_weights(in_size: int, extent: float, out_size: int = IMG_SIZE) -> np.ndarray:
    """Pillow's antialiased Lanczos resampling weights, ``(out_size, in_size)`` float32.

    Same support, centres and per-output normalisation as Pillow's
    ``precompute_coeffs`` for the box ``[0, extent)``; Pillow applies them in
    fixed point with an 8-bit intermediate, so results agree to rounding.
    """
    scale = extent / out_size
    filterscale = max(scale, 1.0)
    support = 3.0 * filterscale
    w = np.zeros((out_size, in_size), np.float64)
    for xx in range(out_size):
        center = (xx + 0.5) * scale
        xmin = max(int(center - support + 0.5), 0)
        xmax = min(int(center + support + 0.5), in_size)
        x = np.arange(xmin, xmax)
        k = _lanczos((x - center + 0.5) / filterscale)
        total = k.sum()
        if total != 0:
            w[xx, xmin:xmax] = k / total
    return w.astype(np.float32)


#: OpenBLAS runs a GEMM single-threaded below m*n*k = 65536 * 4; above it, its
#: threads spin against the other workers (Ray runs one per core) and a
#: 32x32 resize can take 100x longer. Products are cut below that size.
_SINGLE_THREAD_GEMM = 65536 * 4 - 1


def _gemm(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """``a @ b`` in pieces small enough for single-threaded BLAS (see above)."""
    m, k = a.shape
    n = b.shape[1]
    if m * n * k <= _SINGLE_THREAD_GEMM:
        return a @ b
    out = np.zeros((m, n), np.result_type(a, b))
    kc = max(1, min(k, _SINGLE_THREAD_GEMM // max(1, m)))
    nc = max(1, _SINGLE_THREAD_GEMM // (m * kc))
    for k0 in range(0, k, kc):
        for n0 in range(0, n, nc):
            out[:, n0 : n0 + nc] += a[:, k0 : k0 + kc] @ b[k0 : k0 + kc, n0 : n0 + nc]
    return out


def _resize32(gray: np.ndarray, extent: tuple[float, float]) -> np.ndarray:
    """Lanczos resize of a 2-D uint8 array's ``[0, w) x [0, h)`` box to 32x32 (two small matmuls)."""
    rows, cols = gray.shape
    wy = _lanczos_weights(rows, float(extent[1]))
    wx = _lanczos_weights(cols, float(extent[0]))
    out = _gemm(_gemm(wy, gray.astype(np.float32)), np.ascontiguousarray(wx.T))
    return np.clip(np.rint(out), 0, 255).astype(np.uint8)


def phash_image(im: Image.Image) -> int:
    """The reference pHash of a Pillow image (no orientation handling here)."""
    return int(hash_from_pixels(_pil_gray32(im.convert("L"))))


def _exact_pixels(data: bytes) -> np.ndarray:
    im = _open(data)
    with decode_errors():
        if getattr(im, "n_frames", 1) > 1:
            im.seek(0)
        im = ImageOps.exif_transpose(im)
        return _pil_gray32(im.convert("L"))


def reduction_for(width: int, height: int, min_side: int = MIN_DECODE_SIDE) -> int:
    """Largest libjpeg scale denominator (1, 2, 4, 8) keeping the short side >= ``min_side``."""
    short = min(width, height)
    for k in (8, 4, 2):
        if short / k >= min_side:
            return k
    return 1


def _extent(shape: tuple[int, int], size: tuple[int, int], k: int) -> tuple[float, float]:
    """True (x, y) extent of a k-reduced decode of shape (rows, cols).

    libjpeg returns ``ceil(w / k)`` pixels, the last one covering a partial
    block; ``size`` may be in the stored or the EXIF-oriented frame.
    """
    rows, cols = shape
    a, b = size
    for w, h in ((a, b), (b, a)):
        if -(-w // k) == cols and -(-h // k) == rows:
            return (w / k, h / k)
    return (float(cols), float(rows))  # header disagrees with the pixels: trust the pixels


def _fast_pixels(data: bytes, size: tuple[int, int] | None, min_side: int) -> np.ndarray:
    import cv2

    if not data:
        raise ImageError("empty_file")
    if not data.startswith(_JPEG_SOI):
        gray = cv2.imdecode(np.frombuffer(data, np.uint8), cv2.IMREAD_GRAYSCALE)
        if gray is None or gray.ndim != 2 or gray.size == 0:
            return _exact_pixels(data)  # formats OpenCV lacks, or a clear error from Pillow
        return _resize32(gray, (gray.shape[1], gray.shape[0]))
    if size is None or not all(size):
        size = _open(data).size
    if size[0] * size[1] > 2 * Image.MAX_IMAGE_PIXELS:
        raise ImageError("decompression_bomb", f"{size[0]}x{size[1]} pixels")
    k = reduction_for(*size, min_side=min_side)
    flag = cv2.IMREAD_GRAYSCALE if k == 1 else getattr(cv2, _REDUCED[k])
    gray = cv2.imdecode(np.frombuffer(data, np.uint8), flag)
    if gray is None or gray.size == 0:
        return _exact_pixels(data)  # Pillow says why (truncated, decode_error, ...)
    return _resize32(gray, _extent(gray.shape, size, k))


def gray32(
    data: bytes,
    *,
    size: tuple[int, int] | None = None,
    exact: bool = False,
    min_side: int = MIN_DECODE_SIDE,
) -> np.ndarray:
    """The 32x32 grayscale block the hash is computed from. Raises :class:`ImageError`."""
    if exact:
        return _exact_pixels(data)
    return _fast_pixels(data, size, min_side)


def phash_bytes(
    data: bytes,
    *,
    size: tuple[int, int] | None = None,
    exact: bool = False,
    min_side: int = MIN_DECODE_SIDE,
) -> int:
    """pHash of one encoded image. ``size`` (from a table's header columns) saves a header parse."""
    return int(hash_from_pixels(gray32(data, size=size, exact=exact, min_side=min_side)))


def phash_many(
    datas: Sequence[bytes | None],
    *,
    sizes: Sequence[tuple[int, int] | None] | None = None,
    exact: bool = False,
    min_side: int = MIN_DECODE_SIDE,
    progress: bool = False,
) -> PhashResult:
    """pHashes of many encoded images; failures are kept as reasons, never raised.

    The DCT and median run once over the whole batch.
    """
    n = len(datas)
    blocks = np.zeros((n, IMG_SIZE, IMG_SIZE), np.uint8)
    errors: list[str | None] = [None] * n
    it = range(n)
    if progress:
        from tqdm import tqdm

        it = tqdm(it, desc="phash", unit="img")
    for i in it:
        data = datas[i]
        if data is None:
            errors[i] = "missing_image"
            continue
        size = sizes[i] if sizes is not None else None
        try:
            blocks[i] = gray32(bytes(data), size=size, exact=exact, min_side=min_side)
        except ImageError as e:
            errors[i] = e.reason
        except Exception as e:  # a codec crash must not lose the batch
            errors[i] = f"decode_error:{type(e).__name__}"
    hashes = hash_from_pixels(blocks) if n else np.zeros(0, np.uint64)
    hashes[[e is not None for e in errors]] = 0
    return PhashResult(hashes=hashes, errors=errors)
