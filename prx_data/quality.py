"""``python -m prx_data.quality``: the ``quality`` job of :data:`prx_data.cli.JOBS`."""

from prx_data.cli import shim

main = shim("quality", __name__)
