"""``python -m prx_data.demo``: the export path end to end on an embedded sample.

A shim: the argument parsing lives in :mod:`prx_data.cli.demo`.
"""

import sys

from prx_data.cli.demo import main

if __name__ == "__main__":
    sys.exit(main())
