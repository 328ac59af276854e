"""How much does JPEG re-encoding cost on your images? And what quality was a JPEG saved at?

``python -m prx_data.jpeg_fidelity --folder DIR`` (or ``--table URI``) decodes
a sample of images, encodes them with the exporter's encoder
(:func:`prx_data.core.imaging.encode`, default q92) for 1 and 10 cycles (each
cycle decodes the previous output and encodes it again), and reports PSNR
against the decoded original, and LPIPS when the ``lpips`` package and its
weights are available, by resolution band. The PRX recipe chose q92 from such
a table; its figures are printed alongside for comparison.

``python -m prx_data.jpeg_fidelity --estimate-quality FILE ...`` estimates
the quality a JPEG was saved at by matching its quantization tables against
libjpeg's Annex K tables scaled for Q = 1..100 (what Pillow, OpenCV,
libjpeg-turbo and most tools write). Files with other tables (Photoshop,
cameras) get the nearest Q and ``exact=False``.
"""

from __future__ import annotations

import io
import math
import os
from collections import Counter
from collections.abc import Iterator, Sequence
from dataclasses import asdict, dataclass, field

import numpy as np
from PIL import Image

from prx_data.core.errors import UsageError
from prx_data.core.imaging import DEFAULT_JPEG_QUALITY, ImageError, decode, encode

# --- quality estimation -----------------------------------------------------------------------

#: ITU-T T.81 Annex K.1 luminance table, row-major (natural order).
ANNEX_K_LUMA = (
    16, 11, 10, 16, 24, 40, 51, 61,
    12, 12, 14, 19, 26, 58, 60, 55,
    14, 13, 16, 24, 40, 57, 69, 56,
    14, 17, 22, 29, 51, 87, 80, 62,
    18, 22, 37, 56, 68, 109, 103, 77,
    24, 35, 55, 64, 81, 104, 113, 92,
    49, 64, 78, 87, 103, 121, 120, 101,
    72, 92, 95, 98, 112, 100, 103, 99,
)  # fmt: skip
#: Annex K.2 chrominance table.
ANNEX_K_CHROMA = (
    17, 18, 24, 47, 99, 99, 99, 99,
    18, 21, 26, 66, 99, 99, 99, 99,
    24, 26, 56, 99, 99, 99, 99, 99,
    47, 66, 99, 99, 99, 99, 99, 99,
    *([99] * 32),
)  # fmt: skip


def libjpeg_tables(quality: int, force_baseline: bool = True) -> tuple[np.ndarray, np.ndarray]:
    """libjpeg's ``jpeg_set_quality`` tables (luma, chroma) in natural order.

    Scale is 5000/Q below 50 and 200-2Q from 50; entries are rounded, at
    least 1, and at most 255 for baseline files (Pillow forces baseline).
    """
    if not 1 <= quality <= 100:
        raise UsageError(f"quality must be 1..100, got {quality}")
    scale = 5000 // quality if quality < 50 else 200 - 2 * quality
    hi = 255 if force_baseline else 32767
    out = []
    for base in (ANNEX_K_LUMA, ANNEX_K_CHROMA):
        t = (np.asarray(base, np.int64) * scale + 50) // 100
        out.append(np.clip(t, 1, hi))
    return out[0], out[1]


@dataclass(frozen=True)
class QualityEstimate:
    """``quality`` is libjpeg's Q whose tables match; ``exact`` when they match entry for entry."""

    quality: int
    exact: bool
    #: Mean absolute difference per table entry to the chosen Q's tables (0 when exact).
    distance: float
    tables: int


_TABLES = {q: libjpeg_tables(q) for q in range(1, 101)}
_TABLES_EXT = {q: libjpeg_tables(q, force_baseline=False) for q in range(1, 101)}


