"""One plan spec: the train config, the loader, plan_buckets and the planner CLI read the same one."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest

from prx_data.stream.planner import BucketCount, DatasetCount, PlanSpec, plan_buckets
from tests.exportkit import make_export

REPO = Path(__file__).resolve().parents[1]
SMOKE = REPO / "configs" / "train" / "smoke_cpu.yaml"
BUCKETS = {"512/1.000": 48, "512/0.778": 24, "1024/1.000": 16}


@pytest.fixture(scope="module")
def export(tmp_path_factory):
    root = tmp_path_factory.mktemp("spec") / "tree"
    return make_export(str(root), BUCKETS, samples_per_part=8)


def test_plan_buckets_takes_a_spec_or_its_fields_as_keywords():
    counts = [DatasetCount("a", [BucketCount("512/1.000", 100), BucketCount("512/0.778", 40)])]
    spec = PlanSpec(device_batch_size=4, num_workers=2, small_buckets="drop")
    by_spec = plan_buckets(counts, spec, world_size=2)
    by_kw = plan_buckets(
        counts, device_batch_size=4, num_workers=2, small_buckets="drop", world_size=2
    )
    assert by_spec.to_dict() == by_kw.to_dict()
    assert by_spec.spec == spec and by_kw.spec == spec
    # A spec's field can be overridden for one call.
    assert plan_buckets(counts, spec, num_workers=1).num_workers == 1


def test_every_plan_setting_is_one_data_plan_key_with_the_plan_default():
    """``data.plan`` is PlanSpec's fields with PlanSpec's defaults (batch, workers, block aside)."""
    import inspect

    from prx_data.stream.dataset import BucketedDataset
    from prx_data.train.config import DataConfig, PlanConfig

    elsewhere = {"device_batch_size", "num_workers", "shuffle_block_size", "bucket_spec"}
    fields = {f.name: f.default for f in dataclasses.fields(PlanSpec) if f.name not in elsewhere}
    assert {f.name: f.default for f in dataclasses.fields(PlanConfig)} == fields
    assert not set(fields) & {f.name for f in dataclasses.fields(DataConfig)}
    # The loader takes the spec, not a mirror of its fields with defaults of its own.
    assert not set(fields) & set(inspect.signature(BucketedDataset.__init__).parameters)
    cfg = DataConfig(
        plan=PlanConfig(
            tier=1024,
            include_higher_tiers=True,
            num_canonical_nodes=4,
            replication=2,
            epoch_size=64,
            shuffle=False,
            shuffle_seed=5,
            batching_method="device_per_stream",
            small_buckets="drop",
        ),
        num_workers=3,
        streaming={"shuffle_block_size": 1000},
    )
    spec = cfg.plan_spec(8)
    for name in fields:
        assert getattr(spec, name) == getattr(cfg.plan, name), name
    assert spec.device_batch_size == 8 and spec.shuffle_block_size == 1000
    assert spec.num_workers == 3


def test_old_flat_plan_keys_still_load_with_one_line_warning():
    from prx_data.train.config import ConfigError, load_config

    with pytest.warns(FutureWarning, match=r"data\.tier is now data\.plan\.tier"):
        cfg = load_config(None, ["data.tier=1024"])
    assert cfg.data.plan.tier == 1024
    with pytest.warns(FutureWarning, match="data.shuffle_seed is now data.plan.shuffle_seed"):
        cfg = load_config(None, data={"data": {"shuffle_seed": 5}})
    assert cfg.data.plan.shuffle_seed == 5
    with pytest.raises(ConfigError, match="both given"):
        load_config(None, data={"data": {"shuffle": False, "plan": {"shuffle": True}}})


def test_the_dataset_takes_one_spec_or_the_keywords_not_both(export):
    from prx_data.stream.dataset import BucketedDataset

    spec = PlanSpec(tier=512, device_batch_size=4, num_canonical_nodes=1, small_buckets="drop")
    a = BucketedDataset(export.root, spec=spec)
    b = BucketedDataset(
        export.root, tier=512, batch_size=4, num_canonical_nodes=1, small_buckets="drop"
    )
    assert a.spec == b.spec == spec
    assert a.plan.to_dict() == b.plan.to_dict() and a.fingerprint == b.fingerprint
    with pytest.raises(ValueError, match="not both"):
        BucketedDataset(export.root, spec=spec, num_workers=2)
    with pytest.raises(TypeError, match="tier= and batch_size="):
        BucketedDataset(export.root, batch_size=4)


def _overrides(root: str) -> list[str]:
    return [
        f"variables.data_root={root}",
        "data.global_batch_size=4",
        "data.plan.include_higher_tiers=true",
        "eval.enabled=true",
        "eval.holdout_fraction=0.25",
    ]


def test_the_planner_previews_the_runs_own_plan_with_the_holdout(export, tmp_path, capsys):
    from prx_data.cli.planner import main
    from prx_data.train.config import load_config
    from prx_data.train.data import build_dataset
    from prx_data.train.evaluation import build_evaluator, holdout_for

    cfg = load_config(SMOKE, _overrides(export.root))
    # One process, so a world of one: the loader's own plan, built as the trainer builds it.
    train = build_dataset(cfg.data, 4, holdout=holdout_for(cfg, "train"))
    held = build_evaluator(cfg, 1, cfg.model.patch_size).dataloader.dataloader.dataset
    for extra, ds in (([], train), (["--eval"], held)):
        out = tmp_path / "plan.json"
        argv = ["--config", str(SMOKE), *_overrides(export.root)]
        assert main([*argv, *extra, "--json", str(out)]) == 0
        assert json.loads(out.read_text()) == ds.plan.to_dict()
    skipped = sum(b.skipped for b in train.plan.buckets)
    assert 0 < skipped < sum(BUCKETS.values())  # the hold-out is in the preview
    assert "batching=per_stream world=1" in capsys.readouterr().out


def test_the_planner_refuses_plan_flags_next_to_a_config(export, capsys):
    from prx_data.cli.planner import main

    with pytest.raises(SystemExit):
        main(["--config", str(SMOKE), "--tier", "512"])
    assert "--tier: with --config" in capsys.readouterr().err
    assert main(["--config", str(SMOKE), "data.bogus=1"]) == 2
    assert "data.bogus" in capsys.readouterr().out


def test_a_yaml_dataset_is_the_notebook_dataset_spec():
    """``data.datasets`` entries are ``DatasetSpec`` itself: every key a notebook passes."""
    from prx_data.stream.spec import DatasetSpec
    from prx_data.train.config import load_config

    cfg = load_config(
        None,
        ["data.datasets.0.allow_incomplete=true"],
        data={"data": {"datasets": [{"root": "/x", "proportion": 0.5, "name": "x"}]}},
    )
    (ds,) = cfg.data.datasets
    assert ds == DatasetSpec(root="/x", proportion=0.5, name="x", allow_incomplete=True)
    assert ds.label == "x"
