"""``python -m prx_data.verify``: the ``verify`` job of :data:`prx_data.cli.JOBS`."""

from prx_data.cli import shim

main = shim("verify", __name__)
