"""A Mosaic ``Stream`` over one bucket whose shard readers apply the bucket's skip lists.

A stream with no remote reads the export's own shard files. Streaming's
``cache_limit`` eviction picks the coldest shard across *all* streams and
unlinks it (``StreamingDataset._evict_coldest_shard`` -> ``Reader.evict``;
mosaicml/streaming#988), so mixing a remote root with a local one would delete
the local export. Such shards are pinned here: they never count towards the
cache limit and evicting them removes nothing.

A remote shard may carry more files than its index names: the export's attached
column files of that shard (:mod:`prx_data.stream.attached`). They are added to
the reader's files, so streaming downloads them with the shard (from the
export's ``_columns/`` folder, not the bucket's), counts them in the cache and
evicts them with it.
"""

from __future__ import annotations

import os
from typing import Any

import numpy as np
from streaming import Stream

from prx_data.core.errors import UsageError
from prx_data.core.streaming_compat import FileInfo, MDSReader, World, mds_reader_args, retry
from prx_data.export import naming, safety
from prx_data.skips import sidecar as skiplist
from prx_data.skips.reader import SkipMDSReader


class SkipStream(Stream):
    """A ``Stream`` over one bucket whose shard readers leave the skipped samples out.

    ``skips`` maps shard basenames (as in the index) to sorted skipped indices;
    shards whose every sample is skipped are left out altogether.
    """

    def __init__(
        self,
        *,
        skips: dict[str, np.ndarray] | None = None,
        extras: dict[str, list[tuple[str, str, int]]] | None = None,
        **kwargs: Any,
    ) -> None:
        super().__init__(**kwargs)
        self.skips = skips or {}
        #: Per shard basename: (path in the local bucket folder, remote URI, bytes) of each
        #: file fetched and evicted with it (a remote stream only).
        self.extras = extras or {}
        self._extra_uris = {rel: uri for fs in self.extras.values() for rel, uri, _ in fs}

    def get_shards(self, world: World, allow_unsafe_types: bool) -> list:
        """Streaming's shard readers, checked before any shard file is opened or decoded.

        Names: any relative path inside the stream's directory, as the MDS
        format allows (:func:`safety.check_stream_basenames`); streaming joins
        them to ``local`` unchecked. Columns: safe encodings only, whatever
        ``allow_unsafe_types`` says (no pickle on data paths).
        """
        # Building readers opens no shard; the columns are checked below, more strictly.
        shards = super().get_shards(world, True)
        directory = os.path.join(self.local, self.split or "")
        index = os.path.join(directory, naming.INDEX_NAME)
        safety.check_stream_basenames(
            index,
            directory,
            (i.basename for r in shards for i in (r.raw_data, r.zip_data) if i is not None),
        )
        out = []
        for reader in shards:
            if isinstance(reader, MDSReader):
                entry = {
                    "format": "mds",
                    "column_names": list(reader.column_names),
                    "column_encodings": list(reader.column_encodings),
                }
                problem = safety.columns_problem(entry)
                if problem is not None:
                    raise safety.UnsafeIndexError(f"{index}: {problem}")
            reader.validate(False)  # streaming's own rule on top, for every format
            skipped = self.skips.get(reader.raw_data.basename)
            if skipped is None or not len(skipped):
                out.append(reader)
                continue
            if not isinstance(reader, MDSReader):
                raise UsageError(
                    f"{self.local}: skip lists need MDS shards, got {type(reader).__name__}; "
                    "export with python -m prx_data.write_mds"
                )
            if int(skipped[-1]) >= reader.samples:
                raise skiplist.SkipListError(
                    f"{self.local}/{reader.raw_data.basename}: skip index {int(skipped[-1])} "
                    f">= shard samples {reader.samples}"
                )
            wrapped = SkipMDSReader.wrap(reader, skipped)
            if wrapped.samples:
                out.append(wrapped)
        if self.remote is None:  # the files are the export itself, not a cache
            out = [_pin(r, self.local) for r in out]
        elif self.extras:
            for reader in out:
                for rel, _uri, nbytes in self.extras.get(reader.raw_data.basename, ()):
                    reader.file_pairs.append((FileInfo(rel, nbytes, {}), None))
        return out

    def _download_file(self, from_basename: str, to_basename: str | None = None) -> str:
        """Streaming's download, except a shard's extra files, which come from their own URI."""
        uri = self._extra_uris.get(from_basename)
        if uri is None:
            return super()._download_file(from_basename, to_basename)
        local = os.path.join(self.local, self.split or "", from_basename)
        retry(clean_up_fn=self._downloader.clean_up, num_attempts=self.download_retry)(
            lambda: self._downloader.download(uri, local, self.download_timeout)
        )()
        return local

    def prepare_shard(self, shard: Any) -> int:
        delta = super().prepare_shard(shard)
        # A pinned shard (the export's own file) is outside the cache's accounting. A compressed
        # local export streams with a remote (the export) and decompresses into the cache.
        return 0 if self.remote is None else delta


class _Pinned:
    """A shard reader over an export's own files: outside the cache, never evicted."""

    def evict(self) -> int:
        return 0

    def set_up_local(self, listing: set[str], safe_keep_zip: bool) -> int:
        return 0  # not cache usage (and streaming's clean-up never touches the export)

    def get_max_size(self) -> int:
        return 0  # needs no room in the cache


class PinnedMDSReader(_Pinned, MDSReader):
    """An ``MDSReader`` over a shard of a local export (module level, so workers unpickle it)."""


class PinnedSkipMDSReader(_Pinned, SkipMDSReader):
    """A ``SkipMDSReader`` over a shard of a local export."""


def _pin(reader: Any, local: str) -> MDSReader:
    if isinstance(reader, SkipMDSReader):
        args = {**mds_reader_args(reader), "samples": reader.raw_samples}
        return PinnedSkipMDSReader(skipped=reader.skipped, **args)
    if isinstance(reader, MDSReader):
        return PinnedMDSReader(**mds_reader_args(reader))
    raise UsageError(
        f"{local}: a local export needs MDS shards, got {type(reader).__name__}; "
        "export with python -m prx_data.write_mds"
    )
