"""Frozen diffusers autoencoder for latent-space PRX: images are encoded inside the step.

Like the text encoder, the autoencoder is not written into the exports (they
stay independent of the VAE choice, and skip lists, mixing and resume work
unchanged) and is not a submodule of the trained model (it stays out of the
optimizer, EMA, FSDP and checkpoints; it is reloaded by name or path). Where
the encoder's cost per step matters, ``python -m prx_data.latents`` stores one
VAE's latents beside an export (``vae.source: precomputed``); :meth:`LatentCodec.identity`
is what those latents are checked against.

Latents follow diffusers' convention, the one ``PRXPipeline`` decodes with:
``latent = (z - shift_factor) * scaling_factor``.
"""

from __future__ import annotations

import hashlib
import os

import torch

from prx_data.core.errors import UsageError
from prx_data.train.text_encoder import resolve_dtype

#: Autoencoder classes by the ``_class_name`` of their diffusers config.
KINDS = ("AutoencoderKL", "AutoencoderDC")


def _vae_class(name: str):
    import diffusers

    if name not in KINDS:
        raise UsageError(
            f"vae.name_or_path: a {name!r} checkpoint; supported autoencoders are "
            f"{', '.join(KINDS)}"
        )
    return getattr(diffusers, name)


def load_autoencoder(name_or_path: str, subfolder: str | None, dtype: torch.dtype):
    """The diffusers autoencoder at ``name_or_path`` (class from its config), in ``dtype``."""
    from diffusers import AutoencoderKL

    kw = {"subfolder": subfolder} if subfolder else {}
    try:
        # Any diffusers config.json reads through any ConfigMixin class; the class is in it.
        config = AutoencoderKL.load_config(name_or_path, **kw)
    except (OSError, ValueError) as exc:  # not found, offline, not a repo id
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise UsageError(
            f"vae.name_or_path: cannot read {name_or_path!r} ({first}); give a diffusers "
            "autoencoder folder or hub id (the demo writes a tiny one: python -m prx_data.demo)"
        ) from None
    cls = _vae_class(str(config.get("_class_name", "?")))
    return cls.from_pretrained(name_or_path, torch_dtype=dtype, **kw, **_plain_load())


def _plain_load() -> dict:
    """``low_cpu_mem_usage=False`` where ``accelerate`` is not installed, which is what
    diffusers falls back to anyway; said explicitly, it loads without a notice
    recommending ``pip install accelerate`` at every load (twice per latents job)."""
    from diffusers.utils import is_accelerate_available

    return {} if is_accelerate_available() else {"low_cpu_mem_usage": False}


#: Files of a diffusers model folder that hold its weights (hashed by :func:`weights_digest`).
WEIGHT_SUFFIXES = (".safetensors", ".bin")


def _weights_folder(name_or_path: str, subfolder: str | None, setting: str) -> str:
    """The local folder holding the model's weights (a hub id: its cached snapshot)."""
    if os.path.isdir(name_or_path):
        return os.path.join(name_or_path, subfolder) if subfolder else name_or_path
    from huggingface_hub import snapshot_download

    pattern = f"{subfolder}/*" if subfolder else "*"
    try:  # from_pretrained has just fetched it into the cache
        root = snapshot_download(name_or_path, allow_patterns=[pattern], local_files_only=True)
    except Exception as e:  # noqa: BLE001 (hub errors have no common base): one line
        raise UsageError(
            f"{setting}: cannot find the cached files of {name_or_path!r} to digest its "
            f"weights ({type(e).__name__}); give a local folder"
        ) from None
    return os.path.join(root, subfolder) if subfolder else root


def weights_digest(
    name_or_path: str, subfolder: str | None = None, setting: str = "vae.name_or_path"
) -> str:
    """sha256 of a model's weight files as they are on disk (names and bytes).

    What precomputed latents are bound to beyond the class and factors: two VAEs
    of one class and config with other weights give other latents. Taken from
    the files, not from the loaded tensors, so a trainer that loads the VAE in
    bfloat16 and a latents job that loaded it in float32 agree. The same binds stored
    text embeddings to their encoder. ``setting``: the option named in an error.
    """
    folder = _weights_folder(name_or_path, subfolder, setting)
    names = sorted(
        n
        for n in os.listdir(folder)
        if n.endswith(WEIGHT_SUFFIXES) and os.path.isfile(os.path.join(folder, n))
    )
    if not names:
        raise UsageError(f"{setting}: no weight files ({', '.join(WEIGHT_SUFFIXES)}) in {folder}")
    h = hashlib.sha256()
    for n in names:
        h.update(n.encode() + b"\0")
        with open(os.path.join(folder, n), "rb") as f:
            while chunk := f.read(1 << 24):
                h.update(chunk)
    return h.hexdigest()


