"""``python -m prx_data.jpeg_fidelity``: measure JPEG re-encode fidelity; estimate JPEG quality.

A shim: the argument parsing lives in :mod:`prx_data.cli.jpeg_fidelity`.
"""

import sys

from prx_data.cli.jpeg_fidelity import main

if __name__ == "__main__":
    sys.exit(main())
