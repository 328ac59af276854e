"""The export stage: a Lance table -> ``<out>/<tier>/<ar>/`` Mosaic Data Shards and a report.

:mod:`prx_data.export.layout` owns the tree (part names, manifests, progress
markers, the merged index); :mod:`prx_data.export.unit` turns one work unit (a row range of a fragment)
into MDS parts; the Ray job graph is :mod:`prx_data.pipelines.write_mds`.
"""

from prx_data.export.layout import is_complete
from prx_data.export.unit import (
    ExportConfig,
    ExportError,
    ExportReport,
    UnitResult,
    WorkUnit,
    export_unit,
    finalize,
    plan_units,
    prepare_output,
)

__all__ = [
    "ExportConfig",
    "ExportError",
    "ExportReport",
    "UnitResult",
    "WorkUnit",
    "export_unit",
    "finalize",
    "is_complete",
    "plan_units",
    "prepare_output",
]
