"""Stream bucketed exports into training: skip lists in the sample space, one shape per batch.

An export tree holds one MDS dataset per bucket (``<root>/<tier>/<ar>/``).
:class:`BucketedDataset` turns every bucket of the chosen tier(s) of one or
more export trees into a Mosaic ``Stream`` and mixes them:

* **Skip lists** (:mod:`prx_data.skips.sidecar`) are applied where streaming
  defines its sample space: each shard reader reports only its kept samples
  and maps a kept index to the stored one (:class:`SkipMDSReader`). Epoch
  size, partitioning, shuffling, proportions and resumption all see the
  filtered dataset, and no data is read to leave a sample out.
* **Same-shape batches**: ``per_stream`` batching (one bucket per global
  batch) by default; each bucket's epoch count is sized by
  :mod:`prx_data.stream.planner` so that streaming never pads a bucket.
* **Mixing**: datasets mix by ``proportion`` / ``repeat`` / ``choose``;
  within a dataset, buckets are weighted by their sample counts after skips.
  Remote roots get the same weights as local ones.
* **Remote roots**: local rank 0 of each node fetches the bucket indexes and
  sidecars into the local cache; the other ranks of the node wait and reuse.

See docs/STREAMING.md for the reasoning and the knobs.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import time
import warnings
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
from streaming import Stream, StreamingDataset

from prx_data.core import storage
from prx_data.core.buckets import (
    DEFAULT_SPEC,
    BucketSpec,
    bucket_name,
    parse_bucket_name,
    same_ratio_shape,
)
from prx_data.core.schema import REPORT_NAME
from prx_data.core.streaming_compat import World, maybe_init_dist
from prx_data.export import layout
from prx_data.skips import sidecar as skiplist
from prx_data.skips.reader import SkipMDSReader  # noqa: F401 (re-exported)
from prx_data.stream import cache as shard_cache
from prx_data.stream import foreign as foreign_tree
from prx_data.stream import planner
from prx_data.stream.decode import decode_chw
from prx_data.stream.holdout import Holdout, merge_skips
from prx_data.stream.reader import SkipStream

log = logging.getLogger(__name__)

#: Written last by the node's fetching rank; the other ranks wait for it.
CATALOG_PREFIX = "_prx_catalog."
FETCH_TIMEOUT_S = 600.0


@dataclass
class DatasetSpec:
    """One export tree and how much of it to use.

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
    #: In-memory hold-out by id hash (train side or eval side), merged with the skip lists.
    holdout: Holdout | None = None
    #: The tier of an MDS tree with one folder per aspect ratio (``<ar>/index.json``).
    tier: int | None = None
    #: Item key -> column of an MDS tree another writer made, e.g. ``{"caption": "prompt"}``.
    columns: dict[str, str] | None = None


@dataclass
class BucketSource:
    """One bucket of one export, ready to stream: where it is, its shards and its skips."""

    bucket: str
    remote: str | None  # bucket URI when the root is remote
    local: str  # bucket directory (the export itself, or the cache)
    shards: list[layout.ShardInfo]
    skips: dict[str, np.ndarray]
    #: Per skip list in force: (samples it removes here, sha1 of its indices here).
    lists: dict[str, tuple[int, str]] = field(default_factory=dict)
    #: The columns of a tree another writer made (None: an export of ours).
    foreign: foreign_tree.ForeignColumns | None = None

    @property
    def samples(self) -> int:
        return sum(s.samples for s in self.shards)

    @property
    def skipped(self) -> int:
        return sum(len(v) for v in self.skips.values())


# --- discovery and sidecar fetching ---------------------------------------------------------


def discover_buckets(root: str, tiers: Sequence[int]) -> list[str]:
    """Bucket names of the given tiers that exist under an export root (local or remote)."""
    return layout.list_buckets(root, tiers)


def _catalog_name(tiers: Sequence[int], names: Sequence[str] | None) -> str:
    key = json.dumps([sorted(tiers), None if names is None else sorted(names)])
    return CATALOG_PREFIX + hashlib.sha1(key.encode()).hexdigest()[:12] + ".txt"


def _check_names(root: str, found: set[str], names: Sequence[str] | None) -> None:
    if names:
        missing = sorted(set(names) - found)
        if missing:
            raise skiplist.SkipListError(
                f"skip list(s) {missing} not found under {root} (found: {sorted(found) or 'none'})"
            )


