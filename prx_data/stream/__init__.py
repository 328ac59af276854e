"""The streaming stage: skip-aware MDS readers, bucketed datasets, mixing and the planner.

Notebooks and trainers import :class:`BucketedDataset` and :class:`DatasetSpec`
from here.
"""

from prx_data.stream.dataset import (
    BucketedDataset,
    BucketSource,
    DatasetSpec,
    SkipMDSReader,
    SkipStream,
    discover_buckets,
    fetch_catalog,
    load_sources,
    plan_sources,
)
from prx_data.stream.planner import PlanSpec

__all__ = [
    "BucketSource",
    "BucketedDataset",
    "DatasetSpec",
    "PlanSpec",
    "SkipMDSReader",
    "SkipStream",
    "discover_buckets",
    "fetch_catalog",
    "load_sources",
    "plan_sources",
]
