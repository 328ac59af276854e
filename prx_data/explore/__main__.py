"""``python -m prx_data.explore``: the ``explore`` job of :data:`prx_data.cli.JOBS`."""

from prx_data.cli import shim

shim("explore", __name__)
