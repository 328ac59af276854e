"""The ledger's removals applied while an export writes: opted-out rows never reach a shard.

The driver resolves the corpus ledger's opt-outs into a :class:`~prx_data.core.keys.KeySet`
(ids, source digests, pHashes) and leaves it in the export as one small file
(:data:`KEYS_NAME`) before any unit runs; each unit loads it once per process and
drops every row that matches, counted as ``opted_out`` and listed in
``dropped.parquet``. So an opt-out made before an export is never written into it;
sidecars only hide samples written before the opt-out.

The file is derived state: every run (a resume too) writes it afresh from the ledger,
so an opt-out that lands between a kill and ``--resume`` holds for the units still to run.
"""

from __future__ import annotations

import functools
import io

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from prx_data.core import storage
from prx_data.core.keys import KeySet, sha256_hex
from prx_data.core.schema import ID, IMAGE, PHASH, SHA256
from prx_data.export.naming import PROGRESS_DIR

#: The key set a run's units check rows against (absent: nothing opted out).
KEYS_NAME = "optout-keys.parquet"
#: The drop reason (``ExportReport.dropped``, ``dropped.parquet``).
OPTED_OUT = "opted_out"


def keys_path(out: str) -> str:
    return storage.join(out, PROGRESS_DIR, KEYS_NAME)


def write_keys(out: str, keys: KeySet) -> None:
    """Leave the run's key set in the export (deleted when there is none)."""
    path = keys_path(out)
    if not len(keys):
        if storage.exists(path):
            storage.delete(path)
        return
    buf = io.BytesIO()
    pq.write_table(keys.to_table(), buf)
    storage.write_bytes_atomic(path, buf.getvalue())


@functools.lru_cache(maxsize=4)
def _load(path: str, version: str) -> KeySet:
    data = storage.read_bytes(path)
    return KeySet.from_table(pq.read_table(io.BytesIO(data)))


def load_keys(out: str) -> KeySet:
    """The run's key set (cached per process by the file's version, so a unit reads it once)."""
    path = keys_path(out)
    v = storage.file_version(path)
    if v is None:
        return KeySet.empty()
    return _load(path, f"{v.size}:{v.tag}")


def read_columns(keys: KeySet, available: set[str]) -> list[str]:
    """The extra table columns a unit reads to check its rows against ``keys``."""
    if not len(keys):
        return []
    return [c for c in (SHA256, PHASH) if c in available]


def removed(keys: KeySet, batch: pa.RecordBatch) -> list[bool]:
    """Per row of ``batch``: whether one of its keys (id, source digest, pHash) is removed.

    A row without a recorded digest is hashed from its bytes, only when the set
    holds digests at all.
    """
    if not len(keys):
        return [False] * batch.num_rows
    names = batch.schema.names
    ids = batch.column(names.index(ID))  # whole columns: fingerprinted without per-row numpy
    digests = None
    if keys.needs_digests:
        have = batch.column(names.index(SHA256)) if SHA256 in names else None
        if have is not None and not pc.any(pc.fill_null(pc.equal(have, ""), True)).as_py():
            digests = have
        else:  # rows without a recorded digest are hashed from their bytes
            have = have.to_pylist() if have is not None else None
            images = batch.column(names.index(IMAGE)).to_pylist() if IMAGE in names else None
            digests = []
            for i in range(batch.num_rows):
                d = have[i] if have is not None else None
                if not d and images is not None and images[i]:
                    d = sha256_hex(images[i])
                digests.append(d)
    phashes = batch.column(names.index(PHASH)) if PHASH in names else None
    return keys.matches(ids, digests, phashes).tolist()


__all__ = [
    "KEYS_NAME",
    "OPTED_OUT",
    "keys_path",
    "load_keys",
    "read_columns",
    "removed",
    "write_keys",
]
