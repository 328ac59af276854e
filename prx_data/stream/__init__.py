"""The streaming stage: skip-aware MDS readers, bucketed datasets, mixing and the planner.

Notebooks and trainers import :class:`BucketedDataset` and :class:`DatasetSpec`
from here. The names load lazily, so the planner and ``--help`` of the jobs
that plan do not import Mosaic Streaming (and torch) just to start.
"""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {
    "BucketSource": "prx_data.stream.dataset",
    "BucketedDataset": "prx_data.stream.dataset",
    "DatasetSpec": "prx_data.stream.dataset",
    "SkipMDSReader": "prx_data.stream.dataset",
    "SkipStream": "prx_data.stream.dataset",
    "discover_buckets": "prx_data.stream.dataset",
    "fetch_catalog": "prx_data.stream.dataset",
    "load_sources": "prx_data.stream.dataset",
    "plan_sources": "prx_data.stream.dataset",
    "PlanSpec": "prx_data.stream.planner",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    if name in _EXPORTS:
        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
