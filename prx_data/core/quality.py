"""Image-information measures that flag blank and near-blank images before they reach training.

A transparent overlay flattened on white, a solid fill or a scan of an empty
page decodes fine and buckets fine, so nothing else in the pipeline notices
it. Three cheap numbers on the image *as the export sees it* (decoded by
:func:`prx_data.core.imaging.decode`, so alpha is composited on the same white
background) catch them:

- ``std``: the largest per-channel standard deviation of the pixel values
  (0-255). 0 for a constant image; a solid red/blue split is not blank
  even where its grey levels match, hence per channel;
- ``entropy``: Shannon entropy in bits of the grey-level histogram (0-8);
- ``flat``: the share of pixels whose colour, quantised to 32 levels per
  channel, equals the most common one: an almost-white overlay with a small
  logo has a tiny std but ``flat`` near 1.

All three are measured on a thumbnail of at most :data:`THUMB` pixels a
side: they barely depend on scale, and a JPEG draft decode makes this a few
milliseconds per photo. ``low_information`` is the recommended threshold
for a ``blank`` skip list.

On 35 Debian wallpapers (19 JPEG photos, 16 WebP designs) the two
transparent overlays measured std 0 and 0.08; the flattest real design
(a faint symbol pattern) std 3.5, entropy 1.8, flat 0.77; every photo std
28 or more. So the thresholds below sit well clear of real images.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import pyarrow as pa
from PIL import Image

from prx_data.core.imaging import ImageError, decode

#: Column the quality job writes: a struct of the three measures.
COLUMN = "image_quality"
FIELDS = ("std", "entropy", "flat")
QUALITY_TYPE = pa.struct([pa.field(f, pa.float32()) for f in FIELDS])
#: Longest thumbnail side the measures are taken on.
THUMB = 256
#: Below this std (0-255 scale) an image is treated as blank: JPEG noise on a
#: flat fill stays around 1 or below.
BLANK_STD = 3.0
#: Below this entropy (bits) the picture holds a handful of grey levels at most.
BLANK_ENTROPY = 1.0
#: At or above this share of one colour the image is essentially a fill.
BLANK_FLAT = 0.98
#: The Lance filter that selects low-information rows (for stats, skips and the explorer).
LOW_INFORMATION_SQL = (
    f"{COLUMN}.std < {BLANK_STD} OR {COLUMN}.entropy < {BLANK_ENTROPY} "
    f"OR {COLUMN}.flat >= {BLANK_FLAT}"
)


@dataclass(frozen=True)
class Quality:
    std: float
    entropy: float
    flat: float

    @property
    def low_information(self) -> bool:
        return is_low_information(self.std, self.entropy, self.flat)

    def as_dict(self) -> dict[str, float]:
        return {"std": self.std, "entropy": self.entropy, "flat": self.flat}


def is_low_information(std, entropy, flat):
    """True where an image is blank or nearly so (works on scalars and numpy arrays)."""
    return (
        (np.asarray(std) < BLANK_STD)
        | (np.asarray(entropy) < BLANK_ENTROPY)
        | (np.asarray(flat) >= BLANK_FLAT)
    )


def measure_rgb(rgb: np.ndarray) -> Quality:
    """The three measures of an HxWx3 uint8 array."""
    a = np.asarray(rgb)
    if a.ndim != 3 or a.shape[2] != 3 or a.size == 0:
        raise ValueError(f"expected an HxWx3 array, got shape {a.shape}")
    flat_px = a.reshape(-1, 3)
    std = float(flat_px.astype(np.float32).std(axis=0).max())
    grey = (flat_px @ np.array([299, 587, 114], np.uint32) // 1000).astype(np.uint8)
    hist = np.bincount(grey, minlength=256).astype(np.float64)
    p = hist[hist > 0] / grey.size
    entropy = float(-(p * np.log2(p)).sum()) + 0.0  # + 0.0: no "-0.0" for constant images
    q = (flat_px >> 3).astype(np.uint32)
    codes = (q[:, 0] << 10) | (q[:, 1] << 5) | q[:, 2]
    flat = float(np.bincount(codes).max() / codes.size)
    return Quality(round(std, 3), round(entropy, 4), round(flat, 4))


def measure_image(im: Image.Image) -> Quality:
    """Measures of a decoded RGB Pillow image, on a thumbnail of at most :data:`THUMB` a side."""
    im = im.convert("RGB")
    if max(im.size) > THUMB:
        im = im.copy()
        im.thumbnail((THUMB, THUMB), Image.Resampling.BOX)
    return measure_rgb(np.asarray(im))


def measure(data: bytes) -> Quality:
    """Measures of encoded image bytes, decoded as the export decodes them (alpha on white).

    Raises :class:`prx_data.core.imaging.ImageError` for bytes that are not a
    readable image.
    """
    return measure_image(decode(data, draft_to=(THUMB, THUMB)))


def measure_many(images: Sequence[bytes | None]) -> pa.StructArray:
    """A :data:`QUALITY_TYPE` array; null where the bytes are missing or unreadable."""
    out: list[dict[str, float] | None] = []
    for data in images:
        if not data:
            out.append(None)
            continue
        try:
            out.append(measure(data).as_dict())
        except ImageError:
            out.append(None)
    return pa.array(out, type=QUALITY_TYPE)
