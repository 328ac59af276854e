"""Training: config loading/overrides/errors, captions, flow, collate, and a tiny overfit run."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from prx_data.train.captions import CaptionPolicy
from prx_data.train.config import ConfigError, load_config, to_yaml
from prx_data.train.data import collate, num_samples_in_batch, split_batch
from prx_data.train.flow import interpolate, logit_normal_timesteps, uint8_to_unit
from tests.trainkit import save_tiny_t5, tiny_overrides

REPO = Path(__file__).resolve().parents[1]
CONFIGS = sorted((REPO / "configs" / "train").glob("*.yaml"))


@pytest.fixture(scope="module")
def tiny_t5(tmp_path_factory) -> str:
    return save_tiny_t5(tmp_path_factory.mktemp("t5"))


# --- config -------------------------------------------------------------------


YAML = """
variables:
  root: /data/a
model:
  hidden_size: 128
  num_heads: 4
data:
  datasets:
    - root: ${variables.root}
      proportion: 0.7
    - root: /data/b
      proportion: 0.3
  plan:
    tier: 512
  caption_columns:
    - {name: caption_vlm, weight: 3}
    - {name: caption, weight: 1}
  streaming:
    predownload: 8
trainer:
  max_duration: 10ba
"""


def _write(tmp_path: Path, text: str) -> Path:
    p = tmp_path / "run.yaml"
    p.write_text(text)
    return p


def test_yaml_and_overrides(tmp_path):
    cfg = load_config(
        _write(tmp_path, YAML),
        [
            "variables.root=/data/z",
            "data.datasets.1.proportion=0.5",
            "data.plan.tier=1024",
            "data.plan.include_higher_tiers=true",
            "optimizer.betas=[0.8,0.99]",
            "trainer.ema.enabled=true",
            "data.streaming.cache_limit=10gb",
            "data.caption_columns.0.weight=2.5",
        ],
    )
    assert cfg.data.datasets[0].root == "/data/z"  # interpolation sees the override
    assert [d.proportion for d in cfg.data.datasets] == [0.7, 0.5]
    assert cfg.data.plan.tier == 1024 and cfg.data.plan.include_higher_tiers is True
    assert cfg.optimizer.betas == [0.8, 0.99]
    assert cfg.trainer.ema.enabled is True
    assert cfg.data.streaming == {"predownload": 8, "cache_limit": "10gb"}
    assert [(c.name, c.weight) for c in cfg.data.caption_columns] == [
        ("caption_vlm", 2.5),
        ("caption", 1.0),
    ]
    assert cfg.model.hidden_size == 128 and cfg.model.depth == 16  # YAML over defaults
    # The resolved YAML reloads to the same config.
    again = load_config(_write(tmp_path, to_yaml(cfg)))
    assert again == cfg


@pytest.mark.parametrize(
    ("yaml_text", "overrides", "key"),
    [
        ("data:\n  tierr: 512\n", [], "data.tierr"),
        ("", ["data.plan.tier=abc"], "data.plan.tier"),
        ("", ["trainer.max_durationn=3ba"], "trainer.max_durationn"),
        ("data:\n  datasets:\n    - root: /x\n      weight: 2\n", [], "weight"),
        ("", ["model.hidden_size=100", "model.num_heads=3"], "model.hidden_size"),
        ("", ["data.caption_dropout=1.5"], "data.caption_dropout"),
        ("", ["trainer.precision=amp_bf17"], "trainer.precision"),
        ("", ["trainer.autoresume=true"], "trainer.save_folder"),
        ("", ["optimizer.name=sgdd"], "optimizer.name"),
        (
            "data:\n  datasets:\n    - {root: /x, proportion: 1, repeat: 2}\n",
            [],
            "data.datasets.0",
        ),
        ("", ["data.plan.batching_method=random"], "data.plan.batching_method"),
        ("", ["nonsense"], "nonsense"),
        ("", ["trainer.max_duration=10 steps"], "trainer.max_duration"),
    ],
)
def test_bad_config_names_the_key(tmp_path, yaml_text, overrides, key):
    with pytest.raises(ConfigError) as err:
        load_config(_write(tmp_path, yaml_text), overrides)
    assert key in str(err.value)


def test_device_batch_size_must_divide():
    from prx_data.train.config import device_batch_size

    cfg = load_config(None, ["data.global_batch_size=12"])
    assert device_batch_size(cfg.data, 4) == 3
    with pytest.raises(ConfigError, match="data.global_batch_size"):
        device_batch_size(cfg.data, 5)
    cfg = load_config(None, ["data.global_batch_size=12", "data.device_batch_size=4"])
    with pytest.raises(ConfigError, match="data.device_batch_size"):
        device_batch_size(cfg.data, 4)


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.name)
def test_shipped_configs_load(path):
    cfg = load_config(path)
    assert cfg.data.datasets and cfg.trainer.run_name


def test_cli_help_and_config_error():
    env_cmd = [sys.executable, "-m", "prx_data.train"]
    out = subprocess.run([*env_cmd, "--help"], capture_output=True, text=True, cwd=REPO)
    assert out.returncode == 0 and "autoresume" in out.stdout and "key=value" in out.stdout
    bad = subprocess.run(
        [*env_cmd, str(REPO / "configs/train/smoke_cpu.yaml"), "data.tierr=1", "--print-config"],
        capture_output=True,
        text=True,
        cwd=REPO,
    )
    assert bad.returncode == 2 and "data.tierr" in bad.stderr


# --- captions, flow, collate -------------------------------------------------------


def test_caption_policy_weights_dropout_and_fallback():
    n = 4000
    batch = {"a": ["A"] * n, "b": ["B"] * n}
    g = torch.Generator().manual_seed(0)
    picks = CaptionPolicy(("a", "b"), (3.0, 1.0), dropout=0.2).choose(batch, g)
    share = {k: picks.count(k) / n for k in ("A", "B", "")}
    # 0.8 * 0.75 = 0.6, 0.8 * 0.25 = 0.2, dropout 0.2; binomial sd < 0.01 at n=4000.
    assert abs(share["A"] - 0.6) < 0.03 and abs(share["B"] - 0.2) < 0.03
    assert abs(share[""] - 0.2) < 0.03
    # An empty pick falls back to the other column instead of silently training unconditioned.
    only_a = CaptionPolicy(("a", "b"), (1.0, 0.0)).choose({"a": ["", "x"], "b": ["y", "z"]})
    assert only_a == ["y", "x"]
    with pytest.raises(KeyError, match="caption_vlm"):
        CaptionPolicy.single("caption_vlm").choose({"caption": ["x"]})


def test_caption_policy_warns_once_when_its_columns_are_empty():
    import warnings

    import prx_data.train.captions as C

    empty = {"caption": ["", None, ""], "caption_vlm": ["", "", ""]}
    policy = CaptionPolicy(("caption", "caption_vlm"), (1.0, 1.0), warn_empty=True)
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        policy.choose(empty)
        policy.choose(empty)  # once, not per batch
    (w,) = [x for x in seen if "were empty" in str(x.message)]
    assert "caption, caption_vlm were empty for 100% of the 3 samples" in str(w.message)
    # A share above the threshold, once enough samples were drawn; dropout does not count.
    n = C.EMPTY_WARN_AFTER
    mostly = {"caption": ["x" if i % 4 == 0 else "" for i in range(n)]}
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        CaptionPolicy(("caption",), (1.0,), warn_empty=True).choose(mostly)
        CaptionPolicy(("caption",), (1.0,), dropout=0.6, warn_empty=True).choose(
            {"caption": ["x"] * n}, torch.Generator().manual_seed(0)
        )
        CaptionPolicy(("caption",), (1.0,)).choose(empty)  # eval's policy: no warning
    assert len([x for x in seen if "were empty for 75%" in str(x.message)]) == 1
    assert len([x for x in seen if "were empty" in str(x.message)]) == 1


def test_flow_pieces():
    x0 = uint8_to_unit(torch.tensor([[[[0, 255]]]], dtype=torch.uint8))
    assert x0.flatten().tolist() == [-1.0, 1.0]
    noise = torch.randn(3, 3, 4, 4)
    x = torch.randn(3, 3, 4, 4)
    t = torch.tensor([0.0, 1.0, 0.25])
    xt = interpolate(x, noise, t)
    assert torch.equal(xt[0], x[0]) and torch.equal(xt[1], noise[1])
    assert torch.allclose(xt[2], 0.75 * x[2] + 0.25 * noise[2])
    ts = logit_normal_timesteps(
        10000, mean=1.0, std=1.0, generator=torch.Generator().manual_seed(1)
    )
    assert float(ts.min()) > 0 and float(ts.max()) < 1
    assert abs(float(torch.logit(ts).mean()) - 1.0) < 0.05


def test_collate_counts_and_refuses_mixed_shapes():
    a = {"image": torch.zeros(3, 8, 4, dtype=torch.uint8), "id": "a", "tier": 512, "caption": "x"}
    b = {"image": torch.zeros(3, 8, 4, dtype=torch.uint8), "id": "b", "tier": 512, "caption": "y"}
    batch = collate([a, b])
    assert batch["image"].shape == (2, 3, 8, 4) and batch["id"] == ["a", "b"]
    assert batch["tier"].tolist() == [512, 512] and num_samples_in_batch(batch) == 2
    parts = split_batch(batch, 1)
    assert [p["id"] for p in parts] == [["a"], ["b"]]
    c = dict(a, image=torch.zeros(3, 4, 8, dtype=torch.uint8))
    with pytest.raises(ValueError, match="single bucket"):
        collate([a, c])


def test_resume_guard_refuses_a_different_global_batch():
    from prx_data.train.callbacks import ResumeGuard

    saved = ResumeGuard(global_batch_size=8, num_workers=2).state_dict()
    ResumeGuard(8, 2).load_state_dict(saved)  # same layout: fine on any world size
    with pytest.raises(ValueError, match="data.global_batch_size"):
        ResumeGuard(16, 2).load_state_dict(saved)
    with pytest.raises(ValueError, match="data.num_workers"):
        ResumeGuard(8, 4).load_state_dict(saved)


def test_data_wait_monitor_measures_the_blocked_share():
    from prx_data.train.callbacks import DataWaitMonitor

    logged: list[dict] = []

    class _Logger:  # test double: records what the callback logs
        def log_metrics(self, metrics):
            logged.append(dict(metrics))

    def run(wait_s: float, compute_s: float) -> DataWaitMonitor:
        mon, lg = DataWaitMonitor(window_size=10), _Logger()
        mon.fit_start(None, lg)
        for _ in range(2):
            mon.before_dataloader(None, lg)
            time.sleep(wait_s)
            mon.after_dataloader(None, lg)
            time.sleep(compute_s)
            mon.batch_end(None, lg)
        return mon

    starved = run(0.15, 0.01)  # ~0.94 of each step waiting on data
    assert starved.fraction > 0.6 and logged[-1]["time/data_wait_ms"] >= 150
    assert abs(logged[-1]["throughput/data_wait_fraction"] - starved.fraction) < 1e-9
    fed = run(0.01, 0.15)  # ~0.06
    assert fed.fraction < 0.4


# --- model and trainer ---------------------------------------------------------------


def test_text_encoder_loads_by_path(tiny_t5):
    from prx_data.train.text_encoder import TextEncoder

    enc = TextEncoder.from_pretrained(tiny_t5, max_length=16, dtype="float32")
    feats, mask = enc.encode(["a red circle", ""])
    assert feats.shape == (2, 16, 64) and enc.hidden_size == 64
    assert mask[0].sum() > mask[1].sum() >= 1  # "" is just the end-of-sequence token
    assert not any(p.requires_grad for p in enc.model.parameters())
    penultimate = TextEncoder.from_pretrained(tiny_t5, max_length=16, dtype="float32", layer=-2)
    assert not torch.allclose(penultimate.encode(["a red circle"])[0], feats[:1])


def test_decoder_only_text_tower_loads(tmp_path):
    """A causal LM (Qwen-style) serves as encoder through its base model's hidden states."""
    from prx_data.core.tinymodels import build_tiny_causal_lm
    from prx_data.train.text_encoder import TextEncoder

    enc = TextEncoder.from_pretrained(str(build_tiny_causal_lm(tmp_path / "qwen")), max_length=8)
    assert type(enc.model).__name__ == "Qwen2Model" and enc.hidden_size == 32
    feats, mask = enc.encode(["a red photo", "the cat"])
    assert feats.shape == (2, 8, 32) and mask.dtype == torch.bool


