"""``python -m prx_data.download``: a shim over :mod:`prx_data.cli.download`."""

import sys

from prx_data.cli.download import main

sys.exit(main())
