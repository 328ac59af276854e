"""``python -m prx_data.table``: a shim over :mod:`prx_data.cli.table`."""

import sys

from prx_data.cli.table import main

sys.exit(main())
