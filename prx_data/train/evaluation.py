"""Held-out flow loss at fixed noise and timesteps, per timestep band, as Composer metrics.

Training loss is noisy (random t, random noise, random caption), so it cannot
show whether step 20k beats step 10k. The eval loss removes that noise: every
held-out sample gets noise and one timestep per band drawn from a generator
seeded by its *id* (not its position in the batch or rank), the first
non-empty caption column and no dropout. The same checkpoint therefore
scores the same on any world size, batch size or run, and the per-band
numbers show where on the noise path the model improves (low t: detail,
high t: composition).
"""

from __future__ import annotations

import dataclasses
import hashlib
import os
from collections.abc import Mapping, Sequence
from typing import Any

import torch
from composer.core import DataSpec, Evaluator
from torchmetrics import Metric

from prx_data.core.errors import UsageError
from prx_data.stream.planner import PlanError
from prx_data.stream.spec import DatasetSpec
from prx_data.train.captions import CaptionPolicy
from prx_data.train.config import DataConfig, TrainConfig

#: Metric name of the loss over all bands.
TOTAL = "FlowLoss"


def band_edges(num_bands: int) -> list[tuple[float, float]]:
    """[0, 1] split into ``num_bands`` equal timestep bands."""
    return [(k / num_bands, (k + 1) / num_bands) for k in range(num_bands)]


def band_name(lo: float, hi: float) -> str:
    """Metric name of one band, e.g. ``FlowLoss_t0.25-0.50``."""
    return f"{TOTAL}_t{lo:.2f}-{hi:.2f}"


