"""``python -m prx_data.classify``: the ``classify`` job of :data:`prx_data.cli.JOBS`."""

from prx_data.cli import shim

main = shim("classify", __name__)
