"""``python -m prx_data.explore``: a shim over :mod:`prx_data.cli.explore`."""

import sys

from prx_data.cli.explore import main

sys.exit(main())
