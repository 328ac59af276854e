"""Sample grids during training: fixed prompts and seeds, Euler flow sampling with CFG.

Loss curves say little about what a diffusion model draws. :class:`SampleGrid`
samples the same prompts from the same noise at every checkpoint, so grids
from successive checkpoints can be compared side by side. In pixel space the
sampler is the project's own :func:`prx_data.train.flow.euler_sample`
(diffusers' ``PRXPipeline`` assumes a VAE's latent grid); a test checks that
it gives the same images as ``PRXPipeline`` driven with the same noise, text
features and timesteps. In latent space (``vae:``) sampling goes through the
real ``diffusers.PRXPipeline`` with our VAE, so the grid shows what the
pipeline draws from the checkpoint.

Grid layout: one row per prompt; one column per (shape, seed), shapes in
config order, seeds inner. Each cell is the size of the largest shape, the
image centred on black. Every rank samples (FSDP needs all ranks in each
forward); rank 0 writes ``<folder>/ba<batch>.png`` and logs it to the loggers.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Sequence

import numpy as np
import torch
from composer.core import Callback, Event, State
from composer.loggers import Logger
from composer.utils import dist
from PIL import Image

from prx_data.core.errors import UsageError
from prx_data.train.flow import euler_sample

log = logging.getLogger(__name__)


def cfg_velocity(model, cond: torch.Tensor, cond_mask, uncond, uncond_mask, guidance: float):
    """Velocity function with classifier-free guidance: v_u + g (v_c - v_u)."""

    def velocity(x: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        if guidance == 1.0:
            return model.transformer(
                hidden_states=x, timestep=t, encoder_hidden_states=cond, attention_mask=cond_mask
            ).sample
        feats = torch.cat([uncond, cond])
        mask = torch.cat([uncond_mask, cond_mask]) if cond_mask is not None else None
        v = model.transformer(
            hidden_states=torch.cat([x, x]),
            timestep=torch.cat([t, t]),
            encoder_hidden_states=feats,
            attention_mask=mask,
        ).sample
        v_u, v_c = v.float().chunk(2)
        return (v_u + guidance * (v_c - v_u)).to(x.dtype)

    return velocity


def seeded_noise(seeds: Sequence[int], shape: tuple[int, int], channels: int = 3) -> torch.Tensor:
    """[len(seeds), C, H, W] standard normal noise, one CPU generator per seed."""
    w, h = shape
    return torch.stack(
        [torch.randn(channels, h, w, generator=torch.Generator().manual_seed(s)) for s in seeds]
    )


@torch.no_grad()
def sample_images(
    model,
    prompts: Sequence[str],
    seeds: Sequence[int],
    shape: tuple[int, int],
    *,
    steps: int,
    guidance_scale: float,
    device: torch.device,
) -> torch.Tensor:
    """uint8 [len(prompts) * len(seeds), 3, H, W], prompt-major (prompt 0 x all seeds first)."""
    if getattr(model, "vae", None) is not None:
        return pipeline_sample_images(
            model, prompts, seeds, shape, steps=steps, guidance_scale=guidance_scale, device=device
        )
    was_training = model.training
    model.eval()
    try:
        n_p, n_s = len(prompts), len(seeds)
        texts = [p for p in prompts for _ in seeds]
        feats, mask = model.encode_text(texts + [""] * len(texts), device)
        feats = feats.to(next(model.transformer.parameters()).dtype)
        cond, uncond = feats.chunk(2)
        cond_mask, uncond_mask = mask.chunk(2) if mask is not None else (None, None)
        noise = seeded_noise(seeds, shape, model.transformer.config.in_channels)
        noise = noise.repeat(n_p, 1, 1, 1).to(device)
        velocity = cfg_velocity(model, cond, cond_mask, uncond, uncond_mask, guidance_scale)
        x = euler_sample(velocity, noise, steps=steps)
        assert x.shape[0] == n_p * n_s
        return ((x.float().clamp(-1, 1) + 1.0) * 127.5).round().to(torch.uint8).cpu()
    finally:
        model.train(was_training)


def prx_pipeline(model):
    """``diffusers.PRXPipeline`` over the model's transformer and VAE (text features passed in)."""
    from diffusers import FlowMatchEulerDiscreteScheduler
    from diffusers.pipelines.prx.pipeline_prx import PRXPipeline

    pipe = PRXPipeline(
        transformer=model.transformer,
        scheduler=FlowMatchEulerDiscreteScheduler(),
        text_encoder=None,
        tokenizer=None,
        vae=model.vae.vae if model.vae is not None else None,
    )
    pipe.set_progress_bar_config(disable=True)
    return pipe


