"""Eval hold-out, eval loss, sample grids, rerun hygiene and parallelism options of the trainer."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from prx_data.train.config import ConfigError, load_config
from tests.trainkit import save_tiny_t5, tiny_overrides

REPO = Path(__file__).resolve().parents[1]
SMOKE = REPO / "configs" / "train" / "smoke_cpu.yaml"
BUCKETS = {"512/1.000": 24, "512/0.778": 16}


@pytest.fixture(scope="module")
def tiny_t5(tmp_path_factory) -> str:
    return save_tiny_t5(tmp_path_factory.mktemp("t5"))


@pytest.fixture(scope="module")
def export(tmp_path_factory):
    from tests.exportkit import make_export

    root = tmp_path_factory.mktemp("export") / "tree"
    return make_export(str(root), BUCKETS, samples_per_part=8)


def _ids(ds) -> list[str]:
    return [ds[i]["id"] for i in range(ds.num_samples)]


# --- hold-out slice -----------------------------------------------------------------------


def test_holdout_slice_is_disjoint_from_training_and_covers_the_export(export):
    """Train side + eval side partition the export by id hash, in the sample space."""
    from prx_data.stream.dataset import BucketedDataset, DatasetSpec
    from prx_data.stream.holdout import Holdout

    def dataset(keep: str) -> BucketedDataset:
        spec = DatasetSpec(root=export.root, holdout=Holdout(0.25, "eval", keep))
        return BucketedDataset(spec, tier=512, batch_size=1, shuffle=False, small_buckets="drop")

    train, held = dataset("train"), dataset("eval")
    train_ids, held_ids = _ids(train), _ids(held)
    assert not set(train_ids) & set(held_ids)
    assert sorted(train_ids + held_ids) == sorted(export.all_ids())
    # The slice is the hash's, not the layout's: recomputed from the ids alone.
    mask = Holdout(0.25, "eval").held_out(sorted(export.all_ids()))
    assert sorted(held_ids) == sorted(np.asarray(sorted(export.all_ids()))[mask].tolist())
    assert 0 < len(held_ids) < len(train_ids)
    # Skipped samples are out of the epoch itself (planner counts), not filtered on read.
    assert train.num_samples == len(train_ids) and held.num_samples == len(held_ids)
    # Another salt draws another slice.
    other = Holdout(0.25, "other").held_out(sorted(export.all_ids()))
    assert not np.array_equal(mask, other)


def test_holdout_rejects_bad_fractions_and_sides():
    from prx_data.stream.holdout import Holdout

    with pytest.raises(ValueError, match="fraction"):
        Holdout(1.0)
    with pytest.raises(ValueError, match="side"):
        Holdout(0.1, keep="both")


# --- smoke run: eval and sample grid --------------------------------------------------------


def _smoke_cfg(tmp_path: Path, export, t5: str, run: str, extra=()):
    return load_config(
        SMOKE,
        [
            *tiny_overrides(t5),
            f"variables.data_root={export.root}",
            f"variables.run_name={run}",
            "data.plan.include_higher_tiers=false",
            f"trainer.save_folder={tmp_path / '{run_name}' / 'checkpoints'}",
            f"sampling.folder={tmp_path / '{run_name}' / 'samples'}",
            "trainer.max_duration=4ba",
            "trainer.save_interval=4ba",
            "logging.log_to_console=false",
            *extra,
        ],
    )


class RecordingDestinationDouble:
    """Test double of a logger destination: records logged images and metric names."""

    def __new__(cls):
        from composer.loggers import LoggerDestination

        class Recorder(LoggerDestination):
            def __init__(self) -> None:
                self.images: list[tuple[str, int, tuple]] = []
                self.metrics: set[str] = set()

            def log_images(self, images, name="Images", channels_last=False, step=None, *a, **kw):
                self.images.append((name, step, tuple(np.asarray(images).shape)))

            def log_metrics(self, metrics, step=None):
                self.metrics |= set(metrics)

        return Recorder()


def _fit(cfg, monkeypatch=None):
    from prx_data.train import trainer as trainer_mod
    from prx_data.train.sampling import SampleGrid
    from prx_data.train.trainer import build_trainer

    recorder = RecordingDestinationDouble()
    if monkeypatch is not None:
        monkeypatch.setattr(trainer_mod, "build_loggers", lambda cfg: [recorder])
    torch.manual_seed(0)
    trainer = build_trainer(cfg)
    trainer.fit()
    metrics = {k: float(v.compute()) for k, v in trainer.state.eval_metrics.get("eval", {}).items()}
    grid = next(c for c in trainer.state.callbacks if isinstance(c, SampleGrid))
    written = list(grid.written)
    trainer.close()
    if monkeypatch is not None:
        return metrics, written, recorder
    return metrics, written


def test_smoke_config_runs_eval_and_writes_a_sample_grid(tmp_path, export, tiny_t5, monkeypatch):
    from prx_data.train.evaluation import TOTAL, band_edges, band_name
    from prx_data.train.sampling import LABEL_H, PROMPT_W, grid_size, labelled_size

    cfg = _smoke_cfg(tmp_path, export, tiny_t5, "a")
    metrics, written, recorder = _fit(cfg, monkeypatch)
    names = {TOTAL} | {band_name(lo, hi) for lo, hi in band_edges(cfg.eval.num_bands)}
    assert set(metrics) == names
    assert all(np.isfinite(v) and v > 0 for v in metrics.values())
    # The total is the mean over bands (each sample scored once per band).
    bands = [metrics[band_name(lo, hi)] for lo, hi in band_edges(cfg.eval.num_bands)]
    assert metrics[TOTAL] == pytest.approx(sum(bands) / len(bands), rel=1e-9)

    assert written == [str(tmp_path / "a" / "samples" / "ba0000004.png")]
    s = cfg.sampling
    assert grid_size(len(s.prompts), len(s.seeds), s.shapes) == (4 * 64, 2 * 96)
    want = labelled_size(len(s.prompts), len(s.seeds), s.shapes)
    assert want == (4 * 64 + PROMPT_W, 2 * 96 + LABEL_H)
    with Image.open(written[0]) as im:
        assert im.size == want and im.mode == "RGB"
        labels = np.asarray(im)
        arr = labels[LABEL_H:, PROMPT_W:]
    # The seed band and the prompt band carry text (dark pixels on white).
    assert labels[:LABEL_H, PROMPT_W:].min() < 128 and labels[LABEL_H:, :PROMPT_W].min() < 128
    # 64x64 cells are centred in 64x96 cells: black bands above and below them only.
    assert arr[:16, :128].max() == 0 and arr[:16, 128:].max() > 0
    # The grid and the eval metrics reached the configured loggers.
    assert recorder.images == [("samples/grid", 4, (want[1], want[0], 3))]
    assert {f"metrics/eval/{n}" for n in names} <= recorder.metrics

    # Same config, new run folder: the eval loss is identical.
    again, _ = _fit(_smoke_cfg(tmp_path, export, tiny_t5, "b"))
    assert again == metrics


def test_eval_loss_is_fixed_per_sample_not_per_batch(tiny_t5):
    """Scoring a batch whole or split gives the same per-sample losses (noise keyed by id)."""
    from prx_data.train.trainer import build_model

    torch.manual_seed(0)
    cfg = load_config(None, tiny_overrides(tiny_t5))
    model = build_model(cfg)
    model.configure_eval(3, seed=5)
    g = torch.Generator().manual_seed(0)
    batch = {
        "image": (torch.rand(4, 3, 64, 64, generator=g) * 255).to(torch.uint8),
        "caption": ["a", "b", "", "d"],
        "id": ["x/1", "x/2", "x/3", "x/4"],
    }
    whole = model.eval_forward(batch)
    assert whole.shape == (4, 3)
    part = model.eval_forward({k: v[2:] for k, v in batch.items()})
    torch.testing.assert_close(part, whole[2:])
    model.configure_eval(3, seed=6)
    assert not torch.allclose(model.eval_forward(batch), whole)


def test_rerunning_a_finished_run_says_so(tmp_path, export, tiny_t5, capsys):
    from prx_data.cli.train import main
    from prx_data.train.trainer import build_trainer, run_is_finished

    cfg = _smoke_cfg(tmp_path, export, tiny_t5, "done", ["eval.enabled=false"])
    trainer = build_trainer(cfg)
    assert not run_is_finished(trainer)
    trainer.fit()
    trainer.close()
    again = build_trainer(cfg)
    assert run_is_finished(again)
    again.close()

    args = [
        str(SMOKE),
        *tiny_overrides(tiny_t5),
        f"variables.data_root={export.root}",
        "variables.run_name=done",
        "data.plan.include_higher_tiers=false",
        f"trainer.save_folder={tmp_path / '{run_name}' / 'checkpoints'}",
        f"sampling.folder={tmp_path / '{run_name}' / 'samples'}",
        "trainer.max_duration=4ba",
        "eval.enabled=false",
        "logging.log_to_console=false",
    ]
    assert main(args) == 0
    err = capsys.readouterr().err
    assert "'done' is already finished" in err and "trainer.max_duration" in err


def test_resume_refuses_a_different_holdout():
    from prx_data.train.callbacks import ResumeGuard

    saved = ResumeGuard(8, 2, holdout="0.01/eval").state_dict()
    ResumeGuard(8, 2, holdout="0.01/eval").load_state_dict(saved)
    with pytest.raises(ValueError, match="held out"):
        ResumeGuard(8, 2, holdout="none").load_state_dict(saved)
    # Checkpoints written before the hold-out existed count as "none".
    legacy = {"global_batch_size": 8, "num_workers": 2}
    ResumeGuard(8, 2).load_state_dict(legacy)


# --- sampler --------------------------------------------------------------------------------


def test_sampler_matches_diffusers_prx_pipeline(tiny_t5):
    """euler_sample + CFG gives PRXPipeline's images for the same noise, features and steps."""
    from diffusers import FlowMatchEulerDiscreteScheduler
    from diffusers.pipelines.prx.pipeline_prx import PRXPipeline

    from prx_data.train.flow import euler_sample
    from prx_data.train.sampling import cfg_velocity, seeded_noise
    from prx_data.train.trainer import build_model

    torch.manual_seed(0)
    cfg = load_config(None, tiny_overrides(tiny_t5))
    model = build_model(cfg).eval()
    prompts = ["a red fox", "a city at night"]
    feats, mask = model.encode_text(prompts + ["", ""], torch.device("cpu"))
    cond, uncond = feats.chunk(2)
    cmask, umask = mask.chunk(2)
    noise = seeded_noise([3, 4], (64, 32))
    steps, guidance = 5, 3.5

    with torch.no_grad():
        ours = euler_sample(cfg_velocity(model, cond, cmask, uncond, umask, guidance), noise, steps)
        pipe = PRXPipeline(
            transformer=model.transformer,
            scheduler=FlowMatchEulerDiscreteScheduler(),
            text_encoder=None,
            tokenizer=None,
            vae=None,
        )
        pipe.set_progress_bar_config(disable=True)
        # PRXPipeline's CFG step passes a [2] timestep, so it samples one prompt per call.
        ref = torch.cat(
            [
                pipe(
                    prompt_embeds=cond[i : i + 1],
                    prompt_attention_mask=cmask[i : i + 1],
                    negative_prompt_embeds=uncond[i : i + 1],
                    negative_prompt_attention_mask=umask[i : i + 1],
                    latents=noise[i : i + 1].clone(),
                    height=32,
                    width=64,
                    timesteps=(torch.linspace(1.0, 0.0, steps + 1)[:-1] * 1000).tolist(),
                    guidance_scale=guidance,
                    output_type="pt",
                    use_resolution_binning=False,
                ).images
                for i in range(len(prompts))
            ]
        )
    torch.testing.assert_close(ours, ref, rtol=1e-4, atol=1e-4)
    assert not torch.allclose(ours, noise)


