"""The training dataloader: bucketed MDS stream -> StreamingDataLoader -> Composer DataSpec.

Every device batch comes from one bucket, so shapes vary *between* batches;
Composer's default sample counting assumes fixed shapes, hence the explicit
``get_num_samples_in_batch``. The loader is a ``StreamingDataLoader`` so that
its position (``state_dict``) goes into each Composer checkpoint and a resume
continues mid-epoch without reading the skipped data.
"""

from __future__ import annotations

import dataclasses
import importlib
from collections.abc import Callable, Sequence
from typing import Any

import torch
from composer.core import DataSpec
from streaming import StreamingDataLoader, StreamingDataset

from prx_data.core.errors import UsageError
from prx_data.stream.dataset import BucketedDataset
from prx_data.train.config import DataConfig, device_batch_size

#: Keys the collate function stacks into tensors; every other key becomes a list.
TENSOR_KEYS = ("image", "latent")
INT_KEYS = ("tier", "width", "height")


def collate(samples: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """Stack one bucket's samples: image -> uint8 [B, 3, H, W]; ints -> int64 [B]; rest -> lists.

    Raises ValueError when shapes differ (a batch must come from one bucket).
    """
    if not samples:
        raise ValueError("empty batch")
    out: dict[str, Any] = {}
    for key in samples[0]:
        values = [s[key] for s in samples]
        if key in TENSOR_KEYS and isinstance(values[0], (bytes, bytearray)):
            out[key] = values  # encoded images, decoded on the device (data.decode=device)
        elif key in TENSOR_KEYS:
            shapes = {tuple(v.shape) for v in values}
            if len(shapes) != 1:
                raise UsageError(
                    f"batch mixes image shapes {sorted(shapes)}; each device batch must come "
                    "from a single bucket (batching_method='device_per_stream' or 'per_stream')"
                )
            out[key] = torch.stack([torch.as_tensor(v) for v in values])
        elif key in INT_KEYS:
            out[key] = torch.tensor([int(v) for v in values], dtype=torch.int64)
        else:
            out[key] = values
    return out


def num_samples_in_batch(batch: dict[str, Any]) -> int:
    """Images in a batch (batches differ in shape, so count the leading dim of ``image``)."""
    return len(batch["image"])


def batch_shape(batch: dict[str, Any]) -> tuple[int, int]:
    """(width, height) of a batch's images: the tensor's, or its run-tier bucket's for bytes."""
    images = batch["image"]
    if isinstance(images, torch.Tensor):
        return int(images.shape[-1]), int(images.shape[-2])
    from prx_data.core.buckets import parse_bucket_name

    b = parse_bucket_name(batch["bucket"][0])
    return b.width, b.height


def num_tokens_in_batch(batch: dict[str, Any], patch_size: int) -> int:
    """Image tokens (patches) in a batch, for tokens/s throughput."""
    w, h = batch_shape(batch)
    return int(len(batch["image"]) * (h // patch_size) * (w // patch_size))


def split_batch(batch: dict[str, Any], microbatch_size: int | float) -> list[dict[str, Any]]:
    """Split tensors and lists along the batch dim into microbatches of ``microbatch_size``."""
    size = int(microbatch_size)
    n = num_samples_in_batch(batch)
    chunks = []
    for start in range(0, n, size):
        chunks.append({k: v[start : start + size] for k, v in batch.items()})
    return chunks


def _load_factory(path: str) -> Callable[[DataConfig, int], StreamingDataset]:
    module, _, name = path.partition(":")
    try:
        return getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError) as exc:
        raise UsageError(f"data.factory: cannot import {path!r}: {exc}") from None


def build_dataset(
    cfg: DataConfig,
    batch_size: int,
    holdout: Any = None,
    plan_label: str = "bucket",
    latents: bool = False,
) -> StreamingDataset:
    """The bucketed stream of ``cfg`` (``prx_data.stream.dataset.BucketedDataset``) for one rank.

    ``holdout`` (a ``prx_data.stream.holdout.Holdout``) leaves out one side of an
    id-hash hold-out split in every dataset's sample space. ``latents`` attaches each
    sample's precomputed VAE latent (``vae.source: precomputed``).
    """
    if cfg.factory and latents:
        raise UsageError(
            "data.factory with vae.source: precomputed: a factory's dataset carries no "
            "latents; set vae.source: encode"
        )
    if cfg.factory:
        if holdout is not None:
            raise UsageError(
                "data.factory cannot apply the eval hold-out slice; use eval.source=export"
            )
        return _load_factory(cfg.factory)(cfg, batch_size)
    cls = EncodedBucketedDataset if cfg.decode == "device" else BucketedDataset
    columns = tuple(dict.fromkeys(c.name for c in cfg.caption_columns))
    streaming = dict(cfg.streaming)
    streaming.pop("shuffle_block_size", None)  # in the spec
    return cls(
        dataset_specs(cfg, holdout),
        spec=cfg.plan_spec(batch_size),
        caption_columns=columns,
        extra_columns=tuple(dict.fromkeys(cfg.extra_columns)),
        on_change=cfg.on_change,
        plan_label=plan_label,
        latents=latents,
        **streaming,
    )


def dataset_specs(cfg: DataConfig, holdout: Any = None) -> list:
    """The ``DatasetSpec`` of each of ``cfg.datasets`` (what the loader and the planner read)."""
    if not cfg.datasets:
        raise UsageError("data.datasets: at least one dataset (export root) is required")
    return [
        dataclasses.replace(
            d,
            skip_lists=list(d.skip_lists) if d.skip_lists is not None else None,
            columns=dict(d.columns) if d.columns is not None else None,
            holdout=holdout if holdout is not None else d.holdout,
        )
        for d in cfg.datasets
    ]


class EncodedBucketedDataset(BucketedDataset):
    """``BucketedDataset`` whose ``image`` stays the encoded bytes (``data.decode=device``)."""

    decode_images = False


def build_dataloader(
    dataset: StreamingDataset, cfg: DataConfig, batch_size: int
) -> StreamingDataLoader:
    """StreamingDataLoader (resumable) over ``dataset`` with the bucket-aware collate."""
    workers = cfg.num_workers
    kwargs: dict[str, Any] = {}
    if workers > 0:
        kwargs["persistent_workers"] = cfg.persistent_workers
        if cfg.prefetch_factor is not None:
            kwargs["prefetch_factor"] = cfg.prefetch_factor
    return StreamingDataLoader(
        dataset,
        batch_size=batch_size,
        num_workers=workers,
        collate_fn=collate,
        pin_memory=cfg.pin_memory and torch.cuda.is_available(),
        drop_last=True,
        **kwargs,
    )


def build_dataspec(
    cfg: DataConfig,
    world_size: int,
    patch_size: int,
    dataset: StreamingDataset | None = None,
    holdout: Any = None,
    latents: bool = False,
) -> DataSpec:
    """Dataset + loader + sample/token counting for one rank of a ``world_size`` run."""
    batch = device_batch_size(cfg, world_size)
    ds = (
        dataset
        if dataset is not None
        else build_dataset(cfg, batch, holdout=holdout, latents=latents)
    )
    loader = build_dataloader(ds, cfg, batch)
    rep = cfg.plan.replication or 1
    return DataSpec(
        loader,
        get_num_samples_in_batch=lambda b: unique_share(num_samples_in_batch(b), rep),
        # Composer wants whole token counts; a device batch divisible by R keeps them exact.
        get_num_tokens_in_batch=lambda b: round(
            unique_share(num_tokens_in_batch(b, patch_size), rep)
        ),
        split_batch=split_batch,
    )


def unique_share(count: int, replication: int) -> int | float:
    """This rank's share of the *unique* samples (or tokens) in its batch.

    Composer sums every rank's count into the timestamp that it checkpoints
    and hands to ``dataset.state_dict(num_samples)``. With ``replication`` R,
    R ranks hold the same batch, so each counts 1/R of it: the sum is the
    unique count and the resume position is right. Composer accepts float
    counts whose sum over ranks is whole (world size is a multiple of R).
    """
    return count if replication == 1 else count / replication