def euler_timesteps(steps: int) -> list[float]:
    """Scheduler timesteps (0..1000) of ``euler_sample``'s uniform grid from t=1 to 0."""
    return (torch.linspace(1.0, 0.0, steps + 1)[:-1] * 1000).tolist()


@torch.no_grad()
def pipeline_sample_images(
    model,
    prompts: Sequence[str],
    seeds: Sequence[int],
    shape: tuple[int, int],
    *,
    steps: int,
    guidance_scale: float,
    device: torch.device,
) -> torch.Tensor:
    """Like :func:`sample_images`, through ``PRXPipeline`` with the model's VAE decoding.

    The pipeline's CFG step passes a [2] timestep, so it draws one image per call.
    """
    w, h = shape
    f = model.pixel_patch
    if w % f or h % f:
        raise UsageError(
            f"sampling.shapes: {w}x{h} is not a multiple of {f} "
            "(model.patch_size x the VAE's compression)"
        )
    was_training = model.training
    model.eval()
    try:
        feats, mask = model.encode_text([*prompts, ""], device)
        feats = feats.to(next(model.transformer.parameters()).dtype)
        channels, lh, lw = model.vae.latent_shape(w, h)
        noise = seeded_noise(seeds, (lw, lh), channels).to(device)
        pipe = prx_pipeline(model)
        negative = {}
        if guidance_scale > 1.0:
            negative = {
                "negative_prompt_embeds": feats[-1:],
                "negative_prompt_attention_mask": mask[-1:],
            }
        out = []
        for i in range(len(prompts)):
            for j in range(len(seeds)):
                img = pipe(
                    prompt_embeds=feats[i : i + 1],
                    prompt_attention_mask=mask[i : i + 1],
                    latents=noise[j : j + 1].clone(),
                    height=h,
                    width=w,
                    timesteps=euler_timesteps(steps),
                    guidance_scale=guidance_scale,
                    output_type="pt",
                    use_resolution_binning=False,
                    **negative,
                ).images
                out.append(img.float().clamp(0, 1).mul(255).round().to(torch.uint8).cpu())
        return torch.cat(out)
    finally:
        model.train(was_training)


def grid_size(n_prompts: int, n_seeds: int, shapes: Sequence[Sequence[int]]) -> tuple[int, int]:
    """(width, height) of the grid image."""
    cell_w = max(s[0] for s in shapes)
    cell_h = max(s[1] for s in shapes)
    return cell_w * n_seeds * len(shapes), cell_h * n_prompts


def make_grid(
    per_shape: Sequence[torch.Tensor], n_prompts: int, n_seeds: int, shapes
) -> Image.Image:
    """Tile prompt-major uint8 batches (one per shape) into one RGB image."""
    gw, gh = grid_size(n_prompts, n_seeds, shapes)
    cell_w, cell_h = gw // (n_seeds * len(shapes)), gh // n_prompts
    grid = Image.new("RGB", (gw, gh))
    for si, (imgs, (w, h)) in enumerate(zip(per_shape, shapes, strict=True)):
        for p in range(n_prompts):
            for s in range(n_seeds):
                arr = imgs[p * n_seeds + s].permute(1, 2, 0).numpy()
                col = si * n_seeds + s
                x = col * cell_w + (cell_w - w) // 2
                y = p * cell_h + (cell_h - h) // 2
                grid.paste(Image.fromarray(arr, "RGB"), (x, y))
    return grid


#: Height of the seed/shape band above a labelled grid, width of the prompt band left of it.
LABEL_H, PROMPT_W = 14, 128


def labelled_size(n_prompts: int, n_seeds: int, shapes: Sequence[Sequence[int]]) -> tuple[int, int]:
    """(width, height) of :func:`label_grid`'s image: the grid plus its label bands."""
    gw, gh = grid_size(n_prompts, n_seeds, shapes)
    return gw + PROMPT_W, gh + LABEL_H