# --- parallelism options ----------------------------------------------------------------------


def test_replication_with_fsdp_is_refused():
    with pytest.raises(ConfigError, match="data.plan.replication"):
        load_config(None, ["parallelism.fsdp.enabled=true", "data.plan.replication=2"])
    # replication=1 is the default behaviour and allowed; without FSDP replication stays valid.
    load_config(None, ["parallelism.fsdp.enabled=true", "data.plan.replication=1"])
    load_config(None, ["data.plan.replication=2"])


@pytest.mark.parametrize(
    "overrides,key",
    [
        (["parallelism.fsdp.activation_checkpointing=true"], "parallelism.fsdp"),
        (["parallelism.fsdp.enabled=true", "parallelism.fsdp.sharding_strategy=HALF"], "sharding"),
        (
            [
                "parallelism.fsdp.enabled=true",
                "parallelism.fsdp.version=2",
                "parallelism.fsdp.sharding_strategy=HYBRID_SHARD",
            ],
            "sharding_strategy",
        ),
        (["eval.enabled=true", "eval.holdout_fraction=0"], "eval.holdout_fraction"),
        (["eval.enabled=true", "eval.source=export"], "eval.datasets"),
        (["sampling.enabled=true", "sampling.shapes=[[100,64]]"], "sampling.shapes.0"),
        (["sampling.enabled=true", "sampling.guidance_scale=0.5"], "sampling.guidance_scale"),
    ],
)
def test_bad_eval_sampling_parallelism_options_name_the_key(overrides, key):
    with pytest.raises(ConfigError, match=key):
        load_config(None, overrides)


