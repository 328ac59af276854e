"""Latent-space PRX: a frozen diffusers autoencoder in the step, PRXPipeline sampling, resume."""

from __future__ import annotations

import shutil
from collections import Counter
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from prx_data.train.config import ConfigError, load_config
from tests.trainkit import save_tiny_t5, tiny_overrides

REPO = Path(__file__).resolve().parents[1]
SMOKE_LATENT = REPO / "configs" / "train" / "smoke_latent_cpu.yaml"


@pytest.fixture(scope="module")
def tiny_t5(tmp_path_factory) -> str:
    return save_tiny_t5(tmp_path_factory.mktemp("t5"))


@pytest.fixture(scope="module")
def vaes(tmp_path_factory) -> dict[str, str]:
    from prx_data.train.vae import save_tiny_autoencoder

    root = tmp_path_factory.mktemp("vae")
    return {k: save_tiny_autoencoder(str(root / k), k) for k in ("AutoencoderKL", "AutoencoderDC")}


@pytest.fixture(scope="module")
def export(tmp_path_factory):
    from tests.exportkit import make_export

    root = tmp_path_factory.mktemp("export") / "tree"
    return make_export(str(root), {"512/1.000": 12, "512/0.778": 8}, samples_per_part=8)


def latent_overrides(t5: str, vae: str, patch: int = 2) -> list[str]:
    return [*tiny_overrides(t5), f"vae.name_or_path={vae}", f"model.patch_size={patch}"]


# --- config and codec ------------------------------------------------------------------------


@pytest.mark.parametrize(
    "overrides,key",
    [
        (["vae.posterior=median"], "vae.posterior"),
        (["vae.dtype=float8"], "vae.dtype"),
        (["vae.scaling_factor=0"], "vae.scaling_factor"),
        (["model.in_channels=16"], "model.in_channels"),
        (["eval.enabled=true", "eval.device_batch_size=0"], "eval.device_batch_size"),
    ],
)
def test_bad_vae_options_name_the_key(overrides, key):
    with pytest.raises(ConfigError, match=key):
        load_config(None, overrides)


@pytest.mark.parametrize("kind", ["AutoencoderKL", "AutoencoderDC"])
def test_codec_reads_factors_and_shapes_from_the_vae_config(vaes, kind):
    from prx_data.train.vae import LatentCodec

    codec = LatentCodec.from_pretrained(vaes[kind], dtype="float32")
    assert codec.kind == kind and not any(p.requires_grad for p in codec.vae.parameters())
    raw = codec.vae.config
    if kind == "AutoencoderKL":
        assert (codec.compression, codec.latent_channels) == (8, 4)
        assert (codec.scaling_factor, codec.shift_factor) == (0.5, 0.1)
    else:
        assert (codec.compression, codec.latent_channels) == (32, 8)
        assert (codec.scaling_factor, codec.shift_factor) == (0.8, 0.0)
    x = torch.rand(2, 3, 64, 96) * 2 - 1
    z = codec.encode(x)
    assert z.shape == (2, *codec.latent_shape(96, 64)) and z.dtype == torch.float32
    # (z - shift) * scale, the convention PRXPipeline decodes with.
    out = codec.vae.encode(x)
    unscaled = out.latent_dist.mode() if kind == "AutoencoderKL" else out.latent
    torch.testing.assert_close(z, (unscaled - codec.shift_factor) * codec.scaling_factor)
    assert raw.scaling_factor == codec.scaling_factor and raw.shift_factor == codec.shift_factor
    # Overrides win over the config and reach what the pipeline reads.
    other = LatentCodec.from_pretrained(vaes[kind], dtype="float32", scaling_factor=2.0)
    assert other.vae.config.scaling_factor == 2.0
    torch.testing.assert_close(other.encode(x), z / codec.scaling_factor * 2.0)


