"""Training PRX on the bucketed streams: config, model, data, callbacks, trainer assembly.

Heavy modules (torch, diffusers, composer) load on first use of a name, so
``import prx_data.train`` stays cheap for tools that only read configs.
"""

from __future__ import annotations

from prx_data.core.lazy import lazy_exports

_EXPORTS = {
    "ConfigError": "config",
    "TrainConfig": "config",
    "load_config": "config",
    "to_yaml": "config",
    "CaptionPolicy": "captions",
    "TextEncoder": "text_encoder",
    "PRXFlowModel": "model",
    "build_transformer": "model",
    "build_dataspec": "data",
    "build_dataset": "data",
    "collate": "data",
    "DataWaitMonitor": "callbacks",
    "SampleIdLogger": "callbacks",
    "ResumeGuard": "callbacks",
    "consumed_ids": "callbacks",
    "attempts_summary": "callbacks",
    "build_model": "trainer",
    "build_trainer": "trainer",
    "train": "trainer",
}

__all__, __getattr__ = lazy_exports(__name__, _EXPORTS)
