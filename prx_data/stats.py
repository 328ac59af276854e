"""``python -m prx_data.stats``: the ``stats`` job of :data:`prx_data.cli.JOBS`."""

from prx_data.cli import shim

main = shim("stats", __name__)
