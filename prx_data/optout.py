"""``python -m prx_data.optout``: add an opt-out skip list to an export.

A shim: the argument parsing lives in :mod:`prx_data.cli.optout`.
"""

import sys

from prx_data.cli.optout import main

if __name__ == "__main__":
    sys.exit(main())
