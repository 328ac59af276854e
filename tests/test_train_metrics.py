"""FID / CMMD / DINO-MMD: reference values, tiny feature models, the callback, ``compare``."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from torch import nn

from prx_data.train.config import ConfigError, load_config
from tests.trainkit import save_tiny_t5, tiny_overrides

REPO = Path(__file__).resolve().parents[1]
SMOKE_LATENT = REPO / "configs" / "train" / "smoke_latent_cpu.yaml"


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> dict[str, str]:
    from prx_data.train.metrics import save_tiny_metric_models
    from prx_data.train.vae import save_tiny_autoencoder

    root = tmp_path_factory.mktemp("tiny")
    paths = save_tiny_metric_models(str(root))
    paths["t5"] = save_tiny_t5(root / "t5")
    paths["vae"] = save_tiny_autoencoder(str(root / "vae"))
    return paths


# --- reference implementations ------------------------------------------------------------------


def _numpy_mmd(x: np.ndarray, y: np.ndarray, sigma: float = 10.0, scale: float = 1000.0) -> float:
    """google-research/cmmd distance.mmd, written out with numpy."""
    gamma = 1 / (2 * sigma**2)

    def k(a, b):
        d2 = (a * a).sum(1)[:, None] + (b * b).sum(1)[None, :] - 2 * a @ b.T
        return np.exp(-gamma * d2)

    return float(scale * (k(x, x).mean() + k(y, y).mean() - 2 * k(x, y).mean()))


def test_mmd_matches_a_numpy_reference():
    from prx_data.train.metrics import mmd

    rng = np.random.default_rng(0)
    for n, m, d, shift in [(40, 30, 16, 0.5), (25, 25, 64, 2.0), (10, 50, 8, 0.0)]:
        x = rng.normal(size=(n, d))
        y = rng.normal(size=(m, d)) + shift
        got = float(mmd(torch.from_numpy(x), torch.from_numpy(y)))
        assert got == pytest.approx(_numpy_mmd(x, y), rel=1e-4, abs=1e-8)


class _Passthrough(nn.Module):
    """Test double of a feature extractor: the 'images' already are the features."""

    num_features = 12

    def forward(self, x):
        return x.double()


def test_frechet_distance_matches_scipy_sqrtm():
    """torchmetrics' FID computation (what FID uses here) = the scipy sqrtm formula to 1e-4."""
    from scipy import linalg
    from torchmetrics.image.fid import FrechetInceptionDistance

    rng = np.random.default_rng(1)
    x = rng.normal(size=(200, 12))
    y = rng.normal(size=(150, 12)) @ rng.normal(size=(12, 12)) * 0.5 + 0.3
    fid = FrechetInceptionDistance(feature=_Passthrough())
    fid.update(torch.from_numpy(x), real=True)
    fid.update(torch.from_numpy(y), real=False)
    got = float(fid.compute())
    mu1, mu2 = x.mean(0), y.mean(0)
    s1, s2 = np.cov(x, rowvar=False), np.cov(y, rowvar=False)
    covmean = linalg.sqrtm(s1 @ s2).real
    want = float(((mu1 - mu2) ** 2).sum() + np.trace(s1 + s2 - 2 * covmean))
    assert got == pytest.approx(want, rel=1e-4)


# --- tiny feature models ------------------------------------------------------------------------


def _images(seed: int, n: int = 6, size: int = 48) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return (torch.rand(n, 3, size, size, generator=g) * 255).to(torch.uint8)


def test_metrics_are_deterministic_zero_for_identical_and_grow_with_a_shift(tiny):
    from prx_data.train.metrics import build_metrics

    real = _images(0)
    shifted = (real.float() * 0.5 + 100).to(torch.uint8)
    values = {}
    for _attempt in range(2):
        metrics = build_metrics(tiny["fid"], tiny["clip"], tiny["dino"])
        assert list(metrics) == ["FID", "CMMD", "DINO-MMD"]
        for name, m in metrics.items():
            m.update(real, real=True)
            m.update(real, real=False)
            same = float(m.compute())
            m.reset()
            m.update(real, real=True)
            m.update(shifted, real=False)
            values.setdefault(name, []).append((same, float(m.compute())))
    for name, ((same, far), again) in values.items():
        assert again == (same, far), name  # fresh models from the same files: same numbers
        assert abs(same) < 1e-6, (name, same)
        assert far > 1e-3, (name, far)


