"""``python -m prx_data.semdedup``: embedding-cluster dedup and a 'semdedup' skip list.

A shim: the argument parsing lives in :mod:`prx_data.cli.semdedup`.
"""

import sys

from prx_data.cli.semdedup import main

if __name__ == "__main__":
    sys.exit(main())
