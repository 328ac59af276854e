"""Procedural test images for the pHash, dedup and JPEG-fidelity tests.

Each image mixes a colour gradient, smoothed multi-scale noise and random
shapes, so its low-frequency DCT content is varied (a flat or purely random
image would make a poor perceptual-hash test). Everything is seeded.
"""

from __future__ import annotations

import io

import cv2
import numpy as np
from PIL import Image, ImageDraw


def make_image(seed: int, width: int, height: int) -> Image.Image:
    """A deterministic RGB picture: gradient + smoothed noise + shapes."""
    rng = np.random.default_rng(seed)
    x = np.arange(width, dtype=np.float32)[None, :] / width
    y = np.arange(height, dtype=np.float32)[:, None] / height
    angle = rng.uniform(0, 2 * np.pi)
    t = ((np.cos(angle) * x + np.sin(angle) * y + 1.0) / 2.0)[..., None]
    c0 = rng.uniform(0, 255, 3).astype(np.float32)
    c1 = rng.uniform(0, 255, 3).astype(np.float32)
    base = c0 + (c1 - c0) * t
    # Noise at a few scales, upsampled so it has structure, not just grain.
    for cells, amp in ((4, 60.0), (16, 25.0), (64, 8.0)):
        gw, gh = (
            max(2, cells * width // max(width, height)),
            max(2, cells * height // max(width, height)),
        )
        grid = rng.normal(0, amp, (gh, gw, 3)).astype(np.float32)
        base += cv2.resize(grid, (width, height), interpolation=cv2.INTER_CUBIC)
    im = Image.fromarray(np.clip(base, 0, 255, out=base).astype(np.uint8), "RGB")
    draw = ImageDraw.Draw(im)
    for _ in range(int(rng.integers(3, 12))):
        x0, x1 = sorted(rng.uniform(0, width, 2))
        y0, y1 = sorted(rng.uniform(0, height, 2))
        fill = tuple(int(v) for v in rng.integers(0, 256, 3))
        kind = rng.integers(0, 3)
        if kind == 0:
            draw.ellipse((x0, y0, x1 + 1, y1 + 1), fill=fill)
        elif kind == 1:
            draw.rectangle((x0, y0, x1 + 1, y1 + 1), fill=fill)
        else:
            pts = [(float(rng.uniform(0, width)), float(rng.uniform(0, height))) for _ in range(3)]
            draw.polygon(pts, fill=fill)
    return im


def jpeg(im: Image.Image, quality: int = 92, **kwargs) -> bytes:
    buf = io.BytesIO()
    im.save(buf, "JPEG", quality=quality, **kwargs)
    return buf.getvalue()


def png(im: Image.Image) -> bytes:
    buf = io.BytesIO()
    im.save(buf, "PNG", compress_level=1)
    return buf.getvalue()


def sizes(n: int, seed: int = 0, lo: int = 96, hi: int = 1600) -> list[tuple[int, int]]:
    """Random sizes with aspect ratios between 1:2 and 2:1."""
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(n):
        long = int(rng.integers(lo, hi))
        short = int(long * rng.uniform(0.5, 1.0))
        out.append((long, short) if rng.random() < 0.5 else (short, long))
    return out
