"""Resolution tiers and aspect-ratio buckets: pure functions, no I/O.

Every image is assigned a *tier* (the training resolution it can serve
without being upscaled more than 4/3) and, within that tier, the
patch-aligned shape whose aspect ratio is nearest in log space. All tiers
share one grid of 13 shapes expressed in patch units, so a sample from a
higher tier can be downsized to the same-ratio shape of a lower tier.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field

from prx_data.core.errors import UsageError

__all__ = [
    "BucketSpec",
    "DEFAULT_SPEC",
    "DEFAULT_TIERS",
    "DROP_ASPECT_RATIO",
    "DROP_TOO_SMALL",
    "aspect_label",
    "assign_bucket",
    "bucket_name",
    "parse_bucket_name",
    "same_ratio_shape",
]

DEFAULT_TIERS: tuple[int, ...] = (512, 1024, 2048, 4096)
#: Patches per side at tier T is T / PATCH_DIVISOR, i.e. a 16x16 grid for a square image.
PATCH_DIVISOR = 16
#: The shared shape grid in patch units, (width, height), portrait to landscape.
#: Roughly constant token count (240-256 patches), aspect ratio 0.5 to 2.0.
BASE_GRID: tuple[tuple[int, int], ...] = (
    (11, 22),
    (12, 21),
    (12, 20),
    (13, 19),
    (14, 18),
    (15, 17),
    (16, 16),
    (17, 15),
    (18, 14),
    (19, 13),
    (20, 12),
    (21, 12),
    (22, 11),
)
MIN_ASPECT = 0.5
MAX_ASPECT = 2.0
#: An image may be upscaled by at most this factor (per side) to reach its tier.
MAX_UPSCALE = 4 / 3

DROP_TOO_SMALL = "too_small"
DROP_ASPECT_RATIO = "aspect_ratio"


def check_tiers(tiers, valid: Sequence[int] = DEFAULT_TIERS, flag: str = "--tiers") -> None:
    """Refuse tiers the trainer and planner would refuse later (their bucket spec's), naming
    the valid ones: an export or latents at 768 would be written and then never trained on."""
    bad = [t for t in tiers if t not in valid]
    if bad:
        raise UsageError(
            f"{flag} {','.join(map(str, bad))}: not a tier of the bucket spec the trainer and "
            f"planner use; valid tiers: {','.join(map(str, valid))}"
        )


@dataclass(frozen=True)
class BucketSpec:
    """Configuration of the tier/shape table. The defaults are the PRX recipe."""

    tiers: tuple[int, ...] = DEFAULT_TIERS
    grid: tuple[tuple[int, int], ...] = BASE_GRID
    patch_divisor: int = PATCH_DIVISOR
    min_aspect: float = MIN_ASPECT
    max_aspect: float = MAX_ASPECT
    max_upscale: float = MAX_UPSCALE
    _shapes: dict[int, tuple[tuple[int, int], ...]] = field(
        default_factory=dict, compare=False, repr=False
    )

    def __post_init__(self) -> None:
        if not self.tiers or sorted(set(self.tiers)) != list(self.tiers):
            raise UsageError(f"tiers must be strictly increasing, got {self.tiers}")
        for t in self.tiers:
            if t % self.patch_divisor:
                raise UsageError(f"tier {t} is not divisible by patch_divisor={self.patch_divisor}")
        for t in self.tiers:
            self._shapes[t] = tier_shapes(t, self.grid, self.patch_divisor)

    def shapes(self, tier: int) -> tuple[tuple[int, int], ...]:
        """The (width, height) shapes of one tier, portrait to landscape."""
        try:
            return self._shapes[tier]
        except KeyError:
            raise UsageError(f"unknown tier {tier}; configured tiers are {self.tiers}") from None

    def floor_pixels(self, tier: int) -> float:
        """Smallest pixel count that may serve `tier` (upscale at most `max_upscale`)."""
        side = tier / self.max_upscale
        return side * side


@dataclass(frozen=True)
class Bucket:
    tier: int
    width: int
    height: int

    @property
    def aspect(self) -> float:
        return self.width / self.height

    @property
    def name(self) -> str:
        """Directory name relative to the export root, e.g. ``1024/1.000``."""
        return bucket_name(self.tier, self.width, self.height)


@dataclass(frozen=True)
class Assignment:
    """Result of bucketing one image: a bucket, or a drop reason."""

    bucket: Bucket | None
    reason: str | None = None


def tier_shapes(
    tier: int, grid: Sequence[tuple[int, int]] = BASE_GRID, patch_divisor: int = PATCH_DIVISOR
) -> tuple[tuple[int, int], ...]:
    """Scale the patch grid to pixels for one tier (patch size = tier / patch_divisor)."""
    patch = tier // patch_divisor
    return tuple((w * patch, h * patch) for w, h in grid)


DEFAULT_SPEC = BucketSpec()


def aspect_label(width: int, height: int) -> str:
    return f"{width / height:.3f}"


def bucket_name(tier: int, width: int, height: int) -> str:
    return f"{tier}/{aspect_label(width, height)}"


def assign_tier(width: int, height: int, spec: BucketSpec = DEFAULT_SPEC) -> int | None:
    """Largest tier whose floor (tier / max_upscale)^2 is at most the pixel count."""
    pixels = width * height
    best = None
    for tier in spec.tiers:
        if pixels >= spec.floor_pixels(tier) - 1e-6:
            best = tier
    return best


def nearest_shape(width: int, height: int, shapes: Sequence[tuple[int, int]]) -> tuple[int, int]:
    """The shape whose aspect ratio is nearest in log space (ties go to the first)."""
    target = math.log(width / height)
    return min(shapes, key=lambda s: abs(math.log(s[0] / s[1]) - target))


def assign_bucket(width: int, height: int, spec: BucketSpec = DEFAULT_SPEC) -> Assignment:
    """Bucket an image of the given (EXIF-oriented) size, or say why it is dropped.

    Size is checked before aspect ratio, so a 1x1 image is ``too_small``.
    """
    if width <= 0 or height <= 0:
        return Assignment(None, DROP_TOO_SMALL)
    tier = assign_tier(width, height, spec)
    if tier is None:
        return Assignment(None, DROP_TOO_SMALL)
    aspect = width / height
    # A tiny tolerance keeps exact 1:2 and 2:1 images (e.g. 1000x2000) in.
    if aspect < spec.min_aspect * (1 - 1e-9) or aspect > spec.max_aspect * (1 + 1e-9):
        return Assignment(None, DROP_ASPECT_RATIO)
    w, h = nearest_shape(width, height, spec.shapes(tier))
    return Assignment(Bucket(tier, w, h))


def same_ratio_shape(bucket: Bucket, tier: int, spec: BucketSpec = DEFAULT_SPEC) -> tuple[int, int]:
    """Shape at `tier` with the same grid position as `bucket` (for lower-tier training)."""
    shapes = spec.shapes(bucket.tier)
    idx = shapes.index((bucket.width, bucket.height))
    return spec.shapes(tier)[idx]


def parse_bucket_name(name: str, spec: BucketSpec = DEFAULT_SPEC) -> Bucket:
    """Inverse of :func:`bucket_name` against the configured shape table."""
    tier_s, _, ar = name.strip("/").partition("/")
    tier = int(tier_s)
    for w, h in spec.shapes(tier):
        if aspect_label(w, h) == ar:
            return Bucket(tier, w, h)
    raise UsageError(f"{name!r} is not a bucket of tier {tier}")
