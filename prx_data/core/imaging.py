"""Image decode, normalisation, cover-resize and encode.

Decoding is defensive: the decompression-bomb guard stays on, EXIF
orientation is applied, every mode ends as 8-bit RGB and only the first
frame of an animation is used. Failures raise :class:`ImageError` with a
short machine-readable ``reason`` that the jobs count in their reports.
"""

from __future__ import annotations

import dataclasses
import io
import math
import os
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import numpy as np
from PIL import Image, ImageFile, ImageOps, UnidentifiedImageError

from prx_data.core.errors import PrxDataError, UsageError

__all__ = [
    "CODECS",
    "DEFAULT_CODEC",
    "DEFAULT_JPEG_QUALITY",
    "DRAFT_MARGIN",
    "EncodeSpec",
    "ImageError",
    "RESAMPLE",
    "cover_resize",
    "decode",
    "draft_size",
    "encode",
    "open_image",
    "prepare_with",
    "probe",
]

# Truncated files must fail loudly rather than decode to grey.
ImageFile.LOAD_TRUNCATED_IMAGES = False

#: libjpeg's DCT-domain downscale is only used down to this multiple of the
#: resize target: drafting to the exact size loses fidelity on hard images for
#: little speed (benchmarks/results/codecs.md; see ``--draft-margin``).
DRAFT_MARGIN = 1.5
DEFAULT_JPEG_QUALITY = 92
BACKGROUND = (255, 255, 255)

#: Resampling filters for the cover-resize, best first (Pillow's, all with an
#: exact crop box). Lanczos is the default; the others trade fidelity for speed
#: (measured frontier: benchmarks/results/codecs.md).
RESAMPLE = {
    "lanczos": Image.Resampling.LANCZOS,
    "bicubic": Image.Resampling.BICUBIC,
    "hamming": Image.Resampling.HAMMING,
    "bilinear": Image.Resampling.BILINEAR,
    "box": Image.Resampling.BOX,
}

# Orientation tags that swap width and height.
_TRANSPOSING_ORIENTATIONS = {5, 6, 7, 8}


class ImageError(PrxDataError):
    """A sample that cannot become a training image, with a countable reason."""

    def __init__(self, reason: str, detail: str = ""):
        super().__init__(f"{reason}: {detail}" if detail else reason)
        self.reason = reason
        self.detail = detail


@dataclass(frozen=True)
class ImageInfo:
    """What the header says: size after EXIF orientation, and the format."""

    width: int
    height: int
    format: str
    orientation: int = 1


@dataclass(frozen=True)
class Prepared:
    data: bytes
    width: int
    height: int
    #: Crop box in the oriented source image: (left, top, right, bottom), floats.
    crop_box: tuple[float, float, float, float]


def open_image(data: bytes) -> Image.Image:
    """Lazily open encoded bytes (header only), mapping failures to :class:`ImageError`."""
    if not data:
        raise ImageError("empty_file")
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", Image.DecompressionBombWarning)
            return Image.open(io.BytesIO(data))
    except Image.DecompressionBombError as e:
        raise ImageError("decompression_bomb", str(e)) from None
    except UnidentifiedImageError:
        raise ImageError("not_an_image") from None
    except (OSError, ValueError, SyntaxError) as e:
        raise ImageError("decode_error", str(e)) from None


def _orientation(im: Image.Image) -> int:
    try:
        value = im.getexif().get(0x0112, 1)
        return int(value) if value in range(1, 9) else 1
    except Exception:
        return 1


def probe(data: bytes) -> ImageInfo:
    """Read size, format and orientation from the header without decoding pixels."""
    im = open_image(data)
    w, h = im.size
    orientation = _orientation(im)
    if orientation in _TRANSPOSING_ORIENTATIONS:
        w, h = h, w
    return ImageInfo(w, h, (im.format or "unknown").lower(), orientation)


def _to_rgb(im: Image.Image) -> Image.Image:
    """Any mode to 8-bit RGB; transparency is composited on a white background."""
    mode = im.mode
    if mode == "RGB":
        return im
    if mode in ("I;16", "I;16B", "I;16L", "I;16N", "I", "F"):
        arr = np.asarray(im)
        if mode == "F":
            arr = np.clip(arr, 0.0, 1.0 if arr.max(initial=0) <= 1.0 else 255.0)
            scale = 255.0 if arr.max(initial=0) <= 1.0 else 1.0
            arr8 = (arr * scale).round().astype(np.uint8)
        else:
            hi = 65535 if mode.startswith("I;16") or arr.max(initial=0) > 255 else 255
            arr8 = (arr.astype(np.float64) * (255.0 / hi)).round().clip(0, 255).astype(np.uint8)
        return Image.fromarray(arr8, "L").convert("RGB")
    if mode == "P":
        im = im.convert("RGBA") if "transparency" in im.info else im.convert("RGB")
        mode = im.mode
        if mode == "RGB":
            return im
    if mode in ("RGBA", "LA", "PA", "RGBa", "La"):
        rgba = im.convert("RGBA")
        bg = Image.new("RGBA", rgba.size, BACKGROUND + (255,))
        bg.alpha_composite(rgba)
        return bg.convert("RGB")
    if mode == "1":
        return im.convert("L").convert("RGB")
    # L, CMYK, YCbCr, LAB, HSV and friends: Pillow's conversion is correct for these.
    return im.convert("RGB")