def _check_orphans(
    root: str, orphans: Sequence[skiplist.SidecarProblem], names: Sequence[str] | None
) -> None:
    """Stray ``*.skip`` files are never applied: refuse if they claim a requested list, else warn."""
    if not orphans or names == []:
        return
    wanted = {n.lower() for n in names or []}
    hit = [o for o in orphans if o.claimed is not None and o.claimed.lower() in wanted]
    if hit:
        raise skiplist.SkipListError(
            f"{root}: {len(hit)} sidecar(s) of a requested skip list cannot be applied:\n  "
            + "\n  ".join(o.text() for o in hit[:10])
            + "\nrebuild them with python -m prx_data.skips add, or delete them"
        )
    more = f" (and {len(orphans) - 5} more)" if len(orphans) > 5 else ""
    warnings.warn(
        f"{root}: {len(orphans)} stray sidecar(s) are not applied: "
        + "; ".join(o.text() for o in orphans[:5])
        + more
        + ". Run python -m prx_data.skips list to see them all.",
        stacklevel=3,
    )


def fetch_catalog(
    spec: DatasetSpec,
    tiers: Sequence[int],
    local: str,
    *,
    is_leader: bool,
    timeout: float = FETCH_TIMEOUT_S,
) -> list[str]:
    """Copy a remote export's bucket indexes and chosen sidecars into ``local``, once per node.

    The leader (local rank 0) lists and fetches, refreshes the cache (stale
    sidecars are removed) and writes a catalog file last; other ranks wait
    for that file and make no remote request. Returns the bucket names.
    """
    names = spec.skip_lists
    marker = os.path.join(local, _catalog_name(tiers, names))
    if not is_leader:
        _node_barrier()
        deadline = time.monotonic() + timeout
        while not os.path.exists(marker):
            if time.monotonic() > deadline:
                raise TimeoutError(f"{marker}: local rank 0 did not finish fetching skip lists")
            time.sleep(0.05)
        with open(marker) as f:
            text = f.read()
        if text.startswith(_ERROR):
            raise RuntimeError(f"local rank 0 failed to fetch {spec.root}: {text[len(_ERROR) :]}")
        return [line for line in text.splitlines() if line]
    if os.path.exists(marker):
        os.remove(marker)
    try:
        buckets = _fetch(spec, tiers, local)
    except Exception as e:
        # Tell the waiting ranks why, instead of leaving them at the barrier.
        storage.write_bytes_atomic(marker, f"{_ERROR}{type(e).__name__}: {e}".encode())
        _node_barrier()
        raise
    storage.write_bytes_atomic(marker, "".join(b + "\n" for b in buckets).encode())
    _node_barrier()
    return buckets


_ERROR = "ERROR "


def _node_barrier() -> None:
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        torch.distributed.barrier()


def _fetch(spec: DatasetSpec, tiers: Sequence[int], local: str) -> list[str]:
    names = spec.skip_lists
    buckets = discover_buckets(spec.root, tiers)
    report_uri = storage.join(spec.root, REPORT_NAME)
    report = storage.read_bytes(report_uri) if storage.exists(report_uri) else None
    # A cached shard is reused only if it belongs to the current index entry (stream/cache.py).
    tracked = shard_cache.is_tracked(local)
    cached_report = os.path.join(local, REPORT_NAME)
    same_report = report is not None and _read_local(cached_report) == report
    found: set[str] = set()
    orphans: list[skiplist.SidecarProblem] = []
    for bucket in buckets:
        remote_b = layout.rel_join(spec.root, bucket)
        local_b = os.path.join(local, *bucket.split("/"))
        index_uri = storage.join(remote_b, layout.INDEX_NAME)
        index = storage.read_bytes(index_uri)
        try:
            obj = json.loads(index)
        except ValueError as e:
            raise layout.UnsafeIndexError(f"{index_uri}: not valid JSON ({e})") from None
        entries = layout.check_index_entries(index_uri, obj, plain=True)
        cached = shard_cache.read_cached_index(local_b, layout.INDEX_NAME) if tracked else None
        shard_cache.drop_stale_shards(local_b, cached, entries, same_report=same_report)
        # Checked before it reaches the cache: streaming joins its names to ``local`` blindly.
        storage.write_bytes_atomic(os.path.join(local_b, layout.INDEX_NAME), index)
        shards = [layout.ShardInfo.from_index_entry(e) for e in entries]
        listed, stray = skiplist.scan_sidecars(spec.root, bucket, shards)
        orphans += stray
        found |= set(listed)
        chosen = list(listed) if names is None else [n for n in names if n in listed]
        want = {skiplist.sidecar_basename(b, n) for n in chosen for b in listed[n]}
        for rel in storage.list_files(local_b, skiplist.SUFFIX):
            if rel.replace(os.sep, "/") not in want:
                os.remove(os.path.join(local_b, rel))

        def get(rel: str, remote_b: str = remote_b, local_b: str = local_b) -> None:
            data = storage.read_bytes(storage.join(remote_b, *rel.split("/")))
            storage.write_bytes_atomic(os.path.join(local_b, *rel.split("/")), data)

        layout.map_io(get, sorted(want), True)
    # Last: the cached report dates the cached shards of an index without hashes.
    if report is not None:  # the loader's completeness check reads the cached copy
        storage.write_bytes_atomic(cached_report, report)
    elif os.path.exists(cached_report):
        os.remove(cached_report)
    shard_cache.mark_tracked(local)
    _check_orphans(spec.root, orphans, names)
    _check_names(spec.root, found, names)
    return buckets


