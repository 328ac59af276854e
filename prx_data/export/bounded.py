"""Bounded parallel small reads (part indexes, unit markers, manifests, sidecars).

Object storage is latency-bound, so many requests are kept in flight; results
come back in input order, so what is written from them is the same bytes as a
one-by-one read.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Iterable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import TypeVar

from prx_data.core import storage

T = TypeVar("T")
R = TypeVar("R")
#: Parallel small-file requests against object storage.
IO_THREADS = 16


def map_io(fn, items: Sequence, remote: bool) -> list:
    return map_bounded(fn, items, IO_THREADS if remote else 1)


#: Threads for the driver's many small reads (part indexes, unit markers, manifests,
#: sidecars): object storage is latency-bound, so many requests in flight; a local disk
#: gains from a few (parquet decoding and file opens release the GIL).
REMOTE_IO_WORKERS = 32
LOCAL_IO_WORKERS = 4


def io_workers(path: str) -> int:
    """How many small reads to keep in flight against ``path``'s storage."""
    return REMOTE_IO_WORKERS if storage.is_remote(path) else LOCAL_IO_WORKERS


def imap_bounded(fn: Callable[[T], R], items: Iterable[T], workers: int) -> Iterator[R]:
    """``fn`` over ``items`` on at most ``workers`` threads, yielded in ``items``' order.

    At most ``2 * workers`` calls are in flight or waiting to be yielded, so a
    million parts cost a bounded number of futures, and results (and the first
    error, in input order) are deterministic whatever the thread timing.
    """
    if workers <= 1:
        yield from map(fn, items)
        return
    window = 2 * workers
    pending: deque = deque()
    with ThreadPoolExecutor(workers) as ex:
        try:
            for x in items:
                pending.append(ex.submit(fn, x))
                if len(pending) >= window:
                    yield pending.popleft().result()
            while pending:
                yield pending.popleft().result()
        finally:
            for f in pending:  # an error or an abandoned generator: start nothing new
                f.cancel()


def map_bounded(fn: Callable[[T], R], items: Iterable[T], workers: int) -> list[R]:
    """:func:`imap_bounded` as a list (results in input order)."""
    return list(imap_bounded(fn, items, workers))