def test_feature_models_load_by_path_with_their_classes(tiny):
    from transformers import CLIPVisionModelWithProjection, Dinov2Model

    from prx_data.train.metrics import load_features

    clip = load_features("clip", tiny["clip"])
    dino = load_features("dino", tiny["dino"])
    assert isinstance(clip.model, CLIPVisionModelWithProjection)
    assert isinstance(dino.model, Dinov2Model)
    feats = clip(_images(3, n=2))
    assert feats.shape == (2, 16)
    torch.testing.assert_close(feats.norm(dim=-1), torch.ones(2, dtype=torch.float64))


@pytest.mark.parametrize(
    "overrides,key",
    [
        (["metrics.enabled=true"], "eval.enabled"),
        (["metrics.enabled=true", "eval.enabled=true", "metrics.num_samples=1"], "num_samples"),
        (
            [
                "metrics.enabled=true",
                "eval.enabled=true",
                "metrics.fid_model=null",
                "metrics.clip_model=null",
                "metrics.dino_model=null",
            ],
            "metrics.fid_model",
        ),
    ],
)
def test_bad_metrics_options_name_the_key(overrides, key):
    with pytest.raises(ConfigError, match=key):
        load_config(None, overrides)


# --- the callback on the latent smoke config ---------------------------------------------------------


def _smoke(tmp_path: Path, tiny, export_root: str, run: str, extra=()):
    return load_config(
        SMOKE_LATENT,
        [
            *tiny_overrides(tiny["t5"]),
            "model.patch_size=4",
            f"vae.name_or_path={tiny['vae']}",
            f"metrics.fid_model={tiny['fid']}",
            f"metrics.clip_model={tiny['clip']}",
            f"metrics.dino_model={tiny['dino']}",
            f"variables.data_root={export_root}",
            f"variables.run_name={run}",
            "data.plan.include_higher_tiers=false",
            f"trainer.save_folder={tmp_path / '{run_name}' / 'checkpoints'}",
            "trainer.max_duration=2ba",
            "trainer.save_interval=2ba",
            "eval.interval=2ba",
            "metrics.interval=2ba",
            "metrics.num_samples=4",
            "metrics.steps=2",
            "sampling.enabled=false",
            "logging.log_to_console=false",
            *extra,
        ],
    )


@pytest.mark.slow
@pytest.mark.timeout(1200)
def test_smoke_latent_config_logs_fid_cmmd_dino_mmd(tmp_path, tiny, monkeypatch):
    from composer.loggers import LoggerDestination

    from prx_data.train import trainer as trainer_mod
    from prx_data.train.metrics import GenerationMetrics
    from tests.exportkit import make_export

    class RecorderDouble(LoggerDestination):
        """Test double of a logger destination: records metric names and values."""

        def __init__(self) -> None:
            self.metrics: dict[str, float] = {}

        def log_metrics(self, metrics, step=None):
            self.metrics.update({k: float(v) for k, v in metrics.items()})

    export = make_export(str(tmp_path / "export"), {"512/1.000": 12, "512/0.778": 8})
    recorder = RecorderDouble()
    monkeypatch.setattr(trainer_mod, "build_loggers", lambda cfg: [recorder])
    cfg = _smoke(tmp_path, tiny, export.root, "m")
    torch.manual_seed(0)
    trainer = trainer_mod.build_trainer(cfg)
    trainer.fit()
    cb = next(c for c in trainer.state.callbacks if isinstance(c, GenerationMetrics))
    trainer.close()
    assert len(cb.written) == 1
    record = json.loads(Path(cb.written[0]).read_text())
    assert record["batch"] == 2 and record["num_samples"] == 4
    assert set(record["metrics"]) == {"FID", "CMMD", "DINO-MMD"}
    assert all(np.isfinite(v) for v in record["metrics"].values())
    for name, value in record["metrics"].items():
        assert recorder.metrics[f"metrics/gen/{name}"] == pytest.approx(value)
    folder = tmp_path / "m" / "checkpoints" / "metrics"
    assert Path(cb.written[0]).parent == folder
    evals = json.loads((folder / "eval-ba0000002.json").read_text())
    assert "FlowLoss" in evals["metrics"]

    # Fixed prompts and seeds: the same config scores the same in a new run folder.
    torch.manual_seed(0)
    trainer = trainer_mod.build_trainer(_smoke(tmp_path, tiny, export.root, "m2"))
    trainer.fit()
    cb2 = next(c for c in trainer.state.callbacks if isinstance(c, GenerationMetrics))
    trainer.close()
    assert cb2.history == cb.history


# --- compare ------------------------------------------------------------------------------------------