def sample_seed(sample_id: str, seed: int) -> int:
    """A 63-bit generator seed from a sample id and the eval seed."""
    digest = hashlib.blake2b(f"{seed}:{sample_id}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 1


def fixed_noise_and_timesteps(
    ids: Sequence[str], shape: Sequence[int], num_bands: int, seed: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-sample noise [B, *shape] and timesteps [B, num_bands] (one inside each band), on CPU."""
    noises, ts = [], []
    for sid in ids:
        g = torch.Generator().manual_seed(sample_seed(str(sid), seed))
        noises.append(torch.randn(tuple(shape), generator=g))
        u = torch.rand(num_bands, generator=g, dtype=torch.float64)
        ts.append(((torch.arange(num_bands, dtype=torch.float64) + u) / num_bands).float())
    return torch.stack(noises), torch.stack(ts)


class BandFlowLoss(Metric):
    """Mean per-sample flow loss in one timestep band (``band=None``: over all bands).

    Updated with the ``[B, num_bands]`` per-sample losses of ``eval_forward``;
    sums are float64 and summed over ranks.
    """

    full_state_update = False

    def __init__(self, band: int | None = None) -> None:
        super().__init__()
        self.band = band
        self.add_state(
            "total", default=torch.tensor(0.0, dtype=torch.float64), dist_reduce_fx="sum"
        )
        self.add_state("count", default=torch.tensor(0, dtype=torch.int64), dist_reduce_fx="sum")

    def update(self, losses: torch.Tensor) -> None:
        vals = losses if self.band is None else losses[:, self.band]
        self.total += vals.detach().double().sum().to(self.total.device)
        self.count += int(vals.numel())

    def compute(self) -> torch.Tensor:
        if int(self.count) == 0:
            return torch.tensor(float("nan"), dtype=torch.float64)
        return self.total / self.count


def eval_metrics(num_bands: int) -> dict[str, Metric]:
    """The total metric plus one per band."""
    out: dict[str, Metric] = {TOTAL: BandFlowLoss(None)}
    for k, (lo, hi) in enumerate(band_edges(num_bands)):
        out[band_name(lo, hi)] = BandFlowLoss(k)
    return out


def eval_caption_policy(columns: Sequence[str]) -> CaptionPolicy:
    """The first non-empty configured caption column, never dropped."""
    cols = tuple(dict.fromkeys(columns))
    return CaptionPolicy(cols, (1.0,) + (0.0,) * (len(cols) - 1), 0.0)


def per_sample_band_losses(model: Any, batch: Mapping[str, Any]) -> torch.Tensor:
    """``[B, num_bands]`` flow losses of ``model`` (a PRXFlowModel) at the fixed noise/timesteps."""
    from prx_data.train.flow import interpolate, velocity_target

    images = model.batch_images(batch)
    device = images.device
    x0 = model.clean_inputs(images, latent=batch.get("latent"))
    captions = model.eval_captions.choose(batch, torch.Generator().manual_seed(0))
    feats, mask = model.encode_text(captions, device)
    feats = feats.to(next(model.transformer.parameters()).dtype)
    noise, ts = fixed_noise_and_timesteps(
        [str(i) for i in batch["id"]], x0.shape[1:], model.eval_bands, model.eval_seed
    )
    noise = noise.to(device=device, dtype=x0.dtype)
    ts = ts.to(device)
    target = velocity_target(x0, noise)
    cols = []
    for k in range(ts.shape[1]):
        t = ts[:, k]
        pred = model.transformer(
            hidden_states=interpolate(x0, noise, t),
            timestep=t,
            encoder_hidden_states=feats,
            attention_mask=mask,
        ).sample
        cols.append((pred.float() - target.float()).pow(2).flatten(1).mean(1))
    return torch.stack(cols, dim=1)


#: How to make an eval plan that cannot run work (the end of its one-line error).
EVAL_FIX = (
    "raise eval.holdout_fraction, lower eval.device_batch_size / eval.global_batch_size, "
    "or turn eval off (eval.enabled=false)"
)


def _one_line(exc: Exception) -> str:
    """A plan refusal's problems on one line (its text lists them one per line)."""
    lines = [ln.strip(" -") for ln in str(exc).splitlines()]
    lines = [ln for ln in lines if ln and ln != "bucket plan refused:"]
    return "; ".join(lines) or type(exc).__name__


#: The eval stream's cache of a remote root: a subdirectory of the dataset's ``local``.
EVAL_CACHE = "eval"


def eval_datasets(cfg: TrainConfig) -> list[DatasetSpec]:
    """Export trees the eval stream reads: the training ones (slice) or ``eval.datasets``.

    Each cache moves to ``<local>/eval``: streaming refuses a second dataset on
    a local directory that a live one caches a remote into ("Reused local
    directory"), and the training stream lives as long as the eval one.
    """
    chosen = cfg.eval.datasets if cfg.eval.source == "export" else cfg.data.datasets
    return [
        d if d.local is None else dataclasses.replace(d, local=os.path.join(d.local, EVAL_CACHE))
        for d in chosen
    ]


def holdout_for(cfg: TrainConfig, keep: str):
    """The hold-out of ``cfg`` for one side, or None when eval is off or reads separate exports."""
    if not cfg.eval.enabled or cfg.eval.source != "slice":
        return None
    from prx_data.stream.holdout import Holdout

    return Holdout(cfg.eval.holdout_fraction, cfg.eval.holdout_salt, keep)


def eval_data_config(cfg: TrainConfig, world_size: int) -> DataConfig:
    """The training data config turned into a fixed, unshuffled, single-pass eval stream."""
    d = cfg.data
    e = cfg.eval
    if e.device_batch_size is not None:
        gbs = e.device_batch_size * world_size
    else:
        gbs = e.global_batch_size or d.global_batch_size
    streaming = dict(d.streaming)
    # Every epoch must pick the same samples when a bucket is trimmed to whole batches.
    streaming["sampling_method"] = "fixed"
    return DataConfig(
        datasets=eval_datasets(cfg),
        plan=dataclasses.replace(
            d.plan,
            shuffle=False,
            batching_method="per_stream",
            # A hold-out too small for one whole eval batch per bucket (a small export, many
            # ranks) is evaluated with a few samples repeated rather than not at all.
            small_buckets="fill",
            epoch_size=None,
        ),
        caption_columns=list(d.caption_columns),
        extra_columns=list(d.extra_columns),
        caption_dropout=0.0,
        global_batch_size=gbs,
        device_batch_size=None,
        num_workers=e.num_workers,
        persistent_workers=False,
        pin_memory=d.pin_memory,
        decode=d.decode,
        streaming=streaming,
        factory=None,
    )


#: Fewest distinct held-out images the generation metrics are computed on: FID's covariance
#: needs two per side (torchmetrics raises on one, at the end of a run), and an MMD of one
#: image against one is no distance between distributions.
METRIC_MIN_SAMPLES = 2


def check_metrics_holdout(cfg: TrainConfig, plan: Any) -> None:
    """Refuse, at plan time, a hold-out with too few distinct images for FID/CMMD/DINO-MMD.

    Counts each bucket's distinct held-out samples the eval pass reaches (``min(kept,
    choose)``): the copies ``small_buckets: fill`` and the ranks' padding repeat are not
    samples (:class:`~prx_data.train.metrics.GenerationMetrics` skips them too).
    """
    if not cfg.metrics.enabled:
        return
    from prx_data.train.config import METRIC_MODELS

    names = [name for name, key in METRIC_MODELS if getattr(cfg.metrics, key)]
    distinct = sum(min(b.kept, b.choose) for b in plan.buckets if not b.excluded)
    if names and distinct < METRIC_MIN_SAMPLES:
        raise PlanError(
            f"metrics: {', '.join(names)} need at least {METRIC_MIN_SAMPLES} distinct held-out "
            f"images and the hold-out holds {distinct} (repeated copies do not count); raise "
            "eval.holdout_fraction, or turn them off (metrics.enabled=false)"
        )


def build_evaluator(cfg: TrainConfig, world_size: int, patch_size: int) -> Evaluator:
    """The Composer Evaluator for ``cfg.eval`` (label ``eval``)."""
    from prx_data.train.config import device_batch_size as _dbs
    from prx_data.train.data import (
        build_dataloader,
        build_dataset,
        num_samples_in_batch,
        num_tokens_in_batch,
        split_batch,
    )

    if cfg.data.factory:
        raise UsageError(
            "eval.enabled with data.factory: the eval stream is built from data.datasets or "
            "eval.datasets; drop data.factory or turn eval off"
        )
    dcfg = eval_data_config(cfg, world_size)
    try:
        batch = _dbs(dcfg, world_size)
    except ValueError as exc:
        raise UsageError(str(exc).replace("data.", "eval.", 1)) from None
    try:
        ds = build_dataset(
            dcfg,
            batch,
            holdout=holdout_for(cfg, "eval"),
            plan_label="eval",
            latents=cfg.vae.source == "precomputed",
        )
    except PlanError as exc:
        raise PlanError(f"eval: {_one_line(exc)}; {EVAL_FIX}") from None
    kept = sum(b.choose for b in ds.plan.buckets if not b.excluded)
    if kept == 0:
        raise PlanError(f"eval: no held-out sample to evaluate; {EVAL_FIX}")
    check_metrics_holdout(cfg, ds.plan)
    loader = build_dataloader(ds, dcfg, batch)
    spec = DataSpec(
        loader,
        get_num_samples_in_batch=num_samples_in_batch,
        get_num_tokens_in_batch=lambda b: num_tokens_in_batch(b, patch_size),
        split_batch=split_batch,
    )
    return Evaluator(
        label="eval",
        dataloader=spec,
        metric_names=list(eval_metrics(cfg.eval.num_bands)),
        subset_num_batches=cfg.eval.subset_num_batches,
        eval_interval=cfg.eval.interval,
        device_eval_microbatch_size=batch,
    )
