"""``python -m prx_data.skips``: the ``skips`` job of :data:`prx_data.cli.JOBS`."""

from prx_data.cli import shim

shim("skips", __name__)
