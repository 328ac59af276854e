"""Loader-side decode: an exported image to the run's training shape, cheaply.

Training at 512 from a 2048- or 4096-tier bucket used to decode every JPEG at
full size and then throw most of the pixels away. Here JPEGs are
DCT-downscaled while decoding (Pillow ``draft``), to no less than
:data:`prx_data.core.imaging.DRAFT_MARGIN` x the target, the same fidelity
rule the export uses, and then Lanczos cover-resized to the exact shape.
Samples already at the target shape take the plain decode path: for baseline
and progressive YCbCr or grey JPEGs without EXIF that is libjpeg-turbo through
``torchvision.io.decode_jpeg``, straight into the ``[3, H, W]`` tensor the step
wants (a channel-first view of the decoder's own buffer, no conversion or
copy). Its pixels are Pillow's: both run libjpeg-turbo's default accurate
integer IDCT with fancy upsampling (tested equal). Everything else (PNG
exports, CMYK, EXIF orientation) goes through Pillow.

:func:`decode_batch` is the other route: the loader passes the encoded bytes
through and the training step decodes a whole batch on the GPU (nvJPEG via
``torchvision.io.decode_jpeg``), then cover-resizes with antialiased bicubic
interpolation. It takes the decode off the loader's CPU entirely.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np
import torch

from prx_data.core import imaging

__all__ = [
    "decode_batch",
    "decode_chw",
]

_JPEG_MAGIC = b"\xff\xd8\xff"


def decode_chw(data: bytes, shape: tuple[int, int]) -> torch.Tensor:
    """Encoded image -> uint8 tensor [3, H, W] of ``shape`` = (width, height), for the loader.

    Same pixels as :func:`decode_to`. The result may be a channel-first view
    of a channel-last buffer (``torch.stack`` in the collate makes the batch
    contiguous). Raises :class:`prx_data.core.imaging.ImageError` for bytes
    that do not decode.
    """
    head = _plain_jpeg_size(data)
    if head == shape:
        import torchvision.io as tio

        try:
            t = tio.decode_jpeg(
                torch.frombuffer(bytearray(data), dtype=torch.uint8), mode=tio.ImageReadMode.RGB
            )
        except RuntimeError as e:
            msg = str(e)
            reason = "truncated" if "truncated" in msg else "decode_error"
            raise imaging.ImageError(reason, msg) from None
        if (t.shape[2], t.shape[1]) == shape:
            return t
    return torch.from_numpy(decode_to(data, shape)).permute(2, 0, 1)


#: Start-of-frame markers (every SOFn but DHT C4, JPG C8 and DAC CC).
_SOF = frozenset((0xC0, 0xC1, 0xC2, 0xC3, 0xC5, 0xC6, 0xC7, 0xC9, 0xCA, 0xCB, 0xCD, 0xCE, 0xCF))


def _plain_jpeg_size(data: bytes) -> tuple[int, int] | None:
    """(width, height) of an 8-bit YCbCr/grey JPEG with no EXIF segment; None for anything else.

    Walks the marker segments up to the first scan, so it costs microseconds.
    """
    if data[:3] != _JPEG_MAGIC:
        return None
    i, n, size = 2, len(data), None
    while i + 4 <= n:
        if data[i] != 0xFF:
            return None
        marker = data[i + 1]
        if marker == 0xFF:  # fill byte
            i += 1
            continue
        if marker == 0xDA:  # start of scan: the header is complete
            return size
        seg = int.from_bytes(data[i + 2 : i + 4], "big")
        if marker in _SOF:
            if i + 10 > n or data[i + 4] != 8 or data[i + 9] not in (1, 3):
                return None  # 12-bit or CMYK: Pillow's conversion
            h = int.from_bytes(data[i + 5 : i + 7], "big")
            w = int.from_bytes(data[i + 7 : i + 9], "big")
            size = (w, h)
        elif marker == 0xE1 and data[i + 4 : i + 10] == b"Exif\x00\x00":
            return None  # may carry an orientation: Pillow applies it
        i += 2 + seg
    return None


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


def decode_batch(datas: Sequence[bytes], shape: tuple[int, int], device) -> torch.Tensor:
    """Encoded images of one bucket -> uint8 [B, 3, H, W] of ``shape`` = (width, height) on ``device``.

    JPEGs decode in one batched call on ``device`` (nvJPEG on CUDA, libjpeg on
    CPU); other formats decode on the CPU and move. Sources of another size are
    cover-resized (antialiased bicubic, centre crop).
    """
    import torchvision.io as tio

    dev = torch.device(device)
    tensors = [torch.frombuffer(bytearray(d), dtype=torch.uint8) for d in datas]
    out: list[torch.Tensor | None] = [None] * len(tensors)
    jpeg = [i for i, d in enumerate(datas) if bytes(d[:3]) == _JPEG_MAGIC]
    if jpeg:
        decoded = tio.decode_jpeg(
            [tensors[i] for i in jpeg], mode=tio.ImageReadMode.RGB, device=dev
        )
        for i, t in zip(jpeg, decoded, strict=True):
            out[i] = t
    for i, t in enumerate(out):
        if t is None:
            try:
                out[i] = tio.decode_image(tensors[i], mode=tio.ImageReadMode.RGB).to(dev)
            except RuntimeError as e:
                raise imaging.ImageError("decode_error", str(e)) from None
    return torch.stack([_cover_tensor(t, *shape) for t in out])


def _cover_tensor(t, dst_w: int, dst_h: int):
    import torch.nn.functional as F

    _, h, w = t.shape
    if (w, h) == (dst_w, dst_h):
        return t
    scale = max(dst_w / w, dst_h / h)
    nh, nw = max(dst_h, math.ceil(h * scale - 1e-6)), max(dst_w, math.ceil(w * scale - 1e-6))
    x = F.interpolate(
        t[None].float(), size=(nh, nw), mode="bicubic", antialias=True, align_corners=False
    )
    top, left = (nh - dst_h) // 2, (nw - dst_w) // 2
    x = x[0, :, top : top + dst_h, left : left + dst_w]
    return x.round_().clamp_(0, 255).to(t.dtype)
