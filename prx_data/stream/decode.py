"""Loader-side decode: an exported image to the run's training shape, cheaply.

Training at 512 from a 2048- or 4096-tier bucket used to decode every JPEG at
full size and then throw most of the pixels away. Here JPEGs are
DCT-downscaled while decoding (Pillow ``draft``), to no less than
:data:`prx_data.core.imaging.DRAFT_MARGIN` x the target, the same fidelity
rule the export uses, and then Lanczos cover-resized to the exact shape.
Samples already at the target shape take the plain decode path.
"""

from __future__ import annotations

import numpy as np

from prx_data.core import imaging


def decode_to(data: bytes, shape: tuple[int, int]) -> np.ndarray:
    """Encoded image -> uint8 array [H, W, 3] of ``shape`` = (width, height).

    Raises :class:`prx_data.core.imaging.ImageError` (with a countable reason)
    for bytes that do not decode.
    """
    dst_w, dst_h = shape
    info = imaging.probe(data)
    src = (info.width, info.height)
    if src == (dst_w, dst_h):
        im = imaging.decode(data)
    else:
        im = imaging.decode(data, draft_to=imaging.draft_size(*src, dst_w, dst_h))
        if im.size != (dst_w, dst_h):
            full = src
            # A header that disagrees with the pixels (rare, broken files): trust the pixels.
            if abs(im.size[0] / im.size[1] - src[0] / src[1]) > 0.02 * (src[0] / src[1]):
                full = im.size
            im, _ = imaging.cover_resize(im, dst_w, dst_h, full_size=full)
    if im.size != (dst_w, dst_h):
        raise imaging.ImageError("decode_error", f"decoded {im.size}, expected {shape}")
    return np.array(im, dtype=np.uint8)
