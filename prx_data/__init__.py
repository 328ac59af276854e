"""prx-data: image-text collections -> Lance -> bucketed MDS -> Composer streams.

The stages are packages, in the order the data travels::

    core -> table -> ingest / columns -> explore / export -> skips -> stream -> train

Ray Data job graphs live in the top-level ``pipelines`` package and the
``python -m prx_data.<job>`` commands in :mod:`prx_data.cli`. The names below
are the public API; they load lazily so ``import prx_data`` stays cheap.
"""

from __future__ import annotations

from prx_data.core.lazy import lazy_exports

__version__ = "0.1.0"

_EXPORTS = {
    "BucketSpec": "prx_data.core.buckets",
    "assign_bucket": "prx_data.core.buckets",
    "open_table": "prx_data.table",
    "update_column": "prx_data.table",
    "ExportConfig": "prx_data.export",
    "BucketedDataset": "prx_data.stream",
    "DatasetSpec": "prx_data.stream",
    "load_config": "prx_data.train",
    "build_trainer": "prx_data.train",
}

__all__, __getattr__ = lazy_exports(__name__, _EXPORTS)
