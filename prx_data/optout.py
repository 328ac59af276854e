"""``python -m prx_data.optout``: the ``optout`` job of :data:`prx_data.cli.JOBS`."""

from prx_data.cli import shim

main = shim("optout", __name__)
