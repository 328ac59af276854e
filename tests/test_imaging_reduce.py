"""The default codec (``vips-reduce``): libvips' Lanczos3 reduce on exactly the crop box that
Pillow's Lanczos uses, with Pillow's decode, errors and q92 encode."""

from __future__ import annotations

import io
import math

import numpy as np
import pytest
from PIL import Image

from prx_data.core.imaging import (
    CODECS,
    DEFAULT_CODEC,
    EncodeSpec,
    ImageError,
    _encode_array,
    axis_plan,
    check_codec,
    cover_box,
    decode,
    decode_scaled,
    draft_size,
    enlarge_exact,
    prepare_with,
    reduce_exact,
)
from prx_data.core.sample_data import photo_like
from tests import badinputs as bad


def _psnr(a: np.ndarray, b: np.ndarray) -> float:
    mse = np.mean((a.astype(np.float64) - b.astype(np.float64)) ** 2)
    return 99.0 if mse == 0 else float(10 * np.log10(255.0**2 / mse))


def _save(im: Image.Image, fmt: str, **kw) -> bytes:
    buf = io.BytesIO()
    im.save(buf, fmt, **kw)
    return buf.getvalue()


def _pixels(data: bytes) -> np.ndarray:
    return np.asarray(Image.open(io.BytesIO(data)).convert("RGB"))


@pytest.fixture(scope="module")
def detailed() -> np.ndarray:
    """Band-limited noise at about half the source's Nyquist: a sub-pixel shift shows."""
    rng = np.random.default_rng(0)
    noise = Image.fromarray((rng.random((379, 501, 3)) * 255).astype(np.uint8))
    return np.asarray(noise.resize((1001, 757), Image.Resampling.BICUBIC))


def _pillow(arr: np.ndarray, box, w: int, h: int) -> np.ndarray:
    return np.asarray(Image.fromarray(arr).resize((w, h), Image.Resampling.LANCZOS, box=box))


@pytest.mark.parametrize(
    "box,dst,aligned",
    [
        ((0.0, 21.0, 1001.0, 736.0), (448, 320), True),  # a cover box on whole pixels
        ((250.25, 0.0, 750.75, 757.0), (320, 484), True),  # centre on a half pixel
        ((0.0, 0.0, 1000.5, 756.5), (500, 378), False),  # a 2x draft of 2001 x 1513
        ((300.1, 200.7, 700.3, 500.9), (200, 150), False),  # off-centre, off the lattice
    ],
)
def test_output_grid_is_the_exact_box(detailed, box, dst, aligned):
    """Close to Pillow's Lanczos over the same box (48-51 dB here), closer than Pillow's
    own output moved by 1/20 of a source pixel (41-43 dB)."""
    w, h = dst
    ref = _pillow(detailed, box, w, h)
    out = reduce_exact(detailed, box, w, h)
    assert out is not None and out.shape == (h, w, 3)
    plans = axis_plan(1001, box[0], box[2], w), axis_plan(757, box[1], box[3], h)
    assert all(p.align == 1.0 for p in plans) == aligned
    dx = 0.05 if box[2] + 0.05 <= 1001 else 0.0
    dy = 0.05 - dx
    moved = _pillow(detailed, (box[0] + dx, box[1] + dy, box[2] + dx, box[3] + dy), w, h)
    assert _psnr(out, ref) > 46.0 > _psnr(moved, ref)


def test_same_size_and_enlarged_sources():
    """A source already at the bucket's size keeps its pixels; an enlargement (at most 4/3
    under the bucket rule) scores within a dB of Pillow's Lanczos against the float
    reference, on the same exact box."""
    src = photo_like(448, 576, 1)[0]
    out = prepare_with(DEFAULT_CODEC, _save(src, "PNG"), 448, 576, fmt="png")
    assert np.array_equal(_pixels(out.data), np.asarray(src))
    small = _save(photo_like(450, 330, 2)[0], "JPEG", quality=95)
    a = prepare_with(DEFAULT_CODEC, small, 576, 448, fmt="png")
    b = prepare_with("pillow", small, 576, 448, fmt="png")
    assert a.crop_box == b.crop_box
    ref = _float_reference(small, 576, 448)
    pa, pb = _psnr(ref, _pixels(a.data)), _psnr(ref, _pixels(b.data))
    assert pa > 40.0 and pa > pb - 1.0