def _read_local(path: str) -> bytes | None:
    try:
        with open(path, "rb") as f:
            return f.read()
    except FileNotFoundError:
        return None


def load_sources(
    spec: DatasetSpec,
    tiers: Sequence[int],
    world: World | None = None,
    caption_columns: Sequence[str] = ("caption",),
) -> list[BucketSource]:
    """Every bucket of ``tiers`` in one export with its shards and (validated) skips.

    A tree another writer made (no export marker or report, or adopted:
    :mod:`prx_data.stream.foreign`) has no report to check, and its columns are
    resolved per bucket.
    """
    world = world or World.detect()
    if spec.tier is not None:
        layout.declare_flat_tier(spec.root, spec.tier)
    from prx_data.export import adopt

    plain = adopt.is_foreign_tree(spec.root)
    mapping = dict(spec.columns or {})
    if plain:  # ids as adopted: skip lists name samples by them
        rec = adopt.read_record(spec.root)
        if rec is not None:
            mapping["id"] = rec.get("id_column") or ""  # "": synthetic ids
    if storage.is_remote(spec.root):
        if not spec.local:
            raise ValueError(
                f"{spec.root}: a remote root needs DatasetSpec.local (a cache directory)"
            )
        buckets = fetch_catalog(spec, tiers, spec.local, is_leader=world.is_local_leader)
        base = spec.local
    else:
        buckets = discover_buckets(spec.root, tiers)
        base = spec.root
    if not buckets:
        raise FileNotFoundError(f"no buckets of tier(s) {list(tiers)} under {spec.root}")
    out = []
    found: set[str] = set()
    report = None
    if not spec.allow_incomplete and not plain:
        report = layout.read_report(base)
        layout.check_export_complete(
            spec.root, report, count_markers=not storage.is_remote(spec.root)
        )
    orphans: list[skiplist.SidecarProblem] = []
    for bucket in buckets:
        entries = layout.read_index_entries(base, bucket)
        shards = [layout.ShardInfo.from_index_entry(e) for e in entries]
        cols = None
        if plain:
            index_path = layout.rel_join(spec.root, f"{bucket}/{layout.INDEX_NAME}")
            cols = foreign_tree.resolve_columns(index_path, entries, mapping, caption_columns)
        if report is not None:
            layout.check_bucket_complete(spec.root, bucket, shards, report)
        skips: dict[str, np.ndarray] = {}
        lists: dict[str, tuple[int, str]] = {}
        if spec.skip_lists != []:
            listing, stray = skiplist.scan_sidecars(base, bucket, shards)
            orphans += stray
            found |= set(listing)
            skips, lists = _load_lists(base, bucket, shards, spec.skip_lists, listing)
        if spec.holdout is not None:
            skips = merge_skips(skips, spec.holdout.skips(spec.root, bucket, shards))
        remote = layout.rel_join(spec.root, bucket) if storage.is_remote(spec.root) else None
        local_b = os.path.join(base, *bucket.split("/"))
        if not storage.is_remote(spec.root):
            local_b = layout.rel_join(base, bucket)
        out.append(BucketSource(bucket, remote, local_b, shards, skips, lists, cols))
    _check_orphans(spec.root, orphans, spec.skip_lists)
    _check_names(spec.root, found, spec.skip_lists)
    return out


