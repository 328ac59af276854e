"""``python -m prx_data.ingest``: a shim over :mod:`prx_data.cli.ingest`."""

import sys

from prx_data.cli.ingest import main

sys.exit(main())
