"""Streaming MDS trees another writer made: which columns the loader needs, and their items.

An export of ours has the columns of ``prx_data.core.schema.MDS_COLUMNS``; a
plain MDSWriter tree has whatever its writer chose (``image`` as ``jpeg``,
``prompt`` for the caption, ...). The training step needs an image and each
caption column; ``DatasetSpec(columns={"image": "jpg", "caption": "txt"})``
maps item keys to the tree's column names. ``id``, ``width`` and ``height``
are optional: without an id column an item's id is ``<bucket>/<shard>:<index>``,
the synthetic id ``python -m prx_data.adopt`` records, and without a size the
stored image's size is reported.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from prx_data.core import imaging
from prx_data.core.buckets import BucketSpec, parse_bucket_name, same_ratio_shape
from prx_data.export.layout import ForeignTreeError

#: Encodings the loader can turn into an image: encoded bytes, or what streaming decodes to PIL.
IMAGE_ENCODINGS = ("bytes", "jpeg", "png", "pil", "jpeg_array", "jpegarray")
_INT = ("int", "int8", "int16", "int32", "int64", "uint8", "uint16", "uint32", "uint64")


@dataclass(frozen=True)
class ForeignColumns:
    """Where a plain tree keeps what an item needs (MDS column names)."""

    image: str
    captions: tuple[tuple[str, str], ...]  # (item key, column)
    id: str | None  # None: synthetic ids <bucket>/<shard>:<index>
    width: str | None
    height: str | None
    #: ``bytes`` stays encoded (for decoding on the GPU); the others streaming decodes to PIL.
    image_encoding: str = "bytes"


def resolve_columns(
    index_path: str,
    entries: Sequence[Mapping],
    mapping: Mapping[str, str] | None,
    caption_columns: Sequence[str],
) -> ForeignColumns:
    """The columns of a plain bucket for each item key, or one line saying what is missing."""
    mapping = dict(mapping or {})
    have: dict[str, str] | None = None
    for e in entries:
        cols = dict(zip(e["column_names"], e["column_encodings"], strict=True))
        have = cols if have is None else {k: v for k, v in have.items() if cols.get(k) == v}
    have = have or {}
    listed = ", ".join(f"{k}:{v}" for k, v in sorted(have.items()))

    def need(key: str) -> str:
        col = mapping.get(key, key)
        if col not in have:
            raise ForeignTreeError(
                f"{index_path}: the loader needs an image and a caption per sample, and has no "
                f"column {col!r} for {key!r} (columns: {listed}); map yours with "
                f"DatasetSpec(columns={{'image': ..., {caption_columns[0]!r}: ...}}) "
                "(data.datasets[].columns in a training config)"
                if caption_columns
                else f"{index_path}: no column {col!r} for {key!r} (columns: {listed})"
            )
        return col

    image = need("image")
    if have[image] not in IMAGE_ENCODINGS:
        raise ForeignTreeError(
            f"{index_path}: image column {image!r} is encoded {have[image]!r}; the loader reads "
            f"{', '.join(IMAGE_ENCODINGS)}"
        )
    captions = tuple((c, need(c)) for c in caption_columns)

    def optional(key: str, kinds: tuple[str, ...]) -> str | None:
        col = mapping.get(key, key)
        return col if have.get(col) in kinds else None

    return ForeignColumns(
        image,
        captions,
        optional("id", ("str",)),
        optional("width", _INT),
        optional("height", _INT),
        have[image],
    )


def run_shape(bucket: str, run_tier: int, spec: BucketSpec) -> tuple[int, int] | None:
    """The shape a plain bucket streams at: our grid's rule, or (off-grid) as stored.

    A ratio on the grid of ``spec`` resizes exactly like an export's bucket;
    another ratio (e.g. PRX's 27-shape grid) keeps the stored size, which a
    bucket tree shares within a bucket, and streams only at its own tier.
    """
    try:
        return same_ratio_shape(parse_bucket_name(bucket, spec), run_tier, spec)
    except ValueError:
        tier = int(bucket.split("/")[0])
        if tier != run_tier:
            raise ForeignTreeError(
                f"bucket {bucket}: its ratio is not on the bucket grid, so it streams at its "
                f"stored size and only at tier {tier}, not {run_tier}; train at tier {tier} or "
                "leave include_higher_tiers off"
            ) from None
        return None


def to_chw(value: Any, shape: tuple[int, int] | None) -> torch.Tensor:
    """Encoded bytes or a PIL image -> uint8 [3, H, W]; cover-resized when ``shape`` differs."""
    from PIL import Image

    if isinstance(value, (bytes, bytearray, memoryview)):
        if shape is not None:
            from prx_data.stream.decode import decode_chw

            return decode_chw(bytes(value), shape)
        im = imaging.decode(bytes(value))
    elif isinstance(value, Image.Image):
        im = value.convert("RGB") if value.mode != "RGB" else value
    elif isinstance(value, np.ndarray) and value.ndim == 3:
        im = Image.fromarray(value[..., :3].astype(np.uint8))
    else:
        raise ForeignTreeError(f"cannot read an image from a {type(value).__name__}")
    if shape is not None and im.size != shape:
        im = imaging.cover_resize(im, *shape)[0]
    return torch.from_numpy(np.asarray(im).copy()).permute(2, 0, 1)


def item(
    raw: Mapping[str, Any],
    cols: ForeignColumns,
    *,
    shape: tuple[int, int] | None,
    run_tier: int,
    bucket: str,
    run_bucket: str,
    shard: str,
    index: int,
    decode: bool,
) -> dict[str, Any]:
    """One training item from a plain tree's sample (the keys an export's item has)."""
    image = raw[cols.image]
    out: dict[str, Any] = {
        "image": to_chw(image, shape) if decode else image,
        "id": raw[cols.id] if cols.id else f"{bucket}/{shard}:{index}",
        "tier": run_tier,
        "bucket": run_bucket,
        "source_bucket": bucket,
    }
    if cols.width and cols.height:
        out["width"], out["height"] = int(raw[cols.width]), int(raw[cols.height])
    elif decode:
        out["width"], out["height"] = int(out["image"].shape[2]), int(out["image"].shape[1])
    for key, col in cols.captions:
        out[key] = raw[col]
    return out
