"""Every private Mosaic Streaming symbol the project uses, in one place, behind a version check.

The skip-aware loader and the rewrite reach below streaming's public API
(``streaming.Stream`` / ``StreamingDataset`` / ``MDSWriter``) for shard
readers, the world layout and decompression, and the export loads the writer
without the package's ``__init__`` (:func:`mds_writer`). Those internals change between
releases without notice, so they are imported here only, and importing
this module on an unknown streaming version fails with what to check.

When upgrading streaming, re-run ``tests/test_streaming_compat.py`` (one
contract test per symbol) and the upstream suite with our Stream swapped in
(see docs/STREAMING.md), then add the version to :data:`SUPPORTED`.
"""

from __future__ import annotations

import importlib.util
import os
import sys
import threading
import types
from collections.abc import Callable
from types import ModuleType
from typing import Any

#: Streaming release prefixes whose internals match what the project relies on.
SUPPORTED = ("0.13.",)

# --- ``streaming`` without its package ``__init__`` ------------------------------------------
#
# ``import streaming`` runs the package's ``__init__``, which imports every dataset it ships
# (C4's tokenizer pulls in transformers and torch's dynamo): the main part of a fresh Ray
# worker's start-up before its first export unit (benchmarks/results/streaming_import.md).
# The writer and the internals below need only ``streaming.base`` submodules. So when
# ``streaming`` is not imported yet, the packages ``streaming`` and ``streaming.base`` are
# registered with their ``__init__`` deferred: the submodules load beneath them, and the first
# attribute the package does not have yet (``streaming.StreamingDataset``,
# ``streaming.__version__``, ...) runs the real ``__init__`` in that same module object.
# Everything else that imports ``streaming`` sees the real package.

_RUN_LOCK = threading.RLock()


class _Deferred(types.ModuleType):
    """A package module whose ``__init__`` runs on the first attribute it lacks."""

    def __getattr__(self, attr: str):
        with _RUN_LOCK:  # one thread runs the __init__; the others wait for it
            if type(self) is _Deferred:
                self.__class__ = types.ModuleType  # from here on a plain module
                self.__spec__.loader.exec_module(self)
        return getattr(self, attr)  # AttributeError as usual when the package has none


def _defer(name: str) -> None:
    spec = importlib.util.find_spec(name)
    if spec is None or spec.loader is None or not spec.submodule_search_locations:
        raise ImportError(f"{name} is not installed: `pip install mosaicml-streaming`")
    mod = importlib.util.module_from_spec(spec)
    mod.__class__ = _Deferred
    sys.modules[name] = mod
    parent, _, child = name.rpartition(".")
    if parent:
        types.ModuleType.__setattr__(sys.modules[parent], child, mod)


def defer_package_init() -> None:
    """Register ``streaming`` and ``streaming.base`` with their ``__init__`` deferred, if not imported."""
    if "streaming" not in sys.modules:
        _defer("streaming")
        _defer("streaming.base")


def streaming_version() -> str:
    """The installed streaming release, without running the package ``__init__`` for it."""
    defer_package_init()
    pkg = sys.modules["streaming"]
    if type(pkg) is _Deferred:
        from streaming._version import __version__

        return __version__
    return pkg.__version__


# Only streaming.base submodules are needed from here on: the package's own __init__ (its
# datasets, transformers) runs when something asks for it.
_streaming_version = streaming_version()

if not _streaming_version.startswith(SUPPORTED):
    raise ImportError(
        f"prx-data was checked against mosaicml-streaming {', '.join(v + 'x' for v in SUPPORTED)}, "
        f"found {_streaming_version}. Check that MDSReader's constructor and get_item, "
        "Stream.get_shards, Stream.prepare_shard, Reader.evict/set_up_local/get_max_size "
        "(pinned local shards), World.detect, maybe_init_dist, decompress, reader_from_json, "
        "get_partitions, generate_work (on_change='continue'), get_hash, is_safe_mds_encoding and get_sampling (looked up as a "
        "global of streaming.base.dataset), MDSWriter at streaming.base.format.mds.writer and "
        "the package's __init__ run on first use (defer_package_init) "
        "behave as before (tests/test_streaming_compat.py), then add the version to "
        "prx_data.core.streaming_compat.SUPPORTED; or pin mosaicml-streaming==0.13.0."
    )

from streaming.base.compression import decompress  # noqa: E402
from streaming.base.distributed import maybe_init_dist  # noqa: E402
from streaming.base.format import reader_from_json  # noqa: E402
from streaming.base.format.base.reader import FileInfo  # noqa: E402
from streaming.base.format.mds.encodings import (  # noqa: E402
    get_mds_encoded_size,
    get_mds_encodings,
    is_mds_encoding,
    is_mds_encoding_safe,
    mds_encode,
)
from streaming.base.format.mds.reader import MDSReader  # noqa: E402
from streaming.base.hashing import get_hash  # noqa: E402
from streaming.base.partition import get_partitions  # noqa: E402
from streaming.base.util import retry  # noqa: E402
from streaming.base.world import World  # noqa: E402

