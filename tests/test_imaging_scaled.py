"""Fast decodes keep the pixels and the geometry: still WebPs through libwebp's RGB decoder,
whole-factor reduces, and crop boxes mapped through the draft's exact factor."""

from __future__ import annotations

import io

import numpy as np
import pytest
from PIL import Image

from prx_data.core.imaging import (
    check_codec,
    cover_resize,
    decode,
    decode_scaled,
    decode_scaled_array,
    draft_size,
    prepare,
    prepare_with,
)
from prx_data.core.sample_data import photo_like


def _save(im: Image.Image, fmt: str, **kw) -> bytes:
    buf = io.BytesIO()
    im.save(buf, fmt, **kw)
    return buf.getvalue()


def _pillow_rgb(data: bytes) -> np.ndarray:
    return np.asarray(Image.open(io.BytesIO(data)).convert("RGB"))


@pytest.mark.parametrize("lossless", [False, True])
def test_still_webp_decodes_to_pillows_pixels(lossless):
    data = _save(photo_like(701, 503, 3)[0], "WEBP", quality=90, lossless=lossless)
    im, k = decode_scaled(data)
    assert k == 1 and im.mode == "RGB" and im.size == (701, 503)
    assert np.array_equal(np.asarray(im), _pillow_rgb(data))


def test_webp_with_alpha_or_frames_keeps_pillows_path():
    rgba = photo_like(300, 200, 4)[0].convert("RGBA")
    rgba.putalpha(128)
    data = _save(rgba, "WEBP", quality=90)
    im = decode(data)
    assert im.mode == "RGB"
    # composited on white, as before: a half-transparent image is lighter than its colours
    assert np.asarray(im).mean() > np.asarray(rgba.convert("RGB")).mean()


