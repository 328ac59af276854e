"""``python -m prx_data.verify``: check an export's report, indexes, shards, manifests and sidecars.

A shim: the argument parsing lives in :mod:`prx_data.cli.verify`.
"""

import sys

from prx_data.cli.verify import main

if __name__ == "__main__":
    sys.exit(main())
