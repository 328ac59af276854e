"""``python -m prx_data.quality``: measure blank and near-blank images into a table column.

A shim: the argument parsing lives in :mod:`prx_data.cli.quality`.
"""

import sys

from prx_data.cli.quality import main

if __name__ == "__main__":
    sys.exit(main())
