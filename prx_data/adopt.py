"""``python -m prx_data.adopt``: id manifests and shard hashes for an MDS tree of another writer.

A shim: the argument parsing lives in :mod:`prx_data.cli.adopt`.
"""

import sys

from prx_data.cli.adopt import main

if __name__ == "__main__":
    sys.exit(main())
