"""``python -m prx_data.score``: CLIP, aesthetic, watermark and NSFW scores into table columns.

A shim: the argument parsing lives in :mod:`prx_data.cli.score`.
"""

import sys

from prx_data.cli.score import main

if __name__ == "__main__":
    sys.exit(main())
