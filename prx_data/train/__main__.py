"""``python -m prx_data.train``: a shim over :mod:`prx_data.cli.train`."""

import sys

from prx_data.cli.train import main

sys.exit(main())
