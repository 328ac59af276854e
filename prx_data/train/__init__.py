"""Training PRX on the bucketed streams: config, model, data, callbacks, trainer assembly.

Heavy modules (torch, diffusers, composer) load on first use of a name, so
``import prx_data.train`` stays cheap for tools that only read configs.
"""

from __future__ import annotations

import importlib
from typing import Any

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

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    if name in _EXPORTS:
        module = importlib.import_module(f"{__name__}.{_EXPORTS[name]}")
        return getattr(module, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
