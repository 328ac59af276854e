"""``python -m prx_data.search``: the ``search`` job of :data:`prx_data.cli.JOBS`."""

from prx_data.cli import shim

main = shim("search", __name__)
