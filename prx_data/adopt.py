"""``python -m prx_data.adopt``: the ``adopt`` job of :data:`prx_data.cli.JOBS`."""

from prx_data.cli import shim

main = shim("adopt", __name__)