def test_fsdp_options_map_to_composer(tiny_t5):
    from composer.utils.parallelism import FSDP2Config, FSDPConfig
    from diffusers.models.transformers.transformer_prx import PRXBlock

    from prx_data.train.trainer import build_model, parallelism_kwargs

    cfg = load_config(
        None,
        [
            *tiny_overrides(tiny_t5),
            "parallelism.fsdp.enabled=true",
            "parallelism.fsdp.sharding_strategy=HYBRID_SHARD",
            "parallelism.fsdp.data_parallel_shard_degree=8",
            "parallelism.fsdp.activation_checkpointing=true",
            "parallelism.compile=true",
            "parallelism.compile_mode=max-autotune",
        ],
    )
    model = build_model(cfg)
    kw = parallelism_kwargs(cfg, model)
    fsdp = kw["parallelism_config"]["fsdp"]
    assert isinstance(fsdp, FSDPConfig)
    assert (fsdp.sharding_strategy, fsdp.data_parallel_shard_degree) == ("HYBRID_SHARD", 8)
    assert fsdp.activation_checkpointing and fsdp.use_orig_params
    assert kw["compile_config"] == {"mode": "max-autotune"}
    blocks = [m for m in model.transformer.modules() if model.transformer.fsdp_wrap_fn(m)]
    assert blocks and all(isinstance(m, PRXBlock) for m in blocks)
    assert len(blocks) == cfg.model.depth

    cfg2 = load_config(
        None,
        [*tiny_overrides(tiny_t5), "parallelism.fsdp.enabled=true", "parallelism.fsdp.version=2"],
    )
    assert isinstance(parallelism_kwargs(cfg2, model)["parallelism_config"]["fsdp"], FSDP2Config)
    assert parallelism_kwargs(load_config(None), model) == {}


