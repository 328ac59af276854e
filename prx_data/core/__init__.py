"""Pure parts every stage builds on: schema, bucket math, imaging, hashing, storage paths."""

#: The parts are modules, imported by path (``from prx_data.core import storage``); none
#: is re-exported here, so importing one part never loads the others.
__all__ = [
    "buckets",
    "clusters",
    "confined",
    "descriptor",
    "errors",
    "flags",
    "imaging",
    "keys",
    "lance_compat",
    "lazy",
    "lease",
    "phash",
    "quality",
    "reports",
    "runtime",
    "sample_data",
    "schema",
    "storage",
    "streaming_compat",
    "tinymodels",
]
