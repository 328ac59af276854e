"""Content keys of an image and the opt-out key set every writer checks rows against.

An opt-out must follow the *image*, not the name it was ingested under: a
byte-identical copy has another row id, and a re-encoded or resized copy has
other bytes but the same perceptual hash. So a removal is keyed three ways
(row id, sha256 of the source bytes, 64-bit pHash) and a row is out when any
of its keys is in the set.

The set is held as sorted ``uint64`` fingerprints, one array per key kind, so
a writer checks a batch with one ``searchsorted`` and the set costs 8 bytes a
key (80 MB at 10^7 keys) in every worker, whatever the ids' lengths:

* sha256 digests: their first 8 bytes (already uniform);
* pHashes: the hash itself (exact);
* ids: the first 8 bytes of their BLAKE2b digest.

A 64-bit fingerprint can collide: with 10^7 keys and 10^8 rows checked, the
expected number of rows wrongly matched is about 5e-5 (n*m/2^64). A row that
is left out is still counted and listed (``opted_out`` in ``dropped.parquet``),
never dropped silently.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import numpy as np
import pyarrow as pa

#: Key kinds, in the order they are stored.
KINDS = ("id", "sha256", "phash")
#: pHashes that say nothing about an image (flat images all hash to these), never used as keys.
DEGENERATE_PHASHES = frozenset({0, (1 << 64) - 1})


def sha256_hex(data: bytes) -> str:
    """The digest an opt-out binds to: sha256 of the bytes exactly as ingested."""
    return hashlib.sha256(data).hexdigest()


def _id_fingerprints(ids: Sequence[str | None]) -> tuple[np.ndarray, np.ndarray]:
    out = np.zeros(len(ids), np.uint64)
    valid = np.zeros(len(ids), bool)
    for i, v in enumerate(ids):
        if v:
            out[i] = int.from_bytes(hashlib.blake2b(v.encode(), digest_size=8).digest(), "big")
            valid[i] = True
    return out, valid


def _digest_fingerprints(digests: Sequence[str | None]) -> tuple[np.ndarray, np.ndarray]:
    out = np.zeros(len(digests), np.uint64)
    valid = np.zeros(len(digests), bool)
    for i, v in enumerate(digests):
        if v and len(v) == 64:
            try:
                out[i] = int(v[:16], 16)
            except ValueError:
                continue
            valid[i] = True
    return out, valid


def _phash_fingerprints(phashes: Sequence[int | None]) -> tuple[np.ndarray, np.ndarray]:
    out = np.zeros(len(phashes), np.uint64)
    valid = np.zeros(len(phashes), bool)
    for i, v in enumerate(phashes):
        if v is None:
            continue
        u = int(v) & ((1 << 64) - 1)  # stored as int64 in tables: the same 64 bits
        if u in DEGENERATE_PHASHES:
            continue
        out[i], valid[i] = u, True
    return out, valid


_FINGERPRINT = {
    "id": _id_fingerprints,
    "sha256": _digest_fingerprints,
    "phash": _phash_fingerprints,
}


def fingerprints(kind: str, values: Sequence) -> np.ndarray:
    """The sorted unique fingerprints of ``values`` of one key kind (nulls and junk left out)."""
    fp, valid = _FINGERPRINT[kind](list(values))
    return np.unique(fp[valid])


def _column(values: pa.Array | pa.ChunkedArray | Iterable | None) -> list:
    if values is None:
        return []
    if isinstance(values, (pa.Array, pa.ChunkedArray)):
        return values.to_pylist()
    return list(values)


@dataclass(frozen=True)
class KeySet:
    """Sorted fingerprints of the removed ids, source digests and pHashes (see the module doc)."""

    id: np.ndarray
    sha256: np.ndarray
    phash: np.ndarray

    @classmethod
    def empty(cls) -> KeySet:
        z = np.zeros(0, np.uint64)
        return cls(z, z, z)

    @classmethod
    def of(
        cls,
        ids: Iterable[str | None] = (),
        digests: Iterable[str | None] = (),
        phashes: Iterable[int | None] = (),
    ) -> KeySet:
        return cls(
            fingerprints("id", _column(ids)),
            fingerprints("sha256", _column(digests)),
            fingerprints("phash", _column(phashes)),
        )

    def __len__(self) -> int:
        return len(self.id) + len(self.sha256) + len(self.phash)

    @property
    def needs_digests(self) -> bool:
        """Whether rows must be checked by their source digest (a writer computes missing ones)."""
        return len(self.sha256) > 0

    def matches(
        self,
        ids: Sequence[str | None],
        digests: Sequence[str | None] | None = None,
        phashes: Sequence[int | None] | None = None,
    ) -> np.ndarray:
        """A bool mask over the rows: True where any of the row's keys is in the set."""
        n = len(ids)
        hit = np.zeros(n, bool)
        for kind, values in (("id", ids), ("sha256", digests), ("phash", phashes)):
            keys = getattr(self, kind)
            if values is None or not len(keys):
                continue
            fp, valid = _FINGERPRINT[kind](list(values))
            pos = np.searchsorted(keys, fp)
            pos[pos >= len(keys)] = 0
            hit |= valid & (keys[pos] == fp)
        return hit

    def to_table(self) -> pa.Table:
        """One ``kind``/``key`` row per fingerprint (the file a run hands its workers)."""
        kinds, keys = [], []
        for k in KINDS:
            arr = getattr(self, k)
            kinds.append(np.full(len(arr), KINDS.index(k), np.int8))
            keys.append(arr)
        return pa.table(
            {"kind": pa.array(np.concatenate(kinds)), "key": pa.array(np.concatenate(keys))}
        )

    @classmethod
    def from_table(cls, t: pa.Table) -> KeySet:
        kind = t["kind"].to_numpy()
        key = t["key"].to_numpy().astype(np.uint64, copy=False)
        parts = [np.unique(key[kind == i]) for i in range(len(KINDS))]
        return cls(*parts)


__all__ = [
    "DEGENERATE_PHASHES",
    "KINDS",
    "KeySet",
    "fingerprints",
    "sha256_hex",
]