def _load_lists(
    base: str,
    bucket: str,
    shards: list[layout.ShardInfo],
    names: Sequence[str] | None,
    listing: dict[str, list[str]],
) -> tuple[dict[str, np.ndarray], dict[str, tuple[int, str]]]:
    """The union of the chosen lists per shard, and per list its size and content digest.

    Each sidecar is read once; the digests let a resume tell that a list was
    added, removed or changed since its checkpoint.
    """
    chosen = sorted(listing) if names is None else list(names)
    merged: dict[str, list[np.ndarray]] = {}
    lists: dict[str, tuple[int, str]] = {}
    for name in chosen:
        one = skiplist.load_skips(base, bucket, shards, [name], listing=listing)
        h = hashlib.sha1()
        n = 0
        for shard in sorted(one):
            idx = np.ascontiguousarray(one[shard], dtype=np.uint32)
            h.update(shard.encode() + b"\0" + idx.tobytes())
            n += len(idx)
            merged.setdefault(shard, []).append(idx)
        if n:
            lists[name] = (n, h.hexdigest())
    skips = {
        b: (a[0] if len(a) == 1 else np.unique(np.concatenate(a))).astype(np.uint32)
        for b, a in merged.items()
    }
    return skips, lists


# --- resume fingerprint ----------------------------------------------------------------------

#: What ``BucketedDataset.load_state_dict`` may do when the sample space changed since the
#: checkpoint: refuse (default), or start the checkpoint's epoch over with the current lists.
ON_CHANGE = ("error", "restart_epoch")
FINGERPRINT_KEY = "prx_fingerprint"


class ResumeMismatch(planner.PlanError):
    """The checkpoint's sample space differs from this dataset's: continuing would be wrong."""


def fingerprint(
    specs: Sequence[DatasetSpec],
    sources: Sequence[Sequence[BucketSource]],
    plan: planner.Plan,
    *,
    tier: int,
    include_higher_tiers: bool,
    bucket_spec: BucketSpec,
) -> dict[str, Any]:
    """What defines the epoch's sample space, as plain JSON types (no world size in it).

    Datasets and weights, the skip lists in force with their size and a digest
    of their content, the epoch size, tier and bucket spec, the data-parallel
    global batch, replication and planning unit, and a digest of the
    per-bucket plan. Two runs with equal fingerprints see the same epoch, on
    any world size.
    """
    datasets = []
    for spec, src in zip(specs, sources, strict=True):
        per_list: dict[str, dict[str, Any]] = {}
        for name in sorted({n for b in src for n in b.lists}):
            h = hashlib.sha1()
            n = 0
            for b in src:
                if name in b.lists:
                    n += b.lists[name][0]
                    h.update(f"{b.bucket}:{b.lists[name][1]};".encode())
            per_list[name] = {"samples": n, "digest": h.hexdigest()[:16]}
        datasets.append(
            {
                "root": spec.root,
                "proportion": spec.proportion,
                "repeat": spec.repeat,
                "choose": spec.choose,
                "samples": sum(b.samples for b in src),
                "skip_lists": per_list,
            }
        )
    buckets = json.dumps([[b.dataset, b.bucket, b.choose] for b in plan.buckets])
    return {
        "version": 1,
        "tier": tier,
        "include_higher_tiers": include_higher_tiers,
        "bucket_spec": hashlib.sha1(repr(bucket_spec).encode()).hexdigest()[:16],
        "batching_method": plan.batching_method,
        # Fixed across elastic resumes (streaming's rule); a change reorders the epoch.
        "global_batch_size": plan.global_batch_size,
        "replication": plan.replication,
        "unit": plan.unit,
        "epoch_size": plan.epoch_size,
        "datasets": datasets,
        "plan": hashlib.sha1(buckets.encode()).hexdigest()[:16],
    }


#: How :func:`describe_changes` words a list in force on one side only: since a checkpoint.
SINCE_CHECKPOINT = (
    "{root}: skip list {name!r} added since the checkpoint ({n} samples in this tier)",
    "{root}: skip list {name!r} no longer applied ({n} samples would come back)",
)


