"""A deterministic hold-out slice by sample id, applied as an in-memory skip set.

The training stream and the eval stream read the same export; a sample
belongs to the hold-out when a keyed hash of its id falls below
``fraction``. The training side skips the hold-out and the eval side skips
everything else, both through the skip-aware shard readers of
:mod:`prx_data.stream.dataset`, so the exclusion lives in the sample space:
epoch sizes, partitioning and resume positions all see the reduced dataset,
and nothing is filtered in ``__iter__``.

Membership depends on the id and the salt only, not on shard layout or
re-exports. The ids come from each bucket's ``ids.parquet`` manifests (no
image bytes are read); every rank computes the same sets at start-up.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

import numpy as np

from prx_data.core.errors import UsageError
from prx_data.export import layout
from prx_data.skips import sidecar as skiplist

#: Keep the training samples (skip the hold-out) or keep the hold-out (skip the rest).
SIDES = ("train", "eval")
_SCALE = float(1 << 64)


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

    def held_out(self, ids: Iterable[str]) -> np.ndarray:
        """Boolean mask: which ids are in the hold-out slice."""
        key = self.salt.encode()[:64]
        out = [
            int.from_bytes(hashlib.blake2b(i.encode(), digest_size=8, key=key).digest(), "little")
            / _SCALE
            < self.fraction
            for i in ids
        ]
        return np.asarray(out, dtype=bool)

    def skips(
        self, root: str, bucket: str, shards: Sequence[layout.ShardInfo]
    ) -> dict[str, np.ndarray]:
        """Sorted indices to skip per shard basename of one bucket, for this side."""
        table = layout.read_manifests(root, [bucket])
        known = {s.basename: s for s in shards}
        if len(table) != sum(s.samples for s in shards):
            raise skiplist.SkipListError(
                f"{root}/{bucket}: the ids.parquet manifests list {len(table)} samples but the "
                f"index has {sum(s.samples for s in shards)}; a hold-out needs complete manifests"
            )
        mask = self.held_out(table["id"].to_pylist())
        drop = mask if self.keep == "train" else ~mask
        out: dict[str, list[int]] = {}
        for shard, index, d in zip(
            table["shard"].to_pylist(), table["index"].to_pylist(), drop, strict=True
        ):
            if shard not in known:
                raise skiplist.SkipListError(
                    f"{root}/{bucket}: manifest names shard {shard!r}, which the index lacks"
                )
            if d:
                out.setdefault(shard, []).append(int(index))
        return {k: np.unique(np.asarray(v, np.int64)) for k, v in out.items()}


def merge_skips(a: Mapping[str, np.ndarray], b: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
    """Union of two per-shard skip sets (sorted, unique)."""
    out = {k: np.asarray(v, np.int64) for k, v in a.items()}
    for k, v in b.items():
        out[k] = np.union1d(out[k], v) if k in out else np.asarray(v, np.int64)
    return out
