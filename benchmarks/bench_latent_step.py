"""Per-step cost of encoding images with the VAE inside the step, against precomputed latents.

Two parts:

  measured   CPU, tiny models: one training step (forward, backward, AdamW) of a
             latent PRX on uint8 images that the frozen AutoencoderKL encodes in
             the step, against the same step fed precomputed latents of the same
             shape. Rounds interleaved, medians; reported as a ratio.
  at scale   FLOPs counted on meta tensors (torch.utils.flop_counter, nothing
             computed or downloaded): the Flux VAE encoder (AutoencoderKL with
             FLUX.1's config) on one 512 x 512 image, against one training step
             (forward + backward) of the PRX transformer of latent_512.yaml on
             its 1024 tokens. That ratio is the in-step encoding overhead on a GPU
             where both run at the same efficiency.

    python benchmarks/bench_latent_step.py [--rounds 5] [--batch 4] [--size 256]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))


def _measured(args) -> dict:
    import torch

    from prx_data.train.config import load_config
    from prx_data.train.text_encoder import save_tiny_t5
    from prx_data.train.trainer import build_model
    from prx_data.train.vae import save_tiny_autoencoder

    work = Path(tempfile.mkdtemp(prefix="bench-latent-"))
    t5 = save_tiny_t5(str(work / "t5"))
    vae = save_tiny_autoencoder(str(work / "vae"))
    cfg = load_config(
        None,
        [
            f"text_encoder.name_or_path={t5}",
            "text_encoder.max_length=32",
            "text_encoder.dtype=float32",
            f"vae.name_or_path={vae}",
            "vae.dtype=float32",
            "model.patch_size=2",
            "model.hidden_size=64",
            "model.num_heads=4",
            "model.depth=2",
            "model.mlp_ratio=2.0",
        ],
    )
    torch.manual_seed(0)
    model = build_model(cfg)
    opt = torch.optim.AdamW(model.transformer.parameters(), lr=1e-4)
    g = torch.Generator().manual_seed(0)
    images = (torch.rand(args.batch, 3, args.size, args.size, generator=g) * 255).to(torch.uint8)
    batch = {"image": images, "caption": ["a photo"] * args.batch}
    latents = model.clean_inputs(images)  # the same shape a precomputed column would give
    encode = model.clean_inputs

    def step(precomputed: bool) -> float:
        model.clean_inputs = (lambda im, gen=None: latents) if precomputed else encode
        t0 = time.perf_counter()
        loss = model.loss(model(batch), batch)
        loss.backward()
        opt.step()
        opt.zero_grad()
        return time.perf_counter() - t0

    step(True), step(False)  # warm-up
    times = {True: [], False: []}
    for _ in range(args.rounds):
        for pre in (False, True):
            times[pre].append(step(pre))
    in_step, pre = statistics.median(times[False]), statistics.median(times[True])
    return {
        "batch": args.batch,
        "image": f"{args.size}x{args.size}",
        "latent": list(latents.shape[1:]),
        "step_s_in_step_encode": round(in_step, 4),
        "step_s_precomputed": round(pre, 4),
        "ratio": round(in_step / pre, 3),
    }


def _flops(fn) -> int:
    from torch.utils.flop_counter import FlopCounterMode

    with FlopCounterMode(display=False) as counter:
        fn()
    return int(counter.get_total_flops())


def _at_scale() -> dict:
    import torch
    from diffusers.models.transformers.transformer_prx import PRXTransformer2DModel

    from prx_data.train.config import load_config
    from prx_data.train.vae import kl_autoencoder

    with torch.device("meta"):
        # FLUX.1 VAE config (black-forest-labs/FLUX.1-dev, vae/config.json).
        vae = kl_autoencoder(
            block_out_channels=(128, 256, 512, 512),
            layers_per_block=2,
            latent_channels=16,
            norm_num_groups=32,
            sample_size=1024,
            use_quant_conv=False,
            use_post_quant_conv=False,
        )
        cfg = load_config(REPO / "configs" / "train" / "latent_512.yaml")
        m = cfg.model
        head = m.hidden_size // m.num_heads
        prx = PRXTransformer2DModel(
            in_channels=16,
            patch_size=m.patch_size,
            context_in_dim=2304,  # T5Gemma 2B's width
            hidden_size=m.hidden_size,
            mlp_ratio=m.mlp_ratio,
            num_heads=m.num_heads,
            depth=m.depth,
            axes_dim=[head // 2, head // 2],
        )
        x = torch.empty(1, 3, 512, 512)
        z = torch.empty(1, 16, 64, 64)
        text = torch.empty(1, 256, 2304)
        t = torch.empty(1)

    def encode():
        with torch.no_grad():
            vae.encode(x)

    def train_step():
        out = prx(hidden_states=z, timestep=t, encoder_hidden_states=text).sample
        out.sum().backward()

    enc, step = _flops(encode), _flops(train_step)
    params = sum(p.numel() for p in prx.parameters())
    return {
        "vae_encoder_gflop_per_512_image": round(enc / 1e9, 1),
        "prx_train_step_gflop_per_image": round(step / 1e9, 1),
        "prx_params_m": round(params / 1e6, 1),
        "flop_ratio_encode_over_step": round(enc / step, 4),
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--size", type=int, default=256)
    p.add_argument("--skip-scale", action="store_true", help="only the measured CPU part")
    args = p.parse_args(argv)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    out = {"measured_cpu_tiny": _measured(args)}
    if not args.skip_scale:
        out["flops_at_prx_scale"] = _at_scale()
    print(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
