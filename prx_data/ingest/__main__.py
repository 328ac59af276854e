"""``python -m prx_data.ingest``: the ``ingest`` job of :data:`prx_data.cli.JOBS`."""

from prx_data.cli import shim

shim("ingest", __name__)
