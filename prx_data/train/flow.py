"""Rectified-flow (flow-matching) pieces, kept as pure tensor functions.

Convention (PRX / SD3): t = 0 is data, t = 1 is noise,
``x_t = (1 - t) * x0 + t * noise`` and the network predicts the velocity
``dx_t/dt = noise - x0``. Timesteps are logit-normal, which puts more
training signal on the middle of the path where the task is hardest.
"""

from __future__ import annotations

import torch


def uint8_to_unit(images: torch.Tensor) -> torch.Tensor:
    """uint8 [B, 3, H, W] in 0..255 -> float in [-1, 1]."""
    if images.dtype != torch.uint8:
        raise TypeError(f"expected uint8 images, got {images.dtype}")
    return images.float().div_(127.5).sub_(1.0)


def logit_normal_timesteps(
    n: int,
    *,
    mean: float = 0.0,
    std: float = 1.0,
    device: torch.device | str | None = None,
    generator: torch.Generator | None = None,
) -> torch.Tensor:
    """t = sigmoid(N(mean, std)), shape [n], float32 in (0, 1)."""
    z = torch.randn(n, generator=generator, device=generator.device if generator else device)
    return torch.sigmoid(z * std + mean).to(device)


def interpolate(x0: torch.Tensor, noise: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
    """x_t = (1 - t) x0 + t noise, t broadcast over all but the batch dim."""
    tb = t.view(-1, *([1] * (x0.dim() - 1))).to(x0.dtype)
    return (1.0 - tb) * x0 + tb * noise


def velocity_target(x0: torch.Tensor, noise: torch.Tensor) -> torch.Tensor:
    return noise - x0


def euler_sample(
    velocity_fn,
    noise: torch.Tensor,
    steps: int = 20,
) -> torch.Tensor:
    """Integrate from t=1 (noise) to t=0 with Euler steps: x <- x + (t_next - t) v(x, t)."""
    x = noise
    ts = torch.linspace(1.0, 0.0, steps + 1, device=noise.device)
    for i in range(steps):
        t = ts[i].expand(noise.shape[0])
        v = velocity_fn(x, t)
        x = x + (ts[i + 1] - ts[i]) * v
    return x