@pytest.mark.parametrize(
    "box,dst",
    [
        ((0.0, 21.3, 1001.0, 736.7), (1280, 914)),  # the filled axis and a fractional one
        ((13.37, 0.0, 987.63, 757.0), (1212, 942)),
        ((1.3, 2.1, 701.3, 522.1), (901, 671)),  # a start before the image (edge repeated)
        ((0.45, 0.6, 750.55, 500.6), (1000, 667)),  # no start fits: the exact warp
    ],
)
def test_enlargement_grid_is_the_exact_box(detailed, box, dst):
    """OpenCV's resize from a chosen start pixel gives the exact mapping's pixels (one
    warpAffine over the box, same kernel), not those of a grid moved by 1/20 pixel."""
    import cv2

    w, h = dst
    out = enlarge_exact(detailed, box, w, h)
    assert out.shape == (h, w, 3)

    def warp(b):
        sx, sy = (b[2] - b[0]) / w, (b[3] - b[1]) / h
        m = np.array([[sx, 0, b[0] + 0.5 * sx - 0.5], [0, sy, b[1] + 0.5 * sy - 0.5]])
        flags = cv2.INTER_CUBIC | cv2.WARP_INVERSE_MAP
        return cv2.warpAffine(detailed, m, (w, h), flags=flags, borderMode=cv2.BORDER_REPLICATE)

    inner = (slice(4, -4), slice(4, -4))  # edges: resize and warp extend the image alike
    moved = warp((box[0] + 0.05, box[1] + 0.05, box[2] + 0.05, box[3] + 0.05))
    assert _psnr(out[inner], warp(box)[inner]) > 50.0 > 45.0 > _psnr(moved[inner], out[inner])


def test_reduce_plan_for_a_factor_just_above_one():
    """A 2572 x 1740 photo into its 2432 x 1664 bucket (factor 1.046): the output count's
    parity stays odd until the crop is too narrow, so the plan reads wider instead."""
    box = cover_box(2572, 1740, 2432, 1664)
    plan = axis_plan(2572, box[0], box[2], 2432)
    assert plan is not None and plan.lo >= 0 and plan.lo + plan.size <= 2572
    assert (math.floor(plan.size / plan.factor + 0.5) - 2432) == 2 * plan.trim


def test_opencv_encode_is_pillows():
    """The default path's BGR arrays leave through OpenCV's encoder with Pillow's bytes."""
    rgb = np.asarray(photo_like(640, 480, 4)[0])
    for subsampling in (-1, 0, 2):
        spec = EncodeSpec(subsampling=subsampling)
        ours = _encode_array(np.ascontiguousarray(rgb[..., ::-1]), True, spec)
        assert ours == spec.encode(Image.fromarray(rgb))


def _float_reference(data: bytes, w: int, h: int) -> np.ndarray:
    """What the benchmark scores against: full decode, float Lanczos over the exact box."""
    im = decode(data)
    box = cover_box(*im.size, w, h)
    chans = [
        np.asarray(c.convert("F").resize((w, h), Image.Resampling.LANCZOS, box=box))
        for c in im.split()
    ]
    return np.stack(chans, -1)


def test_fidelity_of_a_drafted_odd_sized_jpeg():
    """A 2x-drafted JPEG whose sides do not divide by 2 (the alignment pass) scores like
    the Pillow codec against the float reference, with the same q92 tables and box."""
    data = _save(photo_like(1001, 757, 5)[0], "JPEG", quality=95)
    w, h = 320, 240
    assert decode_scaled(data, draft_size(1001, 757, w, h))[1] == 2
    assert axis_plan(501, 0.0, 500.5, w).align > 1.0
    ref = _float_reference(data, w, h)
    a, b = prepare_with(DEFAULT_CODEC, data, w, h), prepare_with("pillow", data, w, h)
    assert a.crop_box == b.crop_box
    qa, qb = Image.open(io.BytesIO(a.data)), Image.open(io.BytesIO(b.data))
    assert qa.quantization == qb.quantization
    pa, pb = _psnr(ref, _pixels(a.data)), _psnr(ref, _pixels(b.data))
    assert pa > 30.0 and pa > pb - 0.2  # 32.2 both
    a, b = (prepare_with(c, data, w, h, fmt="png") for c in (DEFAULT_CODEC, "pillow"))
    pa, pb = _psnr(ref, _pixels(a.data)), _psnr(ref, _pixels(b.data))
    assert pa > 44.0 and pa > pb - 1.0  # before the encode: 46.2 and 46.7


@pytest.mark.parametrize(
    "data,reason",
    [
        (bad.truncated_jpeg(), "truncated"),
        (b"", "empty_file"),
        (bad.not_an_image(), "not_an_image"),
        (bad.bomb_gif(), "decompression_bomb"),
    ],
)
def test_same_error_reasons_as_pillow(data, reason):
    for codec in (DEFAULT_CODEC, "pillow"):
        with pytest.raises(ImageError) as e:
            prepare_with(codec, data, 512, 512)
        assert e.value.reason == reason


def test_settings_of_the_default_codec():
    """It takes the draft margins the pillow codec takes; other filters are Pillow's."""
    assert DEFAULT_CODEC == "vips-reduce" and DEFAULT_CODEC in CODECS
    check_codec(DEFAULT_CODEC, "lanczos", 1.0)
    with pytest.raises(ValueError, match="margin"):
        check_codec(DEFAULT_CODEC, "lanczos", 0.9)
    data = _save(photo_like(1200, 900, 3)[0], "JPEG", quality=95)
    a = prepare_with(DEFAULT_CODEC, data, 448, 320, resample="hamming", draft_margin=1.0)
    b = prepare_with("pillow", data, 448, 320, resample="hamming", draft_margin=1.0)
    assert a.data == b.data
