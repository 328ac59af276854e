import math

import pytest

from prx_data.core.buckets import (
    DEFAULT_SPEC,
    Bucket,
    BucketSpec,
    assign_bucket,
    assign_tier,
    bucket_name,
    nearest_shape,
    parse_bucket_name,
    same_ratio_shape,
)

SHAPES_512 = [
    (352, 704),
    (384, 672),
    (384, 640),
    (416, 608),
    (448, 576),
    (480, 544),
    (512, 512),
    (544, 480),
    (576, 448),
    (608, 416),
    (640, 384),
    (672, 384),
    (704, 352),
]


def test_512_shapes_exact():
    assert list(DEFAULT_SPEC.shapes(512)) == SHAPES_512


@pytest.mark.parametrize("tier", [1024, 2048, 4096])
def test_higher_tiers_scale_the_same_grid(tier):
    k = tier // 512
    assert list(DEFAULT_SPEC.shapes(tier)) == [(w * k, h * k) for w, h in SHAPES_512]
    assert DEFAULT_SPEC.shapes(1024)[0] == (704, 1408) and DEFAULT_SPEC.shapes(1024)[-1] == (
        1408,
        704,
    )


@pytest.mark.parametrize("tier", [512, 1024, 2048, 4096])
def test_shapes_patch_aligned_constant_tokens_ratio_range(tier):
    patch = tier // 16
    shapes = DEFAULT_SPEC.shapes(tier)
    assert len(shapes) == 13
    for w, h in shapes:
        assert w % patch == 0 and h % patch == 0
        assert 240 <= (w // patch) * (h // patch) <= 256
        assert 0.5 <= w / h <= 2.0
    ratios = [w / h for w, h in shapes]
    assert ratios == sorted(ratios)


def test_tier_floor_rule():
    # floor of tier T is (3T/4)^2 pixels; the largest satisfied tier wins
    assert assign_tier(384, 384) == 512
    assert assign_tier(384, 383) is None
    assert assign_tier(767, 768) == 512
    assert assign_tier(768, 768) == 1024
    assert assign_tier(1536, 1536) == 2048
    assert assign_tier(3072, 3072) == 4096
    assert assign_tier(10000, 10000) == 4096
    # never upscaled more than 4/3 per side
    for w, h in [(384, 384), (700, 900), (2000, 1300), (3100, 3100)]:
        b = assign_bucket(w, h).bucket
        assert math.sqrt(b.width * b.height / (w * h)) <= 4 / 3 + 1e-9


def test_drop_reasons():
    assert assign_bucket(1, 1).reason == "too_small"
    assert assign_bucket(300, 300).reason == "too_small"
    assert assign_bucket(5000, 500).reason == "aspect_ratio"
    assert assign_bucket(500, 5000).reason == "aspect_ratio"
    assert assign_bucket(2001, 1000).reason == "aspect_ratio"
    assert assign_bucket(2000, 1000).bucket is not None  # exactly 2:1 is kept
    assert assign_bucket(1000, 2000).bucket is not None
    assert assign_bucket(0, 100).reason == "too_small"


def test_nearest_is_log_space():
    # 0.75 lies between 448x576 (0.778) and 416x608 (0.684). Linear distance picks 0.778
    # (|0.028| vs |0.066|); log distance agrees here, so build a case where they differ:
    shapes = [(1, 2), (1, 1)]
    # midpoint in log space between 0.5 and 1 is 1/sqrt(2) = 0.7071; linear midpoint is 0.75
    assert nearest_shape(72, 100, shapes) == (1, 1)  # 0.72 > 0.7071 -> nearer 1 in log space
    assert nearest_shape(70, 100, shapes) == (1, 2)
    # 0.72 is nearer 0.5 linearly? |0.72-0.5|=0.22 > |1-0.72|=0.28 is False -> linear says 0.5
    assert abs(0.72 - 0.5) < abs(1 - 0.72)


def test_bucket_names_roundtrip():
    assert bucket_name(512, 352, 704) == "512/0.500"
    assert bucket_name(1024, 1024, 1024) == "1024/1.000"
    assert bucket_name(2048, 2688, 1536) == "2048/1.750"
    for tier in DEFAULT_SPEC.tiers:
        for w, h in DEFAULT_SPEC.shapes(tier):
            b = Bucket(tier, w, h)
            assert parse_bucket_name(b.name) == b
    with pytest.raises(ValueError):
        parse_bucket_name("512/0.901")


def test_same_ratio_shape_across_tiers():
    b = assign_bucket(3000, 1700).bucket
    assert b.tier == 2048
    w, h = same_ratio_shape(b, 512)
    assert (w, h) in DEFAULT_SPEC.shapes(512)
    assert math.isclose(w / h, b.width / b.height)


def test_custom_spec():
    spec = BucketSpec(tiers=(256, 512))
    assert spec.shapes(256)[6] == (256, 256)
    assert assign_bucket(600, 600, spec).bucket.tier == 512
    assert assign_bucket(200, 200, spec).bucket.tier == 256
    with pytest.raises(ValueError):
        BucketSpec(tiers=(512, 256))
    with pytest.raises(ValueError):
        BucketSpec(tiers=(500,))
