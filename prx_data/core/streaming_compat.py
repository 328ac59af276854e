"""Every private Mosaic Streaming symbol the project uses, in one place, behind a version check.

The skip-aware loader and the rewrite reach below streaming's public API
(``streaming.Stream`` / ``StreamingDataset`` / ``MDSWriter``) for shard
readers, the world layout and decompression. Those internals change between
releases without notice, so they are imported here only, and importing
this module on an unknown streaming version fails with what to check.

When upgrading streaming, re-run ``tests/test_streaming_compat.py`` (one
contract test per symbol) and the upstream suite with our Stream swapped in
(see docs/STREAMING.md), then add the version to :data:`SUPPORTED`.
"""

from __future__ import annotations

from collections.abc import Callable
from types import ModuleType
from typing import Any

from prx_data.core.mds_writer import streaming_version

# Only streaming.base submodules are needed here: the package's own __init__ (its datasets,
# transformers) runs when something asks for it (see prx_data.core.mds_writer).
_streaming_version = streaming_version()

#: Streaming release prefixes whose internals match what the project relies on.
SUPPORTED = ("0.13.",)

if not _streaming_version.startswith(SUPPORTED):
    raise ImportError(
        f"prx-data was checked against mosaicml-streaming {', '.join(v + 'x' for v in SUPPORTED)}, "
        f"found {_streaming_version}. Check that MDSReader's constructor and get_item, "
        "Stream.get_shards, Stream.prepare_shard, Reader.evict/set_up_local/get_max_size "
        "(pinned local shards), World.detect, maybe_init_dist, decompress, reader_from_json, "
        "get_partitions, get_hash, is_safe_mds_encoding and get_sampling (looked up as a "
        "global of streaming.base.dataset) "
        "behave as before (tests/test_streaming_compat.py), then add the version to "
        "prx_data.core.streaming_compat.SUPPORTED; or pin mosaicml-streaming==0.13.0."
    )

from streaming.base.compression import decompress  # noqa: E402
from streaming.base.distributed import maybe_init_dist  # noqa: E402
from streaming.base.format import reader_from_json  # noqa: E402
from streaming.base.format.base.reader import FileInfo  # noqa: E402
from streaming.base.format.mds.encodings import (  # noqa: E402
    get_mds_encodings,
    is_mds_encoding,
    is_mds_encoding_safe,
)
from streaming.base.format.mds.reader import MDSReader  # noqa: E402
from streaming.base.hashing import get_hash  # noqa: E402
from streaming.base.partition import get_partitions  # noqa: E402
from streaming.base.world import World  # noqa: E402

__all__ = [
    "SUPPORTED",
    "FileInfo",
    "MDSReader",
    "World",
    "decompress",
    "get_hash",
    "get_partitions",
    "is_safe_mds_encoding",
    "maybe_init_dist",
    "mds_reader_args",
    "reader_from_json",
    "sampling_hooks",
]


def mds_reader_args(reader: MDSReader) -> dict:
    """The constructor arguments that rebuild ``reader`` (so subclasses never copy ``__dict__``)."""
    return {
        "dirname": reader.dirname,
        "split": reader.split or None,
        "column_encodings": reader.column_encodings,
        "column_names": reader.column_names,
        "column_sizes": reader.column_sizes,
        "compression": reader.compression,
        "hashes": reader.hashes,
        "raw_data": reader.raw_data,
        "samples": reader.samples,
        "size_limit": reader.size_limit,
        "zip_data": reader.zip_data,
    }


def is_safe_mds_encoding(encoding: object) -> bool:
    """True for an MDS column encoding streaming knows whose decoding cannot run code.

    Streaming's own test (``is_mds_encoding_safe``) compares the whole string
    with ``pkl``, so ``pkl:x`` passes it; here the encoding's name (before any
    ``:`` argument) must be a known encoding that is not unsafe, and the whole
    string must parse as that encoding.
    """
    if not isinstance(encoding, str):
        return False
    name = encoding.split(":", 1)[0]
    if name not in get_mds_encodings() or not is_mds_encoding_safe(name):
        return False
    try:
        return is_mds_encoding(encoding) and is_mds_encoding_safe(encoding)
    except Exception:  # noqa: BLE001 - a malformed argument (``ndarray:nonsense``) is not safe
        return False


def sampling_hooks() -> tuple[ModuleType, Callable[..., Any]]:
    """Streaming's ``get_sampling`` and the module that looks it up as a global at each call.

    ``StreamingDataset.resample_streams`` calls ``get_sampling`` through
    ``streaming.base.dataset``'s globals; :mod:`prx_data.stream.sampling` reroutes that
    name to its vectorised equivalent. Imported on call: the dataset module pulls in
    streaming's whole loader.
    """
    import streaming.base.dataset as dataset_module
    from streaming.base.sampling import get_sampling

    return dataset_module, get_sampling