@contextmanager
def decode_errors() -> Iterator[None]:
    """Map Pillow's pixel-decoding failures to :class:`ImageError` reasons."""
    try:
        yield
    except ImageError:
        raise
    except Image.DecompressionBombError as e:
        raise ImageError("decompression_bomb", str(e)) from None
    except OSError as e:
        msg = str(e)
        reason = (
            "truncated" if "truncated" in msg or "broken data stream" in msg else "decode_error"
        )
        raise ImageError(reason, msg) from None
    except (ValueError, SyntaxError, EOFError, MemoryError) as e:
        raise ImageError("decode_error", str(e)) from None


def _decode_still_webp(
    data: bytes, size: tuple[int, int], draft_to: tuple[int, int] | None, bgr: bool = False
) -> tuple[np.ndarray, int] | None:
    """An opaque still WebP through libwebp's plain RGB decoder (OpenCV's); None: use Pillow.

    The pixels are the ones Pillow decodes (both are libwebp; checked equal on
    the benchmark corpus), at about 0.7x the cost on large images: Pillow 11
    decodes every WebP through the animation API into an RGBA canvas first.
    With ``draft_to`` the image is then box-reduced by the largest whole factor
    that keeps it at least that size (WebP has no DCT draft); returns the image
    and that factor. Failures fall back to Pillow, which raises the usual
    :class:`ImageError`. ``bgr``: OpenCV's own channel order (for its encoder).
    """
    try:
        import cv2
    except ImportError:  # pragma: no cover - opencv is a dependency
        return None
    rgb = None if bgr else getattr(cv2, "IMREAD_COLOR_RGB", None)  # OpenCV >= 4.11
    arr = cv2.imdecode(np.frombuffer(data, np.uint8), cv2.IMREAD_COLOR if rgb is None else rgb)
    if arr is None or arr.ndim != 3 or arr.shape[2] != 3 or (arr.shape[1], arr.shape[0]) != size:
        return None
    if rgb is None and not bgr:
        arr = cv2.cvtColor(arr, cv2.COLOR_BGR2RGB)
    k = _whole_factor(size, draft_to)
    if k > 1:
        arr = _box_reduce(arr, k)
    return arr, k


