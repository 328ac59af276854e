"""A small, deterministic, photo-like sample collection for the demo and tests.

Images are procedural (smooth gradients, soft shapes, texture and sensor-like
noise) so that JPEG behaves as it does on photographs rather than on flat
synthetic colour. Each image has a caption sidecar that describes what was
drawn, so caption search has something true to find.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass

import numpy as np
from PIL import Image, ImageDraw, ImageFilter

COLOURS = {
    "red": (200, 40, 40),
    "green": (40, 160, 60),
    "blue": (40, 70, 200),
    "yellow": (230, 200, 40),
    "purple": (130, 50, 160),
    "orange": (240, 130, 30),
    "teal": (30, 150, 150),
    "white": (235, 235, 235),
}
SHAPES = ("circle", "square", "triangle", "stripe")
#: (width, height) pairs spanning tiers 512..2048 and aspect ratios 0.5..2.0.
DEFAULT_SIZES: tuple[tuple[int, int], ...] = (
    (512, 512),
    (640, 480),
    (480, 640),
    (800, 400),
    (400, 800),
    (1024, 768),
    (768, 1024),
    (1280, 720),
    (720, 1280),
    (1600, 1200),
    (1920, 1080),
    (1200, 1800),
    (2400, 1600),
    (3000, 2000),
    (900, 900),
    (1100, 600),
)


@dataclass(frozen=True)
class SampleItem:
    path: str
    width: int
    height: int
    caption: str


def photo_like(width: int, height: int, seed: int) -> tuple[Image.Image, str]:
    """A textured, noisy image with one or two described shapes."""
    rng = np.random.default_rng(seed)
    names = list(COLOURS)
    bg1, bg2 = rng.choice(len(names), 2, replace=False)
    c1, c2 = np.array(COLOURS[names[bg1]], float), np.array(COLOURS[names[bg2]], float)
    # A low-resolution random field upsampled gives smooth, photo-like structure.
    small = rng.random((8, 8, 3))
    field = (
        np.asarray(
            Image.fromarray((small * 255).astype(np.uint8)).resize(
                (width, height), Image.Resampling.BICUBIC
            ),
            dtype=np.float32,
        )
        / 255.0
    )
    t = np.linspace(0, 1, height, dtype=np.float32)[:, None, None]
    base = c1 * (1 - t) + c2 * t
    arr = base * (0.7 + 0.3 * field)
    im = Image.fromarray(arr.clip(0, 255).astype(np.uint8))
    draw = ImageDraw.Draw(im)
    shape = SHAPES[int(rng.integers(len(SHAPES)))]
    colour = names[int(rng.integers(len(names)))]
    s = min(width, height)
    cx, cy = int(rng.integers(s // 4, width - s // 4)), int(rng.integers(s // 4, height - s // 4))
    r = int(s * rng.uniform(0.12, 0.3))
    fill = COLOURS[colour]
    if shape == "circle":
        draw.ellipse((cx - r, cy - r, cx + r, cy + r), fill=fill)
    elif shape == "square":
        draw.rectangle((cx - r, cy - r, cx + r, cy + r), fill=fill)
    elif shape == "triangle":
        draw.polygon([(cx, cy - r), (cx - r, cy + r), (cx + r, cy + r)], fill=fill)
    else:
        for k in range(-3, 4):
            draw.line(
                (cx + k * r // 2 - r, 0, cx + k * r // 2 + r, height),
                fill=fill,
                width=max(2, r // 6),
            )
    im = im.filter(ImageFilter.GaussianBlur(radius=max(0.6, s / 900)))
    noise = rng.normal(0, 4.0, (height, width, 3))
    out = (np.asarray(im, np.float32) + noise).clip(0, 255).astype(np.uint8)
    caption = (
        f"a {colour} {shape} on a {names[bg1]} to {names[bg2]} gradient background, "
        f"{width}x{height} photo"
    )
    return Image.fromarray(out), caption


def make_sample_collection(
    folder: str,
    sizes: tuple[tuple[int, int], ...] = DEFAULT_SIZES,
    repeats: int = 2,
    seed: int = 0,
) -> list[SampleItem]:
    """Write ``len(sizes) * repeats`` images with .txt / .json caption sidecars."""
    os.makedirs(folder, exist_ok=True)
    items = []
    k = 0
    for rep in range(repeats):
        for w, h in sizes:
            im, caption = photo_like(w, h, seed * 100_003 + k)
            stem = f"img_{k:04d}"
            fmt = ("jpg", "png", "webp")[k % 7 % 3] if rep else "jpg"
            path = os.path.join(folder, f"{stem}.{fmt}")
            if fmt == "jpg":
                im.save(path, "JPEG", quality=95)
            elif fmt == "png":
                im.save(path, "PNG", compress_level=1)
            else:
                im.save(path, "WEBP", quality=90)
            if k % 2:
                with open(os.path.join(folder, f"{stem}.json"), "w") as f:
                    json.dump({"caption": caption, "license": "CC0"}, f)
            else:
                with open(os.path.join(folder, f"{stem}.txt"), "w") as f:
                    f.write(caption)
            items.append(SampleItem(path, w, h, caption))
            k += 1
    return items