class LatentCodec:
    """A frozen AutoencoderKL / AutoencoderDC: uint8-range images <-> scaled latents.

    Deliberately not an ``nn.Module`` (see the module docstring).
    """

    def __init__(
        self,
        vae,
        *,
        scaling_factor: float | None = None,
        shift_factor: float | None = None,
        posterior: str = "mode",
        tiling: bool = False,
        tile_size: int | None = None,
    ) -> None:
        self.vae = vae.eval().requires_grad_(False)
        self.kind = type(vae).__name__
        #: sha256 of the weight files (:func:`weights_digest`); None for a VAE built in memory.
        self.weights: str | None = None
        cfg = vae.config
        self.scaling_factor = float(
            scaling_factor if scaling_factor is not None else getattr(cfg, "scaling_factor", 1.0)
        )
        shift = shift_factor if shift_factor is not None else getattr(cfg, "shift_factor", None)
        self.shift_factor = float(shift or 0.0)
        # PRXPipeline decodes with the config's factors: make them the ones we train with.
        vae.register_to_config(scaling_factor=self.scaling_factor, shift_factor=self.shift_factor)
        self.posterior = posterior
        self.latent_channels = int(cfg.latent_channels)
        if hasattr(vae, "spatial_compression_ratio"):
            self.compression = int(vae.spatial_compression_ratio)
        else:
            self.compression = 2 ** (len(cfg.block_out_channels) - 1)
        if tiling:
            self.enable_tiling(tile_size)

    @classmethod
    def from_pretrained(
        cls,
        name_or_path: str,
        *,
        subfolder: str | None = None,
        dtype: str = "auto",
        device: torch.device | str | None = None,
        **kwargs,
    ) -> LatentCodec:
        vae = load_autoencoder(name_or_path, subfolder, resolve_dtype(dtype, device))
        codec = cls(vae, **kwargs)
        codec.weights = weights_digest(name_or_path, subfolder)
        if device is not None:
            codec.to(device)
        return codec

    def enable_tiling(self, tile_size: int | None = None) -> None:
        """Tiled encode/decode: activation memory per tile, not per 2048/4096 image."""
        v = self.vae
        if self.kind == "AutoencoderDC":
            # The stride must follow the tile (diffusers keeps 448 otherwise and drops rows)
            # and stay a whole number of latent cells: overlap ~1/8 tile, in cells.
            stride = None
            if tile_size is not None:
                c = self.compression
                stride = int(tile_size) - c * max(1, round(int(tile_size) / 8 / c))
            v.enable_tiling(
                tile_sample_min_height=tile_size,
                tile_sample_min_width=tile_size,
                tile_sample_stride_height=stride,
                tile_sample_stride_width=stride,
            )
            return
        v.enable_tiling()
        if tile_size is not None:
            v.tile_sample_min_size = int(tile_size)
            v.tile_latent_min_size = int(tile_size) // self.compression

    def identity(self) -> dict:
        """What latents made by this codec depend on: class, factors, posterior, grid, weights.

        Precomputed latents (:mod:`prx_data.export.latents`) record it, and a
        trainer whose codec says otherwise refuses them.
        """
        return {
            "class": self.kind,
            "scaling_factor": self.scaling_factor,
            "shift_factor": self.shift_factor,
            "posterior": self.posterior,
            "compression": self.compression,
            "latent_channels": self.latent_channels,
            "weights": self.weights,
        }

    @property
    def device(self) -> torch.device:
        return next(self.vae.parameters()).device

    @property
    def dtype(self) -> torch.dtype:
        return next(self.vae.parameters()).dtype

    def to(self, device: torch.device | str) -> LatentCodec:
        self.vae.to(device)
        return self

    def latent_shape(self, width: int, height: int) -> tuple[int, int, int]:
        """(channels, height, width) of the latent of a ``width`` x ``height`` image."""
        c = self.compression
        return self.latent_channels, height // c, width // c

    @torch.no_grad()
    def encode(self, x: torch.Tensor, generator: torch.Generator | None = None) -> torch.Tensor:
        """Images in [-1, 1] [B, 3, H, W] -> scaled latents (float32) [B, C, H/f, W/f]."""
        if self.device != x.device:
            self.to(x.device)
        c = self.compression
        if x.shape[-1] % c or x.shape[-2] % c:
            raise UsageError(
                f"image {x.shape[-1]}x{x.shape[-2]} is not a multiple of the VAE's {c}x compression"
            )
        out = self.vae.encode(x.to(self.dtype))
        if self.kind == "AutoencoderKL":
            dist = out.latent_dist
            z = dist.sample(generator) if self.posterior == "sample" else dist.mode()
        else:
            z = out.latent
        want = (x.shape[-2] // c, x.shape[-1] // c)
        if tuple(z.shape[-2:]) != want:
            raise UsageError(
                f"the {self.kind} encoded {x.shape[-1]}x{x.shape[-2]} to a "
                f"{z.shape[-1]}x{z.shape[-2]} latent, not {want[1]}x{want[0]}; with vae.tiling "
                "pick a vae.tile_size that divides the image (or turn tiling off)"
            )
        return (z.float() - self.shift_factor) * self.scaling_factor

    @torch.no_grad()
    def decode(self, latents: torch.Tensor) -> torch.Tensor:
        """Scaled latents -> images in about [-1, 1] (float32)."""
        z = latents / self.scaling_factor + self.shift_factor
        return self.vae.decode(z.to(self.dtype), return_dict=False)[0].float()


def kl_autoencoder(block_out_channels: tuple[int, ...], **config):
    """An ``AutoencoderKL`` over RGB with one encoder/decoder block per width (8x at 4 widths).

    ``config`` is the rest of its diffusers config (latent channels, norm groups, ...);
    built on the current default device, so ``torch.device("meta")`` costs nothing.
    """
    from diffusers import AutoencoderKL

    n = len(block_out_channels)
    return AutoencoderKL(
        in_channels=3,
        out_channels=3,
        down_block_types=("DownEncoderBlock2D",) * n,
        up_block_types=("UpDecoderBlock2D",) * n,
        block_out_channels=block_out_channels,
        **config,
    )


def save_tiny_autoencoder(path: str, kind: str = "AutoencoderKL", seed: int = 0) -> str:
    """Save a small, randomly initialised autoencoder at ``path``; returns the path.

    For offline smoke runs and tests only (its latents are noise): it goes
    through ``save_pretrained`` / ``from_pretrained`` like a real VAE. KL:
    8x compression, 4 latent channels (Flux-style shift factor); DC: 32x, 8 channels.
    """
    import os

    from diffusers import AutoencoderDC

    if os.path.exists(os.path.join(path, "config.json")):
        return path
    torch.manual_seed(seed)
    if kind == "AutoencoderKL":
        vae = kl_autoencoder(
            block_out_channels=(4, 8, 8, 8),
            layers_per_block=1,
            latent_channels=4,
            norm_num_groups=2,
            sample_size=64,
            scaling_factor=0.5,
            shift_factor=0.1,
        )
    elif kind == "AutoencoderDC":
        vae = AutoencoderDC(
            in_channels=3,
            latent_channels=8,
            attention_head_dim=4,
            encoder_block_types="ResBlock",
            decoder_block_types="ResBlock",
            encoder_block_out_channels=(4, 8, 8, 8, 8, 8),
            decoder_block_out_channels=(4, 8, 8, 8, 8, 8),
            encoder_layers_per_block=(1, 1, 1, 1, 1, 1),
            decoder_layers_per_block=(1, 1, 1, 1, 1, 1),
            encoder_qkv_multiscales=((),) * 6,
            decoder_qkv_multiscales=((),) * 6,
            scaling_factor=0.8,
        )
    else:
        raise UsageError(f"kind {kind!r}: one of {', '.join(KINDS)}")
    vae.save_pretrained(path)
    return path
