"""``python -m prx_data.caption``: re-caption images with a VLM and write the column back.

A shim: the argument parsing lives in :mod:`prx_data.cli.caption`.
"""

import sys

from prx_data.cli.caption import main

if __name__ == "__main__":
    sys.exit(main())