def test_dataset_factory_errors_name_the_key():
    from prx_data.train.data import build_dataset

    cfg = load_config(None, ["data.factory=prx_data.nope:make"])
    with pytest.raises(ValueError, match="data.factory"):
        build_dataset(cfg.data, 4)
    with pytest.raises(ValueError, match="data.datasets"):
        build_dataset(load_config(None).data, 4)


def test_loss_decreases_on_tiny_overfit_set(tiny_t5):
    """A tiny pixel-space PRX overfits four two-tone 32x32 images within 20 steps."""
    from prx_data.train.trainer import build_model

    torch.manual_seed(0)
    cfg = load_config(None, [*tiny_overrides(tiny_t5), "model.patch_size=8"])
    model = build_model(cfg)
    g = torch.Generator().manual_seed(0)
    images = (torch.rand(4, 3, 1, 1, generator=g) * 255).to(torch.uint8).expand(4, 3, 32, 32)
    images = images.clone()
    images[:, :, :16] = 255 - images[:, :, :16]
    batch = {"image": images, "caption": ["a red sky", "a blue sea", "green", "dark room"]}
    before = model.eval_loss(batch, seed=1)
    opt = torch.optim.AdamW(model.transformer.parameters(), lr=3e-3)
    for _ in range(20):
        loss = model.loss(model(batch), batch)
        loss.backward()
        opt.step()
        opt.zero_grad()
    after = model.eval_loss(batch, seed=1)
    assert after < 0.8 * before, (before, after)


