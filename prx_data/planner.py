"""``python -m prx_data.planner``: the ``planner`` job of :data:`prx_data.cli.JOBS`."""

from prx_data.cli import shim

main = shim("planner", __name__)