@pytest.mark.parametrize(
    "kind,shape,tile", [("AutoencoderKL", (128, 192), 64), ("AutoencoderDC", (192, 256), 128)]
)
def test_tiled_encoding_gives_the_same_latent_grid(vaes, kind, shape, tile):
    from prx_data.train.vae import LatentCodec

    codec = LatentCodec.from_pretrained(vaes[kind], dtype="float32")
    x = torch.rand(1, 3, *shape) * 2 - 1
    whole = codec.encode(x)
    tiled = LatentCodec.from_pretrained(vaes[kind], dtype="float32", tiling=True, tile_size=tile)
    assert tiled.vae.use_tiling
    got = tiled.encode(x)
    assert got.shape == whole.shape and not torch.equal(got, whole)  # really tiled
    with pytest.raises(ValueError, match="compression"):
        tiled.encode(torch.zeros(1, 3, shape[0] + 4, shape[1]))


def test_unsupported_autoencoder_is_refused(tmp_path):
    from diffusers import VQModel

    from prx_data.train.vae import LatentCodec

    VQModel(block_out_channels=(8,), norm_num_groups=4, latent_channels=4).save_pretrained(
        tmp_path / "vq"
    )
    with pytest.raises(ValueError, match="supported autoencoders are AutoencoderKL"):
        LatentCodec.from_pretrained(str(tmp_path / "vq"))
    with pytest.raises(ValueError, match="vae.name_or_path: cannot read") as err:
        LatentCodec.from_pretrained(str(tmp_path / "missing"))
    assert "\n" not in str(err.value)


# --- training ----------------------------------------------------------------------------------