def test_shipped_fsdp_configs_state_their_sharding():
    for name, strategy in [
        ("pretrain_1b_fsdp.yaml", "FULL_SHARD"),
        ("pretrain_8b_hsdp.yaml", "HYBRID_SHARD"),
    ]:
        cfg = load_config(REPO / "configs" / "train" / name)
        f = cfg.parallelism.fsdp
        assert f.enabled and f.sharding_strategy == strategy and f.activation_checkpointing
        assert cfg.data.plan.replication is None


def test_smoke_config_documents_run_name_and_autoresume():
    text = SMOKE.read_text()
    assert "run_name names the run folder" in text and "already finished" in text
    assert json.dumps(load_config(SMOKE).trainer.autoresume) == "true"


# --- the prepared GPU check ---------------------------------------------------------------------


def test_gpu_check_without_cuda_prints_one_skipped_line_per_step(capsys, monkeypatch):
    import importlib.util

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    spec = importlib.util.spec_from_file_location("gpu_check", REPO / "scripts" / "gpu_check.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    assert mod.main([]) == 0
    out = capsys.readouterr().out.splitlines()
    rows = [ln for ln in out if ln.split(" ")[0] in mod.STEPS]
    assert [r.split()[0] for r in rows] == list(mod.STEPS)
    assert all(r.endswith("skipped: no CUDA") for r in rows)


@pytest.mark.slow
@pytest.mark.timeout(1800)
def test_gpu_check_train_and_eval_steps_run_on_cpu(tmp_path):
    import subprocess
    import sys

    proc = subprocess.run(
        [
            sys.executable,
            str(REPO / "scripts" / "gpu_check.py"),
            "--device",
            "cpu",
            "--steps",
            "train,data,decode,eval,latent,metrics",
            "--train-steps",
            "6",
            "--work",
            str(tmp_path),
        ],
        capture_output=True,
        text=True,
        timeout=1500,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    rows = {
        ln.split()[0]: ln
        for ln in proc.stdout.splitlines()
        if ln.split(" ")[0] in ("train", "data", "decode", "eval", "latent", "metrics")
    }
    assert set(rows) == {"train", "data", "decode", "eval", "latent", "metrics"} and all(
        " ok " in r for r in rows.values()
    )


# --- decoding on the device ---------------------------------------------------------------------


def _photo_like(w: int, h: int) -> Image.Image:
    yy, xx = np.mgrid[0:h, 0:w].astype(np.float64)
    r = 127 + 100 * np.sin(xx / 37.0) * np.cos(yy / 23.0)
    g = 127 + 90 * np.cos((xx + yy) / 51.0)
    b = 127 + 80 * np.sin(np.hypot(xx - w / 3, yy - h / 2) / 29.0)
    arr = np.stack([r, g, b], -1).clip(0, 255).astype(np.uint8)
    return Image.fromarray(arr, "RGB")


def _jpeg(im: Image.Image) -> bytes:
    import io

    buf = io.BytesIO()
    im.save(buf, "JPEG", quality=92)
    return buf.getvalue()


def test_batch_decode_matches_the_loader_decode():
    """decode_batch (nvJPEG on GPU, libjpeg here) ~ the loader's Pillow path, any source size."""
    from prx_data.core.imaging import ImageError
    from prx_data.stream.decode import decode_batch, decode_to

    def psnr(a, b):
        mse = np.mean((a.astype(np.float64) - b.astype(np.float64)) ** 2)
        return 10 * np.log10(255.0**2 / mse)

    same = [_jpeg(_photo_like(512, 384)), _jpeg(_photo_like(512, 384).transpose(0))]
    out = decode_batch(same, (512, 384), "cpu")
    assert out.shape == (2, 3, 384, 512) and out.dtype == torch.uint8
    for data, got in zip(same, out, strict=True):
        assert psnr(got.permute(1, 2, 0).numpy(), decode_to(data, (512, 384))) > 45
    # Higher-tier sources (another size, slightly other ratio) are cover-resized.
    big = [_jpeg(_photo_like(2048, 1536)), _jpeg(_photo_like(2100, 1536))]
    out = decode_batch(big, (512, 384), "cpu")
    assert out.shape == (2, 3, 384, 512)
    for data, got in zip(big, out, strict=True):
        assert psnr(got.permute(1, 2, 0).numpy(), decode_to(data, (512, 384))) > 35
    # PNG goes through the CPU decoder; garbage is a countable ImageError.
    import io

    buf = io.BytesIO()
    _photo_like(512, 384).save(buf, "PNG")
    png = decode_batch([buf.getvalue()], (512, 384), "cpu")[0].permute(1, 2, 0).numpy()
    np.testing.assert_array_equal(png, np.asarray(_photo_like(512, 384)))
    with pytest.raises(ImageError):
        decode_batch([b"not an image"], (512, 384), "cpu")


def test_trainer_decodes_on_the_device_when_asked(tmp_path, export, tiny_t5):
    from prx_data.train.data import EncodedBucketedDataset
    from prx_data.train.trainer import build_trainer

    cfg = load_config(
        None,
        [
            *tiny_overrides(tiny_t5),
            f"data.datasets=[{{root: {export.root}}}]",
            "data.decode=device",
            "data.global_batch_size=4",
            "data.num_workers=0",
            "trainer.max_duration=2ba",
            "logging.log_to_console=false",
        ],
    )
    trainer = build_trainer(cfg)
    assert isinstance(trainer.state.train_dataloader.dataset, EncodedBucketedDataset)
    batch = next(iter(trainer.state.train_dataloader))
    assert isinstance(batch["image"], list) and isinstance(batch["image"][0], bytes)
    trainer.fit()
    assert int(trainer.state.timestamp.sample) == 8
    assert np.isfinite(float(trainer.state.loss))
    trainer.close()


# --- FSDP wiring on two CPU processes (gloo) ---------------------------------------------------


@pytest.mark.slow
@pytest.mark.timeout(1500)
def test_fsdp2_trains_on_two_gloo_ranks(tmp_path, export, tiny_t5):
    """composer -n 2 with parallelism.fsdp (fully_shard) on CPU: trains and saves a checkpoint.

    Composer's FSDP1 places units on CUDA, so version 1 is checked by scripts/gpu_check.sh.
    """
    import os
    import socket
    import subprocess
    import sys

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    logs = tmp_path / "logs"
    logs.mkdir()
    cmd = [
        sys.executable,
        "-m",
        "composer.cli.launcher",
        "-n",
        "2",
        "--master_port",
        str(port),
        "--stdout",
        str(logs / "rank{rank}.stdout"),
        "--stderr",
        str(logs / "rank{rank}.stderr"),
        "-m",
        "prx_data.cli.train",
        str(SMOKE),
        *tiny_overrides(tiny_t5),
        f"variables.data_root={export.root}",
        "variables.run_name=fsdp2",
        "data.plan.include_higher_tiers=false",
        "data.global_batch_size=4",
        f"trainer.save_folder={tmp_path / 'ckpt'}",
        "trainer.max_duration=2ba",
        "trainer.save_interval=2ba",
        "eval.enabled=false",
        "sampling.enabled=false",
        "parallelism.fsdp.enabled=true",
        "parallelism.fsdp.version=2",
        "parallelism.fsdp.activation_checkpointing=true",
    ]
    env = dict(os.environ, HF_HUB_OFFLINE="1", OMP_NUM_THREADS="1")
    env["PYTHONPATH"] = str(REPO) + os.pathsep + env.get("PYTHONPATH", "")
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=1200)
    tails = "\n".join(p.read_text()[-2000:] for p in sorted(logs.glob("*")))
    assert proc.returncode == 0, proc.stderr[-3000:] + tails
    assert any((tmp_path / "ckpt").rglob("*")), "no checkpoint written"


def test_a_passed_in_dataset_cannot_hide_the_holdout(export, tiny_t5):
    from prx_data.train.trainer import build_trainer

    cfg = load_config(
        None,
        [*tiny_overrides(tiny_t5), "eval.enabled=true", f"data.datasets=[{{root: {export.root}}}]"],
    )
    with pytest.raises(ValueError, match="eval.source=slice with a dataset passed in"):
        build_trainer(cfg, dataset=object())


def test_eval_plan_that_cannot_run_is_one_line_naming_eval(tmp_path, export, tiny_t5):
    from prx_data.stream.planner import PlanError
    from prx_data.train.evaluation import build_evaluator

    # A hold-out so thin that no sample falls in it: nothing to evaluate.
    cfg = _smoke_cfg(tmp_path, export, tiny_t5, "thin", ["eval.holdout_fraction=1e-9"])
    with pytest.raises(PlanError) as info:
        build_evaluator(cfg, 1, cfg.model.patch_size)
    msg = str(info.value)
    assert msg.startswith("eval: ") and "\n" not in msg
    assert "eval.holdout_fraction" in msg  # and how to fix it
