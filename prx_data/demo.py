"""``python -m prx_data.demo``: the ``demo`` job of :data:`prx_data.cli.JOBS`."""

from prx_data.cli import shim

main = shim("demo", __name__)