def test_trainer_on_bucketed_stream(tmp_path, tiny_t5):
    """build_trainer on a real bucketed stream: counting, id log, data wait, checkpoint contents."""
    from prx_data.train.callbacks import DataWaitMonitor, consumed_ids
    from prx_data.train.trainer import build_trainer
    from tests.exportkit import make_export

    export = make_export(str(tmp_path / "export"), {"512/1.000": 8, "512/0.778": 4})
    cfg = load_config(
        None,
        [
            *tiny_overrides(tiny_t5),
            f"data.datasets=[{{root: {tmp_path / 'export'}}}]",
            "data.global_batch_size=4",
            "data.num_workers=0",
            "trainer.max_duration=6ba",
            f"trainer.save_folder={tmp_path / 'ckpt'}",
            "trainer.save_interval=6ba",
            "trainer.run_name=tiny",
            "trainer.ema.enabled=true",
            "trainer.ema.half_life=2ba",
            f"logging.sample_ids_dir={tmp_path / 'ids'}",
            "logging.log_to_console=false",
        ],
    )
    trainer = build_trainer(cfg)
    trainer.fit()
    state = trainer.state
    # Two epochs of 3 batches; samples counted from the image batch dim.
    assert int(state.timestamp.batch) == 6 and int(state.timestamp.sample) == 24
    assert int(state.timestamp.epoch) == 2
    wait = next(c for c in state.callbacks if isinstance(c, DataWaitMonitor))
    assert 0.0 < wait.fraction < 1.0

    ids = consumed_ids(tmp_path / "ids")
    assert sorted(set(ids)) == sorted(export.all_ids())
    assert all(ids.count(i) == 2 for i in set(ids))

    # Saved at the end of batch 6, i.e. the end of epoch 1 (0-based): the loader's position.
    ckpt = torch.load(tmp_path / "ckpt" / "latest-rank0.pt", weights_only=False)
    loader_state = ckpt["state"]["dataset_state"]["train"]
    assert (loader_state["epoch"], loader_state["sample_in_epoch"]) == (1, 12)
    assert [name for name, _ in ckpt["state"]["algorithms"]] == ["EMA"]
    keys = list(ckpt["state"]["model"])
    assert keys and all(k.startswith("transformer.") for k in keys)  # no text encoder weights
    trainer.close()
