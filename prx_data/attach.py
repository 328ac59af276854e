"""``python -m prx_data.attach``: the ``attach`` job of :data:`prx_data.cli.JOBS`."""

from prx_data.cli import shim

main = shim("attach", __name__)