def _whole_factor(size: tuple[int, int], draft_to: tuple[int, int] | None) -> int:
    """The largest whole factor that keeps ``size`` at least ``draft_to`` (1 without one)."""
    if draft_to is None:
        return 1
    return max(1, min(size[0] // max(1, draft_to[0]), size[1] // max(1, draft_to[1])))


_JPEG_EOI = b"\xff\xd9"


def _decode_jpeg_array(
    data: bytes, im: Image.Image, draft_to: tuple[int, int] | None, bgr: bool = False
) -> tuple[np.ndarray, int] | None:
    """A plain RGB JPEG (orientation 1) decoded by OpenCV's libjpeg into an array; None: Pillow.

    The pixels are Pillow's at every draft scale (both are libjpeg-turbo with the
    same IDCT and upsampling; checked equal on the benchmark corpus at 1, 1/2
    and 1/4, and by ``tests/test_imaging_scaled.py``); the draft scale is the one
    Pillow's ``draft`` picks. It skips the copy from Pillow's RGBX storage into
    numpy. A file without its end-of-image marker, or one OpenCV refuses, goes
    to Pillow, which decodes or raises the usual :class:`ImageError`. (OpenCV 5
    refuses every truncation tried; the marker check keeps a release that fills a
    cut scan with grey from passing it as an image.) ``bgr``: OpenCV's own channel
    order, libjpeg's colour conversion writing BGR instead of RGB (same cost).
    """
    try:
        import cv2
    except ImportError:  # pragma: no cover - opencv is a dependency
        return None
    rgb = getattr(cv2, "IMREAD_COLOR_RGB", None)  # OpenCV >= 4.11
    if rgb is None or len(im.tile) != 1 or not data.endswith(_JPEG_EOI):
        return None
    scale = _whole_factor(im.size, draft_to)
    k = next(s for s in (8, 4, 2, 1) if scale >= s)  # JpegImageFile.draft's choice
    # libjpeg's DCT-domain scales; the reduced "grayscale" bit pattern ORed with RGB.
    reduced = {
        2: cv2.IMREAD_REDUCED_GRAYSCALE_2,
        4: cv2.IMREAD_REDUCED_GRAYSCALE_4,
        8: cv2.IMREAD_REDUCED_GRAYSCALE_8,
    }
    flags = (cv2.IMREAD_COLOR if bgr else rgb) | cv2.IMREAD_IGNORE_ORIENTATION | reduced.get(k, 0)
    arr = cv2.imdecode(np.frombuffer(data, np.uint8), flags)
    want = (-(-im.size[1] // k), -(-im.size[0] // k), 3)
    if arr is None or arr.shape != want:
        return None
    return arr, k


def _box_reduce(arr: np.ndarray, k: int) -> np.ndarray:
    """Mean of every k x k block (Pillow's ``reduce``), partial edge blocks over what they hold."""
    import cv2

    h, w = arr.shape[:2]
    h0, w0 = h - h % k, w - w % k
    # Whole blocks: OpenCV's area resize by an integer factor is the exact block mean.
    core = cv2.resize(arr[:h0, :w0], (w0 // k, h0 // k), interpolation=cv2.INTER_AREA)
    if (h0, w0) == (h, w):
        return core
    out = np.empty(((h + k - 1) // k, (w + k - 1) // k, 3), np.uint8)
    out[: h0 // k, : w0 // k] = core
    if w0 < w:
        col = arr[:h0, w0:].reshape(h0 // k, k, w - w0, 3).mean(axis=(1, 2))
        out[: h0 // k, -1] = np.rint(col)
    if h0 < h:
        row = arr[h0:, :w0].reshape(h - h0, w0 // k, k, 3).mean(axis=(0, 2))
        out[-1, : w0 // k] = np.rint(row)
    if w0 < w and h0 < h:
        out[-1, -1] = np.rint(arr[h0:, w0:].reshape(-1, 3).mean(axis=0))
    return out


def decode(data: bytes, draft_to: tuple[int, int] | None = None) -> Image.Image:
    """Decode to an oriented 8-bit RGB image.

    ``draft_to`` is a minimum size in the *oriented* frame; JPEGs may be
    DCT-downscaled and opaque still WebPs box-reduced to no less than it (see
    :data:`DRAFT_MARGIN`).
    """
    return decode_scaled(data, draft_to)[0]


def decode_scaled(data: bytes, draft_to: tuple[int, int] | None = None) -> tuple[Image.Image, int]:
    """:func:`decode`, and the whole factor it shrank by: pixel i covers source [i*k, (i+1)*k)."""
    im, k = _decode_scaled(data, draft_to)
    return (Image.fromarray(im) if isinstance(im, np.ndarray) else im), k


def decode_scaled_array(
    data: bytes, draft_to: tuple[int, int] | None = None
) -> tuple[np.ndarray, int]:
    """:func:`decode_scaled` as an HxWx3 uint8 array.

    Opaque still WebPs and plain RGB JPEGs are decoded straight into the array
    (:func:`_decode_still_webp`, :func:`_decode_jpeg_array`): copying a Pillow
    image out to numpy costs a fifth of its decode.
    """
    im, k = _decode_scaled(data, draft_to, as_array=True)
    return (im if isinstance(im, np.ndarray) else np.asarray(im)), k


def _decode_scaled(
    data: bytes, draft_to: tuple[int, int] | None, as_array: bool = False, bgr: bool = False
) -> tuple[Image.Image | np.ndarray, int]:
    """The decode behind :func:`decode_scaled`; with ``bgr`` a fast path's array is in
    OpenCV's BGR order (a Pillow image is always RGB: tell them apart by type)."""
    im = open_image(data)
    with decode_errors():
        frames = getattr(im, "n_frames", 1)
        if frames > 1:
            im.seek(0)
        orientation = _orientation(im)
        if im.format == "WEBP" and im.mode == "RGB" and frames == 1 and orientation == 1:
            fast = _decode_still_webp(data, im.size, draft_to, bgr)
            if fast is not None:
                return fast
        if as_array and im.format == "JPEG" and im.mode == "RGB" and orientation == 1:
            fast = _decode_jpeg_array(data, im, draft_to, bgr)
            if fast is not None:
                return fast
        k = 1
        if draft_to is not None and im.format == "JPEG":
            dw, dh = draft_to
            if orientation in _TRANSPOSING_ORIENTATIONS:
                dw, dh = dh, dw
            width = im.size[0]
            drafted = im.draft("RGB", (max(1, dw), max(1, dh)))
            if drafted is not None:  # (mode, (0, 0, width / k, height / k))
                k = round(width / drafted[1][2])
        im.load()
        if orientation != 1:
            im = ImageOps.exif_transpose(im)
        return _to_rgb(im), k


def cover_box(src_w: int, src_h: int, dst_w: int, dst_h: int) -> tuple[float, float, float, float]:
    """Centre crop box (in source pixels) that cover-resizes src to exactly dst."""
    scale = max(dst_w / src_w, dst_h / src_h)
    cw, ch = dst_w / scale, dst_h / scale
    left = max(0.0, (src_w - cw) / 2)
    top = max(0.0, (src_h - ch) / 2)
    return (left, top, min(float(src_w), left + cw), min(float(src_h), top + ch))


def draft_size(
    src_w: int, src_h: int, dst_w: int, dst_h: int, margin: float = DRAFT_MARGIN
) -> tuple[int, int]:
    """Smallest decode size that still leaves `margin` x the cover-resized size."""
    scale = max(dst_w / src_w, dst_h / src_h)
    return (math.ceil(src_w * scale * margin), math.ceil(src_h * scale * margin))


def scaled_box(
    size: tuple[int, int], full: tuple[int, int], dst_w: int, dst_h: int, shrink: int | None
) -> tuple[tuple[float, float, float, float], tuple[float, float, float, float]]:
    """The cover box in the ``full`` frame, and mapped onto the decoded ``size``."""
    box = cover_box(*full, dst_w, dst_h)
    if shrink:
        sx = sy = 1.0 / shrink
    else:
        sx, sy = size[0] / full[0], size[1] / full[1]
    scaled = (
        max(0.0, box[0] * sx),
        max(0.0, box[1] * sy),
        min(float(size[0]), box[2] * sx),
        min(float(size[1]), box[3] * sy),
    )
    return box, scaled


def cover_resize(
    im: Image.Image,
    dst_w: int,
    dst_h: int,
    full_size: tuple[int, int] | None = None,
    reducing_gap: float | None = None,
    resample: str = "lanczos",
    shrink: int | None = None,
) -> tuple[Image.Image, tuple[float, float, float, float]]:
    """Cover-resize + centre crop to (dst_w, dst_h) in one resample (Lanczos by default).

    ``full_size`` is the oriented size before any draft downscale; the
    returned crop box is expressed in that frame. ``shrink`` is the draft's
    whole factor (:func:`decode_scaled`), which maps the box exactly; without
    it the scale is taken from the sizes, which is off by up to one drafted
    pixel at the far edge when a side does not divide by the factor.
    ``reducing_gap`` lets Pillow first box-reduce by a whole factor, leaving
    at least that multiple of the target for the Lanczos pass (the same rule
    as drafts, for formats that have none); the crop box stays exact.
    """
    box, scaled = scaled_box(im.size, full_size or im.size, dst_w, dst_h, shrink)
    out = im.resize((dst_w, dst_h), _filter(resample), box=scaled, reducing_gap=reducing_gap)
    return out, box


def _filter(resample: str) -> Image.Resampling:
    try:
        return RESAMPLE[resample]
    except KeyError:
        raise UsageError(f"unknown resample {resample!r}; choose from {list(RESAMPLE)}") from None


def encode(
    im: Image.Image,
    fmt: str = "jpeg",
    quality: int = DEFAULT_JPEG_QUALITY,
    subsampling: int | str = -1,
) -> bytes:
    """Encode RGB to JPEG (default q92) or lossless PNG."""
    buf = io.BytesIO()
    if fmt == "jpeg":
        kwargs: dict = {"quality": quality}
        if subsampling != -1:
            kwargs["subsampling"] = subsampling
        im.save(buf, "JPEG", **kwargs)
    elif fmt == "png":
        im.save(buf, "PNG", compress_level=1)
    else:
        raise UsageError(f"unknown output format {fmt!r}; use 'jpeg' or 'png'")
    return buf.getvalue()


def prepare(
    data: bytes,
    dst_w: int,
    dst_h: int,
    src_size: tuple[int, int] | None = None,
    spec: EncodeSpec | None = None,
    **settings,
) -> Prepared:
    """Decode -> cover-resize (Lanczos) -> centre crop -> encode, for one bucket shape.

    With ``use_draft`` the resample starts from no less than ``draft_margin``
    x the target: JPEGs are DCT-downscaled while decoding, other formats are
    box-reduced by a whole factor first. Without it, the full image is resampled.
    ``spec`` (or its fields as keywords): :class:`EncodeSpec`.
    """
    spec = EncodeSpec.of(spec, settings)
    _filter(spec.resample)  # fail before decoding
    src_size, draft_to = _draft_plan(data, src_size, dst_w, dst_h, spec)
    im, k = decode_scaled(data, draft_to=draft_to)
    full, k = _decoded_frame(im.size, src_size, k)
    gap = spec.draft_margin if spec.use_draft else None
    out, box = cover_resize(
        im, dst_w, dst_h, full_size=full, reducing_gap=gap, resample=spec.resample, shrink=k
    )
    return Prepared(spec.encode(out), dst_w, dst_h, box)


def _draft_plan(
    data: bytes,
    src_size: tuple[int, int] | None,
    dst_w: int,
    dst_h: int,
    spec: EncodeSpec,
) -> tuple[tuple[int, int], tuple[int, int] | None]:
    """The source size (from the header when not given) and the size to draft towards."""
    if src_size is None:
        info = probe(data)
        src_size = (info.width, info.height)
    if not spec.use_draft:
        return src_size, None
    return src_size, draft_size(*src_size, dst_w, dst_h, spec.draft_margin)


def _decoded_frame(
    size: tuple[int, int], full: tuple[int, int], k: int
) -> tuple[tuple[int, int], int]:
    """The frame and factor that map the box onto the decoded pixels.

    The header size can disagree with the decoded frame (rare, broken files): then
    trust the pixels. A draft keeps the aspect ratio, so compare ratios.
    """
    if abs(size[0] / size[1] - full[0] / full[1]) > 0.02 * (full[0] / full[1]):
        return size, 1
    if any(-(-f // k) != s for f, s in zip(full, size, strict=True)):
        return full, 0  # the header's size is not the decoded one: map by the sizes
    return full, k


# --- libvips SIMD Lanczos3 over the exact box -----------------------------------------

#: Outputs computed beyond each edge of the bucket and dropped, so that the kernels at
#: the crop's edges see the pixels outside it, as a resample over the whole image does.
_EDGE_OUTPUTS = 4
#: An alignment pass reduces by 1 + (fraction / this): just above 1, barely a filter.
_ALIGN_PAD = 16


@dataclass(frozen=True)
class AxisPlan:
    """One axis of :func:`reduce_exact`: window, alignment pass, crop, main reduce, trim.

    libvips' ``reduceh``/``reducev`` centre their ``round(size / factor)`` outputs on
    their input, so a crop centred on the box's centre, when that centre is a
    multiple of 1/2, gives exactly the box's output grid (extra outputs on both
    sides are dropped). Otherwise (a drafted side that does not divide by the
    draft factor leaves the centre a fraction off) an alignment pass first reduces
    a window of the image (edge pixels repeated past its ends) by ``align``, just
    above 1, chosen so that the centre lands on that lattice; the composed mapping
    is still exact.
    """

    win_lo: int  # window of the alignment pass, in image pixels (may reach past the edges)
    win_size: int
    align: float  # alignment reduce factor; 1.0: no pass, the window is the image
    lo: int  # crop start for the main reduce
    size: int  # crop size
    factor: float  # main reduce factor
    trim: int  # outputs dropped at each end after the main reduce


def axis_plan(n: int, b0: float, b1: float, dst: int) -> AxisPlan | None:
    """Plan one axis of an ``n``-pixel image whose box ``[b0, b1)`` becomes ``dst`` pixels.

    Pixel i covers ``[i, i + 1)``. None when the box is enlarged (``reduce`` only shrinks).
    """
    factor = (b1 - b0) / dst
    if factor < 1.0 or not 0.0 <= b0 < b1 <= n + 1e-6:
        return None
    centre, win_lo, win_size, align, lo_lim, hi_lim = (b0 + b1) / 2, 0, n, 1.0, 0.0, float(n)
    frac = 2 * centre - math.floor(2 * centre)
    if 1e-7 < frac < 1 - 1e-7:
        # The window [L, L + X) has centre A = L + X / 2; the pass maps its output u to
        # A + align * (u - W / 2) (W outputs), so the box centre c lands on
        # W / 2 - _ALIGN_PAD / 2 when align = 2 (c - A) / _ALIGN_PAD: with
        # 2A = floor(2c) - _ALIGN_PAD that is 1 + frac / _ALIGN_PAD.
        twice_a = math.floor(2 * centre) - _ALIGN_PAD
        align = (_ALIGN_PAD + frac) / _ALIGN_PAD
        reach = (_EDGE_OUTPUTS + 4) * factor  # what the main reduce can read beyond the box
        r0, r1 = max(0, math.floor(b0 - reach)), min(n, math.ceil(b1 + reach))
        win_size = max(twice_a - 2 * r0, 2 * r1 - twice_a)
        win_lo = (twice_a - win_size) // 2
        w1 = math.floor(win_size / align + 0.5)

        def to_aligned(c: float) -> float:
            return (c - twice_a / 2) / align + w1 / 2

        b0, b1, centre = to_aligned(b0), to_aligned(b1), to_aligned(centre)
        lo_lim = max(0.0, to_aligned(float(max(0, win_lo))))
        hi_lim = min(float(w1), to_aligned(float(min(n, win_lo + win_size))))
        factor = (b1 - b0) / dst
        if factor < 1.0:
            return None
    twice = round(2 * centre)
    # The largest crop centred on the box whose pixels' centres are in the image, no
    # wider than the bucket plus _EDGE_OUTPUTS on each side; then narrower by 2 until
    # it gives the bucket plus an even number of outputs.
    half = min(centre - math.ceil(lo_lim - 0.5), math.floor(hi_lim + 0.5) - centre)
    x = min(int(2 * half), math.floor((dst + 2 * _EDGE_OUTPUTS + 0.5) * factor))
    if (x - twice) % 2:
        x -= 1
    top = int(2 * half) - (int(2 * half) - twice) % 2
    # Downwards from the preferred width; a factor just above 1 can keep the output count's
    # parity wrong until the crop is too narrow, so then upwards (more outputs to drop).
    for width in [*range(x, 0, -2), *range(x + 2, top + 1, 2)]:
        w = math.floor(width / factor + 0.5)
        if w >= dst and (w - dst) % 2 == 0:
            lo = (twice - width) // 2
            return AxisPlan(win_lo, win_size, align, lo, width, factor, (w - dst) // 2)
    return None


def reduce_exact(
    arr: np.ndarray, box: tuple[float, float, float, float], dst_w: int, dst_h: int
) -> np.ndarray | None:
    """Cover-crop ``box`` of an RGB array to (dst_w, dst_h) with libvips' Lanczos3 reduce.

    The output grid is the box's exactly (see :class:`AxisPlan`); returns an HxWx3
    uint8 array, or None where the plan does not apply (enlarging).
    """
    h, w = arr.shape[:2]
    px = axis_plan(w, box[0], box[2], dst_w)
    py = axis_plan(h, box[1], box[3], dst_h)
    if px is None or py is None:
        return None
    pyvips = _vips()
    arr = np.ascontiguousarray(arr)
    v = pyvips.Image.new_from_memory(arr.data, w, h, 3, "uchar")
    if px.align != 1.0 or py.align != 1.0:
        # The alignment windows: the image part inside, edge pixels repeated outside.
        x0, y0 = max(0, px.win_lo), max(0, py.win_lo)
        x1, y1 = min(w, px.win_lo + px.win_size), min(h, py.win_lo + py.win_size)
        v = v.crop(x0, y0, x1 - x0, y1 - y0)
        v = v.embed(x0 - px.win_lo, y0 - py.win_lo, px.win_size, py.win_size, extend="copy")
        if py.align != 1.0:
            v = v.reducev(py.align, kernel="lanczos3", gap=0.0)
        if px.align != 1.0:
            v = v.reduceh(px.align, kernel="lanczos3", gap=0.0)
    v = v.crop(px.lo, py.lo, px.size, py.size)
    if py.factor != 1.0:
        v = v.reducev(py.factor, kernel="lanczos3", gap=0.0)
    if px.factor != 1.0:
        v = v.reduceh(px.factor, kernel="lanczos3", gap=0.0)
    v = v.crop(px.trim, py.trim, dst_w, dst_h)
    out = np.ndarray((dst_h, dst_w, 3), np.uint8, v.write_to_memory())
    del arr  # kept alive until libvips has read it
    return out


def prepare_reduce(
    data: bytes,
    dst_w: int,
    dst_h: int,
    src_size: tuple[int, int] | None = None,
    spec: EncodeSpec | None = None,
    **settings,
) -> Prepared:
    """:func:`prepare` with libvips' SIMD Lanczos3 reduce in place of Pillow's Lanczos.

    Same decode (draft, orientation, modes, errors) and the same exact crop box.
    A plain RGB JPEG or still WebP is decoded by OpenCV straight into BGR, the
    order OpenCV's encoder takes, and leaves as the same q92 bytes Pillow writes
    (libjpeg-turbo, same tables and 4:2:0): no copy into Pillow's 4-byte pixels
    and no colour swap. Shrinks go through :func:`reduce_exact` (about 4x
    faster than Pillow's Lanczos); enlargements (at most 4/3 under the bucket
    rule) through :func:`enlarge_exact` (OpenCV's bicubic, about 10x faster).
    The non-Lanczos filters take :func:`prepare`'s Pillow resample.
    (benchmarks/results/export-bands.md)
    """
    spec = EncodeSpec.of(spec, settings)
    _filter(spec.resample)  # fail before decoding
    if spec.resample != "lanczos":
        return prepare(data, dst_w, dst_h, src_size, spec)
    src_size, draft_to = _draft_plan(data, src_size, dst_w, dst_h, spec)
    im, k = _decode_scaled(data, draft_to, as_array=True, bgr=True)
    bgr = isinstance(im, np.ndarray)
    arr = im if bgr else np.asarray(im)
    full, k = _decoded_frame((arr.shape[1], arr.shape[0]), src_size, k)
    box, scaled = scaled_box((arr.shape[1], arr.shape[0]), full, dst_w, dst_h, k)
    out = reduce_exact(arr, scaled, dst_w, dst_h)
    if out is None:  # enlarging (or a plan that does not apply)
        out = enlarge_exact(arr, scaled, dst_w, dst_h)
    return Prepared(_encode_array(out, bgr, spec), dst_w, dst_h, box)


def _encode_array(arr: np.ndarray, bgr: bool, spec: EncodeSpec) -> bytes:
    """``spec``'s encode of an HxWx3 array: OpenCV's JPEG encoder for BGR pixels (Pillow's
    bytes, without the copy into Pillow's 4-byte pixels), else Pillow's."""
    sampling = _CV_SAMPLING.get(spec.subsampling) if spec.fmt == "jpeg" else None
    if bgr and sampling is not None:
        import cv2

        ok, enc = cv2.imencode(
            ".jpg",
            arr,
            [cv2.IMWRITE_JPEG_QUALITY, spec.quality, cv2.IMWRITE_JPEG_SAMPLING_FACTOR, sampling],
        )
        if ok:
            return enc.tobytes()
    return spec.encode(Image.fromarray(arr[..., ::-1] if bgr else arr))


#: Pillow's ``subsampling`` values -> OpenCV's sampling factors (Pillow's default, -1, is 4:2:0).
_CV_SAMPLING = {-1: 0x221111, 2: 0x221111, 1: 0x211111, 0: 0x111111}

#: How far (in output pixels) :func:`enlarge_exact`'s grid may sit from the box's. OpenCV's
#: ``warpAffine`` (the exact fallback) places its samples on a 1/32-pixel table, so this
#: is finer than the fallback itself.
_GRID_TOLERANCE = 1 / 64
#: How far before the box :func:`enlarge_exact` may start its input (edge pixels repeated
#: before the image): 128 finds a start for 94 % of the enlargements of a random sample of
#: sizes at the default tiers (64: 88 %).
_ORIGIN_SEARCH = 128


def _resize_origin(b0: float, f: float) -> tuple[int, int] | None:
    """An input start ``c`` (a whole pixel at most ``b0``, negative: before the image) and an
    output offset ``m`` with ``c + m / f`` = ``b0`` to within :data:`_GRID_TOLERANCE` output
    pixels, or None.

    OpenCV's resize by ``f`` maps output ``j`` of an image starting at ``c`` to input
    ``c + (j + 1/2) / f - 1/2``: the box's grid when ``(b0 - c) f`` is whole."""
    start = math.floor(b0)
    for c in range(start, start - _ORIGIN_SEARCH, -1):
        r = (b0 - c) * f
        m = round(r)
        if abs(r - m) <= _GRID_TOLERANCE:
            return c, m
    return None


def enlarge_exact(
    arr: np.ndarray, box: tuple[float, float, float, float], dst_w: int, dst_h: int
) -> np.ndarray:
    """Cover-crop ``box`` of an HxWx3 array to (dst_w, dst_h) with bicubic interpolation on
    exactly the box's output grid (for enlargements; any channel order). The result may
    be a view with a wider row stride (copying 50 MB at the 4096 tier costs 10 ms).

    OpenCV's ``resize`` by the exact scale, from a start pixel chosen so that its grid is
    the box's (:func:`_resize_origin`); where no start within :data:`_ORIGIN_SEARCH`
    pixels gives that, one ``warpAffine`` with the exact mapping (also bicubic, 4-8x
    slower). Fidelity
    against a float Lanczos reference is within about a dB of Pillow's Lanczos at 4/3
    and better than img2dataset's integer-crop resize.
    """
    import cv2

    h, w = arr.shape[:2]
    fx, fy = dst_w / (box[2] - box[0]), dst_h / (box[3] - box[1])
    ox, oy = _resize_origin(box[0], fx), _resize_origin(box[1], fy)
    if ox is not None and oy is not None:
        (cx, mx), (cy, my) = ox, oy
        # Input up to a few pixels past the box (the kernel's reach), whole image if less.
        ex = min(w, math.ceil(box[2]) + 4)
        ey = min(h, math.ceil(box[3]) + 4)
        src = arr[max(cy, 0) : ey, max(cx, 0) : ex]
        if cx < 0 or cy < 0:  # a start before the image: its edge repeated, as resize does
            top, left = max(0, -cy), max(0, -cx)
            src = cv2.copyMakeBorder(src, top, 0, left, 0, cv2.BORDER_REPLICATE)
        out = cv2.resize(src, None, fx=fx, fy=fy, interpolation=cv2.INTER_CUBIC)
        if out.shape[0] >= my + dst_h and out.shape[1] >= mx + dst_w:
            return out[my : my + dst_h, mx : mx + dst_w]  # a view: OpenCV encodes it as is
    sx, sy = 1 / fx, 1 / fy
    m = np.array([[sx, 0, box[0] + 0.5 * sx - 0.5], [0, sy, box[1] + 0.5 * sy - 0.5]])
    return cv2.warpAffine(
        arr,
        m,
        (dst_w, dst_h),
        flags=cv2.INTER_CUBIC | cv2.WARP_INVERSE_MAP,
        borderMode=cv2.BORDER_REPLICATE,
    )


# --- libvips codec path ------------------------------------------------------------

#: ``vips-reduce``: Pillow decode and encode, libvips' Lanczos3 reduce over the exact box
#: (the default); ``pillow``: Pillow throughout; ``vips``: libvips ``thumbnail``.
CODECS = ("vips-reduce", "pillow", "vips")
DEFAULT_CODEC = "vips-reduce"
_VIPS_SUBSAMPLE = {-1: "on", 2: "on", 0: "off"}


def _vips():
    """Import pyvips configured for one image per core and no operation cache."""
    os.environ.setdefault("VIPS_CONCURRENCY", "1")
    try:
        import pyvips
    except ImportError as e:  # pragma: no cover - depends on the install
        raise ImageError(
            "codec_unavailable",
            f"pyvips is not importable ({e}); `pip install pyvips pyvips-binary`",
        ) from None
    pyvips.cache_set_max(0)
    return pyvips


def prepare_vips(
    data: bytes,
    dst_w: int,
    dst_h: int,
    src_size: tuple[int, int] | None = None,
    spec: EncodeSpec | None = None,
    **settings,
) -> Prepared:
    """Same contract as :func:`prepare`, through libvips' ``thumbnail``.

    libvips shrinks JPEGs on load but always leaves at least 2x the target
    before its Lanczos3 reduce (stricter than :data:`DRAFT_MARGIN`), applies
    EXIF orientation and centre-crops to the exact shape. The header checks
    (empty, not an image, decompression bomb) are Pillow's, so both codecs
    count failures under the same reasons.
    """
    spec = EncodeSpec.of(spec, settings)
    fmt, quality, subsampling = spec.fmt, spec.quality, spec.subsampling
    info = probe(data)  # raises ImageError for empty files, non-images and bombs
    if src_size is None:
        src_size = (info.width, info.height)
    if fmt not in ("jpeg", "png"):
        raise UsageError(f"unknown output format {fmt!r}; use 'jpeg' or 'png'")
    if subsampling not in _VIPS_SUBSAMPLE:
        raise UsageError("the vips codec supports subsampling -1 (4:2:0), 0 (4:4:4) or 2 (4:2:0)")
    pyvips = _vips()
    try:
        im = pyvips.Image.thumbnail_buffer(
            data, dst_w, height=dst_h, size="both", crop="centre", option_string="fail_on=error"
        )
        if im.hasalpha():
            im = im.flatten(background=list(BACKGROUND))
        if im.interpretation not in ("srgb",) or im.format != "uchar":
            im = im.colourspace("srgb")
        if im.format != "uchar":
            im = im.cast("uchar")
        if im.bands == 1:
            im = im.bandjoin([im, im])
        elif im.bands > 3:
            im = im.extract_band(0, n=3)
        if (im.width, im.height) != (dst_w, dst_h):
            raise ImageError("decode_error", f"vips produced {im.width}x{im.height}")
        if fmt == "jpeg":
            out = im.jpegsave_buffer(
                Q=quality, subsample_mode=_VIPS_SUBSAMPLE[subsampling], keep="none"
            )
        else:
            out = im.pngsave_buffer(compression=1, keep="none")
    except pyvips.Error as e:
        msg = str(e)
        low = msg.lower()
        if "truncated" in low or "premature end" in low:
            reason = "truncated"
        else:
            reason = _failed_decode_reason(data)
        raise ImageError(reason, msg.strip().splitlines()[0] if msg.strip() else "") from None
    return Prepared(out, dst_w, dst_h, cover_box(*src_size, dst_w, dst_h))


def _failed_decode_reason(data: bytes) -> str:
    """Why an image libvips could not decode fails, by Pillow's full decode.

    libvips keeps one error buffer per process and a reader clears it, so on
    driver threads another thread's call can take the text that said
    "premature end"; the reason must not depend on that text. Runs only on
    the failure path.
    """
    try:
        with decode_errors(), Image.open(io.BytesIO(data)) as im:
            im.load()
    except ImageError as e:
        return e.reason if e.reason == "truncated" else "decode_error"
    return "decode_error"


def check_codec(codec: str, resample: str = "lanczos", draft_margin: float = DRAFT_MARGIN) -> None:
    """Raise ValueError for an unknown codec or filter, or a setting the codec cannot use."""
    if codec not in CODECS:
        raise UsageError(f"unknown codec {codec!r}; choose from {CODECS}")
    _filter(resample)
    if codec == "vips" and resample != "lanczos":
        raise UsageError(f"the vips codec resamples with Lanczos3 only, not {resample!r}")
    if not draft_margin >= 1.0:  # also refuses NaN
        raise UsageError(
            f"draft margin {draft_margin} is below 1.0: the image would be decoded smaller "
            "than the bucket and enlarged again; use 1.0 or more"
        )
    if codec == "vips" and draft_margin != DRAFT_MARGIN:
        raise UsageError("the vips codec keeps libvips' own shrink-on-load margin (2x)")


@dataclass(frozen=True)
class EncodeSpec:
    """How a sample is resized and encoded: the one spelling of the encode settings,
    which every codec path takes (:func:`prepare`, :func:`prepare_reduce`,
    :func:`prepare_vips`, :func:`prepare_with`).

    ``codec``: :data:`CODECS`; ``fmt``: ``jpeg`` or lossless ``png``;
    ``subsampling``: JPEG chroma, -1 = Pillow's default (4:2:0), 0 = 4:4:4, 2 = 4:2:0;
    ``use_draft``: start the resample from no less than ``draft_margin`` x the
    target (JPEG DCT-domain downscale, or a whole-factor box reduce); ``resample``:
    :data:`RESAMPLE`.
    """

    codec: str = DEFAULT_CODEC
    fmt: str = "jpeg"
    quality: int = DEFAULT_JPEG_QUALITY
    subsampling: int | str = -1
    use_draft: bool = True
    draft_margin: float = DRAFT_MARGIN
    resample: str = "lanczos"

    @classmethod
    def of(cls, spec: EncodeSpec | None, settings: dict) -> EncodeSpec:
        """``spec`` with ``settings`` (its fields as keywords) applied; default: the defaults."""
        return dataclasses.replace(spec or cls(), **settings) if settings else spec or cls()

    def check(self) -> None:
        """Raise for a codec, filter or margin that cannot be used (:func:`check_codec`)."""
        check_codec(self.codec, self.resample, self.draft_margin)

    def encode(self, im: Image.Image) -> bytes:
        return encode(im, self.fmt, self.quality, self.subsampling)


def prepare_with(
    spec: EncodeSpec | str,
    data: bytes,
    dst_w: int,
    dst_h: int,
    src_size: tuple[int, int] | None = None,
    **settings,
) -> Prepared:
    """Dispatch to the codec path ``spec`` names (:data:`CODECS`); a codec name stands for
    :class:`EncodeSpec` with that codec, and ``settings`` for its other fields."""
    if isinstance(spec, str):
        spec = EncodeSpec(codec=spec)
    spec = EncodeSpec.of(spec, settings)
    spec.check()
    path = {"vips-reduce": prepare_reduce, "pillow": prepare, "vips": prepare_vips}[spec.codec]
    return path(data, dst_w, dst_h, src_size, spec)
