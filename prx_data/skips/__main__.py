"""``python -m prx_data.skips``: a shim over :mod:`prx_data.cli.skips`."""

import sys

from prx_data.cli.skips import main

sys.exit(main())
