"""``python -m prx_data.stats``: resolution / aspect-ratio / tier distribution of a table, with plots.

A shim: the argument parsing lives in :mod:`prx_data.cli.stats`.
"""

import sys

from prx_data.cli.stats import main

if __name__ == "__main__":
    sys.exit(main())
