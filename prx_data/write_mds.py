"""``python -m prx_data.write_mds``: the ``write_mds`` job of :data:`prx_data.cli.JOBS`."""

from prx_data.cli import shim

main = shim("write_mds", __name__)
