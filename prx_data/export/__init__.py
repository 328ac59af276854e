"""The export stage: a Lance table -> ``<out>/<tier>/<ar>/`` Mosaic Data Shards and a report.

Modules by concern, each importing only those before it: ``naming`` (names and paths of
the tree), ``bounded`` (bounded parallel reads), ``safety`` (confinement and deletion),
``layout`` (the tree as readers see it), ``durable`` (durable writes), ``spec`` (settings
and records), ``merge`` (merge and report), ``prepare`` (output preparation), ``unit``
(one work unit), ``pack`` (the pack stage), ``append`` (what ``write_mds --append``
adds to a complete export, and how it joins it). The job's start, units, completion and
failure are :class:`prx_data.pipelines.write_mds.ExportSink`.
"""

from prx_data.export.layout import is_complete
from prx_data.export.merge import ExportReport, finalize
from prx_data.export.naming import ExportError
from prx_data.export.prepare import plan_units, prepare_output
from prx_data.export.spec import ExportConfig, UnitResult, WorkUnit
from prx_data.export.unit import export_unit

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