def estimate_quality(source: bytes | str | Image.Image) -> QualityEstimate:
    """Estimate the libjpeg quality of a JPEG (bytes, a path or an opened Pillow image)."""
    if isinstance(source, Image.Image):
        im = source
    else:
        data = source if isinstance(source, bytes | bytearray) else open(source, "rb").read()
        try:
            im = Image.open(io.BytesIO(data))
        except Exception:
            raise ImageError("not_an_image") from None
    q = getattr(im, "quantization", None)
    if im.format != "JPEG" or not q:
        raise ImageError("not_a_jpeg", f"format {im.format}")
    tables = [np.asarray(q[k], np.int64) for k in sorted(q)]
    best: tuple[float, int] | None = None
    for quality in range(100, 0, -1):  # prefer the higher Q on ties (only possible with odd tables)
        for ref in (_TABLES[quality], _TABLES_EXT[quality]):
            # Table 0 is luma; every further table is compared with chroma.
            diffs = [
                np.abs(t - (ref[0] if i == 0 else ref[1])).mean() for i, t in enumerate(tables)
            ]
            d = float(np.mean(diffs))
            if best is None or d < best[0]:
                best = (d, quality)
    assert best is not None
    return QualityEstimate(
        quality=best[1], exact=best[0] == 0.0, distance=round(best[0], 4), tables=len(tables)
    )


# --- fidelity --------------------------------------------------------------------------------

#: PSNR (dB, RGB) the PRX team measured for q92 re-encoding: {band: (1 cycle, 10 cycles)}.
PRX_REFERENCE = {"0.25-0.5 MP": (45.1, 42.2), "1-2 MP": (48.7, 45.4)}
#: Band edges in megapixels.
BAND_EDGES = (0.25, 0.5, 1.0, 2.0, 4.0, 8.0, 16.0)
#: Identical images have infinite PSNR; they are reported at this cap.
PSNR_CAP = 99.0
IMAGE_EXTENSIONS = (".jpg", ".jpeg", ".png", ".webp", ".bmp", ".tif", ".tiff", ".gif")


def band_of(pixels: int) -> str:
    """Resolution band label, e.g. ``"1-2 MP"``."""
    mp = pixels / 1e6
    if mp < BAND_EDGES[0]:
        return f"<{BAND_EDGES[0]:g} MP"
    for lo, hi in zip(BAND_EDGES, BAND_EDGES[1:], strict=False):
        if mp < hi:
            return f"{lo:g}-{hi:g} MP"
    return f">={BAND_EDGES[-1]:g} MP"


def _band_key(label: str) -> float:
    num = label.lstrip("<>=").split("-")[0].split(" ")[0]
    return (
        float(num) - (0.5 if label.startswith("<") else 0) + (0.5 if label.startswith(">") else 0)
    )


def psnr(a: np.ndarray, b: np.ndarray) -> float:
    """PSNR in dB between two uint8 images of equal shape (capped at :data:`PSNR_CAP`)."""
    if a.shape != b.shape:
        raise ValueError(f"shapes differ: {a.shape} vs {b.shape}")
    mse = float(np.mean((a.astype(np.float64) - b.astype(np.float64)) ** 2))
    return PSNR_CAP if mse == 0 else min(PSNR_CAP, 10.0 * math.log10(255.0**2 / mse))


def reencode(
    im: Image.Image, quality: int, cycles: Sequence[int], subsampling: int = -1
) -> dict[int, Image.Image]:
    """The image after each requested number of encode/decode cycles with the exporter's encoder."""
    want = sorted(set(cycles))
    if not want or want[0] < 1:
        raise UsageError(f"cycles must be >= 1, got {cycles}")
    out: dict[int, Image.Image] = {}
    cur = im
    for c in range(1, want[-1] + 1):
        cur = Image.open(io.BytesIO(encode(cur, "jpeg", quality, subsampling))).convert("RGB")
        if c in want:
            out[c] = cur
    return out


class _Lpips:
    """LPIPS (AlexNet) when the ``lpips`` package and its weights load; else a reason."""

    def __init__(self) -> None:
        self.model = None
        self.why_not = None
        try:
            import lpips  # noqa: F401
            import torch  # noqa: F401

            self.model = lpips.LPIPS(net="alex", verbose=False).eval()
        except Exception as e:
            self.why_not = f"{type(e).__name__}: {e}"[:200]

    def __call__(self, a: Image.Image, b: Image.Image) -> float:
        import torch

        def t(im: Image.Image):
            x = torch.from_numpy(np.asarray(im, np.float32) / 127.5 - 1.0)
            return x.permute(2, 0, 1)[None]

        with torch.no_grad():
            return float(self.model(t(a), t(b)).item())


