"""A small pixel-derived image descriptor, so similar-image search works offline.

When a source ships no embedding (CLIP and friends), exploration still
needs "more like this". This descriptor is computed from pixels alone, with
no model download, in about a millisecond per image after decode:

- layout: the top-left 8x8 2-D DCT coefficients of a 32x32 grey thumbnail
  (what perceptual hashes use; the DC term is dropped) -> 63 values;
- colour: mean opponent colour (luminance, red-green, yellow-blue) on a
  4x4 grid -> 48 values;
- texture: a 4-bin gradient-orientation histogram, magnitude-weighted, on
  2x2 cells -> 16 values;
- brightness: the mean grey level -> 1 value (128 in all).

Each block is L2-normalised and weighted, then the whole vector is
L2-normalised, so cosine distance compares images. It finds near-duplicates,
crops, recolours and same-scene shots; it is not a semantic embedding.
"""

from __future__ import annotations

import numpy as np
import pyarrow as pa
from PIL import Image
from scipy.fft import dctn

from prx_data.core.imaging import ImageError, decode
from prx_data.core.schema import error_column

DIM = 128
#: Bump when the recipe changes, so stored descriptors can be recomputed.
VERSION = 1
#: Column the toolkit writes descriptors to (the source's own ``embedding`` stays untouched).
COLUMN = "pixel_descriptor"
VECTOR_TYPE = pa.list_(pa.float32(), DIM)

_THUMB = 32
_WEIGHTS = {"dct": 1.0, "colour": 1.0, "grad": 0.7, "bright": 0.3}


def _unit(v: np.ndarray) -> np.ndarray:
    n = float(np.linalg.norm(v))
    return v / n if n > 1e-12 else v


def describe_image(im: Image.Image) -> np.ndarray:
    """Descriptor of an RGB Pillow image (any size)."""
    im = im.convert("RGB").resize((_THUMB, _THUMB), Image.Resampling.BILINEAR)
    a = np.asarray(im, dtype=np.float32) / 255.0
    r, g, b = a[..., 0], a[..., 1], a[..., 2]
    grey = 0.299 * r + 0.587 * g + 0.114 * b

    coeffs = dctn(grey, norm="ortho")[:8, :8].ravel()[1:]  # 63, no DC
    # Opponent colour space: luminance plus two colour-difference axes.
    lab = np.stack([grey, r - g, 0.5 * (r + g) - b], axis=-1)
    colour = lab.reshape(4, 8, 4, 8, 3).mean(axis=(1, 3)).ravel()  # 48
    gy, gx = np.gradient(grey)
    mag = np.hypot(gx, gy)
    bins = np.minimum(((np.arctan2(gy, gx) % np.pi) / np.pi * 4).astype(np.int64), 3)
    grad = np.zeros((2, 2, 4), np.float32)
    half = _THUMB // 2
    for cy in range(2):
        for cx in range(2):
            sl = (slice(cy * half, (cy + 1) * half), slice(cx * half, (cx + 1) * half))
            grad[cy, cx] = np.bincount(bins[sl].ravel(), weights=mag[sl].ravel(), minlength=4)[:4]
    v = np.concatenate(
        [
            _WEIGHTS["dct"] * _unit(coeffs.astype(np.float32)),
            _WEIGHTS["colour"] * _unit(colour.astype(np.float32)),
            _WEIGHTS["grad"] * _unit(grad.ravel()),
            [_WEIGHTS["bright"] * (float(grey.mean()) - 0.5)],
        ]
    )
    return _unit(v).astype(np.float32)


#: Column holding why a row has no descriptor (null where it has one).
ERROR_COLUMN = error_column(COLUMN)
#: Reason for a row without image bytes.
MISSING = "missing_image"


def describe_reason(data: bytes) -> tuple[np.ndarray | None, str | None]:
    """``(descriptor, None)``, or ``(None, reason)`` when the image cannot be described.

    Reasons are :class:`ImageError` reasons (``decode_error``, ``truncated``,
    ...); anything else a broken file raises becomes ``unexpected:<Type>: msg``
    so a batch job goes on and the row still says why.
    """
    try:
        rgb = decode(data, draft_to=(_THUMB * 2, _THUMB * 2))
        return describe_image(rgb), None
    except ImageError as e:
        return None, e.reason
    except Exception as e:  # a broken file must not stop a batch job; the reason is kept
        return None, f"unexpected:{type(e).__name__}: {str(e)[:200]}"


def describe(data: bytes) -> np.ndarray | None:
    """Descriptor of encoded image bytes, or None when it cannot be decoded (see describe_reason)."""
    return describe_reason(data)[0]


def describe_many(
    images: list[bytes | None], reasons: list[str | None] | None = None
) -> pa.FixedSizeListArray:
    """Descriptors as an Arrow column (null where an image is missing or undecodable).

    ``reasons``, when given, is extended with one entry per image: None, or why
    that row has no descriptor.
    """
    flat = np.zeros((len(images), DIM), np.float32)
    valid = np.zeros(len(images), bool)
    for i, data in enumerate(images):
        if data is None:
            if reasons is not None:
                reasons.append(MISSING)
            continue
        v, why = describe_reason(data)
        if reasons is not None:
            reasons.append(why)
        if v is not None:
            flat[i] = v
            valid[i] = True
    values = pa.array(flat.ravel(), pa.float32())
    arr = pa.FixedSizeListArray.from_arrays(values, DIM)
    if valid.all():
        return arr
    return pa.FixedSizeListArray.from_arrays(values, DIM, mask=pa.array(~valid))
