import io

import numpy as np
import pytest
from PIL import Image

from prx_data.core.imaging import (
    ImageError,
    cover_box,
    decode,
    draft_size,
    encode,
    prepare,
    prepare_with,
    probe,
)
from tests import badinputs as bad


def _psnr(a: np.ndarray, b: np.ndarray) -> float:
    mse = np.mean((a.astype(np.float64) - b.astype(np.float64)) ** 2)
    return 10 * np.log10(255.0**2 / mse)


@pytest.mark.parametrize(
    "data,reason",
    [
        (bad.truncated_jpeg(), "truncated"),
        (b"", "empty_file"),
        (bad.not_an_image(), "not_an_image"),
        (bad.bomb_gif(), "decompression_bomb"),
    ],
)
@pytest.mark.parametrize("codec", ["vips-reduce", "pillow", "vips"])
def test_bad_files_raise_with_reason(data, reason, codec):
    with pytest.raises(ImageError) as e:
        prepare_with(codec, data, 512, 512)
    assert e.value.reason == reason


@pytest.mark.parametrize(
    "make",
    [
        bad.cmyk_jpeg,
        bad.png16,
        bad.palette_transparent_png,
        bad.rgba_png,
        bad.animated_gif,
        bad.webp,
    ],
)
@pytest.mark.parametrize("codec", ["vips-reduce", "pillow", "vips"])
def test_any_mode_becomes_rgb(make, codec):
    im = decode(make())
    assert im.mode == "RGB"
    out = prepare_with(codec, make(), 448, 576)
    dec = Image.open(io.BytesIO(out.data))
    assert dec.size == (448, 576) and dec.mode == "RGB" and dec.format == "JPEG"


def test_16bit_keeps_range():
    arr = np.asarray(decode(bad.png16()))
    assert arr.min() == 0 and arr.max() == 255


def test_alpha_composited_on_white():
    arr = np.asarray(decode(bad.rgba_png()))
    assert (arr[:, :300] == 255).all()  # transparent half -> white background


def test_exif_orientation_applied():
    data, (w, h) = bad.exif_rotated_jpeg()
    info = probe(data)
    assert (info.width, info.height) == (w, h) == (600, 800)
    arr = np.asarray(decode(data))
    assert arr.shape[:2] == (800, 600)
    top, bottom = arr[:400].mean(axis=(0, 1)), arr[400:].mean(axis=(0, 1))
    assert top[0] > 150 > top[2] and bottom[2] > 150 > bottom[0]  # red half moved on top
    # and the draft path applies it the same way
    arr2 = np.asarray(Image.open(io.BytesIO(prepare(data, 384, 512).data)))
    assert arr2[:200].mean(axis=(0, 1))[0] > 150


def test_animated_uses_first_frame():
    arr = np.asarray(decode(bad.animated_gif()))
    r, g, b = arr.mean(axis=(0, 1))
    assert r > 150 and g < 80 and b < 80


def test_cover_box_centres_and_matches_ratio():
    left, top, right, bottom = cover_box(2000, 1000, 512, 512)
    assert (left, top, right, bottom) == (500.0, 0.0, 1500.0, 1000.0)
    l2, t2, r2, b2 = cover_box(1000, 2000, 704, 352)
    assert np.isclose((r2 - l2) / (b2 - t2), 2.0) and l2 == 0


def test_draft_size_margin():
    assert draft_size(4000, 3000, 512, 384) == (768, 576)


def test_encode_quality_and_png():
    im = decode(bad.good_jpeg())
    jpg = Image.open(io.BytesIO(encode(im, "jpeg", 92)))
    assert jpg.format == "JPEG"
    png = Image.open(io.BytesIO(encode(im, "png")))
    assert png.format == "PNG" and np.array_equal(np.asarray(png), np.asarray(im))
    with pytest.raises(ValueError):
        encode(im, "gif")


def test_draft_keeps_quality_vs_full_decode():
    """Drafting only down to >= 1.5x the target stays close to a full-decode reference.

    Source and target are half of a 3000x2000 photo to 672x384: the same 2x draft (the
    ratios decide it), a quarter of the pixels to synthesise."""
    from prx_data.core.imaging import DRAFT_MARGIN, decode_scaled
    from prx_data.core.sample_data import photo_like

    src = photo_like(1500, 1000, 42)[0]
    buf = io.BytesIO()
    src.save(buf, "JPEG", quality=95)
    data = buf.getvalue()
    assert decode_scaled(data, draft_size(1500, 1000, 336, 192, DRAFT_MARGIN))[1] == 2  # drafted
    fast = prepare(data, 336, 192, use_draft=True, fmt="png")
    full = prepare(data, 336, 192, use_draft=False, fmt="png")
    a = np.asarray(Image.open(io.BytesIO(fast.data)))
    b = np.asarray(Image.open(io.BytesIO(full.data)))
    assert _psnr(a, b) > 40
    assert fast.crop_box == full.crop_box


