"""The streaming stage: skip-aware MDS readers, bucketed datasets, mixing and the planner.

Notebooks and trainers import :class:`BucketedDataset` and :class:`DatasetSpec`
from here. The names load lazily, so the planner and ``--help`` of the jobs
that plan do not import Mosaic Streaming (and torch) just to start.
"""

from __future__ import annotations

from prx_data.core.lazy import lazy_exports

_EXPORTS = {
    "BucketSource": "prx_data.stream.spec",
    "BucketedDataset": "prx_data.stream.dataset",
    "DatasetSpec": "prx_data.stream.spec",
    "SkipMDSReader": "prx_data.skips.reader",
    "SkipStream": "prx_data.stream.reader",
    "discover_buckets": "prx_data.stream.catalog",
    "fetch_catalog": "prx_data.stream.catalog",
    "load_sources": "prx_data.stream.sources",
    "plan_sources": "prx_data.stream.sources",
    "PlanSpec": "prx_data.stream.planner",
}

__all__, __getattr__ = lazy_exports(__name__, _EXPORTS)
