"""PRX (diffusers ``PRXTransformer2DModel``) in pixel or latent space as a Composer model.

Pixel space, like PRX Pixel: the RGB image is patchified directly
(``in_channels=3``). Latent space (``vae:``): a frozen diffusers autoencoder
encodes the batch inside the step, under ``no_grad``, and the transformer
patchifies its latents (``in_channels`` = the VAE's latent channels); with
``vae.source: precomputed`` the loader serves the latents that
``python -m prx_data.latents`` stored beside the export instead, and the
encoder never runs (its cost per step is the point of storing them). The text
encoder runs frozen inside the step; the loss is rectified-flow velocity MSE.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from composer.models import ComposerModel
from diffusers.models.transformers.transformer_prx import PRXTransformer2DModel

from prx_data.core.errors import UsageError
from prx_data.train import evaluation
from prx_data.train.captions import CaptionPolicy
from prx_data.train.config import FlowConfig, ModelConfig
from prx_data.train.flow import (
    interpolate,
    logit_normal_timesteps,
    uint8_to_unit,
    velocity_target,
)
from prx_data.train.text_encoder import TextEncoder
from prx_data.train.vae import LatentCodec


def build_transformer(
    cfg: ModelConfig, context_in_dim: int, in_channels: int = 3
) -> PRXTransformer2DModel:
    """A fresh (or ``cfg.pretrained``) PRX transformer sized by ``cfg``.

    ``in_channels`` is what the data gives (3 pixels, or the VAE's latent
    channels); an explicit ``cfg.in_channels`` must agree with it.
    """
    if cfg.in_channels is not None and cfg.in_channels != in_channels:
        raise UsageError(
            f"model.in_channels={cfg.in_channels} but the inputs have {in_channels} channels "
            "(3 in pixel space, the VAE's latent_channels in latent space); drop the key"
        )
    if cfg.pretrained:
        model = PRXTransformer2DModel.from_pretrained(cfg.pretrained)
        got = model.config.context_in_dim
        if got != context_in_dim:
            raise UsageError(
                f"model.pretrained expects text features of width {got}, "
                f"the text encoder gives {context_in_dim}"
            )
        if model.config.in_channels != in_channels:
            raise UsageError(
                f"model.pretrained takes {model.config.in_channels} input channels, "
                f"the inputs have {in_channels}"
            )
    else:
        head_dim = cfg.hidden_size // cfg.num_heads
        axes = list(cfg.axes_dim) if cfg.axes_dim else [head_dim // 2, head_dim // 2]
        model = PRXTransformer2DModel(
            in_channels=in_channels,
            patch_size=cfg.patch_size,
            context_in_dim=cfg.context_in_dim or context_in_dim,
            hidden_size=cfg.hidden_size,
            mlp_ratio=cfg.mlp_ratio,
            num_heads=cfg.num_heads,
            depth=cfg.depth,
            axes_dim=axes,
            theta=cfg.theta,
        )
    if cfg.gradient_checkpointing:
        model.enable_gradient_checkpointing()
    return model


class PRXFlowModel(ComposerModel):
    """Composer wrapper: batch -> captions -> text features -> flow-matching loss.

    ``forward`` returns ``(predicted velocity, target velocity)``; ``loss`` is
    their MSE in float32. Only the transformer is trained and checkpointed;
    the text encoder and the VAE (``vae``, None in pixel space) are frozen
    plain objects, reloaded by name or path.
    """

    def __init__(
        self,
        transformer: PRXTransformer2DModel,
        text_encoder: TextEncoder,
        captions: CaptionPolicy,
        flow: FlowConfig | None = None,
        vae: LatentCodec | None = None,
        precomputed: bool = False,
    ) -> None:
        super().__init__()
        if precomputed and vae is None:
            raise UsageError("precomputed latents need the VAE that made them (vae.name_or_path)")
        #: x0 is the batch's ``latent`` (stored by ``python -m prx_data.latents``), never encoded.
        self.precomputed = precomputed
        self.transformer = transformer
        self.text_encoder = text_encoder  # plain object: not a submodule on purpose
        self.vae = vae  # likewise
        self.captions = captions
        self.flow = flow or FlowConfig()
        patch = transformer.config.patch_size
        #: Image pixels per patch side: the patch size times the VAE's compression.
        self._patch = int(patch) * (vae.compression if vae is not None else 1)
        want = vae.latent_channels if vae is not None else 3
        if transformer.config.in_channels != want:
            raise UsageError(
                f"the transformer takes {transformer.config.in_channels} channels but the "
                f"{'VAE latents have' if vae is not None else 'images have'} {want}"
            )
        #: ``text_encoder.source: precomputed``: per caption column, the batch keys of its
        #: stored embeddings and masks, and the empty caption's (set by the trainer after
        #: checking the exports' records); None runs the encoder in the step.
        self.stored_text: dict[str, tuple[str, str]] | None = None
        self.empty_text: tuple[torch.Tensor, torch.Tensor] | None = None
        # Held-out evaluation (prx_data.train.evaluation): bands, seed, caption choice.
        self.eval_bands = 4
        self.eval_seed = 0
        self.eval_captions = evaluation.eval_caption_policy(captions.columns)

    def encode_text(
        self, captions: list[str], device: torch.device
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if self.text_encoder.device != device:
            self.text_encoder.to(device)
        feats, mask = self.text_encoder.encode(captions)
        return feats, mask

    def stored_text_features(
        self, batch: Mapping[str, Any], generator: torch.Generator | None, device: torch.device
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The chosen caption's precomputed embeddings [B, L, D] and mask [B, L] (bool), picked
        per sample as :meth:`CaptionPolicy.choose_index` picks captions; a dropped or empty
        caption takes the empty caption's: what the encoder would give in the step."""
        assert self.stored_text is not None and self.empty_text is not None
        picks = self.captions.choose_index(batch, generator)
        feats, masks = [], []
        for i, j in enumerate(picks):
            if j < 0:
                f, m = self.empty_text
            else:
                fk, mk = self.stored_text[self.captions.columns[j]]
                if fk not in batch or mk not in batch:
                    raise UsageError(
                        f"text_encoder.source: precomputed but the batch has no {fk!r} (the "
                        "loader serves it; a dataset passed in must too)"
                    )
                f, m = (
                    torch.as_tensor(np.array(batch[fk][i])),
                    torch.as_tensor(np.array(batch[mk][i])),
                )
            feats.append(f)
            masks.append(m)
        feats_t = torch.stack(feats).to(device=device, dtype=torch.float32)
        return feats_t, torch.stack(masks).to(device=device).bool()

    def batch_images(self, batch: Mapping[str, Any]) -> torch.Tensor:
        """uint8 [B, 3, H, W] on the model's device; encoded bytes are decoded there (nvJPEG)."""
        images = batch["image"]
        if isinstance(images, torch.Tensor):
            return images
        from prx_data.stream.decode import decode_batch
        from prx_data.train.data import batch_shape

        device = next(self.transformer.parameters()).device
        return decode_batch(images, batch_shape(batch), device)

    @property
    def pixel_patch(self) -> int:
        """Image pixels per token side (patch size x VAE compression)."""
        return self._patch

    def _check_shape(self, x: torch.Tensor) -> None:
        h, w = x.shape[-2:]
        if h % self._patch or w % self._patch:
            what = (
                f"model.patch_size={self.transformer.config.patch_size} x the VAE's "
                f"{self.vae.compression}x compression = {self._patch}"
                if self.vae is not None
                else f"model.patch_size={self._patch}"
            )
            raise UsageError(
                f"image {w}x{h} is not divisible by {what}; "
                "pick a patch size that divides the bucket shapes of the tier"
            )

    def clean_inputs(
        self,
        images: torch.Tensor,
        generator: torch.Generator | None = None,
        latent: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """x0 of the flow: uint8 images -> [-1, 1] pixels, or their VAE latents (no grad).

        With precomputed latents, ``latent`` (the batch's, float32 on the images'
        device) is x0 and the encoder is not called.
        """
        self._check_shape(images)
        if self.precomputed:
            if latent is None:
                raise UsageError(
                    "vae.source: precomputed but the batch has no 'latent' (the loader attaches "
                    "it; a dataset passed in must too)"
                )
            want = (images.shape[0], *self.vae.latent_shape(images.shape[-1], images.shape[-2]))
            if tuple(latent.shape) != want:
                raise UsageError(
                    f"precomputed latents of shape {tuple(latent.shape)} for images "
                    f"{tuple(images.shape)}: expected {want}; the latents were made with "
                    "another VAE or for other images"
                )
            return latent.to(device=images.device, dtype=torch.float32)
        x = uint8_to_unit(images)
        if self.vae is None:
            return x
        with torch.no_grad():
            return self.vae.encode(x, generator)

    def flow_outputs(
        self,
        batch: Mapping[str, Any],
        *,
        generator: torch.Generator | None = None,
        captions: list[str] | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Predicted and target velocity for one batch.

        ``generator`` (on the images' device) fixes t and the noise, and the
        caption choice when ``captions`` is not given: deterministic evaluation.
        """
        images = self.batch_images(batch)
        device = images.device
        x0 = self.clean_inputs(images, generator, latent=batch.get("latent"))
        if captions is None:
            cpu_gen = None
            if generator is not None:
                cpu_gen = torch.Generator().manual_seed(int(generator.initial_seed()))
            if self.stored_text is not None:
                feats, mask = self.stored_text_features(batch, cpu_gen, device)
            else:
                feats, mask = self.encode_text(self.captions.choose(batch, cpu_gen), device)
        else:
            feats, mask = self.encode_text(captions, device)
        param_dtype = next(self.transformer.parameters()).dtype
        feats = feats.to(param_dtype)
        n = x0.shape[0]
        t = logit_normal_timesteps(
            n,
            mean=self.flow.logit_mean,
            std=self.flow.logit_std,
            device=device,
            generator=generator,
        )
        noise = torch.randn(x0.shape, generator=generator, device=device, dtype=x0.dtype)
        x_t = interpolate(x0, noise, t)
        pred = self.transformer(
            hidden_states=x_t,
            timestep=t,
            encoder_hidden_states=feats,
            attention_mask=mask,
        ).sample
        return pred, velocity_target(x0, noise)

    def forward(self, batch: Mapping[str, Any]) -> tuple[torch.Tensor, torch.Tensor]:
        return self.flow_outputs(batch)

    def loss(self, outputs: tuple[torch.Tensor, torch.Tensor], batch: Any) -> torch.Tensor:
        pred, target = outputs
        return F.mse_loss(pred.float(), target.float())

    @torch.no_grad()
    def eval_loss(self, batch: Mapping[str, Any], seed: int = 0) -> float:
        """Loss at fixed t/noise/captions: comparable across training steps."""
        device = self.batch_images(batch).device
        gen = torch.Generator(device=device).manual_seed(seed)
        was_training = self.training
        self.eval()
        try:
            return float(self.loss(self.flow_outputs(batch, generator=gen), batch))
        finally:
            self.train(was_training)

    # --- Composer evaluation: per-band flow loss at fixed noise and timesteps -------------

    def configure_eval(self, num_bands: int, seed: int) -> None:
        """Set the timestep bands and noise seed of the held-out metrics."""
        self.eval_bands = int(num_bands)
        self.eval_seed = int(seed)

    def eval_forward(self, batch: Mapping[str, Any], outputs: Any = None) -> torch.Tensor:
        """``[B, num_bands]`` per-sample losses (see :mod:`prx_data.train.evaluation`)."""
        with torch.no_grad():
            return evaluation.per_sample_band_losses(self, batch)

    def get_metrics(self, is_train: bool = False) -> dict[str, Any]:
        return {} if is_train else evaluation.eval_metrics(self.eval_bands)

    def update_metric(self, batch: Any, outputs: Any, metric: Any) -> None:
        metric.update(outputs)
