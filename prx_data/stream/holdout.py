"""A deterministic hold-out slice by sample id, applied as a skip set; computed once per node.

The training stream and the eval stream read the same export; a sample
belongs to the hold-out when a keyed hash of its id falls below
``fraction``. The training side skips the hold-out and the eval side skips
everything else, both through the skip-aware shard readers of
:mod:`prx_data.stream.reader`, so the exclusion lives in the sample space:
epoch sizes, partitioning and resume positions all see the reduced dataset,
and nothing is filtered in ``__iter__``.

Membership depends on the id and the salt only, not on shard layout or
re-exports. The ids come from each bucket's ``ids.parquet`` manifests (no
image bytes are read), one manifest at a time, so memory is bounded by a
part plus the held-out indices. Hashing one id costs one keyed BLAKE2b
(about 0.7 us); at 10^8 ids that is still a minute, so with a cache
directory the node leader stores the held-out set of each bucket under
``<local>/holdout/`` (keyed by salt, fraction, the bucket's index and the
export's report) and every other rank of the node, and every later run with
that cache, reads it instead (:func:`holdout_skips`). Both sides derive their
skips from the same cached set.
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import posixpath
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

import numpy as np

from prx_data.core import confined, storage
from prx_data.core.errors import UsageError
from prx_data.core.schema import MANIFEST_NAME, REPORT_NAME
from prx_data.export import bounded, layout, naming, safety
from prx_data.skips import sidecar as skiplist
from prx_data.stream.leader import lead, wait_for_leader

#: Keep the training samples (skip the hold-out) or keep the hold-out (skip the rest).
SIDES = ("train", "eval")
_SCALE = float(1 << 64)
#: Subdirectory of a dataset's local cache that holds computed hold-out sets.
HOLDOUT_DIR = "holdout"
WAIT_TIMEOUT_S = 600.0

#: Held-out sample indices per shard basename of one bucket (sorted, unique, int64).
Held = dict[str, np.ndarray]


@dataclass(frozen=True)
class Holdout:
    """Which side of a hold-out split a stream keeps."""

    fraction: float
    salt: str = "eval"
    keep: str = "train"

    def __post_init__(self) -> None:
        if not 0.0 < self.fraction < 1.0:
            raise UsageError(f"hold-out fraction must be in (0, 1), got {self.fraction}")
        if self.keep not in SIDES:
            raise UsageError(f"hold-out side {self.keep!r} is not one of {SIDES}")

    @property
    def key(self) -> str:
        """What makes two hold-outs draw the same slice (the side does not: it is a view)."""
        return hashlib.sha1(f"{self.salt}\0{self.fraction!r}".encode()).hexdigest()[:16]

    def mask(self, ids) -> np.ndarray:
        """Boolean mask over an Arrow string array (or chunked array): which ids are held out.

        One keyed BLAKE2b per id from a state that has already absorbed the
        key block; the threshold test is vectorised and matches
        ``int.from_bytes(digest, "little") / 2**64 < fraction`` exactly.
        """
        import pyarrow as pa

        if ids.null_count:
            raise skiplist.SkipListError("a hold-out needs an id for every sample; found nulls")
        values = ids.cast(pa.large_binary()).to_pylist()
        base = hashlib.blake2b(digest_size=8, key=self.salt.encode()[:64])
        copy = base.copy

        def digest(b: bytes) -> bytes:
            h = copy()
            h.update(b)
            return h.digest()

        words = np.frombuffer(b"".join(map(digest, values)), dtype="<u8")
        return words.astype(np.float64) / _SCALE < self.fraction

    def held_out(self, ids: Iterable[str]) -> np.ndarray:
        """Boolean mask: which ids are in the hold-out slice."""
        import pyarrow as pa

        return self.mask(pa.array(list(ids), pa.string()))

    def side(self, held: Mapping[str, np.ndarray], shards: Sequence[layout.ShardInfo]) -> Held:
        """This side's skips from a bucket's held-out set: the set itself, or its complement."""
        if self.keep == "train":
            return {k: v for k, v in held.items() if len(v)}
        out = {}
        for s in shards:
            rest = np.setdiff1d(
                np.arange(s.samples, dtype=np.int64), held.get(s.basename, _EMPTY), True
            )
            if len(rest):
                out[s.basename] = rest
        return out

    def skips(self, root: str, bucket: str, shards: Sequence[layout.ShardInfo]) -> Held:
        """Sorted indices to skip per shard basename of one bucket, for this side."""
        return self.side(held_set(self, root, bucket, shards), shards)


_EMPTY = np.zeros(0, np.int64)


def held_set(hold: Holdout, root: str, bucket: str, shards: Sequence[layout.ShardInfo]) -> Held:
    """The held-out indices of one bucket, read from its manifests one part at a time.

    Refuses manifests that do not describe the index exactly (every shard's
    samples listed once), since the eval side is the complement of this set.
    """
    known = {s.basename: s.samples for s in shards}
    counts: dict[str, int] = {}
    held: dict[str, list[np.ndarray]] = {}
    adopted = layout.adopted_manifest(root, bucket)
    if storage.exists(adopted):  # an adopted tree: one manifest per bucket, read in batches
        batches = layout.read_adopted_manifest(root, bucket, set(known), ADOPTED_BATCH_ROWS)
        parts = (_held_in_table(hold, root, bucket, adopted, t, known) for t in batches)
    else:
        rels = storage.list_files(layout.rel_join(root, bucket), MANIFEST_NAME)

        def one(rel: str) -> list[tuple[str, int, np.ndarray]]:
            return _held_in_manifest(hold, root, bucket, rel, known)

        parts = bounded.imap_bounded(one, rels, bounded.io_workers(root))
    for part in parts:
        for name, n, idx in part:
            counts[name] = counts.get(name, 0) + n
            held.setdefault(name, []).append(idx)
    total = sum(known.values())
    if sum(counts.values()) != total:
        raise skiplist.SkipListError(
            f"{root}/{bucket}: the ids.parquet manifests list {sum(counts.values())} samples but "
            f"the index has {total}; a hold-out needs complete manifests"
        )
    for name, n in known.items():
        if counts.get(name, 0) != n:
            raise skiplist.SkipListError(
                f"{root}/{bucket}: the ids.parquet manifests list {counts.get(name, 0)} samples "
                f"of shard {name!r} but the index has {n}; a hold-out needs complete manifests"
            )
    return {
        k: (v[0] if len(v) == 1 else np.unique(np.concatenate(v))).astype(np.int64)
        for k, v in held.items()
    }


def _held_in_manifest(
    hold: Holdout, root: str, bucket: str, rel: str, known: Mapping[str, int]
) -> list[tuple[str, int, np.ndarray]]:
    """Per shard named in one manifest: (name, rows, sorted held-out indices)."""
    import pyarrow.parquet as pq

    rel = rel.replace("\\", "/")
    path = layout.rel_join(root, f"{bucket}/{rel}")
    src = io.BytesIO(confined.read(root, path, confined.MANIFEST_MAX_BYTES))
    t = pq.read_table(src, columns=["shard", "index", "id"])  # one part's: small
    safety.check_manifest_shards(path, posixpath.dirname(rel), t["shard"])
    return _held_in_table(hold, root, bucket, path, t, known)


#: Rows of an adopted bucket's (single) manifest read at a time.
ADOPTED_BATCH_ROWS = 1 << 20


def _held_in_table(
    hold: Holdout, root: str, bucket: str, path: str, t, known: Mapping[str, int]
) -> list[tuple[str, int, np.ndarray]]:
    """Per shard named in manifest rows ``t``: (name, rows, sorted held-out indices)."""
    import pyarrow.compute as pc

    mask = hold.mask(t["id"])
    enc = pc.dictionary_encode(t["shard"].combine_chunks())
    codes = enc.indices.to_numpy(zero_copy_only=False)
    index = t["index"].to_numpy().astype(np.int64)
    out = []
    for k, name in enumerate(enc.dictionary.to_pylist()):
        if name not in known:
            raise skiplist.SkipListError(
                f"{root}/{bucket}: manifest names shard {name!r}, which the index lacks"
            )
        sel = codes == k
        idx = index[sel]
        n = len(idx)
        if n and (idx.min() < 0 or idx.max() >= known[name] or len(np.unique(idx)) != n):
            raise skiplist.SkipListError(
                f"{path}: the sample indices of shard {name!r} are not 0..{known[name] - 1} "
                "once each; a hold-out needs manifests that match the index (re-export it)"
            )
        out.append((name, n, np.unique(index[sel & mask])))
    return out


# --- the node's cache of held-out sets -------------------------------------------------------


def _bucket_key(hold: Holdout, base: str, bucket: str) -> str:
    """Identity of one bucket's held-out set: the slice, the bucket's index and the report.

    Read from ``base`` (the export, or the node's cache of a remote one), so
    keying costs no remote request. A re-export, pack or rewrite changes the
    index (or the report, for an index without shard hashes).
    """
    report = layout.rel_join(base, REPORT_NAME)
    h = hashlib.sha1(hold.key.encode())
    try:
        got = confined.read(base, report, confined.SMALL_MAX_BYTES)
    except FileNotFoundError:
        got = b""
    h.update(hashlib.sha1(got).digest())
    index = layout.rel_join(base, f"{bucket}/{naming.INDEX_NAME}")
    h.update(hashlib.sha1(confined.read(base, index, confined.INDEX_MAX_BYTES)).digest())
    return h.hexdigest()[:20]


def _cache_path(cache: str, hold: Holdout, bucket: str, key: str) -> str:
    return os.path.join(cache, HOLDOUT_DIR, hold.key, *bucket.split("/"), key + ".npz")


def _write_held(path: str, held: Held, shards: Sequence[layout.ShardInfo]) -> None:
    names = [s.basename for s in shards]
    parts = [held.get(n, _EMPTY).astype(np.uint32) for n in names]
    offsets = np.cumsum([0] + [len(p) for p in parts], dtype=np.int64)
    buf = io.BytesIO()
    np.savez(
        buf,
        shards=np.asarray(names, dtype=str),
        offsets=offsets,
        indices=np.concatenate(parts) if parts else np.zeros(0, np.uint32),
    )
    storage.write_bytes_atomic(path, buf.getvalue())
    folder = os.path.dirname(path)
    for other in os.listdir(folder):  # older versions of this bucket's set
        if other.endswith(".npz") and other != os.path.basename(path):
            try:
                os.remove(os.path.join(folder, other))
            except FileNotFoundError:
                pass


def _read_held(path: str, shards: Sequence[layout.ShardInfo]) -> Held | None:
    """A cached set, or None when absent or not this index's (no pickle: plain arrays)."""
    try:
        with np.load(path, allow_pickle=False) as z:
            names = [str(n) for n in z["shards"]]
            offsets = z["offsets"]
            indices = z["indices"].astype(np.int64)
    except (OSError, ValueError, KeyError):
        return None
    if names != [s.basename for s in shards] or len(offsets) != len(names) + 1:
        return None
    out = {}
    for i, s in enumerate(shards):
        idx = indices[offsets[i] : offsets[i + 1]]
        if len(idx) and (idx[-1] >= s.samples or np.any(np.diff(idx) <= 0)):
            return None
        if len(idx):
            out[s.basename] = idx
    return out


def holdout_skips(
    hold: Holdout,
    root: str,
    base: str,
    shards: Mapping[str, Sequence[layout.ShardInfo]],
    cache: str | None,
    *,
    is_leader: bool,
    timeout: float = WAIT_TIMEOUT_S,
) -> dict[str, tuple[Held, Held]]:
    """Per bucket: (held-out set, this side's skips), computed once per node when cached.

    ``root`` is where the manifests are; ``base`` holds the bucket indexes
    (and the report) that key the cache; ``cache`` is the node's local
    directory (None: compute here, nothing stored). The leader (local rank 0)
    reads or computes each bucket's set and writes a marker last; the other
    ranks wait for it and read the sets (a missing one is computed, never
    guessed).
    """
    if cache is None:
        return {b: _pair(hold, held_set(hold, root, b, s), s) for b, s in shards.items()}
    keys = {b: _bucket_key(hold, base, b) for b in shards}
    digest = hashlib.sha1(json.dumps(sorted(keys.items())).encode()).hexdigest()[:16]
    marker = os.path.join(cache, HOLDOUT_DIR, hold.key, f"_ready.{digest}")
    out = {}
    if not is_leader:
        wait_for_leader(marker, timeout, f"the hold-out of {root}")
        for b, s in shards.items():
            held = _read_held(_cache_path(cache, hold, b, keys[b]), s)
            out[b] = _pair(hold, held if held is not None else held_set(hold, root, b, s), s)
        return out

    def compute() -> tuple[None, bytes]:
        for b, s in shards.items():
            path = _cache_path(cache, hold, b, keys[b])
            held = _read_held(path, s)
            if held is None:
                held = held_set(hold, root, b, s)
                _write_held(path, held, s)
            out[b] = _pair(hold, held, s)
        return None, b"ok\n"

    lead(marker, compute)
    return out


def _pair(hold: Holdout, held: Held, shards: Sequence[layout.ShardInfo]) -> tuple[Held, Held]:
    return held, hold.side(held, shards)


def merge_skips(a: Mapping[str, np.ndarray], b: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
    """Union of two per-shard skip sets (sorted, unique)."""
    out = {k: np.asarray(v, np.int64) for k, v in a.items()}
    for k, v in b.items():
        out[k] = np.union1d(out[k], v) if k in out else np.asarray(v, np.int64)
    return out
