"""``python -m prx_data.table``: the ``table`` job of :data:`prx_data.cli.JOBS`."""

from prx_data.cli import shim

shim("table", __name__)