@pytest.mark.parametrize("size", [(1200, 900), (1001, 757)])
def test_webp_draft_is_pillows_whole_factor_reduce(size):
    src = photo_like(*size, 5)[0]
    data = _save(src, "WEBP", quality=92)
    im, k = decode_scaled(data, draft_to=(300, 220))
    assert k == min(size[0] // 300, size[1] // 220) > 1
    assert im.size == (-(-size[0] // k), -(-size[1] // k))
    ref = np.asarray(Image.open(io.BytesIO(data)).convert("RGB").reduce(k)).astype(int)
    assert np.abs(np.asarray(im).astype(int) - ref).max() <= 1


def test_jpeg_draft_reports_its_factor():
    data = _save(photo_like(1001, 757, 6)[0], "JPEG", quality=95)
    im, k = decode_scaled(data, draft_to=draft_size(1001, 757, 240, 180))
    assert k == 2 and im.size == (501, 379)


def _pillow_draft(data: bytes, draft_to: tuple[int, int] | None) -> np.ndarray:
    im = Image.open(io.BytesIO(data))
    if draft_to is not None:
        im.draft("RGB", draft_to)
    im.load()
    return np.asarray(im)


@pytest.mark.parametrize(
    "draft_to,k",
    [(None, 1), ((2000, 2000), 1), ((480, 370), 2), ((240, 180), 4), ((120, 90), 8)],
)
@pytest.mark.parametrize("size", [(1001, 757), (1024, 768)])
def test_jpeg_array_decode_is_pillows_draft(size, draft_to, k):
    """The array decode (OpenCV's libjpeg) gives Pillow's pixels at Pillow's draft scale."""
    data = _save(photo_like(*size, 7)[0], "JPEG", quality=92)
    arr, got_k = decode_scaled_array(data, draft_to=draft_to)
    assert got_k == k
    assert arr.shape == (-(-size[1] // k), -(-size[0] // k), 3) and arr.dtype == np.uint8
    assert np.array_equal(arr, _pillow_draft(data, draft_to))


def test_jpeg_array_decode_keeps_pillows_path_where_it_must():
    """A rotated, a grey, a CMYK JPEG and one with bytes after its end marker: Pillow's pixels."""
    src = photo_like(640, 480, 8)[0]
    exif = Image.Exif()
    exif[0x0112] = 6  # rotate 90 degrees
    rotated = _save(src, "JPEG", quality=92, exif=exif.tobytes())
    arr, _ = decode_scaled_array(rotated)
    assert arr.shape == (640, 480, 3)
    assert np.array_equal(arr, np.asarray(decode(rotated)))
    for data in (
        _save(src.convert("L"), "JPEG", quality=92),
        _save(src.convert("CMYK"), "JPEG", quality=92),
        _save(src, "JPEG", quality=92) + b"\0" * 16,
    ):
        arr, _ = decode_scaled_array(data)
        assert np.array_equal(arr, np.asarray(decode(data)))


def test_truncated_jpeg_is_refused_by_the_array_decode():
    """A JPEG cut short never becomes grey-filled pixels: the usual ``truncated`` error."""
    from prx_data.core.imaging import ImageError

    data = _save(photo_like(800, 600, 2)[0], "JPEG", quality=92)
    for cut in (len(data) // 2, len(data) - 2, len(data) - 1):
        with pytest.raises(ImageError) as e:
            decode_scaled_array(data[:cut])
        assert e.value.reason == "truncated"


def test_enlarging_reduce_codec_keeps_the_box():
    """``vips-reduce`` enlarges (OpenCV's bicubic on the exact box) to what Pillow's Lanczos
    gives within a few grey levels, with the same crop box and q92 tables."""
    data = _save(photo_like(900, 700, 9)[0], "JPEG", quality=92)
    a = prepare_with("vips-reduce", data, 1024, 768, fmt="png")
    b = prepare_with("pillow", data, 1024, 768, fmt="png")
    assert a.crop_box == b.crop_box
    diff = np.abs(_png_pixels(a.data).astype(int) - _png_pixels(b.data).astype(int))
    assert diff.mean() < 1.0
    qa = Image.open(io.BytesIO(prepare_with("vips-reduce", data, 1024, 768).data))
    qb = Image.open(io.BytesIO(prepare_with("pillow", data, 1024, 768).data))
    assert qa.quantization == qb.quantization


def _png_pixels(data: bytes) -> np.ndarray:
    return np.asarray(Image.open(io.BytesIO(data)).convert("RGB"))


def _lines(width: int, height: int, xs: list[int]) -> bytes:
    arr = np.full((height, width, 3), 30, np.uint8)
    for x in xs:
        arr[:, x : x + 3] = 230
    return _save(Image.fromarray(arr), "JPEG", quality=100, subsampling=0)


def _centroids(png: bytes, n: int) -> list[float]:
    row = np.asarray(Image.open(io.BytesIO(png)).convert("L"), np.float64).mean(axis=0)
    w = np.clip(row - 30.0, 0, None)
    # split the profile at the midpoints between lines
    peaks = sorted(np.argsort(w)[::-1][: n * 3])
    groups: list[list[int]] = []
    for p in peaks:
        if groups and p - groups[-1][-1] <= 4:
            groups[-1].append(p)
        else:
            groups.append([p])
    out = []
    for g in groups:
        lo, hi = max(0, g[0] - 4), min(len(w), g[-1] + 5)
        xs = np.arange(lo, hi)
        out.append(float((w[lo:hi] * xs).sum() / w[lo:hi].sum()))
    return out


def test_drafted_crop_box_lands_where_the_full_decode_does():
    """A width that does not divide by the draft factor: lines at the far edge stay put."""
    width, height = 1003, 1003
    data = _lines(width, height, [40, 500, 955])
    full = prepare(data, 320, 320, use_draft=False, fmt="png")
    fast = prepare(data, 320, 320, use_draft=True, fmt="png")
    a, b = _centroids(full.data, 3), _centroids(fast.data, 3)
    assert len(a) == len(b) == 3
    assert max(abs(x - y) for x, y in zip(a, b, strict=True)) < 0.05, (a, b)
    assert fast.crop_box == full.crop_box
    # Mapping by the drafted size instead (the old way) moves the far line by ~0.15 px.
    im, k = decode_scaled(data, draft_to=draft_size(width, height, 320, 320))
    assert k == 2 and im.size == (502, 502)
    old, _ = cover_resize(im, 320, 320, full_size=(width, height))
    c = _centroids(_save(old, "PNG"), 3)
    assert abs(c[2] - a[2]) > 0.1


def _q92_tables():
    return Image.open(
        io.BytesIO(_save(Image.new("RGB", (64, 64)), "JPEG", quality=92))
    ).quantization


@pytest.mark.parametrize("resample", ["lanczos", "bicubic", "hamming", "bilinear", "box"])
def test_every_filter_keeps_shape_box_and_q92(resample):
    data = _save(photo_like(1500, 1000, 8)[0], "JPEG", quality=95)
    out = prepare_with("pillow", data, 544, 480, resample=resample)
    im = Image.open(io.BytesIO(out.data))
    assert im.size == (544, 480) and im.quantization == _q92_tables()
    assert out.crop_box == prepare(data, 544, 480).crop_box


def test_codec_and_filter_are_checked():
    check_codec("pillow", "hamming")
    check_codec("vips")
    with pytest.raises(ValueError, match="Lanczos3 only"):
        check_codec("vips", "box")
    with pytest.raises(ValueError, match="unknown resample"):
        check_codec("pillow", "nearest")
    with pytest.raises(ValueError, match="unknown codec"):
        check_codec("magick")