__all__ = [
    "SUPPORTED",
    "defer_package_init",
    "mds_writer",
    "streaming_version",
    "FileInfo",
    "MDSReader",
    "World",
    "decompress",
    "generate_work",
    "get_hash",
    "retry",
    "get_mds_encoded_size",
    "get_partitions",
    "is_safe_mds_encoding",
    "maybe_init_dist",
    "mds_encode",
    "mds_reader_args",
    "quiet_shared_memory",
    "reader_from_json",
    "sampling_hooks",
]


# --- streaming's GCS clients at a GCS emulator ---------------------------------------------------
#
# Streaming 0.13's GCSUploader.__init__ and GCSDownloader._create_gcs_client build their
# google-cloud-storage Client from ``google.auth.default()`` (or from GCS_KEY/GCS_SECRET HMAC
# keys, against storage.googleapis.com only). google-cloud-storage's Client itself honours
# STORAGE_EMULATOR_HOST, but ``google.auth.default()`` fails first where no credentials exist,
# as on a test machine or CI runner beside an emulator. With STORAGE_EMULATOR_HOST set (and no
# HMAC keys), both build an anonymous Client instead, which the emulator accepts; without it,
# streaming's own code runs unchanged.


def _emulator_gcs_client():
    from prx_data.core import storage

    if not storage.gcs_emulator() or (os.environ.get("GCS_KEY") and os.environ.get("GCS_SECRET")):
        return None
    return storage.new_gcs_client()


def _install_gcs_emulator_hooks() -> None:
    from streaming.base.storage import download, upload

    if getattr(upload.GCSUploader, "_prx_emulator_hook", False):
        return
    uploader_init = upload.GCSUploader.__init__
    create_client = download.GCSDownloader._create_gcs_client

    def init(self, out, keep_local=False, progress_bar=False, retry=2, exist_ok=False):
        client = _emulator_gcs_client()
        if client is None:
            uploader_init(self, out, keep_local, progress_bar, retry, exist_ok)
            return
        upload.CloudUploader.__init__(self, out, keep_local, progress_bar, retry, exist_ok)
        self.gcs_client = client
        self.authentication = upload.GCSAuthentication.SERVICE_ACCOUNT
        self.check_bucket_exists(self.remote)

    def create(self) -> None:
        client = _emulator_gcs_client()
        if client is None:
            create_client(self)
        else:
            self._gcs_client = client

    upload.GCSUploader.__init__ = init
    upload.GCSUploader._prx_emulator_hook = True
    download.GCSDownloader._create_gcs_client = create


_install_gcs_emulator_hooks()


def generate_work(method: str, dataset: Any, world: World, epoch: int, sample_in_epoch: int):
    """Streaming's epoch partition (``streaming.base.batching.generate_work``) for any object
    with the dataset attributes it reads (a mid-epoch resume's base space); imported on use."""
    from streaming.base.batching import generate_work as upstream

    return upstream(method, dataset, world, epoch, sample_in_epoch)


def mds_writer() -> type:
    """Streaming's ``MDSWriter`` class, without the package's datasets (a light Ray worker)."""
    from streaming.base.format.mds.writer import MDSWriter

    return MDSWriter


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


# --- shared memory released at exit --------------------------------------------------------------
#
# streaming's ``SharedMemory.cleanup`` (its atexit handler) unlinks the blocks a process
# created, in one ``try``: the first block another process already removed (a rank, a
# worker, or our clean-up of a stale prefix) raises FileNotFoundError, which it passes on,
# and every later block stays registered with multiprocessing's resource tracker. At
# shutdown the tracker then prints "leaked shared_memory objects" and one line per block
# (26 at the end of a smoke training run). :func:`quiet_shared_memory` swaps in a clean-up
# that goes on past a missing block and drops the tracker's record of it.


def _cleanup_shared_memory(self) -> None:
    """streaming's ``SharedMemory.cleanup``, block by block (see above)."""
    from multiprocessing import resource_tracker

    created, opened = list(self.created_shms), list(self.opened_shms)
    self.created_shms, self.opened_shms = [], []  # once, whether atexit or a caller runs it
    for shm in created:
        try:
            shm.close()
        except (BufferError, OSError):
            pass
        try:
            shm.unlink()
        except FileNotFoundError:  # removed by another process: only our record is left
            try:
                resource_tracker.unregister(shm._name, "shared_memory")
            except Exception:  # noqa: BLE001 - a tracker already gone at exit
                pass
    original = resource_tracker.unregister
    resource_tracker.unregister = self.fix_unregister  # attached blocks are not ours to unlink
    try:
        for shm in opened:
            try:
                shm.close()
            except (BufferError, OSError):
                pass
    finally:
        resource_tracker.unregister = original


def quiet_shared_memory() -> None:
    """Make streaming's shared memory release go on past a block already removed (idempotent)."""
    from streaming.base.shared import memory

    memory.SharedMemory.cleanup = _cleanup_shared_memory
