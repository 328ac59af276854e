"""``python -m prx_data.semdedup``: the ``semdedup`` job of :data:`prx_data.cli.JOBS`."""

from prx_data.cli import shim

main = shim("semdedup", __name__)