def describe_changes(
    old: dict[str, Any], new: dict[str, Any], wording: tuple[str, str] = SINCE_CHECKPOINT
) -> list[str]:
    """Human-readable differences between two fingerprints (empty when they match).

    ``wording``: format strings (``root``, ``name``, ``n``) for a skip list
    in force only in ``new``, then only in ``old``.
    """
    out: list[str] = []
    keys = ("tier", "include_higher_tiers", "bucket_spec", "batching_method")
    for key in (*keys, "global_batch_size", "replication", "unit"):
        if old.get(key) != new.get(key):
            out.append(f"{key}: {old.get(key)!r} -> {new.get(key)!r}")
    old_ds = {d["root"]: d for d in old.get("datasets", [])}
    new_ds = {d["root"]: d for d in new.get("datasets", [])}
    for root in old_ds.keys() - new_ds.keys():
        out.append(f"dataset {root} removed")
    for root in new_ds.keys() - old_ds.keys():
        out.append(f"dataset {root} added")
    for root in old_ds.keys() & new_ds.keys():
        a, b = old_ds[root], new_ds[root]
        for key in ("proportion", "repeat", "choose"):
            if a.get(key) != b.get(key):
                out.append(f"{root}: {key} {a.get(key)} -> {b.get(key)}")
        if a.get("samples") != b.get("samples"):
            out.append(f"{root}: {a.get('samples')} -> {b.get('samples')} samples in its shards")
        la, lb = a.get("skip_lists", {}), b.get("skip_lists", {})
        for name in sorted(lb.keys() - la.keys()):
            out.append(wording[0].format(root=root, name=name, n=lb[name]["samples"]))
        for name in sorted(la.keys() - lb.keys()):
            out.append(wording[1].format(root=root, name=name, n=la[name]["samples"]))
        for name in sorted(la.keys() & lb.keys()):
            if la[name] != lb[name]:
                out.append(
                    f"{root}: skip list {name!r} changed ({la[name]['samples']} -> "
                    f"{lb[name]['samples']} samples)"
                )
    order = [d["root"] for d in old.get("datasets", [])]
    if not out and order != [d["root"] for d in new.get("datasets", [])]:
        out.append("datasets reordered")
    if old.get("epoch_size") != new.get("epoch_size"):
        out.append(f"epoch size {old.get('epoch_size')} -> {new.get('epoch_size')}")
    if not out and old.get("plan") != new.get("plan"):
        out.append("the per-bucket plan differs")
    return out


class RankMismatch(planner.PlanError):
    """Ranks planned different sample spaces (e.g. a skip list changed while the job started)."""


def check_ranks_agree(fp: dict[str, Any]) -> None:
    """Raise :class:`RankMismatch` on every rank unless all ranks computed the same fingerprint.

    Each rank (local roots) or node (remote roots) reads the skip lists on its
    own, so a list changed during start-up can split the job into different
    sample spaces: duplicates, misses, or a hang at the first collective. One
    all-gather of a 20-byte digest when they agree; on a mismatch every rank
    gathers every fingerprint and raises the same message. A no-op without an
    initialised process group. JSON over tensors, no pickle.
    """
    dist = torch.distributed
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return
    world = dist.get_world_size()
    device = torch.device("cpu")
    if dist.get_backend() == "nccl":
        device = torch.device("cuda", torch.cuda.current_device())

    def gather(t: torch.Tensor) -> list[torch.Tensor]:
        out = [torch.empty_like(t) for _ in range(world)]
        dist.all_gather(out, t)
        return [x.cpu() for x in out]

    def as_tensor(data: bytes, size: int) -> torch.Tensor:
        buf = np.zeros(size, np.uint8)
        buf[: len(data)] = np.frombuffer(data, np.uint8)
        return torch.from_numpy(buf).to(device)

    text = json.dumps(fp, sort_keys=True).encode()
    digests = gather(as_tensor(hashlib.sha1(text).digest(), 20))
    if all(torch.equal(d, digests[0]) for d in digests):
        return
    sizes = [int(n) for n in gather(torch.tensor([len(text)], dtype=torch.int64, device=device))]
    texts = gather(as_tensor(text, max(sizes)))
    fps = [json.loads(t.numpy()[:n].tobytes()) for t, n in zip(texts, sizes, strict=True)]
    raise RankMismatch(describe_rank_mismatch(fps))


