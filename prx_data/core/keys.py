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
import pyarrow.compute as pc

#: Key kinds, in the order they are stored.
KINDS = ("id", "sha256", "phash")
#: pHashes that say nothing about an image (flat images all hash to these), never used as keys.
DEGENERATE_PHASHES = frozenset({0, (1 << 64) - 1})


def sha256_hex(data: bytes) -> str:
    """The digest an opt-out binds to: sha256 of the bytes exactly as ingested."""
    return hashlib.sha256(data).hexdigest()


Values = Sequence | pa.Array | pa.ChunkedArray
#: Hex digit -> nibble (255: not a hex digit), for the digests' fixed-width view.
_NIBBLE = np.full(256, 255, np.uint8)
for _k, _c in enumerate(b"0123456789abcdef"):
    _NIBBLE[_c] = _NIBBLE[b"0123456789ABCDEF"[_k]] = _k


def _arrow(values: Values, type_: pa.DataType) -> pa.Array | None:
    """``values`` as one Arrow array of ``type_`` (None: they are not of that type)."""
    try:
        arr = values if isinstance(values, (pa.Array, pa.ChunkedArray)) else pa.array(values, type_)
        if isinstance(arr, pa.ChunkedArray):
            arr = arr.combine_chunks()
        return arr.cast(type_)
    except (pa.ArrowInvalid, pa.ArrowTypeError, pa.ArrowNotImplementedError, OverflowError):
        return None


def _pylist(values: Values) -> list:
    return values.to_pylist() if isinstance(values, (pa.Array, pa.ChunkedArray)) else list(values)


def _id_fingerprints(ids: Values) -> tuple[np.ndarray, np.ndarray]:
    """The first 8 bytes of each id's BLAKE2b digest, big-endian (joined, then one view)."""
    vals = _pylist(ids)
    b2, zero = hashlib.blake2b, bytes(8)
    raw = b"".join([b2(v.encode(), digest_size=8).digest() if v else zero for v in vals])
    out = np.frombuffer(raw, ">u8").astype(np.uint64)
    if isinstance(ids, (pa.Array, pa.ChunkedArray)) and pa.types.is_string(ids.type):
        valid = pc.fill_null(pc.greater(pc.binary_length(ids), 0), False)
        return out, valid.to_numpy(zero_copy_only=False)
    valid = np.fromiter((bool(v) for v in vals), bool, len(vals))
    return out, valid


def _digest_fingerprints_loop(digests: Sequence) -> tuple[np.ndarray, np.ndarray]:
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


def _digest_fingerprints(digests: Values) -> tuple[np.ndarray, np.ndarray]:
    """A 64-character digest's first 16 hex digits as a number, decoded from the column's
    bytes in place; the rare row that is not 64 bytes of plain hex takes Python's ``int``
    (which also reads ``0x``, ``_`` and other spellings), so results equal the per-row rule."""
    arr = _arrow(digests, pa.string())
    if arr is None:
        return _digest_fingerprints_loop(_pylist(digests))
    n = len(arr)
    out, valid = np.zeros(n, np.uint64), np.zeros(n, bool)
    if not n:
        return out, valid
    blen = pc.fill_null(pc.binary_length(arr), 0).to_numpy(zero_copy_only=False)
    rows = np.flatnonzero(blen == 64)
    offsets = np.frombuffer(arr.buffers()[1], np.int32)[arr.offset : arr.offset + n]
    data = np.frombuffer(arr.buffers()[2], np.uint8) if arr.buffers()[2] else np.zeros(0, np.uint8)
    if len(rows) == n and offsets[-1] + 64 - offsets[0] == 64 * n:  # all 64 bytes: one view
        heads = data[offsets[0] : offsets[0] + 64 * n].reshape(n, 64)[:, :16]
    else:
        heads = data[offsets[rows, None] + np.arange(16, dtype=np.int64)]
    nib = _NIBBLE[heads]
    hexed = nib.max(axis=1, initial=0) < 16
    # Two hex digits to a byte, eight bytes to a big-endian number.
    fp = np.ascontiguousarray((nib[:, 0::2] << 4) | (nib[:, 1::2] & 15)).view(">u8")[:, 0]
    fp = fp.astype(np.uint64)
    out[rows[hexed]], valid[rows[hexed]] = fp[hexed], True
    # 64 characters in more bytes than 64, or not plain hex: the per-row rule decides.
    odd = np.concatenate([rows[~hexed], np.flatnonzero(blen > 64)])
    if len(odd):
        ofp, ok = _digest_fingerprints_loop(arr.take(pa.array(odd)).to_pylist())
        out[odd], valid[odd] = ofp, ok
    return out, valid


def _phash_fingerprints(phashes: Values) -> tuple[np.ndarray, np.ndarray]:
    """The pHash's 64 bits (stored as int64 in tables), degenerate hashes left out."""
    arr = _arrow(phashes, pa.int64())
    if arr is None:  # Python ints beyond int64 (unsigned spellings): the same 64 bits
        vals = [None if v is None else int(v) & ((1 << 64) - 1) for v in _pylist(phashes)]
        arr = pa.array([None if v is None else v - (1 << 64) if v >> 63 else v for v in vals])
        arr = arr.cast(pa.int64())
    out = pc.fill_null(arr, 0).to_numpy(zero_copy_only=False).view(np.uint64).copy()
    valid = arr.is_valid().to_numpy(zero_copy_only=False)
    for d in DEGENERATE_PHASHES:
        valid &= out != np.uint64(d)
    out[~valid] = 0
    return out, valid


_FINGERPRINT = {
    "id": _id_fingerprints,
    "sha256": _digest_fingerprints,
    "phash": _phash_fingerprints,
}


def fingerprints(kind: str, values: Sequence) -> np.ndarray:
    """The sorted unique fingerprints of ``values`` of one key kind (nulls and junk left out)."""
    fp, valid = _FINGERPRINT[kind](values)
    return np.unique(fp[valid])


def _column(values: pa.Array | pa.ChunkedArray | Iterable | None) -> Values:
    if values is None:
        return []
    if isinstance(values, (pa.Array, pa.ChunkedArray)):
        return values
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
            fp, valid = _FINGERPRINT[kind](_column(values))
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
