"""``python -m prx_data.write_mds``: export a table to resolution/aspect-ratio bucketed MDS.

A shim: the argument parsing lives in :mod:`prx_data.cli.write_mds`.
"""

import sys

from prx_data.cli.write_mds import main

if __name__ == "__main__":
    sys.exit(main())