def describe_rank_mismatch(fps: Sequence[dict[str, Any]]) -> str:
    """One message naming, per group of ranks that differ from rank 0, what differs."""
    groups: dict[str, list[int]] = {}
    for rank, fp in enumerate(fps):
        if rank and fp != fps[0]:
            groups.setdefault(json.dumps(fp, sort_keys=True), []).append(rank)
    lines = []
    for ranks in groups.values():
        who = f"rank {ranks[0]}" if len(ranks) == 1 else f"ranks {', '.join(map(str, ranks))}"
        wording = (
            "{root}: skip list {name!r} applied on " + who + ", not on rank 0 ({n} samples)",
            "{root}: skip list {name!r} applied on rank 0, not on " + who + " ({n} samples)",
        )
        changes = describe_changes(fps[0], fps[ranks[0]], wording) or ["the plans differ"]
        lines += [f"{who} vs rank 0: {c}" for c in changes]
    return (
        f"the {len(fps)} ranks do not agree on the data, so they would not stream one epoch "
        "together:\n  - " + "\n  - ".join(lines) + "\nEach rank (or node, for remote roots) "
        "reads the export and its skip lists at start-up: change skip lists only while no job "
        "is starting, give every rank the same datasets and settings, then start again."
    )


# --- the dataset -----------------------------------------------------------------------------


def _specs(datasets: DatasetSpec | str | Sequence[DatasetSpec | str]) -> list[DatasetSpec]:
    if isinstance(datasets, (str, DatasetSpec)):
        datasets = [datasets]
    out = [d if isinstance(d, DatasetSpec) else DatasetSpec(root=d) for d in datasets]
    if not out:
        raise ValueError("give at least one dataset")
    return out


def _decode(data: bytes, shape: tuple[int, int]) -> torch.Tensor:
    return decode_chw(data, shape)  # higher tiers decode at reduced size (JPEG draft)