def _fake_run(folder: Path, fid: list[float], loss: list[float]) -> Path:
    """A run's metrics folder as the trainer writes it (gen-ba*.json, eval-ba*.json)."""
    m = folder / "checkpoints" / "metrics"
    m.mkdir(parents=True)
    for i, (f, lo) in enumerate(zip(fid, loss, strict=True)):
        step = 100 * (i + 1)
        gen = {"FID": f, "CMMD": f / 10, "DINO-MMD": f / 20}
        (m / f"gen-ba{step:07d}.json").write_text(json.dumps({"batch": step, "metrics": gen}))
        ev = {"FlowLoss": lo, "FlowLoss_t0.00-0.50": lo * 0.8, "FlowLoss_t0.50-1.00": lo * 1.2}
        (m / f"eval-ba{step:07d}.json").write_text(json.dumps({"batch": step, "metrics": ev}))
    return folder


def test_compare_renders_both_runs_and_prints_a_table(tmp_path, capsys):
    from PIL import Image

    from prx_data.cli.train import main

    a = _fake_run(tmp_path / "caption-alt", [80.0, 60.0, 50.0], [0.9, 0.8, 0.7])
    b = _fake_run(tmp_path / "caption-qwen", [70.0, 45.0, 30.0], [0.85, 0.7, 0.6])
    out = tmp_path / "cmp.png"
    assert main(["compare", str(a), str(b), "--out", str(out)]) == 0
    text = capsys.readouterr().out
    lines = {ln.split()[0]: ln.split() for ln in text.splitlines() if ln.strip()}
    for name in ("FID", "CMMD", "DINO-MMD", "FlowLoss", "FlowLoss_t0.00-0.50"):
        assert name in lines, text
    # The last common step, A's and B's values, B - A.
    assert lines["FID"][1:4] == ["300", "50", "30"] and float(lines["FID"][4]) == -20
    assert "caption-alt" in text and "caption-qwen" in text
    with Image.open(out) as im:
        assert im.size[0] > 600 and im.size[1] > 300
        arr = np.asarray(im.convert("RGB")).astype(int)
    # Both runs' lines are drawn: matplotlib's first two colours (blue, orange) both appear.
    blue = ((abs(arr - [31, 119, 180]).sum(-1)) < 30).sum()
    orange = ((abs(arr - [255, 127, 14]).sum(-1)) < 30).sum()
    assert blue > 50 and orange > 50, (blue, orange)

    assert main(["compare", str(a), str(tmp_path / "nothing"), "--out", str(out)]) == 2
    assert "no evaluation results" in capsys.readouterr().err


def test_a_missing_metric_model_is_one_line_naming_the_key(tmp_path):
    from prx_data.train.metrics import build_metrics

    with pytest.raises(ValueError, match="metrics.clip_model: cannot load") as err:
        build_metrics(None, str(tmp_path / "no-clip"), None)
    assert "\n" not in str(err.value)


