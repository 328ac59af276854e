"""The loader's same-size JPEG decode (libjpeg-turbo into CHW) gives Pillow's pixels."""

from __future__ import annotations

import io

import numpy as np
import pytest
import torch
from PIL import Image

from prx_data.core import imaging
from prx_data.stream.decode import decode_chw, decode_to


def _photo(w: int = 96, h: int = 64, seed: int = 0) -> Image.Image:
    rng = np.random.default_rng(seed)
    y, x = np.mgrid[0:h, 0:w]
    base = np.stack([x * 255 / w, y * 255 / h, (x + y) * 127 / (w + h)], axis=-1)
    noise = rng.normal(0, 40, (h, w, 3))
    return Image.fromarray(np.clip(base + noise, 0, 255).astype(np.uint8), "RGB")


def _jpeg(im: Image.Image, **kw) -> bytes:
    buf = io.BytesIO()
    im.save(buf, "JPEG", quality=90, **kw)
    return buf.getvalue()


def _pillow(data: bytes) -> torch.Tensor:
    return torch.from_numpy(np.asarray(imaging.decode(data)).copy()).permute(2, 0, 1)


@pytest.mark.parametrize(
    "kw",
    [{}, {"subsampling": 0}, {"subsampling": 1}, {"progressive": True}, {"grey": True}],
    ids=["420", "444", "422", "progressive", "grey"],
)
def test_same_size_jpeg_decodes_to_pillows_pixels_as_chw(kw):
    im = _photo(seed=len(kw))
    if kw.pop("grey", False):
        im = im.convert("L")
    data = _jpeg(im, **kw)
    got = decode_chw(data, (96, 64))
    assert got.dtype == torch.uint8 and tuple(got.shape) == (3, 64, 96)
    assert torch.equal(got, _pillow(data))
    # The fast path hands out the decoder's own buffer: no channel-first copy.
    assert got.stride() == (1, 96 * 3, 3)


def test_exif_cmyk_png_and_resized_sources_keep_the_pillow_path():
    im = _photo()
    exif = Image.Exif()
    exif[0x0112] = 3  # rotated 180 degrees: same size, other pixels
    cases = [
        _jpeg(im, exif=exif.tobytes()),
        _jpeg(im.convert("CMYK")),
        imaging.encode(im, "png"),
    ]
    for data in cases:
        want = torch.from_numpy(decode_to(data, (96, 64))).permute(2, 0, 1)
        assert torch.equal(decode_chw(data, (96, 64)), want)
    rotated = decode_chw(cases[0], (96, 64))
    assert torch.equal(rotated, _pillow(_jpeg(im)).flip(1, 2))  # the orientation is applied
    # Another size: draft + Lanczos, as before.
    small = decode_chw(_jpeg(im), (48, 32))
    assert torch.equal(small, torch.from_numpy(decode_to(_jpeg(im), (48, 32))).permute(2, 0, 1))


def test_truncated_jpeg_is_a_countable_image_error():
    data = _jpeg(_photo())
    with pytest.raises(imaging.ImageError) as e:
        decode_chw(data[: len(data) // 2], (96, 64))
    assert e.value.reason == "truncated"
