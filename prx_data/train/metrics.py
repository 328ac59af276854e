"""The recipe's yardsticks: FID, CMMD and DINO-MMD of generated against held-out real images.

The data ablations of the recipe (which captioner, which filter) were decided
by training small models on each variant and scoring them with these three.
:class:`GenerationMetrics` does the same during training: at an interval it
generates one image per held-out sample, from that sample's caption, at its
shape, from noise seeded by its id (fixed prompts and seeds: two evaluations
of the same checkpoint agree on any world size), and compares the generated
and the real images.

* **FID**: torchmetrics' ``FrechetInceptionDistance`` (sums and covariances
  reduced over ranks) with a feature module: ``inception`` is the standard FID
  Inception v3 of torch-fidelity (weights from torch-fidelity's release or a
  local file), or any transformers vision model by name or path (pooled features).
* **CMMD** (Jayasumana et al. 2024): squared MMD with a Gaussian RBF kernel,
  sigma 10, times 1000, between L2-normalised CLIP image embeddings
  (``CLIPVisionModelWithProjection``), as google-research/cmmd computes it.
* **DINO-MMD**: the same MMD on L2-normalised DINOv2 CLS features (``Dinov2Model``).

No maintained library computes the RBF MMD (torchmetrics' KID is a polynomial
kernel), so :func:`mmd` is written here and tested against a numpy reference.
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Sequence
from typing import Any

import torch
import torch.nn.functional as F
from composer.core import Callback, Event
from torch import nn
from torchmetrics import Metric

from prx_data.core.errors import UsageError
from prx_data.core.tinymodels import TINY_TRANSFORMER, build_tiny_clip, save_square_processor
from prx_data.train.sampling import IntervalGate

log = logging.getLogger(__name__)

#: CMMD's kernel bandwidth and scale (google-research/cmmd distance.py).
SIGMA = 10.0
SCALE = 1000.0


def mmd(x: torch.Tensor, y: torch.Tensor, sigma: float = SIGMA, scale: float = SCALE):
    """Squared MMD with a Gaussian RBF kernel (biased estimator, diagonals included) x scale."""
    x = x.double()
    y = y.double()
    gamma = 1.0 / (2.0 * sigma**2)
    xx, yy, xy = x @ x.T, y @ y.T, x @ y.T
    xn, yn = xx.diagonal(), yy.diagonal()
    k_xx = torch.exp(-gamma * (-2 * xx + xn[:, None] + xn[None, :])).mean()
    k_yy = torch.exp(-gamma * (-2 * yy + yn[:, None] + yn[None, :])).mean()
    k_xy = torch.exp(-gamma * (-2 * xy + xn[:, None] + yn[None, :])).mean()
    return scale * (k_xx + k_yy - 2 * k_xy)


class MMD(Metric):
    """RBF MMD between real and generated feature sets; features gathered over ranks."""

    full_state_update = False

    def __init__(self, feature: nn.Module) -> None:
        super().__init__()
        self.feature = feature
        self.add_state("real", default=[], dist_reduce_fx="cat")
        self.add_state("fake", default=[], dist_reduce_fx="cat")

    def update(self, images: torch.Tensor, real: bool) -> None:
        feats = self.feature(images).double()
        (self.real if real else self.fake).append(feats)

    def agree_on_shape(self, gather) -> None:
        """Give a rank that drew no sample ``(0, d)`` features, so the ranks' states gather:
        torchmetrics fills an empty list with a 1-d empty tensor, which neither pads against
        nor concatenates with ``(n, d)``. ``gather``: all_gather_object (every rank calls)."""
        dims = [v.shape[1] for v in (*self.real, *self.fake)]
        d = max(gather(dims[0] if dims else 0))
        for state in (self.real, self.fake):
            if not state and d:
                state.append(torch.empty(0, d, dtype=torch.float64, device=self.device))

    def compute(self) -> torch.Tensor:
        def cat(v):
            return torch.cat(v) if isinstance(v, list) else v

        return mmd(cat(self.real), cat(self.fake))


class HFImageFeatures(nn.Module):
    """uint8 images [B, 3, H, W] -> features [B, D] of a transformers vision model (float64).

    Resizes (bicubic, antialiased) to the model's input size and normalises with
    its image processor's mean and std, on the images' device. ``pool``:
    ``image_embeds`` (CLIP projection), ``cls`` (DINOv2 CLS after the final
    norm) or ``pooled`` (the model's pooler output, e.g. a CNN's global pool).
    """

    def __init__(self, model: nn.Module, size: int, mean, std, pool: str, normalize: bool):
        super().__init__()
        self.model = model.eval().requires_grad_(False)
        self.size = int(size)
        self.register_buffer("mean", torch.tensor(mean, dtype=torch.float32).view(1, 3, 1, 1))
        self.register_buffer("std", torch.tensor(std, dtype=torch.float32).view(1, 3, 1, 1))
        self.pool = pool
        self.normalize = normalize

    @torch.no_grad()
    def forward(self, images: torch.Tensor) -> torch.Tensor:
        x = images.float().div(255.0)
        x = F.interpolate(x, size=(self.size, self.size), mode="bicubic", antialias=True)
        x = ((x.clamp(0, 1) - self.mean) / self.std).to(next(self.model.parameters()).dtype)
        out = self.model(pixel_values=x)
        # CLIP: the projected image embedding; DINOv2: the CLS token after the final norm;
        # a CNN: its global pool (what FID's Inception pool3 is).
        feats = out.image_embeds if self.pool == "image_embeds" else out.pooler_output
        feats = feats.flatten(1).double()
        return F.normalize(feats, dim=-1) if self.normalize else feats


def _processor_stats(name_or_path: str) -> tuple[int | None, list[float], list[float]]:
    from transformers import AutoImageProcessor

    try:
        proc = AutoImageProcessor.from_pretrained(name_or_path)
    except (OSError, ValueError):
        return None, [0.5, 0.5, 0.5], [0.5, 0.5, 0.5]
    size = getattr(proc, "crop_size", None) or getattr(proc, "size", None) or {}
    side = size.get("height") or size.get("shortest_edge") if isinstance(size, dict) else size
    return side, list(proc.image_mean), list(proc.image_std)


_KEYS = {"fid": "metrics.fid_model", "clip": "metrics.clip_model", "dino": "metrics.dino_model"}


def load_features(kind: str, name_or_path: str, weights: str | None = None) -> nn.Module:
    """The feature module of one metric: ``fid``, ``clip`` or ``dino``, by name or path.

    A model that cannot be loaded is a one-line ValueError naming the config key.
    """
    try:
        return _load_features(kind, name_or_path, weights)
    except (OSError, ValueError) as exc:  # not found, offline, not a repo id
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise UsageError(
            f"{_KEYS[kind]}: cannot load {name_or_path!r} ({first}); give a local folder or a "
            "hub id (the demo writes tiny ones: python -m prx_data.demo), or null to turn "
            "the metric off"
        ) from None


def _load_features(kind: str, name_or_path: str, weights: str | None) -> nn.Module:
    if kind == "fid" and name_or_path == "inception":
        from torchmetrics.image.fid import NoTrainInceptionV3

        return NoTrainInceptionV3(
            name="inception-v3-compat",
            features_list=["2048"],
            feature_extractor_weights_path=weights,
        )
    side, mean, std = _processor_stats(name_or_path)
    if kind == "clip":
        from transformers import CLIPVisionModelWithProjection

        model = CLIPVisionModelWithProjection.from_pretrained(name_or_path)
        side = side or model.config.image_size
        return HFImageFeatures(model, side, mean, std, "image_embeds", normalize=True)
    from transformers import AutoModel

    model = AutoModel.from_pretrained(name_or_path)
    side = side or getattr(model.config, "image_size", 224)
    if kind == "dino":
        return HFImageFeatures(model, side, mean, std, "cls", normalize=True)
    return HFImageFeatures(model, side, mean, std, "pooled", normalize=False)


def build_metrics(fid: str | None, clip: str | None, dino: str | None, fid_weights=None):
    """name -> torchmetrics Metric with ``update(uint8 images, real: bool)`` and ``compute()``."""
    out: dict[str, Metric] = {}
    if fid:
        from torchmetrics.image.fid import FrechetInceptionDistance

        feature = load_features("fid", fid, fid_weights)
        fid_metric = FrechetInceptionDistance(feature=feature, reset_real_features=True)
        out["FID"] = fid_metric
    if clip:
        out["CMMD"] = MMD(load_features("clip", clip))
    if dino:
        out["DINO-MMD"] = MMD(load_features("dino", dino))
    return out


# --- the callback ------------------------------------------------------------------------------


def _unwrap(model):
    from torch.nn.parallel import DistributedDataParallel

    return model.module if isinstance(model, DistributedDataParallel) else model


def generate_like(model, batch, *, seed: int, steps: int, guidance_scale: float, device):
    """One generated image per sample of ``batch``: its caption, its shape, noise seeded by its id."""
    from prx_data.train.evaluation import sample_seed
    from prx_data.train.sampling import sample_images

    images = model.batch_images(batch)
    h, w = int(images.shape[-2]), int(images.shape[-1])
    captions = model.eval_captions.choose(batch, torch.Generator().manual_seed(0))
    out = []
    for sid, caption in zip(batch["id"], captions, strict=True):
        s = sample_seed(str(sid), seed)
        out.append(
            sample_images(
                model,
                [caption],
                [s],
                (w, h),
                steps=steps,
                guidance_scale=guidance_scale,
                device=device,
            )
        )
    return images, torch.cat(out)


def _select(value, rows: list[int]):
    """The ``rows`` of one batch entry (a tensor, or a list of captions / ids / shapes)."""
    if rows == list(range(len(rows))):
        return value[: len(rows)]
    if isinstance(value, torch.Tensor):
        return value[torch.as_tensor(rows, device=value.device)]
    return [value[i] for i in rows]


class GenerationMetrics(Callback):
    """Composer callback: FID / CMMD / DINO-MMD at an interval, on the held-out eval stream.

    Each rank generates for its own part of the eval stream, distinct samples only (up to
    ``num_samples`` over all ranks: a repeated copy is skipped), the metric states are
    reduced over ranks, rank 0 writes ``<folder>/gen-ba<batch>.json``; every rank logs
    ``metrics/gen/<name>`` to the configured loggers.
    """

    def __init__(
        self,
        metrics: dict[str, Metric],
        *,
        num_samples: int,
        interval: str,
        folder: str | None,
        seed: int = 0,
        steps: int = 28,
        guidance_scale: float = 4.0,
        models: dict[str, str] | None = None,
    ) -> None:
        self.metrics = metrics
        self.num_samples = int(num_samples)
        self._warned_short = False
        self.folder = folder
        self.seed = int(seed)
        self.steps = int(steps)
        self.guidance_scale = float(guidance_scale)
        self.models = dict(models or {})
        self._due = IntervalGate(interval, (Event.BATCH_END, Event.FIT_END))
        #: (batch, {name: value}) of every evaluation, oldest first.
        self.history: list[tuple[int, dict[str, float]]] = []
        self.written: list[str] = []

    def run_event(self, event, state, logger) -> None:
        if self._due(state, event):
            self.evaluate(state, logger)

    def _eval_loader(self, state):
        for ev in state.evaluators:
            if ev.label == "eval":
                return ev.dataloader.dataloader
        raise UsageError("metrics.enabled needs the held-out eval stream: set eval.enabled=true")

    @torch.no_grad()
    def evaluate(self, state, logger) -> dict[str, float]:
        from composer.core.precision import get_precision_context
        from composer.utils import dist

        model = _unwrap(state.model)
        device = next(model.transformer.parameters()).device
        for m in self.metrics.values():
            m.reset()
            m.to(device)
        world, rank = dist.get_world_size(), dist.get_global_rank()
        # Distinct samples only, over all ranks: the eval stream repeats samples (a rank's
        # padding, small_buckets: fill), and a metric on two copies of one image is no
        # metric. Every rank sees every batch's ids (one all-gather per batch, until every
        # rank's loader is done or enough were taken), so all make the same choice.
        taken: set[str] = set()
        got = 0
        batches = iter(self._eval_loader(state))
        while got < self.num_samples:
            batch = next(batches, None)
            ids = [str(i) for i in batch["id"]] if batch is not None else None
            every = dist.all_gather_object(ids) if world > 1 else [ids]
            if all(x is None for x in every):
                break
            mine: list[int] = []
            for r, rank_ids in enumerate(every):
                for i, sid in enumerate(rank_ids or ()):
                    if got >= self.num_samples or sid in taken:
                        continue
                    taken.add(sid)
                    got += 1
                    if r == rank:
                        mine.append(i)
            if not mine:
                continue
            batch = state.device.batch_to_device(batch)
            batch = {k: _select(v, mine) for k, v in batch.items()}
            # Generation in the run's precision; features and statistics in fp32/fp64.
            with get_precision_context(state.precision):
                real, fake = generate_like(
                    model,
                    batch,
                    seed=self.seed,
                    steps=self.steps,
                    guidance_scale=self.guidance_scale,
                    device=device,
                )
            real, fake = real.to(device), fake.to(device)
            for m in self.metrics.values():
                m.update(real, real=True)
                m.update(fake, real=False)
        if world > 1:  # a rank may have drawn nothing: every sample another's copy
            for m in self.metrics.values():
                if isinstance(m, MMD):
                    m.agree_on_shape(dist.all_gather_object)
                elif not hasattr(m, "orig_dtype"):
                    # torchmetrics' FID sets the dtype of its result in update(); its sums
                    # are zeros on a rank without one and reduce as they are.
                    m.orig_dtype = torch.float32
        values = {name: float(m.compute()) for name, m in self.metrics.items()}
        step = int(state.timestamp.batch)
        logger.log_metrics({f"metrics/gen/{k}": v for k, v in values.items()})
        self.history.append((step, values))
        if dist.get_global_rank() == 0 and got < self.num_samples and not self._warned_short:
            self._warned_short = True
            log.warning(
                "metrics.num_samples=%d but the held-out stream gave %d images: FID/CMMD/"
                "DINO-MMD are computed on %d. Raise eval.holdout_fraction, or lower "
                "metrics.num_samples to what the hold-out holds.",
                self.num_samples,
                got,
                got,
            )
        if dist.get_global_rank() == 0 and self.folder:
            folder = self.folder.format(run_name=state.run_name)
            os.makedirs(folder, exist_ok=True)
            path = os.path.join(folder, f"gen-ba{step:07d}.json")
            record = {
                "batch": step,
                "num_samples": got,
                "metrics": values,
                "models": self.models,
                "seed": self.seed,
                "steps": self.steps,
                "guidance_scale": self.guidance_scale,
            }
            with open(path, "w") as fh:
                json.dump(record, fh, indent=1)
            self.written.append(path)
            log.info("generation metrics at batch %d: %s (%s)", step, values, path)
        return values


class EvalLossWriter(Callback):
    """Composer callback: the held-out per-band flow loss to ``<folder>/eval-ba<batch>.json``.

    Together with :class:`GenerationMetrics`' files, this is what
    ``python -m prx_data.train compare`` plots.
    """

    def __init__(self, folder: str) -> None:
        self.folder = folder

    def eval_end(self, state, logger) -> None:
        from composer.utils import dist

        metrics = state.eval_metrics.get("eval", {})
        values = {k: float(v.compute()) for k, v in metrics.items()}
        if dist.get_global_rank() != 0 or not values:
            return
        step = int(state.timestamp.batch)
        folder = self.folder.format(run_name=state.run_name)
        os.makedirs(folder, exist_ok=True)
        with open(os.path.join(folder, f"eval-ba{step:07d}.json"), "w") as fh:
            json.dump({"batch": step, "metrics": values}, fh, indent=1)


# --- tiny models for offline smoke runs and tests -------------------------------------------------


def _saved(path: str, model_type: str | None = None) -> bool:
    """A model saved at ``path`` (of ``model_type``, when given: older demos saved other types)."""
    try:
        with open(os.path.join(path, "config.json")) as fh:
            found = json.load(fh).get("model_type")
    except (OSError, ValueError):
        return False
    return model_type is None or found == model_type


def save_tiny_metric_models(workdir: str, seed: int = 0) -> dict[str, str]:
    """Save tiny random-weight FID (Inception-like CNN), CLIP and DINOv2 models under ``workdir``.

    For offline smoke runs and tests only: the numbers they give are not FID or
    CMMD values anyone can compare with, but every loading and feature path runs.
    The CLIP one is a whole ``CLIPModel`` (CMMD loads its vision tower), so
    ``score clip`` and ``semdedup`` can use it too.
    Returns ``{"fid": path, "clip": path, "dino": path}``.
    """
    from transformers import (
        BitImageProcessor,
        Dinov2Config,
        Dinov2Model,
        ResNetConfig,
        ResNetModel,
    )

    paths = {k: os.path.join(workdir, f"tiny-{k}") for k in ("fid", "clip", "dino")}
    if all(_saved(p, "clip" if k == "clip" else None) for k, p in paths.items()):
        return paths
    torch.manual_seed(seed)
    # Inception-like: a small CNN with a global average pool, features from the pool.
    ResNetModel(
        ResNetConfig(
            num_channels=3,
            embedding_size=8,
            hidden_sizes=[8, 16],
            depths=[1, 1],
            layer_type="basic",
        )
    ).save_pretrained(paths["fid"])
    save_square_processor(BitImageProcessor, paths["fid"], 64)
    build_tiny_clip(paths["clip"], seed)
    Dinov2Model(Dinov2Config(**TINY_TRANSFORMER, image_size=28, patch_size=7)).save_pretrained(
        paths["dino"]
    )
    save_square_processor(BitImageProcessor, paths["dino"], 28)
    return paths


def metric_names(cfg_metrics: Any) -> Sequence[str]:
    """Names of the metrics a ``metrics:`` block turns on, in order."""
    out = []
    from prx_data.train.config import METRIC_MODELS

    for name, key in METRIC_MODELS:
        if getattr(cfg_metrics, key):
            out.append(name)
    return out
