"""The Lance table stage: open, add columns without rewriting images, compact, search, stats.

``prx_data.table.update_column`` is the documented write-back entry point;
:mod:`prx_data.table.search` and :mod:`prx_data.table.resolution` hold the
query and statistics sides.
"""

from prx_data.table.lance_ops import (
    DEFAULT_TARGET_ROWS_PER_FRAGMENT,
    compact,
    open_table,
    quote,
    rows_missing,
    table_exists,
    table_stats,
    update_column,
)

__all__ = [
    "DEFAULT_TARGET_ROWS_PER_FRAGMENT",
    "compact",
    "open_table",
    "quote",
    "rows_missing",
    "table_exists",
    "table_stats",
    "update_column",
]
