"""``python -m prx_data.dedup``: the ``dedup`` job of :data:`prx_data.cli.JOBS`."""

from prx_data.cli import shim

main = shim("dedup", __name__)