@dataclass(frozen=True)
class FidelityConfig:
    """Where to take samples from, and how to re-encode them."""

    folder: str | None = None
    table: str | None = None
    quality: int = DEFAULT_JPEG_QUALITY
    cycles: tuple[int, ...] = (1, 10)
    #: -1: Pillow's default (4:2:0, what the exporter writes by default); 0: 4:4:4; 2: 4:2:0.
    subsampling: int = -1
    limit: int = 100
    seed: int = 0
    #: "auto": LPIPS when importable; "off": never.
    lpips: str = "auto"
    storage_options: dict | None = None
    progress: bool = True

    def __post_init__(self) -> None:
        if (self.folder is None) == (self.table is None):
            raise UsageError("give exactly one of folder or table")
        if not 1 <= self.quality <= 100:
            raise UsageError(f"quality must be 1..100, got {self.quality}")
        if not self.cycles or min(self.cycles) < 1:
            raise UsageError(f"cycles must be >= 1, got {self.cycles}")
        if self.limit < 1:
            raise UsageError("limit must be >= 1")


@dataclass
class BandResult:
    images: int = 0
    #: {cycles: mean PSNR dB}
    psnr_mean: dict[int, float] = field(default_factory=dict)
    #: {cycles: median PSNR dB}: identical images score the 99 dB cap and drag means up.
    psnr_median: dict[int, float] = field(default_factory=dict)
    psnr_min: dict[int, float] = field(default_factory=dict)
    #: {cycles: images that came back bit-identical (PSNR at the cap)}
    identical: dict[int, int] = field(default_factory=dict)
    lpips_mean: dict[int, float] = field(default_factory=dict)


@dataclass
class FidelityReport:
    source: str
    quality: int
    cycles: list[int]
    subsampling: int
    images: int
    errors: dict[str, int]
    #: Estimated quality of the JPEG inputs: {Q or "other": count}.
    source_quality: dict[str, int]
    bands: dict[str, BandResult]
    lpips: str | None  # None when computed, else why not

    def to_dict(self) -> dict:
        return asdict(self)

    def text(self) -> str:
        c = self.cycles
        head = f"{'band':<12}{'images':>7}" + "".join(
            f"{'PSNR@' + str(k):>10}{'median':>8}{'min':>7}" for k in c
        )
        if self.lpips is None:
            head += "".join(f"{'LPIPS@' + str(k):>10}" for k in c)
        head += "   PRX@1/@10 (q92)"
        lines = [
            f"{self.source}: {self.images} images re-encoded at q{self.quality} "
            f"(subsampling {self.subsampling}); PSNR in dB over RGB vs the decoded original "
            "(mean, median, min)",
            head,
        ]
        for name, b in self.bands.items():
            row = f"{name:<12}{b.images:>7}" + "".join(
                f"{b.psnr_mean[k]:>10.1f}{b.psnr_median[k]:>8.1f}{b.psnr_min[k]:>7.1f}" for k in c
            )

            if self.lpips is None:
                row += "".join(f"{b.lpips_mean[k]:>10.4f}" for k in c)
            ref = PRX_REFERENCE.get(name)
            row += f"   {ref[0]:.1f} / {ref[1]:.1f}" if ref else ""
            if sum(b.identical.values()):
                row += f"   ({', '.join(f'{v} at @{k}' for k, v in b.identical.items() if v)}"
                row += f" identical, scored {PSNR_CAP:g} dB)"
            lines.append(row)
        if self.errors:
            lines.append(
                "skipped: " + ", ".join(f"{k} {v}" for k, v in sorted(self.errors.items()))
            )
        if self.source_quality:
            top = sorted(self.source_quality.items(), key=lambda kv: -kv[1])[:8]
            lines.append(
                "input JPEG quality (estimated): " + ", ".join(f"q{k} x{v}" for k, v in top)
            )
        if self.lpips is not None:
            lines.append(f"LPIPS not computed ({self.lpips})")
        return "\n".join(lines)


