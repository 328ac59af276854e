"""Keep an image worker's large buffers in its heap between images.

glibc serves every allocation above its mmap threshold (32 MB at most) with a fresh
``mmap`` and unmaps it at ``free``. An export worker decodes one photo after another,
and a full-scale decode of an 8-18 MP photo is a 36-50 MB array: each one then
page-faults and zeroes every page again, about a tenth of the export step at the
2048 tier (``benchmarks/results/export-bands.md``). With mmap off for large blocks
and a high trim threshold, the next image reuses the pages the last one freed.

The cost is memory that stays mapped between images: at most the worker's peak plus
``trim_bytes`` of free space at the heap's top; anything above that is returned at
``free`` as before. It is process-wide and one-way, so only the export's worker
processes call it (``write_mds --release-buffers`` leaves glibc's defaults alone).
"""

from __future__ import annotations

import ctypes
import platform
import sys
import threading

#: glibc's ``mallopt`` parameters (malloc.h).
M_TRIM_THRESHOLD = -1
M_MMAP_MAX = -4
#: Free space kept at the heap's top between images: one 4096-tier working set.
TRIM_BYTES = 256 << 20

_lock = threading.Lock()
_applied: bool | None = None


def keep_large_buffers(trim_bytes: int = TRIM_BYTES) -> bool:
    """Serve large blocks from the heap and keep up to ``trim_bytes`` of freed space;
    True when glibc took both settings. Once per process: later calls return the first
    answer. A no-op (False) off glibc."""
    global _applied
    with _lock:
        if _applied is None:
            _applied = _apply(trim_bytes)
        return _applied


def _apply(trim_bytes: int) -> bool:
    if not sys.platform.startswith("linux") or platform.libc_ver()[0] != "glibc":
        return False
    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):
        return False
    mallopt.argtypes = (ctypes.c_int, ctypes.c_int)
    mallopt.restype = ctypes.c_int
    # The trim threshold first: it also fixes glibc's dynamic mmap threshold.
    return bool(mallopt(M_TRIM_THRESHOLD, int(trim_bytes))) and bool(mallopt(M_MMAP_MAX, 0))