def _two_tone(n: int, size: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(0)
    images = (torch.rand(n, 3, 1, 1, generator=g) * 255).to(torch.uint8).expand(n, 3, size, size)
    images = images.clone()
    images[:, :, : size // 2] = 255 - images[:, :, : size // 2]
    return images


@pytest.mark.parametrize(
    "kind,size,patch",
    [("AutoencoderKL", 64, 2), pytest.param("AutoencoderDC", 128, 1, marks=pytest.mark.slow)],
)
def test_latent_training_lowers_the_loss(tiny_t5, vaes, kind, size, patch):
    """The transformer follows the VAE (in_channels) and overfits four images in its latents."""
    from prx_data.train.trainer import build_model

    torch.manual_seed(0)
    cfg = load_config(None, latent_overrides(tiny_t5, vaes[kind], patch))
    model = build_model(cfg)
    assert model.transformer.config.in_channels == model.vae.latent_channels
    assert model.pixel_patch == patch * model.vae.compression
    assert not any(p.requires_grad for p in model.vae.vae.parameters())
    batch = {"image": _two_tone(4, size), "caption": ["a red sky", "a blue sea", "green", "dark"]}
    pred, target = model(batch)
    assert pred.shape == (4, *model.vae.latent_shape(size, size))
    before = model.eval_loss(batch, seed=1)
    opt = torch.optim.AdamW(model.transformer.parameters(), lr=3e-3)
    for _ in range(20):
        loss = model.loss(model(batch), batch)
        loss.backward()
        opt.step()
        opt.zero_grad()
    assert all(p.grad is None for p in model.vae.vae.parameters())
    after = model.eval_loss(batch, seed=1)
    assert after < 0.8 * before, (before, after)
    with pytest.raises(ValueError, match="compression"):
        model({"image": _two_tone(1, size + 8), "caption": ["x"]})


def test_explicit_in_channels_must_match_the_vae(tiny_t5, vaes):
    from prx_data.train.trainer import build_model

    cfg = load_config(
        None, [*latent_overrides(tiny_t5, vaes["AutoencoderKL"]), "model.in_channels=3"]
    )
    with pytest.raises(ValueError, match="model.in_channels=3"):
        build_model(cfg)


def _smoke_cfg(tmp_path: Path, export, t5: str, vae: str, run: str, extra=()):
    return load_config(
        SMOKE_LATENT,
        [
            *tiny_overrides(t5),
            "model.patch_size=4",
            f"vae.name_or_path={vae}",
            f"variables.data_root={export.root}",
            f"variables.run_name={run}",
            "data.plan.include_higher_tiers=false",
            f"trainer.save_folder={tmp_path / '{run_name}' / 'checkpoints'}",
            f"sampling.folder={tmp_path / '{run_name}' / 'samples'}",
            "trainer.max_duration=2ba",
            "trainer.save_interval=2ba",
            "eval.interval=2ba",
            "metrics.enabled=false",  # tests/test_train_metrics.py covers the metrics
            "logging.log_to_console=false",
            *extra,
        ],
    )


def test_latent_smoke_config_trains_evaluates_and_the_pipeline_samples_the_checkpoint(
    tmp_path, export, tiny_t5, vaes
):
    """smoke_latent_cpu.yaml trains 2 steps; PRXPipeline + our VAE sample its checkpoint."""
    from diffusers import FlowMatchEulerDiscreteScheduler
    from diffusers.models.transformers.transformer_prx import PRXTransformer2DModel
    from diffusers.pipelines.prx.pipeline_prx import PRXPipeline

    from prx_data.train.flow import euler_sample
    from prx_data.train.sampling import SampleGrid, cfg_velocity, euler_timesteps, seeded_noise
    from prx_data.train.trainer import build_model, build_trainer

    cfg = _smoke_cfg(tmp_path, export, tiny_t5, vaes["AutoencoderKL"], "lat")
    torch.manual_seed(0)
    trainer = build_trainer(cfg)
    trainer.fit()
    metrics = {k: float(v.compute()) for k, v in trainer.state.eval_metrics["eval"].items()}
    assert metrics and all(np.isfinite(v) and v > 0 for v in metrics.values())
    grid = next(c for c in trainer.state.callbacks if isinstance(c, SampleGrid))
    assert len(grid.written) == 1
    from prx_data.train.sampling import labelled_size

    s = cfg.sampling
    with Image.open(grid.written[0]) as im:  # the 4 x 2 grid of 64 x 96 cells, with its labels
        assert im.size == labelled_size(len(s.prompts), len(s.seeds), s.shapes)
    trainer.close()

    # A fresh model from the checkpoint's transformer weights (the only trained part).
    ckpt = torch.load(
        tmp_path / "lat" / "checkpoints" / "latest-rank0.pt", weights_only=False, map_location="cpu"
    )
    weights = {k.removeprefix("transformer."): v for k, v in ckpt["state"]["model"].items()}
    model = build_model(cfg).eval()
    model.transformer.load_state_dict(weights)
    assert isinstance(model.transformer, PRXTransformer2DModel)

    feats, mask = model.encode_text(["a red square on white", ""], torch.device("cpu"))
    noise = seeded_noise([7], (8, 12), model.vae.latent_channels)  # 64 x 96 image
    steps, guidance = 4, 3.0
    pipe = PRXPipeline(
        transformer=model.transformer,
        scheduler=FlowMatchEulerDiscreteScheduler(),
        text_encoder=None,
        tokenizer=None,
        vae=model.vae.vae,
    )
    pipe.set_progress_bar_config(disable=True)
    with torch.no_grad():
        images = pipe(
            prompt_embeds=feats[:1],
            prompt_attention_mask=mask[:1],
            negative_prompt_embeds=feats[1:],
            negative_prompt_attention_mask=mask[1:],
            latents=noise.clone(),
            height=96,
            width=64,
            timesteps=euler_timesteps(steps),
            guidance_scale=guidance,
            output_type="pt",
            use_resolution_binning=False,
        ).images
        # The same latents by our Euler + CFG, decoded by our codec: the factors agree.
        velocity = cfg_velocity(model, feats[:1], mask[:1], feats[1:], mask[1:], guidance)
        ours = model.vae.decode(euler_sample(velocity, noise, steps))
    assert images.shape == (1, 3, 96, 64)
    torch.testing.assert_close(images, (ours.clamp(-1, 1) + 1) / 2, rtol=1e-4, atol=1e-4)


def test_latent_tokens_are_counted_in_image_pixels(tmp_path, export, tiny_t5, vaes):
    from prx_data.train.trainer import build_trainer

    cfg = _smoke_cfg(
        tmp_path,
        export,
        tiny_t5,
        vaes["AutoencoderKL"],
        "tok",
        ["eval.enabled=false", "sampling.enabled=false", "trainer.max_duration=1ba"],
    )
    trainer = build_trainer(cfg)
    trainer.fit()
    # One batch of two 512-tier images: 32 px per token (patch 4 x 8x VAE).
    tokens = int(trainer.state.timestamp.token)
    assert tokens in (2 * 16 * 16, 2 * 16 * 20, 2 * 20 * 16), tokens
    trainer.close()


# --- kill and resume, latent run ---------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.timeout(1800)
def test_killed_latent_run_resumes_exactly_once(tmp_path, vaes):
    """The pixel resume harness with the VAE on: 2 ranks killed mid-epoch, resumed on 2."""
    from prx_data.train.callbacks import attempts_summary, consumed_ids
    from tests import test_train_resume as harness
    from tests.exportkit import make_export

    encoder = save_tiny_t5(tmp_path / "t5")
    export = make_export(str(tmp_path / "export"), harness.BUCKETS)
    expected = sorted(export.all_ids())
    extra = (f"vae.name_or_path={vaes['AutoencoderKL']}", "model.patch_size=4")
    first = tmp_path / "first"
    cmd = harness._command(2, first, encoder, str(tmp_path / "export"), extra)
    done = harness._kill_after(cmd, first, harness.KILL_AFTER_BATCH)
    assert max(done) < harness.BATCHES_PER_EPOCH - 1, done
    harness._clean_shm()
    run = tmp_path / "resume"
    shutil.copytree(first, run, symlinks=True)
    harness._run_to_end(harness._command(2, run, encoder, str(tmp_path / "export"), extra), run)
    harness._clean_shm()
    assert len(attempts_summary(run / "ids")) == 2
    ids = consumed_ids(run / "ids")
    dupes = {k: v for k, v in Counter(ids).items() if v > 1}
    assert not dupes, f"seen twice: {sorted(dupes)[:5]}"
    assert sorted(ids) == expected, f"missing {set(expected) - set(ids)}"


# --- the smoke configs on two ranks, as they are -----------------------------------------------


@pytest.mark.slow
@pytest.mark.timeout(2400)
@pytest.mark.parametrize("config", ["smoke_cpu.yaml", "smoke_latent_cpu.yaml"])
def test_smoke_configs_run_on_two_ranks_as_they_are(tmp_path, vaes, config):
    """`composer -n 2 -m prx_data.train <smoke config>`: only the demo's paths are pointed here."""
    import subprocess
    import sys

    from prx_data.train.metrics import save_tiny_metric_models
    from tests import test_train_resume as harness
    from tests.exportkit import make_export

    export = make_export(str(tmp_path / "export"), {"512/1.000": 24, "512/0.778": 16})
    tiny = save_tiny_metric_models(str(tmp_path))
    env = harness._env()
    env.update(
        PRX_MDS_ROOT=export.root,
        PRX_TEXT_ENCODER=save_tiny_t5(tmp_path / "t5"),
        PRX_VAE=vaes["AutoencoderKL"],
        PRX_FID_MODEL=tiny["fid"],
        PRX_CLIP_MODEL=tiny["clip"],
        PRX_DINO_MODEL=tiny["dino"],
    )
    logs = tmp_path / "logs"
    logs.mkdir()
    cmd = [
        sys.executable,
        "-m",
        "composer.cli.launcher",
        "-n",
        "2",
        "--master_port",
        str(harness._free_port()),
        "--stdout",
        str(logs / "rank{rank}.stdout"),
        "--stderr",
        str(logs / "rank{rank}.stderr"),
        "-m",
        "prx_data.cli.train",
        str(REPO / "configs" / "train" / config),
    ]
    proc = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=2000)
    tails = "\n".join(p.read_text()[-2500:] for p in sorted(logs.glob("*")))
    assert proc.returncode == 0, proc.stderr[-3000:] + tails
    run = tmp_path / "runs" / load_config(REPO / "configs" / "train" / config).trainer.run_name
    assert (run / "checkpoints" / "latest-rank0.pt").exists()
    assert list((run / "samples").glob("ba*.png"))
    assert list((run / "checkpoints" / "metrics").glob("eval-ba*.json"))
    if "latent" in config:
        gen = sorted((run / "checkpoints" / "metrics").glob("gen-ba*.json"))
        assert gen, "no FID/CMMD/DINO-MMD record"
        import json

        record = json.loads(gen[-1].read_text())
        assert set(record["metrics"]) == {"FID", "CMMD", "DINO-MMD"}
        assert 2 <= record["num_samples"] <= 8  # as many as the small hold-out has