def test_compare_puts_the_runs_last_sample_grids_side_by_side(tmp_path):
    from PIL import Image

    from prx_data.train.compare import compare

    runs = []
    for name, colour in (("a", (230, 20, 20)), ("b", (20, 200, 20))):
        run = _fake_run(tmp_path / name, [80.0, 60.0, 50.0], [0.9, 0.8, 0.7])
        (run / "samples").mkdir(exist_ok=True)
        Image.new("RGB", (64, 32), (0, 0, 0)).save(run / "samples" / "ba0000100.png")
        Image.new("RGB", (64, 32), colour).save(run / "samples" / "ba0000300.png")  # the last
        runs.append(run)
    png, _ = compare(str(runs[0]), str(runs[1]), tmp_path / "cmp.png")
    with Image.open(png) as im:
        arr = np.asarray(im.convert("RGB")).astype(int)
    lower = arr[arr.shape[0] // 2 :]
    red = (abs(lower - [230, 20, 20]).sum(-1) < 30).nonzero()[1]
    green = (abs(lower - [20, 200, 20]).sum(-1) < 30).nonzero()[1]
    assert len(red) > 500 and len(green) > 500
    assert red.mean() < arr.shape[1] / 2 < green.mean()  # A on the left, B on the right


# --- distinct held-out samples ----------------------------------------------------------------


def test_a_hold_out_too_small_for_the_metrics_is_refused_at_plan_time(tmp_path, tiny):
    from types import SimpleNamespace as NS

    from prx_data.stream.planner import PlanError
    from prx_data.train.evaluation import check_metrics_holdout

    cfg = _smoke(tmp_path, tiny, str(tmp_path / "export"), "m")
    # One held-out image, "filled" to a batch of 4: one distinct sample, not four.
    plan = NS(buckets=[NS(kept=1, choose=4, excluded=False), NS(kept=9, choose=8, excluded=True)])
    with pytest.raises(
        PlanError, match="need at least 2 distinct held-out images and the hold-out holds 1"
    ):
        check_metrics_holdout(cfg, plan)
    check_metrics_holdout(cfg, NS(buckets=[NS(kept=1, choose=1, excluded=False)] * 2))


def test_generation_metrics_skip_repeated_copies_of_a_sample(monkeypatch):
    """The eval stream repeats samples (padding, small_buckets: fill): each is measured once."""
    from types import SimpleNamespace as NS

    from torchmetrics import Metric

    import prx_data.train.metrics as M

    class Seen(Metric):
        def __init__(self) -> None:
            super().__init__()
            self.add_state("ids", default=[], dist_reduce_fx="cat")

        def update(self, images, real):
            if real:
                self.ids.append(images[:, 0, 0, 0].clone())

        def compute(self):
            from torchmetrics.utilities import dim_zero_cat

            # A list, or one tensor once torchmetrics synced it (a process group exists).
            return torch.tensor(float(len(dim_zero_cat(self.ids))))

    def fake_generate(model, batch, **kw):
        x = batch["image"].float()
        return x, x

    monkeypatch.setattr(M, "generate_like", fake_generate)
    ids = [["a", "b"], ["a", "c"], ["c", "c"], ["d", "a"]]  # four distinct of eight
    batches = [
        {"id": b, "image": torch.tensor([float(ord(i)) for i in b]).reshape(-1, 1, 1, 1)}
        for b in ids
    ]
    model = NS(transformer=nn.Linear(1, 1))
    state = NS(
        model=model,
        precision="fp32",
        device=NS(batch_to_device=lambda b: b),
        evaluators=[NS(label="eval", dataloader=NS(dataloader=batches))],
        timestamp=NS(batch=0),
        run_name="r",
    )
    seen = Seen()
    cb = M.GenerationMetrics({"seen": seen}, num_samples=10, interval="1ba", folder=None)
    logger = NS(log_metrics=lambda m: None)
    assert cb.evaluate(state, logger) == {"seen": 4.0}
    assert sorted(chr(int(v)) for v in torch.cat(seen.ids)) == ["a", "b", "c", "d"]
    cb.num_samples = 3  # the cap counts distinct samples too
    assert cb.evaluate(state, logger) == {"seen": 3.0}


@pytest.mark.parametrize("name", ["smoke_latent_cpu.yaml", "smoke_latent_cached_cpu.yaml"])
def test_smoke_configs_hold_out_enough_of_the_demo_after_the_readme_opt_out(name):
    """The README runs each smoke config after its opt-out row (the demo's first two ids):
    the hold-out must still give the metrics their samples, and training a full batch."""
    import pyarrow as pa

    from prx_data.core.buckets import assign_bucket
    from prx_data.core.sample_data import DEFAULT_SIZES
    from prx_data.stream.holdout import Holdout

    # The demo's export, as its sample collection buckets (python -m prx_data.demo, 2 repeats).
    buckets = {}
    for k, (w, h) in enumerate(list(DEFAULT_SIZES) * 2):
        got = assign_bucket(w, h)
        if got.bucket is not None:
            buckets[f"demo/img_{k:04d}"] = got.bucket
    opted_out = set(sorted(buckets)[:2])  # cli.demo._write_optout_ids: the first ids
    cfg = load_config(REPO / "configs" / "train" / name, [])
    assert cfg.metrics.enabled
    d, e = cfg.data, cfg.eval
    ids = sorted(buckets)
    held = Holdout(e.holdout_fraction, e.holdout_salt, "eval").mask(pa.array(ids)).tolist()
    streamed = {
        i
        for i in ids
        if i not in opted_out
        and (
            buckets[i].tier == d.plan.tier
            or (d.plan.include_higher_tiers and buckets[i].tier > d.plan.tier)
        )
    }
    evaluated = [i for i, h in zip(ids, held, strict=True) if h and i in streamed]
    assert len(evaluated) >= max(2, cfg.metrics.num_samples), evaluated
    trained: dict[str, int] = {}
    for i, h in zip(ids, held, strict=True):
        if not h and i in streamed:
            trained[buckets[i].name] = trained.get(buckets[i].name, 0) + 1
    assert max(trained.values()) >= d.global_batch_size, trained
