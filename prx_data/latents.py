"""``python -m prx_data.latents``: the ``latents`` job of :data:`prx_data.cli.JOBS`."""

from prx_data.cli import shim

main = shim("latents", __name__)
