"""What a loader streams, as plain values: one dataset's settings and one bucket's sources.

The bottom of :mod:`prx_data.stream`: no torch, no streaming, no I/O. The
catalog, the hold-out, resume safety and the dataset build on these.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np

from prx_data.export import layout

# At run time, not only for type checkers: the trainer's YAML schema is this class
# (``data.datasets``), and its loader resolves every field's type.
from prx_data.stream.holdout import Holdout

if TYPE_CHECKING:
    from prx_data.stream.foreign import ForeignColumns


@dataclass
class DatasetSpec:
    """One export tree and how much of it to use: the one dataset type, from a notebook's
    ``BucketedDataset`` to the trainer's ``data.datasets`` YAML list.

    ``skip_lists``: None applies every list found; ``[]`` applies none; a list
    of names applies those (an unknown name is an error, to catch typos).
    ``allow_incomplete``: stream an export that has no ``report.json``, misses
    unit markers, or whose bucket indexes disagree with its report (refused by
    default: such an export did not finish, or was changed after it did).
    """

    root: str
    local: str | None = None
    proportion: float | None = None
    repeat: float | None = None
    choose: int | None = None
    skip_lists: list[str] | None = None
    allow_incomplete: bool = False
    #: Hold-out by id hash (train side or eval side), merged with the skip lists. With
    #: ``local`` (also for a local root) the node computes it once into ``<local>/holdout/``.
    holdout: Holdout | None = None
    #: The tier of an MDS tree with one folder per aspect ratio (``<ar>/index.json``).
    tier: int | None = None
    #: Item key -> column of an MDS tree another writer made, e.g. ``{"caption": "prompt"}``.
    columns: dict[str, str] | None = None
    #: Its name in plans and in each item's ``dataset`` (None: :func:`default_name` of the root).
    name: str | None = None

    @property
    def label(self) -> str:
        """``name``, or the root's last two path parts."""
        return self.name or default_name(self.root)


def default_name(root: str) -> str:
    """The last two parts of an export root: ``s3://b/exports/v1`` -> ``exports/v1``."""
    parts = [p for p in root.rstrip("/").split("/") if p and not p.endswith(":")]
    return "/".join(parts[-2:]) or root


@dataclass
class BucketSource:
    """One bucket of one export, ready to stream: where it is, its shards and its skips."""

    bucket: str
    #: Bucket URI when the root is remote; the export's bucket directory when its shards are
    #: compressed (streaming then decompresses into ``local``, not into the export).
    remote: str | None
    local: str  # bucket directory (the export itself, or the cache)
    shards: list[layout.ShardInfo]
    skips: dict[str, np.ndarray]
    #: Per skip list in force: (samples it removes here, sha1 of its indices here).
    lists: dict[str, tuple[int, str]] = field(default_factory=dict)
    #: With a hold-out: (samples it holds out here, sha1 of that set here), whatever the side.
    held: tuple[int, str] | None = None
    #: The columns of a tree another writer made (None: an export of ours).
    foreign: ForeignColumns | None = None
    #: Per skip list in force: its indices per shard (``skips`` is their union with the
    #: hold-out's side); a mid-epoch resume rebuilds the checkpoint's space from them.
    per_list: dict[str, dict[str, np.ndarray]] = field(default_factory=dict)
    #: The hold-out's side per shard (empty without a hold-out).
    held_side: dict[str, np.ndarray] = field(default_factory=dict)

    @property
    def samples(self) -> int:
        return sum(s.samples for s in self.shards)

    @property
    def skipped(self) -> int:
        return sum(len(v) for v in self.skips.values())


def shard_content_key(shard: layout.ShardInfo) -> str:
    """What a shard is, whatever its folder is called: its samples, bytes and content hashes.

    A re-export that writes the same bytes under other names (a table compacted or
    ingested again) keeps every key; one that changes a shard changes its key. An
    export written without ``--hashes`` has only its size to go by, so its key also
    carries its name (which, for exports of this version, is named by its ids).
    """
    hashes = ",".join(f"{k}={v}" for k, v in sorted(shard.hashes.items()))
    return f"{shard.samples}:{shard.bytes}:{hashes or shard.basename}"


def shard_digest(
    per_shard: Mapping[str, np.ndarray], shards: Sequence[layout.ShardInfo]
) -> tuple[int, str]:
    """(indices, sha1 of the set) of one bucket's per-shard index sets.

    Each shard is keyed by its content (:func:`shard_content_key`), never by
    its folder's name, shards in key order and indices as stored (uint32), so
    equal sets over the same data give equal digests whatever order they were
    built in and whatever the parts are called; a resume compares them.
    """
    keys = {s.basename: shard_content_key(s) for s in shards}
    h = hashlib.sha1()
    n = 0
    for key, shard in sorted((keys.get(b, b), b) for b in per_shard):
        idx = np.ascontiguousarray(per_shard[shard], dtype=np.uint32)
        h.update(key.encode() + b"\0" + idx.tobytes())
        n += len(idx)
    return n, h.hexdigest()


def shards_digest(shards: Sequence[layout.ShardInfo]) -> str:
    """sha1 of a bucket's shards by content (:func:`shard_content_key`), in index order.

    Streaming numbers samples by their shard's place in the index, so the epoch's
    order depends on it: a resume needs the same shards in the same order, and
    not the same folder names.
    """
    return hashlib.sha1("\n".join(map(shard_content_key, shards)).encode()).hexdigest()[:16]
