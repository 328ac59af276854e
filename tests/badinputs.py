"""Test-only builders of awkward and broken image files, one per failure kind."""

from __future__ import annotations

import io
import struct

import numpy as np
from PIL import Image

from prx_data.core.sample_data import photo_like


def _save(im: Image.Image, fmt: str, **kw) -> bytes:
    buf = io.BytesIO()
    im.save(buf, fmt, **kw)
    return buf.getvalue()


def good_jpeg(w: int = 640, h: int = 480, seed: int = 1) -> bytes:
    return _save(photo_like(w, h, seed)[0], "JPEG", quality=95)


def truncated_jpeg() -> bytes:
    data = good_jpeg(800, 600, 2)
    return data[: len(data) // 2]


def cmyk_jpeg() -> bytes:
    return _save(photo_like(600, 600, 3)[0].convert("CMYK"), "JPEG", quality=95)


def png16() -> bytes:
    arr = (np.linspace(0, 65535, 640 * 480).reshape(480, 640)).astype(np.uint16)
    return _save(Image.fromarray(arr, "I;16"), "PNG")


def palette_transparent_png() -> bytes:
    im = photo_like(500, 500, 4)[0].convert("P", palette=Image.Palette.ADAPTIVE, colors=64)
    return _save(im, "PNG", transparency=0)


def rgba_png() -> bytes:
    im = photo_like(600, 450, 5)[0].convert("RGBA")
    a = np.zeros((450, 600), np.uint8)
    a[:, 300:] = 255
    im.putalpha(Image.fromarray(a))
    return _save(im, "PNG")


def exif_rotated_jpeg() -> tuple[bytes, tuple[int, int]]:
    """Stored 800x600 with orientation 6 (rotate 90 CW): displays as 600x800.

    The stored image is red on its left half; after orientation the red half is on top.
    """
    arr = np.zeros((600, 800, 3), np.uint8)
    arr[:, :400] = (220, 20, 20)
    arr[:, 400:] = (20, 20, 220)
    im = Image.fromarray(arr)
    exif = Image.Exif()
    exif[0x0112] = 6
    return _save(im, "JPEG", quality=95, exif=exif.tobytes()), (600, 800)


def one_pixel() -> bytes:
    return _save(Image.new("RGB", (1, 1), (10, 20, 30)), "PNG")


def ten_to_one() -> bytes:
    return _save(photo_like(4000, 400, 6)[0], "JPEG", quality=90)


def bomb_gif() -> bytes:
    """A GIF whose header claims 65535x65535 pixels (far past Pillow's bomb limit)."""
    data = bytearray(_save(Image.new("P", (8, 8)), "GIF"))
    data[6:10] = struct.pack("<HH", 65535, 65535)
    return bytes(data)


def animated_gif() -> bytes:
    frames = [
        Image.new("RGB", (600, 600), c) for c in [(200, 30, 30), (30, 200, 30), (30, 30, 200)]
    ]
    return _save(frames[0], "GIF", save_all=True, append_images=frames[1:], duration=100, loop=0)


def webp() -> bytes:
    return _save(photo_like(700, 500, 7)[0], "WEBP", quality=90)


def not_an_image() -> bytes:
    return b"this is a caption file, not an image\n" * 10


#: (id, bytes, caption, expected drop reason or None if it must be written)
def all_cases() -> list[tuple[str, bytes, str | None, str | None]]:
    return [
        ("bad/good", good_jpeg(), "a good photo", None),
        ("bad/truncated", truncated_jpeg(), "cut short", "truncated"),
        ("bad/zero", b"", "nothing", "empty_file"),
        ("bad/text", not_an_image(), "text", "not_an_image"),
        ("bad/cmyk", cmyk_jpeg(), "cmyk", None),
        ("bad/png16", png16(), "sixteen bit", None),
        ("bad/palette", palette_transparent_png(), "palette", None),
        ("bad/rgba", rgba_png(), "alpha", None),
        ("bad/exif", exif_rotated_jpeg()[0], "rotated", None),
        ("bad/1px", one_pixel(), "tiny", "too_small"),
        ("bad/10to1", ten_to_one(), "panorama", "aspect_ratio"),
        ("bad/bomb", bomb_gif(), "bomb", "decompression_bomb"),
        ("bad/animated", animated_gif(), "animated", None),
        ("bad/webp", webp(), "webp", None),
        ("bad/nocaption", good_jpeg(512, 512, 8), None, None),
        ("bad/emptycaption", good_jpeg(512, 512, 9), "   ", None),
        ("bad/nonutf8", good_jpeg(512, 512, 10), b"caf\xe9 \xff".decode("utf-8", "replace"), None),
        ("bad/hugecaption", good_jpeg(512, 512, 11), "long " * 200_000, None),
    ]
