"""``python -m prx_data.caption``: the ``caption`` job of :data:`prx_data.cli.JOBS`."""

from prx_data.cli import shim

main = shim("caption", __name__)
