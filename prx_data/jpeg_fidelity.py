"""``python -m prx_data.jpeg_fidelity``: the ``jpeg_fidelity`` job of :data:`prx_data.cli.JOBS`."""

from prx_data.cli import shim

main = shim("jpeg_fidelity", __name__)