def test_vips_codec_matches_pillow_contract():
    """Orientation, alpha on white, first frame, q92 tables and crop box agree across codecs."""
    data, _ = bad.exif_rotated_jpeg()
    arr = np.asarray(Image.open(io.BytesIO(prepare_with("vips", data, 384, 512).data)))
    assert arr.shape == (512, 384, 3) and arr[:200].mean(axis=(0, 1))[0] > 150
    arr = np.asarray(Image.open(io.BytesIO(prepare_with("vips", bad.rgba_png(), 448, 576).data)))
    assert (arr[:, :100] > 245).all()
    arr = np.asarray(
        Image.open(io.BytesIO(prepare_with("vips", bad.animated_gif(), 448, 576).data))
    )
    assert arr.mean(axis=(0, 1))[0] > 150
    good = bad.good_jpeg(1600, 1200, 3)
    a, b = prepare_with("vips", good, 576, 448), prepare(good, 576, 448)
    qa, qb = Image.open(io.BytesIO(a.data)), Image.open(io.BytesIO(b.data))
    assert qa.quantization == qb.quantization  # both exactly quality 92
    assert a.crop_box == b.crop_box
    assert _psnr(np.asarray(qa.convert("RGB")), np.asarray(qb.convert("RGB"))) > 30
    png = prepare_with("vips", good, 576, 448, fmt="png")
    assert Image.open(io.BytesIO(png.data)).format == "PNG"
    with pytest.raises(ValueError):
        prepare_with("vips", good, 576, 448, subsampling=1)
    with pytest.raises(ValueError):
        prepare_with("nope", good, 576, 448)


def test_draft_margin_trades_decode_size_for_fidelity():
    """--draft-margin 1.0 lets libjpeg scale by 1/8 where 1.5 stops at 1/4; the result is
    still close to a full decode, and closer at the default margin.

    A 1024x768 photo to 128x96: the 8x source-to-target ratio of 4096x3072 to 512x384, so
    the same scales (1/8, 1/4), with a sixteenth of the pixels to synthesise."""
    from prx_data.core.imaging import DRAFT_MARGIN, check_codec, decode_scaled
    from prx_data.core.sample_data import photo_like

    src = photo_like(1024, 768, 42)[0]
    buf = io.BytesIO()
    src.save(buf, "JPEG", quality=95)
    data = buf.getvalue()
    assert decode_scaled(data, draft_size(1024, 768, 128, 96, 1.0))[1] == 8
    assert decode_scaled(data, draft_size(1024, 768, 128, 96, DRAFT_MARGIN))[1] == 4
    full = np.asarray(
        Image.open(io.BytesIO(prepare(data, 128, 96, use_draft=False, fmt="png").data))
    )
    psnr = {
        m: _psnr(
            np.asarray(
                Image.open(io.BytesIO(prepare(data, 128, 96, fmt="png", draft_margin=m).data))
            ),
            full,
        )
        for m in (1.0, DRAFT_MARGIN)
    }
    assert psnr[1.0] > 40 and psnr[DRAFT_MARGIN] > psnr[1.0]
    for codec, margin in (("pillow", 0.9), ("pillow", float("nan")), ("vips", 1.0)):
        with pytest.raises(ValueError, match="margin"):
            check_codec(codec, "lanczos", margin)


def test_vips_failure_reason_does_not_depend_on_its_shared_error_text(monkeypatch):
    """libvips' error buffer is per process: on driver threads another thread can clear it.
    A truncated JPEG is 'truncated' even when the error text says nothing."""
    from prx_data.core import imaging

    pyvips = imaging._vips()

    def lost_text(*a, **k):
        raise pyvips.Error("")

    monkeypatch.setattr(pyvips.Image, "thumbnail_buffer", lost_text)
    src = io.BytesIO()
    Image.new("RGB", (640, 480), (90, 140, 200)).save(src, "JPEG", quality=90)
    data = src.getvalue()
    with pytest.raises(ImageError) as err:
        prepare_with("vips", bad.truncated_jpeg(), 384, 512)
    assert err.value.reason == "truncated"
    with pytest.raises(ImageError) as err:  # a whole image vips failed on: a decode error
        prepare_with("vips", data, 384, 512)
    assert err.value.reason == "decode_error"
