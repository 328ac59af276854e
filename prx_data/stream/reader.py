"""A Mosaic ``Stream`` over one bucket whose shard readers apply the bucket's skip lists."""

from __future__ import annotations

import os
from typing import Any

import numpy as np
from streaming import Stream

from prx_data.core.streaming_compat import MDSReader, World
from prx_data.export import layout
from prx_data.skips import sidecar as skiplist
from prx_data.skips.reader import SkipMDSReader


class SkipStream(Stream):
    """A ``Stream`` over one bucket whose shard readers leave the skipped samples out.

    ``skips`` maps shard basenames (as in the index) to sorted skipped indices;
    shards whose every sample is skipped are left out altogether.
    """

    def __init__(self, *, skips: dict[str, np.ndarray] | None = None, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.skips = skips or {}

    def get_shards(self, world: World, allow_unsafe_types: bool) -> list:
        shards = super().get_shards(world, allow_unsafe_types)
        index = os.path.join(self.local, self.split or "", layout.INDEX_NAME)
        out = []
        for reader in shards:
            # Before any shard file is opened: streaming joins these names to ``local`` unchecked.
            for info in (reader.raw_data, reader.zip_data):
                if info is not None:
                    layout.check_shard_basename(index, info.basename)
            skipped = self.skips.get(reader.raw_data.basename)
            if skipped is None or not len(skipped):
                out.append(reader)
                continue
            if not isinstance(reader, MDSReader):
                raise TypeError(f"skip lists need MDS shards, got {type(reader).__name__}")
            if int(skipped[-1]) >= reader.samples:
                raise skiplist.SkipListError(
                    f"{self.local}/{reader.raw_data.basename}: skip index {int(skipped[-1])} "
                    f">= shard samples {reader.samples}"
                )
            wrapped = SkipMDSReader.wrap(reader, skipped)
            if wrapped.samples:
                out.append(wrapped)
        return out
