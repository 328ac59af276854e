"""``python -m prx_data.score``: the ``score`` job of :data:`prx_data.cli.JOBS`."""

from prx_data.cli import shim

main = shim("score", __name__)