class BucketedDataset(StreamingDataset):
    """A StreamingDataset over the buckets of one or more export trees.

    Each item: ``image`` (uint8 [3, H, W] at the run tier's shape for the
    sample's aspect ratio; higher-tier samples are Lanczos-downsized), ``id``,
    each caption column, ``tier`` (the run tier), ``bucket`` (its run-tier
    bucket name), ``width``/``height`` (the original image size), and
    ``source_bucket``. Every device batch comes from one bucket.

    Extra keyword arguments go to ``StreamingDataset`` (e.g. ``predownload``,
    ``cache_limit``, ``download_retry``, ``shuffle_block_size``), except
    ``allow_unsafe_types=True``, which is refused.
    ``num_workers`` must equal the DataLoader's: the epoch is sized for it.
    ``small_buckets="drop"`` leaves out buckets too small for one planning unit
    (with a warning) instead of failing. The preflight plan is ``self.plan``
    (logged on rank 0). ``state_dict`` carries a fingerprint of the sample
    space; ``on_change`` says what a resume does when it differs (see
    :meth:`load_state_dict`).
    """

    #: False: ``image`` stays the encoded bytes, for decoding on the GPU (``decode.decode_batch``).
    decode_images = True

    def __init__(
        self,
        datasets: DatasetSpec | str | Sequence[DatasetSpec | str],
        *,
        tier: int,
        batch_size: int,
        include_higher_tiers: bool = False,
        caption_columns: Sequence[str] = ("caption",),
        batching_method: str = "per_stream",
        shuffle: bool = True,
        shuffle_seed: int = 9176,
        num_canonical_nodes: int | None = None,
        replication: int | None = None,
        epoch_size: int | None = None,
        num_workers: int | None = None,
        small_buckets: str = "error",
        bucket_spec: BucketSpec = DEFAULT_SPEC,
        on_change: str = "error",
        **streaming_kwargs: Any,
    ) -> None:
        if on_change not in ON_CHANGE:
            raise ValueError(f"on_change must be one of {ON_CHANGE}, got {on_change!r}")
        if streaming_kwargs.get("allow_unsafe_types"):
            raise ValueError(
                "BucketedDataset refuses allow_unsafe_types=True: it streams only safe column "
                "encodings (no pickle, which runs code from the data); re-export the data with a "
                "safe encoding"
            )
        self.on_change = on_change
        #: Set by a resume that restarted its epoch: what changed and how many samples repeat.
        self.restarted_epoch: dict[str, Any] | None = None
        specs = _specs(datasets)
        bucket_spec.shapes(tier)  # unknown tier -> clear error
        tiers = [t for t in bucket_spec.tiers if t == tier or (include_higher_tiers and t > tier)]
        self.run_tier = tier
        self.caption_columns = tuple(caption_columns)
        self.bucket_spec = bucket_spec
        destroy_dist = maybe_init_dist()
        try:
            world = World.detect()
            sources = [load_sources(s, tiers, world, self.caption_columns) for s in specs]
            counts = [
                planner.DatasetCount(
                    s.root,
                    [planner.BucketCount(b.bucket, b.samples, b.skipped) for b in src],
                    s.proportion,
                    s.repeat,
                    s.choose,
                )
                for s, src in zip(specs, sources, strict=True)
            ]
            self.plan = planner.plan_buckets(
                counts,
                device_batch_size=batch_size,
                world_size=world.num_ranks,
                num_nodes=world.num_nodes,
                num_workers=num_workers or 1,
                num_canonical_nodes=num_canonical_nodes,
                replication=replication,
                batching_method=batching_method,
                epoch_size=epoch_size,
                shuffle=shuffle,
                shuffle_block_size=streaming_kwargs.get("shuffle_block_size"),
                small_buckets=small_buckets,
            ).check()
            if world.rank == 0:
                log.info("bucket plan:\n%s", self.plan.report())
                for w in self.plan.warnings:
                    log.warning("bucket plan: %s", w)
            self.fingerprint = fingerprint(
                specs,
                sources,
                self.plan,
                tier=tier,
                include_higher_tiers=include_higher_tiers,
                bucket_spec=bucket_spec,
            )
            check_ranks_agree(self.fingerprint)  # before streaming's first collective
            streams: list[Stream] = []
            self.stream_info: list[tuple[int, str, tuple[int, int]]] = []
            #: Per stream: the columns of a tree another writer made (None: an export of ours).
            self.stream_foreign: list[tuple[foreign_tree.ForeignColumns, Any] | None] = []
            plans = iter(self.plan.buckets)
            for di, src in enumerate(sources):
                for b in src:
                    bp = next(plans)
                    if bp.excluded or bp.choose == 0:
                        continue
                    streams.append(
                        SkipStream(
                            remote=b.remote,
                            local=b.local,
                            choose=bp.choose,
                            skips=b.skips,
                        )
                    )
                    if b.foreign is not None:
                        if not self.decode_images and b.foreign.image_encoding != "bytes":
                            raise foreign_tree.ForeignTreeError(
                                f"{b.local}: image column {b.foreign.image!r} is encoded "
                                f"{b.foreign.image_encoding!r}, which streaming decodes on the "
                                "CPU; decoding on the device needs 'bytes': decode on the CPU"
                            )
                        fshape = foreign_tree.run_shape(b.bucket, tier, bucket_spec)
                        self.stream_foreign.append((b.foreign, fshape))
                        shape = fshape or (0, 0)  # 0: as stored
                    else:
                        self.stream_foreign.append(None)
                        shape = same_ratio_shape(
                            parse_bucket_name(b.bucket, bucket_spec), tier, bucket_spec
                        )
                    self.stream_info.append((di, b.bucket, shape))
            super().__init__(
                streams=streams,
                batch_size=batch_size,
                shuffle=shuffle,
                shuffle_seed=shuffle_seed,
                num_canonical_nodes=self.plan.num_canonical_nodes,
                batching_method=batching_method,
                replication=replication,
                **streaming_kwargs,
            )
            if self.cache_limit and self.max_shard_size_across_all_streams:
                # A look-ahead past what the cache holds can stall the epoch for good.
                asked = streaming_kwargs.get("predownload")
                most = shard_cache.predownload_within_cache(
                    self.cache_limit,
                    int(self.max_shard_size_across_all_streams),
                    num_workers or 1,
                    asked,
                )
                self.predownload = most if asked is not None else min(self.predownload, most)
        finally:
            if destroy_dist:
                torch.distributed.destroy_process_group()

    # Streaming calls this for every sample id of the epoch (after partitioning).
    def get_item(self, sample_id: int, retry: int = 7) -> dict[str, Any]:
        raw = super().get_item(sample_id, retry)
        if any(self.stream_foreign):
            shard_id, k = self.spanner[sample_id]
            found = self.stream_foreign[self.stream_per_shard[shard_id]]
            if found is not None:
                return self._foreign_item(raw, shard_id, k, *found)
        bucket = parse_bucket_name(raw["bucket"], self.bucket_spec)
        shape = same_ratio_shape(bucket, self.run_tier, self.bucket_spec)
        item: dict[str, Any] = {
            "image": _decode(raw["image"], shape) if self.decode_images else raw["image"],
            "id": raw["id"],
            "tier": self.run_tier,
            "bucket": bucket_name(self.run_tier, *shape),
            "source_bucket": raw["bucket"],
            "width": int(raw["width"]),
            "height": int(raw["height"]),
        }
        for c in self.caption_columns:
            if c not in raw:
                raise KeyError(
                    f"caption column {c!r} is not in the export (columns: {sorted(raw)})"
                )
            item[c] = raw[c]
        return item

    def _foreign_item(self, raw, shard_id: int, k: int, cols, shape) -> dict[str, Any]:
        """An item of a tree another writer made (:func:`prx_data.stream.foreign.item`)."""
        reader = self.shards[shard_id]
        stored = reader.stored_index(k) if isinstance(reader, SkipMDSReader) else k
        _di, bucket, run_shape = self.stream_info[self.stream_per_shard[shard_id]]
        run_bucket = bucket if shape is None else bucket_name(self.run_tier, *run_shape)
        return foreign_tree.item(
            raw,
            cols,
            shape=shape,
            run_tier=self.run_tier,
            bucket=bucket,
            run_bucket=run_bucket,
            shard=reader.raw_data.basename,
            index=stored,
            decode=self.decode_images,
        )

    def __iter__(self):
        info = torch.utils.data.get_worker_info()
        running = info.num_workers if info is not None else 1
        if running != self.plan.num_workers:
            raise planner.PlanError(
                f"the epoch was planned for {self.plan.num_workers} DataLoader worker(s) but "
                f"{running} are running: pass num_workers={running} to BucketedDataset"
            )
        return super().__iter__()

    def state_dict(self, num_samples: int, from_beginning: bool) -> dict[str, Any]:
        """Streaming's resume position plus the fingerprint of this epoch's sample space."""
        obj = super().state_dict(num_samples, from_beginning)
        obj[FINGERPRINT_KEY] = self.fingerprint
        return obj

    def load_state_dict(self, obj: dict[str, Any]) -> None:
        """Resume, never silently onto a different sample space.

        Refuses a canonical node count that differs from the plan's. When the
        fingerprint differs (a skip list added, removed or changed, other
        weights, another tier or bucket spec, another epoch size), raises
        :class:`ResumeMismatch` naming every change, unless ``on_change`` is
        ``"restart_epoch"``: then the checkpoint's epoch starts over on the
        current sample space and the samples it had already trained repeat.
        """
        ncn = obj.get("num_canonical_nodes")
        if ncn is not None and ncn != self.plan.num_canonical_nodes:
            raise planner.PlanError(
                f"checkpoint was written with num_canonical_nodes={ncn} but this dataset was "
                f"planned with {self.plan.num_canonical_nodes}: pass num_canonical_nodes={ncn}"
            )
        obj = dict(obj)
        old = obj.pop(FINGERPRINT_KEY, None)
        done = int(obj.get("sample_in_epoch", 0))
        if old is None:
            log.warning(
                "the checkpoint's data state has no fingerprint (written before prx-data "
                "recorded one): cannot verify that skip lists and weights are unchanged"
            )
        elif changes := describe_changes(old, self.fingerprint):
            listed = "\n  - ".join(changes)
            if self.on_change == "error":
                raise ResumeMismatch(
                    f"the data changed since the checkpoint (epoch {obj.get('epoch')}, "
                    f"{done} samples into it):\n  - {listed}\n"
                    "The epoch's sample order is fixed by its sample space, so continuing would "
                    "repeat some samples and skip others, and could train on newly skipped ones. "
                    "Choices (docs/STREAMING.md, 'Resuming after a change'):\n"
                    f"  - on_change='restart_epoch' (data.on_change): start epoch "
                    f"{obj.get('epoch')} over with the current lists and weights; the {done} "
                    "samples already trained this epoch are seen again, newly skipped ones never;\n"
                    "  - restore the checkpoint's lists and weights to finish the epoch as planned "
                    "(only when the change is not an opt-out that must take effect now)."
                )
            log.warning(
                "the data changed since the checkpoint:\n  - %s\nrestarting epoch %s with the "
                "current sample space (%d samples); the %d samples already trained this epoch "
                "repeat",
                listed,
                obj.get("epoch"),
                self.plan.epoch_size,
                done,
            )
            obj["sample_in_epoch"] = 0
            self.restarted_epoch = {"changes": changes, "repeated_samples": done}
        super().load_state_dict(obj)
