"""``python -m prx_data.classify``: label captions visual / text / nsfw and write the column back.

A shim: the argument parsing lives in :mod:`prx_data.cli.classify`.
"""

import sys

from prx_data.cli.classify import main

if __name__ == "__main__":
    sys.exit(main())