def _folder_samples(folder: str, limit: int, seed: int) -> Iterator[tuple[str, bytes]]:
    paths = []
    for root, _dirs, files in os.walk(folder):
        for f in files:
            if f.lower().endswith(IMAGE_EXTENSIONS):
                paths.append(os.path.join(root, f))
    paths.sort()
    rng = np.random.default_rng(seed)
    if len(paths) > limit:
        paths = [paths[i] for i in sorted(rng.choice(len(paths), limit, replace=False))]
    for p in paths:
        with open(p, "rb") as f:
            yield p, f.read()


def _table_samples(
    uri: str, limit: int, seed: int, storage_options: dict | None
) -> Iterator[tuple[str, bytes]]:
    from prx_data.core import schema as S
    from prx_data.table.lance_ops import open_table

    ds = open_table(uri, storage_options)
    n = ds.count_rows()
    rng = np.random.default_rng(seed)
    rows = sorted(rng.choice(n, min(limit, n), replace=False).tolist()) if n else []
    for start in range(0, len(rows), 32):
        t = ds.take(rows[start : start + 32], columns=[S.ID, S.IMAGE])
        yield from zip(t[S.ID].to_pylist(), t[S.IMAGE].to_pylist(), strict=True)


def run_fidelity(cfg: FidelityConfig) -> FidelityReport:
    """Re-encode a sample and report PSNR (and LPIPS) per resolution band."""
    from tqdm.auto import tqdm

    if cfg.folder is not None:
        samples = _folder_samples(cfg.folder, cfg.limit, cfg.seed)
        source = cfg.folder
    else:
        samples = _table_samples(cfg.table, cfg.limit, cfg.seed, cfg.storage_options)
        source = cfg.table
    lp = _Lpips() if cfg.lpips == "auto" else None
    lpips_note = "disabled" if lp is None else lp.why_not
    cycles = sorted(set(cfg.cycles))
    errors: Counter = Counter()
    src_q: Counter = Counter()
    per_band: dict[str, dict[str, list]] = {}
    n = 0
    for _name, data in tqdm(
        samples, total=cfg.limit, desc="jpeg_fidelity", unit="img", disable=not cfg.progress
    ):
        if not data:
            errors["empty_file"] += 1
            continue
        try:
            im = decode(data)
        except ImageError as e:
            errors[e.reason] += 1
            continue
        if data[:2] == b"\xff\xd8":
            try:
                est = estimate_quality(data)
                src_q[str(est.quality) if est.exact else "other"] += 1
            except ImageError:
                pass
        ref = np.asarray(im)
        outs = reencode(im, cfg.quality, cycles, cfg.subsampling)
        slot = per_band.setdefault(band_of(im.width * im.height), {"psnr": [], "lpips": []})
        slot["psnr"].append([psnr(ref, np.asarray(outs[c])) for c in cycles])
        if lp is not None and lp.model is not None:
            slot["lpips"].append([lp(im, outs[c]) for c in cycles])
        n += 1
    bands: dict[str, BandResult] = {}
    for name in sorted(per_band, key=_band_key):
        p = np.asarray(per_band[name]["psnr"])
        b = BandResult(images=len(p))
        b.psnr_mean = {c: round(float(p[:, i].mean()), 2) for i, c in enumerate(cycles)}
        b.psnr_median = {c: round(float(np.median(p[:, i])), 2) for i, c in enumerate(cycles)}
        b.psnr_min = {c: round(float(p[:, i].min()), 2) for i, c in enumerate(cycles)}
        b.identical = {c: int((p[:, i] >= PSNR_CAP).sum()) for i, c in enumerate(cycles)}
        if per_band[name]["lpips"]:
            lv = np.asarray(per_band[name]["lpips"])
            b.lpips_mean = {c: round(float(lv[:, i].mean()), 5) for i, c in enumerate(cycles)}
        bands[name] = b
    return FidelityReport(
        source=source,
        quality=cfg.quality,
        cycles=cycles,
        subsampling=cfg.subsampling,
        images=n,
        errors=dict(errors),
        source_quality=dict(src_q),
        bands=bands,
        lpips=lpips_note,
    )
