"""A shard reader whose sample space leaves a skip list out (no data is read to skip)."""

from __future__ import annotations

from typing import Any

import numpy as np

from prx_data.core.streaming_compat import MDSReader, mds_reader_args


class SkipMDSReader(MDSReader):
    """An MDS shard reader whose sample space excludes a sorted set of skipped indices.

    ``samples`` is the kept count; ``get_item(k)`` reads the k-th kept sample.
    A module-level class (not a patched method) so spawned workers can unpickle it.
    """

    raw_samples: int
    skipped: np.ndarray
    _shift_keys: np.ndarray

    def __init__(self, *, skipped: np.ndarray, **reader_args: Any) -> None:
        super().__init__(**reader_args)
        self.raw_samples = self.samples
        self.skipped = np.asarray(skipped, np.int64)
        # Kept samples before the i-th skipped one; searching it maps kept -> stored in O(log n).
        self._shift_keys = self.skipped - np.arange(len(self.skipped), dtype=np.int64)
        self.samples = self.raw_samples - len(self.skipped)

    @classmethod
    def wrap(cls, reader: MDSReader, skipped: np.ndarray) -> SkipMDSReader:
        """A skip-aware reader over the same shard, built through MDSReader's constructor."""
        return cls(skipped=skipped, **mds_reader_args(reader))

    def stored_index(self, idx: int) -> int:
        """The index within the shard file of the ``idx``-th kept sample."""
        if not 0 <= idx < self.samples:
            raise IndexError(f"kept sample {idx} out of range 0..{self.samples - 1}")
        return int(idx + np.searchsorted(self._shift_keys, idx, side="right"))

    def get_item(self, idx: int) -> dict[str, Any]:
        return super().get_item(self.stored_index(idx))
