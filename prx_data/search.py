"""``python -m prx_data.search``: full-text, vector and hybrid search over a table; builds the indexes.

A shim: the argument parsing lives in :mod:`prx_data.cli.search`.
"""

import sys

from prx_data.cli.search import main

if __name__ == "__main__":
    sys.exit(main())
