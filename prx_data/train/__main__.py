"""``python -m prx_data.train``: the ``train`` job of :data:`prx_data.cli.JOBS`."""

from prx_data.cli import shim

shim("train", __name__)
