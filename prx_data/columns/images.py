"""Fit an image into a vision model's pixel budget before it is sent.

Vision-language models cost (and accept) a bounded number of pixels: the
Qwen-VL family tiles an image into 28x28 patches between ``min_pixels`` and
``max_pixels``. Downsizing once, before the image crosses the Ray object
store or the network, keeps transfers small and matches what the model
would do anyway.
"""

from __future__ import annotations

import math

from PIL import Image

from prx_data.core import imaging
from prx_data.core.errors import UsageError

__all__ = [
    "DEFAULT_MAX_PIXELS",
    "fit_image",
]

#: Qwen2/2.5/3-VL's common serving budget: 1280 patches of 28x28 (~1 MP).
DEFAULT_MAX_PIXELS = 1280 * 28 * 28
JPEG_QUALITY = 95


def fit_size(width: int, height: int, max_pixels: int) -> tuple[int, int]:
    """Largest size with the same aspect ratio and at most ``max_pixels`` pixels."""
    if width * height <= max_pixels:
        return width, height
    scale = math.sqrt(max_pixels / (width * height))
    w, h = max(1, int(width * scale)), max(1, int(height * scale))
    while w * h > max_pixels:  # float rounding at the edge
        w, h = max(1, w - 1), max(1, h - 1)
    return w, h


def fit_image(data: bytes, max_pixels: int = DEFAULT_MAX_PIXELS) -> tuple[bytes, int, int]:
    """Decode (EXIF-oriented RGB), downsize to the budget, re-encode as JPEG.

    Raises :class:`prx_data.core.imaging.ImageError` (with a countable ``reason``)
    for bytes that are not a usable image.
    """
    if max_pixels < 1:
        raise UsageError(f"max_pixels must be positive, got {max_pixels}")
    info = imaging.probe(data)
    w, h = fit_size(info.width, info.height, max_pixels)
    im = imaging.decode(data, draft_to=imaging.draft_size(info.width, info.height, w, h))
    if im.size != (w, h):
        im = im.resize((w, h), Image.Resampling.LANCZOS)
    return imaging.encode(im, "jpeg", quality=JPEG_QUALITY), w, h
