"""Image decode, normalisation, cover-resize and encode.

Decoding is defensive: the decompression-bomb guard stays on, EXIF
orientation is applied, every mode ends as 8-bit RGB and only the first
frame of an animation is used. Failures raise :class:`ImageError` with a
short machine-readable ``reason`` that the jobs count in their reports.
"""

from __future__ import annotations

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

# Truncated files must fail loudly rather than decode to grey.
ImageFile.LOAD_TRUNCATED_IMAGES = False

#: libjpeg's DCT-domain downscale is only used down to this multiple of the
#: resize target: drafting to the exact size costs up to 16 dB on hard images
#: (on the real-photo corpus: 2.4 dB on the worst detailed image, for 1.3x the
#: speed; the export's ``--draft-margin`` trades one for the other).
DRAFT_MARGIN = 1.5
DEFAULT_JPEG_QUALITY = 92
BACKGROUND = (255, 255, 255)

#: Resampling filters for the cover-resize, best first (Pillow's, all with an
#: exact crop box). Lanczos is the default; the others trade fidelity for speed
#: (see the Codecs section of docs/ARCHITECTURE.md for the measured frontier).
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
    data: bytes, size: tuple[int, int], draft_to: tuple[int, int] | None
) -> tuple[Image.Image, int] | None:
    """An opaque still WebP through libwebp's plain RGB decoder (OpenCV's); None: use Pillow.

    The pixels are the ones Pillow decodes (both are libwebp; checked equal on
    the benchmark corpus), at about 0.7x the cost on large images: Pillow 11
    decodes every WebP through the animation API into an RGBA canvas first.
    With ``draft_to`` the image is then box-reduced by the largest whole factor
    that keeps it at least that size (WebP has no DCT draft); returns the image
    and that factor. Failures fall back to Pillow, which raises the usual
    :class:`ImageError`.
    """
    try:
        import cv2
    except ImportError:  # pragma: no cover - opencv is a dependency
        return None
    rgb = getattr(cv2, "IMREAD_COLOR_RGB", None)  # OpenCV >= 4.11
    arr = cv2.imdecode(np.frombuffer(data, np.uint8), cv2.IMREAD_COLOR if rgb is None else rgb)
    if arr is None or arr.ndim != 3 or arr.shape[2] != 3 or (arr.shape[1], arr.shape[0]) != size:
        return None
    if rgb is None:
        arr = cv2.cvtColor(arr, cv2.COLOR_BGR2RGB)
    k = 1
    if draft_to is not None:
        k = max(1, min(size[0] // max(1, draft_to[0]), size[1] // max(1, draft_to[1])))
        if k > 1:
            arr = _box_reduce(arr, k)
    return Image.fromarray(arr), k


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
    im = open_image(data)
    with decode_errors():
        frames = getattr(im, "n_frames", 1)
        if frames > 1:
            im.seek(0)
        orientation = _orientation(im)
        if im.format == "WEBP" and im.mode == "RGB" and frames == 1 and orientation == 1:
            fast = _decode_still_webp(data, im.size, draft_to)
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
    fw, fh = full_size or im.size
    box = cover_box(fw, fh, dst_w, dst_h)
    if shrink:
        sx = sy = 1.0 / shrink
    else:
        sx, sy = im.size[0] / fw, im.size[1] / fh
    iw, ih = im.size
    scaled = (
        max(0.0, box[0] * sx),
        max(0.0, box[1] * sy),
        min(float(iw), box[2] * sx),
        min(float(ih), box[3] * sy),
    )
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
    fmt: str = "jpeg",
    quality: int = DEFAULT_JPEG_QUALITY,
    use_draft: bool = True,
    subsampling: int | str = -1,
    resample: str = "lanczos",
    draft_margin: float = DRAFT_MARGIN,
) -> Prepared:
    """Decode -> cover-resize (Lanczos) -> centre crop -> encode, for one bucket shape.

    With ``use_draft`` the resample starts from no less than ``draft_margin``
    x the target: JPEGs are DCT-downscaled while decoding, other formats are
    box-reduced by a whole factor first. Without it, the full image is resampled.
    """
    _filter(resample)  # fail before decoding
    if src_size is None:
        info = probe(data)
        src_size = (info.width, info.height)
    draft_to = draft_size(*src_size, dst_w, dst_h, draft_margin) if use_draft else None
    im, k = decode_scaled(data, draft_to=draft_to)
    # The header size can disagree with the decoded frame (rare, broken files):
    # then trust the pixels. A draft keeps the aspect ratio, so compare ratios.
    full = src_size
    if abs(im.size[0] / im.size[1] - full[0] / full[1]) > 0.02 * (full[0] / full[1]):
        full, k = im.size, 1
    elif any(-(-f // k) != s for f, s in zip(full, im.size, strict=True)):
        k = 0  # the header's size is not the decoded one: map by the sizes
    gap = draft_margin if use_draft else None
    out, box = cover_resize(
        im, dst_w, dst_h, full_size=full, reducing_gap=gap, resample=resample, shrink=k
    )
    return Prepared(encode(out, fmt, quality, subsampling), dst_w, dst_h, box)


# --- libvips codec path ------------------------------------------------------------

CODECS = ("pillow", "vips")
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
    fmt: str = "jpeg",
    quality: int = DEFAULT_JPEG_QUALITY,
    subsampling: int | str = -1,
) -> Prepared:
    """Same contract as :func:`prepare`, through libvips' ``thumbnail``.

    libvips shrinks JPEGs on load but always leaves at least 2x the target
    before its Lanczos3 reduce (stricter than :data:`DRAFT_MARGIN`), applies
    EXIF orientation and centre-crops to the exact shape. The header checks
    (empty, not an image, decompression bomb) are Pillow's, so both codecs
    count failures under the same reasons.
    """
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
        reason = "truncated" if ("truncated" in low or "premature end" in low) else "decode_error"
        raise ImageError(reason, msg.strip().splitlines()[0] if msg.strip() else "") from None
    return Prepared(out, dst_w, dst_h, cover_box(*src_size, dst_w, dst_h))


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


def prepare_with(codec: str, data: bytes, dst_w: int, dst_h: int, **kwargs) -> Prepared:
    """Dispatch to the chosen codec path (``pillow`` or ``vips``)."""
    check_codec(codec, kwargs.get("resample", "lanczos"), kwargs.get("draft_margin", DRAFT_MARGIN))
    if codec == "pillow":
        return prepare(data, dst_w, dst_h, **kwargs)
    for key in ("use_draft", "resample", "draft_margin"):
        kwargs.pop(key, None)
    return prepare_vips(data, dst_w, dst_h, **kwargs)
