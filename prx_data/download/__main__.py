"""``python -m prx_data.download``: the ``download`` job of :data:`prx_data.cli.JOBS`."""

from prx_data.cli import shim

shim("download", __name__)
