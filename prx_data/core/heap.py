"""Keep an image worker's large buffers in its heap between images.

glibc serves every allocation above its mmap threshold (32 MB at most) with a fresh
``mmap`` and unmaps it at ``free``. An export worker decodes one photo after another,
and a full-scale decode of an 8-18 MP photo is a 36-50 MB array: each one then
page-faults and zeroes every page again, about a tenth of the export step at the
2048 tier (``benchmarks/results/export-bands.md``). With mmap off for large blocks
and a high trim threshold, the next image reuses the pages the last one freed.

The cost is memory that stays mapped between images: at most the worker's peak plus
:data:`TRIM_BYTES` of free space at the heap's top; anything above that is returned
at ``free`` as before. The setting is process-wide and lasts the process, so it is
given only to processes that do nothing else: the export's Ray workers, started with
:data:`WORKER_ENV` (glibc reads it at start; other C libraries ignore it). Units that
run on the driver's threads (small exports, ``--engine local``) leave the caller's
process as it is, and ``write_mds --release-buffers`` leaves the workers' too.
"""

from __future__ import annotations

#: Free space kept at the heap's top between images: one 4096-tier working set.
TRIM_BYTES = 256 << 20
#: glibc's malloc settings for an export worker (``mallopt``'s ``M_MMAP_MAX`` and
#: ``M_TRIM_THRESHOLD``, as the environment variables glibc reads when a process starts).
WORKER_ENV = {"MALLOC_MMAP_MAX_": "0", "MALLOC_TRIM_THRESHOLD_": str(TRIM_BYTES)}


def worker_env(keep: bool) -> dict[str, str]:
    """The environment an export's Ray workers start with: :data:`WORKER_ENV` when
    ``keep`` (``ExportConfig.keep_heap``), else nothing."""
    return dict(WORKER_ENV) if keep else {}