def label_grid(
    grid: Image.Image, prompts: Sequence[str], seeds: Sequence[int], shapes
) -> Image.Image:
    """The grid with each column's seed and shape above it and each row's prompt to its left.

    A grid is read across checkpoints and runs (``train compare``): the labels
    say which prompt and noise each cell is, without the config at hand.
    """
    from PIL import ImageDraw, ImageFont

    font = ImageFont.load_default()
    n_cols = len(seeds) * len(shapes)
    cell_w, cell_h = grid.width // n_cols, grid.height // max(1, len(prompts))
    out = Image.new("RGB", (grid.width + PROMPT_W, grid.height + LABEL_H), (255, 255, 255))
    out.paste(grid, (PROMPT_W, LABEL_H))
    draw = ImageDraw.Draw(out)
    for si, (w, h) in enumerate(shapes):
        for k, seed in enumerate(seeds):
            x = PROMPT_W + (si * len(seeds) + k) * cell_w + 2
            draw.text((x, 1), f"seed {seed} {w}x{h}", fill=(0, 0, 0), font=font)
    per_line = max(1, (PROMPT_W - 4) // 6)
    for p, prompt in enumerate(prompts):
        words, lines, line = str(prompt).split(), [], ""
        for word in words:
            if line and len(line) + 1 + len(word) > per_line:
                lines.append(line)
                line = word
            else:
                line = f"{line} {word}".strip()
        lines.append(line)
        for i, text in enumerate(lines[: max(1, cell_h // 12)]):
            draw.text((2, LABEL_H + p * cell_h + 2 + 12 * i), text, fill=(0, 0, 0), font=font)
    return out


class IntervalGate:
    """True once per batch on ``events`` when ``interval`` (Composer's time string) is due.

    ``FIT_END`` always passes (include_end_of_training), and a batch that already passed
    (an interval end that is also the end of training) does not pass again.
    """

    def __init__(self, interval: str, events: tuple[Event, ...]) -> None:
        from composer.utils.misc import create_interval_scheduler

        self._due = create_interval_scheduler(interval, include_end_of_training=True)
        self._events = events
        self._last_batch: int | None = None

    def __call__(self, state: State, event: Event) -> bool:
        if event not in self._events:
            return False
        if event != Event.FIT_END and not self._due(state, event):
            return False
        batch = int(state.timestamp.batch)
        if batch == self._last_batch:
            return False
        self._last_batch = batch
        return True


class SampleGrid(Callback):
    """Samples a fixed prompt/seed/shape grid at an interval and at the end of training."""

    def __init__(
        self,
        prompts: Sequence[str],
        seeds: Sequence[int],
        shapes: Sequence[Sequence[int]],
        *,
        steps: int,
        guidance_scale: float,
        interval: str,
        folder: str,
    ) -> None:
        self.prompts = list(prompts)
        self.seeds = [int(s) for s in seeds]
        self.shapes = [(int(s[0]), int(s[1])) for s in shapes]
        self.steps = steps
        self.guidance_scale = guidance_scale
        self.folder = folder
        self._due = IntervalGate(
            interval, (Event.BATCH_CHECKPOINT, Event.EPOCH_CHECKPOINT, Event.FIT_END)
        )
        #: Paths written by this rank (rank 0 only), oldest first.
        self.written: list[str] = []

    def run_event(self, event: Event, state: State, logger: Logger) -> None:
        if self._due(state, event):
            self.sample(state, logger)

    def sample(self, state: State, logger: Logger) -> Image.Image:
        from composer.core.precision import get_precision_context
        from torch.nn.parallel import DistributedDataParallel

        model = (
            state.model.module if isinstance(state.model, DistributedDataParallel) else state.model
        )
        device = next(model.transformer.parameters()).device
        per_shape = []
        with get_precision_context(state.precision):
            for shape in self.shapes:
                per_shape.append(
                    sample_images(
                        model,
                        self.prompts,
                        self.seeds,
                        shape,
                        steps=self.steps,
                        guidance_scale=self.guidance_scale,
                        device=device,
                    )
                )
        grid = make_grid(per_shape, len(self.prompts), len(self.seeds), self.shapes)
        grid = label_grid(grid, self.prompts, self.seeds, self.shapes)
        if dist.get_global_rank() == 0:
            batch = int(state.timestamp.batch)
            folder = self.folder.format(run_name=state.run_name)
            os.makedirs(folder, exist_ok=True)
            path = os.path.join(folder, f"ba{batch:07d}.png")
            grid.save(path)
            self.written.append(path)
            logger.log_images(np.asarray(grid), name="samples/grid", step=batch, channels_last=True)
            log.info("sample grid: %s", path)
        return grid
