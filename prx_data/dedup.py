"""``python -m prx_data.dedup``: perceptual-hash dedup: dup_of column and a 'dedup' skip list.

A shim: the argument parsing lives in :mod:`prx_data.cli.dedup`.
"""

import sys

from prx_data.cli.dedup import main

if __name__ == "__main__":
    sys.exit(main())
