"""``python -m prx_data.planner``: preflight: batches per bucket, tail drops, fatal configurations.

A shim: the argument parsing lives in :mod:`prx_data.cli.planner`.
"""

import sys

from prx_data.cli.planner import main

if __name__ == "__main__":
    sys.exit(main())
