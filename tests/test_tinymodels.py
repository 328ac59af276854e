"""The demo's tiny random-weight models: one per job, loadable by the classes the jobs use."""

from __future__ import annotations

import json

import pytest


@pytest.mark.timeout(300)
def test_demo_models_load_as_each_job_loads_them(tmp_path):
    from transformers import (
        AutoConfig,
        AutoModelForImageClassification,
        CLIPModel,
        CLIPVisionModelWithProjection,
    )

    from prx_data.columns.scores import LinearHead, load_state_dict
    from prx_data.core.tinymodels import CLIP_PROJECTION_DIM, DEMO_MODELS, save_demo_models

    paths = save_demo_models(tmp_path)
    assert set(paths) == set(DEMO_MODELS)
    clip = CLIPModel.from_pretrained(paths["clip"])  # score clip, semdedup
    vision = CLIPVisionModelWithProjection.from_pretrained(paths["clip"])  # CMMD
    assert clip.config.projection_dim == vision.config.projection_dim == CLIP_PROJECTION_DIM
    head = LinearHead.from_state_dict(load_state_dict(paths["aesthetic"]))
    assert head.input_dim == CLIP_PROJECTION_DIM  # reads the tiny CLIP's embedding
    for key, label in (("watermark", "watermark"), ("nsfw", "nsfw")):
        model = AutoModelForImageClassification.from_pretrained(paths[key])
        assert label in model.config.id2label.values()
    assert AutoConfig.from_pretrained(paths["vlm"]).model_type == "qwen2_vl"
    assert AutoConfig.from_pretrained(paths["lm"]).model_type == "qwen2"
    # A rerun keeps them; a vision-only CLIP an older demo saved is replaced.
    config = tmp_path / DEMO_MODELS["clip"] / "config.json"
    stamp = config.stat().st_mtime_ns
    assert save_demo_models(tmp_path) == paths and config.stat().st_mtime_ns == stamp
    vision.save_pretrained(paths["clip"])
    assert json.loads(config.read_text())["model_type"] != "clip"
    save_demo_models(tmp_path)
    assert json.loads(config.read_text())["model_type"] == "clip"
