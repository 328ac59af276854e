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

import dataclasses
import functools
import logging
import os
from collections.abc import Sequence
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
from prx_data.core.errors import UnknownName, UsageError
from prx_data.core.streaming_compat import World, maybe_init_dist, quiet_shared_memory
from prx_data.export import latents as latents_store
from prx_data.export import npyfile
from prx_data.skips.reader import SkipMDSReader
from prx_data.stream import attached as attached_columns
from prx_data.stream import cache as shard_cache
from prx_data.stream import foreign as foreign_tree
from prx_data.stream import midepoch, planner
from prx_data.stream.catalog import fetch_catalog
from prx_data.stream.decode import decode_chw
from prx_data.stream.reader import SkipStream
from prx_data.stream.resume import (
    FINGERPRINT_KEY,
    ON_CHANGE,
    RankMismatch,
    ResumeMismatch,
    check_ranks_agree,
    check_workers,
    describe_changes,
    describe_rank_mismatch,
    fingerprint,
    resume_state,
)
from prx_data.stream.sampling import vectorised_sampling
from prx_data.stream.sources import load_sources, plan_sources
from prx_data.stream.spec import DatasetSpec

#: The dataset, and the loader's public names most callers import with it.
__all__ = [
    "BucketedDataset",
    "DatasetSpec",
    "RankMismatch",
    "ResumeMismatch",
    "describe_rank_mismatch",
    "fetch_catalog",
    "load_sources",
]

log = logging.getLogger(__name__)

quiet_shared_memory()  # no "leaked shared_memory" lines at the end of a run


def _specs(datasets: DatasetSpec | str | Sequence[DatasetSpec | str]) -> list[DatasetSpec]:
    if isinstance(datasets, (str, DatasetSpec)):
        datasets = [datasets]
    out = [d if isinstance(d, DatasetSpec) else DatasetSpec(root=d) for d in datasets]
    if not out:
        raise UsageError("give at least one dataset")
    return out


#: The plan keywords ``BucketedDataset`` takes as a shorthand for ``spec=PlanSpec(...)``:
#: PlanSpec's own fields (``batch_size`` is its ``device_batch_size``), so their defaults
#: are PlanSpec's and nowhere else. ``shuffle_block_size`` is also streaming's own keyword.
_PLAN_KEYS = frozenset(f.name for f in dataclasses.fields(planner.PlanSpec)) - {
    "shuffle_block_size",
    "device_batch_size",
}


def _plan_spec(spec: planner.PlanSpec | None, kwargs: dict[str, Any]) -> planner.PlanSpec:
    """``spec``, or one built from the plan keywords among ``kwargs`` (never both); the plan
    keywords are taken out of ``kwargs``, which leaves streaming's."""
    given = {k: kwargs.pop(k) for k in list(kwargs) if k in _PLAN_KEYS or k == "batch_size"}
    if "batch_size" in given:
        given["device_batch_size"] = given.pop("batch_size")
    if not given.get("num_workers", 1):  # the DataLoader's 0: one (this process)
        given["num_workers"] = 1
    block = kwargs.get("shuffle_block_size")
    if spec is None:
        if given.get("tier") is None or given.get("device_batch_size") is None:
            raise TypeError("BucketedDataset needs tier= and batch_size= (or spec=PlanSpec(...))")
        return planner.PlanSpec(**given, shuffle_block_size=block)
    if given:
        raise UsageError(f"give spec= or the plan keywords, not both (also given: {sorted(given)})")
    if block is not None and spec.shuffle_block_size not in (None, block):
        raise UsageError(
            f"shuffle_block_size={block} differs from the spec's {spec.shuffle_block_size}"
        )
    return spec if block is None else spec.replace(shuffle_block_size=block)


@functools.lru_cache(maxsize=npyfile.MAPS_KEPT)
def _latent_file(
    root: str, key: str, dtype: str, shape: tuple[int, ...], cached: tuple[str, str] | None
) -> np.ndarray:
    """A shard's latents, checked and memory-mapped once per process (workers map their own)."""
    return latents_store.load_npy(root, key, dtype, shape, cached=cached)


def _find_latents_record(root: str, local: str | None, is_leader: bool) -> dict | None:
    """The export's latents record, or None when it has none: read in place, or once per node
    into the cache of a remote export (:func:`prx_data.stream.attached.fetch_small`)."""
    if not storage.is_remote(root):
        return latents_store.read_record(root)
    rel = latents_store.RECORD_NAME
    raw = attached_columns.fetch_small(
        root, local, [rel], is_leader=is_leader, what="latents record"
    ).get(rel)
    return None if raw is None else latents_store.parse_record(raw, root)


def _latents_record(root: str, local: str | None, is_leader: bool) -> dict:
    """:func:`_find_latents_record`, refusing an export without latents in one line."""
    record = _find_latents_record(root, local, is_leader)
    if record is None:
        raise latents_store.no_latents(root)
    return record


def _latent_extras(root: str, record: dict, source: Any) -> dict[str, list[tuple[str, str, int]]]:
    """For a remote export: per shard, its latents file, fetched and evicted with the shard."""
    if not storage.is_remote(root):
        return {}
    out = {}
    for s in source.shards:
        key = latents_store.shard_key(source.bucket, s.basename)
        rec = record["shards"][key]
        rel = latents_store.cache_rel(key, str(rec.get("xxh64")))
        out[s.basename] = [(rel, latents_store.npy_path(root, key), int(rec["npy_bytes"]))]
    return out


def _stream_latents(
    root: str,
    source: Any,
    shape: tuple[int, int],
    records: dict[str, dict],
    bucket_spec: BucketSpec = DEFAULT_SPEC,
    local: str | None = None,
    is_leader: bool = True,
) -> tuple[str, str, tuple[int, int, int]]:
    """(root, dtype, one latent's shape) of a bucket whose latents are all there and made
    from its shards.

    Raises :class:`~prx_data.export.latents.LatentsError` (one line) for a foreign
    tree, a higher tier (latents are at each shard's own shape), no record, or
    shards the record does not vouch for. A remote export's record is read once per
    node into ``local``; its files travel with their shards (:func:`_latent_extras`).
    """
    if source.foreign is not None:
        raise latents_store.LatentsError(
            f"{root}: precomputed latents are read from exports of ours, not an MDS tree "
            "another writer made; set vae.source: encode"
        )
    b = parse_bucket_name(source.bucket, bucket_spec)
    if (b.width, b.height) != tuple(shape):
        raise latents_store.LatentsError(
            f"{root}/{source.bucket}: precomputed latents are at each shard's own shape, and "
            f"this run trains it at {shape[0]}x{shape[1]}; set data.plan.include_higher_tiers: false "
            "(or vae.source: encode)"
        )
    if root not in records:
        records[root] = _latents_record(root, local, is_leader)
    record = records[root]
    stale = latents_store.stale_shards(record, source.bucket, source.shards)
    if stale:
        raise latents_store.LatentsError(
            f"{root}: {len(stale)} shard(s) have no up-to-date latents (first: {stale[0]}); "
            f"run python -m prx_data.latents {root} --vae VAE"
        )
    vae = record.get("vae") or {}
    try:
        f, c = int(vae["compression"]), int(vae["latent_channels"])
    except (KeyError, TypeError, ValueError):
        raise latents_store.LatentsError(
            f"{root}: its latents record names no VAE grid (compression, latent_channels); "
            f"run python -m prx_data.latents {root} --vae VAE --replace"
        ) from None
    return root, str(record.get("dtype")), (c, b.height // f, b.width // f)


def _decode(data: bytes, shape: tuple[int, int]) -> torch.Tensor:
    return decode_chw(data, shape)  # higher tiers decode at reduced size (JPEG draft)


#: Keys every item has (an extra column may not take one of them).
_ITEM_KEYS = ("image", "id", "tier", "bucket", "source_bucket", "width", "height")


class BucketedDataset(StreamingDataset):
    """A StreamingDataset over the buckets of one or more export trees.

    Each item: ``image`` (uint8 [3, H, W] at the run tier's shape for the
    sample's aspect ratio; higher-tier samples are Lanczos-downsized), ``id``,
    each caption column, ``tier`` (the run tier), ``bucket`` (its run-tier
    bucket name), ``width``/``height`` (the original image size),
    ``source_bucket``, ``dataset`` (its :attr:`DatasetSpec.label`), and each of ``extra_columns`` (table columns the export
    kept with ``write_mds --keep-columns``, as they were stored: NaN for a
    missing float, None for another missing value, or columns attached beside the
    shards: ``python -m prx_data.attach``'s, and ``img_latent``, the latent
    ``python -m prx_data.latents`` stored for the sample, as a float32 numpy array
    [C, H/f, W/f], on an export that has latents); with ``latents=True`` also
    ``latent`` (the same latent as a float32 tensor; exports of ours at their own
    tier only). Every device batch comes from one bucket.

    The plan settings are one :class:`prx_data.stream.planner.PlanSpec`
    (``spec``; the trainer's ``data.plan`` builds the same type), so every plan
    default is PlanSpec's. As a shorthand its fields may be given as keywords
    instead (``tier=512, batch_size=8``: ``batch_size`` is ``device_batch_size``),
    not both. ``self.spec`` is the spec in force. The other keywords are the
    loader's own (captions, extra columns, ``on_change``, latents); anything
    else goes to ``StreamingDataset`` (e.g. ``predownload``, ``cache_limit``,
    ``download_retry``, ``shuffle_block_size``), except
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
        spec: planner.PlanSpec | None = None,
        *,
        caption_columns: Sequence[str] = ("caption",),
        extra_columns: Sequence[str] = (),
        on_change: str = "error",
        plan_label: str = "bucket",
        latents: bool = False,
        **streaming_kwargs: Any,
    ) -> None:
        if on_change not in ON_CHANGE:
            raise UsageError(f"on_change must be one of {ON_CHANGE}, got {on_change!r}")
        if streaming_kwargs.get("allow_unsafe_types"):
            raise UsageError(
                "BucketedDataset refuses allow_unsafe_types=True: it streams only safe column "
                "encodings (no pickle, which runs code from the data); re-export the data with a "
                "safe encoding"
            )
        spec = _plan_spec(spec, streaming_kwargs)
        if spec.shuffle_block_size is not None:
            streaming_kwargs["shuffle_block_size"] = spec.shuffle_block_size
        self.spec = spec
        #: How the plan is logged: "bucket" (the table) or a side stream's name (one line).
        self.plan_label = plan_label
        self.on_change = on_change
        #: Set by a resume that restarted its epoch: what changed and how many samples repeat.
        self.restarted_epoch: dict[str, Any] | None = None
        #: Set by a resume that continued its epoch (``on_change="continue"``, or a checkpoint
        #: of a continued epoch): what it left out, what remains (:mod:`.midepoch`).
        self.continued_epoch: dict[str, Any] | None = None
        self._continued: midepoch.Continued | None = None
        specs = _specs(datasets)
        #: Each dataset's name (``DatasetSpec.label``), carried in every item as ``dataset``.
        self.dataset_names = [s.label for s in specs]
        spec.tiers()  # unknown tier -> clear error
        self.run_tier = spec.tier
        self.caption_columns = tuple(caption_columns)
        self.extra_columns = tuple(extra_columns)
        clash = set(self.extra_columns) & {*self.caption_columns, *_ITEM_KEYS}
        if clash:
            raise UsageError(
                f"extra_columns {sorted(clash)} clash with a caption column or an item key"
            )
        self.bucket_spec = spec.bucket_spec
        #: Attach each sample's precomputed VAE latent as ``latent`` (``vae.source: precomputed``).
        self.latents = bool(latents)
        #: Per stream with latents: (export root, storage dtype, one latent's shape).
        self.stream_latents: list[tuple[str, str, tuple[int, int, int]] | None] = []
        #: Per stream: whether ``img_latent`` (an extra column) comes from its ``_latents/``.
        self.stream_latent_column: list[bool] = []
        #: Per stream: its export's attached columns (:mod:`.attached`) and, per column
        #: served from one, its record entry per shard basename (empty: all from the shards).
        self.stream_attached: list[
            tuple[attached_columns.DatasetColumns, dict[str, dict[str, dict]]] | None
        ] = []
        destroy_dist = maybe_init_dist()
        try:
            world = World.detect()
            sources, plan = plan_sources(specs, spec, world, caption_columns=self.caption_columns)
            self.plan = plan.check()
            # What a continued epoch rebuilds its base space from (main process only).
            self._space = (specs, sources)
            #: Per dataset: where its lists stand in their log, recorded in every checkpoint so
            #: a list changed in place later can be rebuilt as it was (:mod:`.midepoch`).
            self.lists_at = [midepoch.lists_at(s.root) for s in specs]
            if world.rank == 0:
                if self.plan_label == "bucket":
                    log.info("bucket plan:\n%s", self.plan.report(warnings=False))
                else:  # a side stream (eval): one line
                    log.info("%s plan: %s", self.plan_label, self.plan.summary())
                for w in self.plan.warnings:
                    log.warning("%s plan: %s", self.plan_label, w)
            self.fingerprint = fingerprint(
                specs,
                sources,
                self.plan,
                tier=spec.tier,
                include_higher_tiers=spec.include_higher_tiers,
                bucket_spec=spec.bucket_spec,
            )
            check_ranks_agree(self.fingerprint)  # before streaming's first collective
            streams: list[Stream] = []
            self.stream_info: list[tuple[int, str, tuple[int, int]]] = []
            #: Per stream: the columns of a tree another writer made (None: an export of ours).
            self.stream_foreign: list[tuple[foreign_tree.ForeignColumns, Any] | None] = []
            decisions = self.plan.decisions()
            records: dict[str, dict] = {}  # export root -> its latents record
            #: Remote export root -> its latents record (its cached files are named by digest).
            self._latent_records: dict[str, dict] = {}
            wanted = (*self.caption_columns, *self.extra_columns)
            for di, src in enumerate(sources):
                cols = None
                # img_latent, the latents job's attached column: from _latents/ where the
                # export has latents; elsewhere a shard column (a folded export's, a tree
                # another writer made) like any other.
                latent_column = False
                if not any(b.foreign is not None for b in src):
                    cols = attached_columns.load_columns(
                        specs[di].root, specs[di].local, wanted, is_leader=world.is_local_leader
                    )
                    root = specs[di].root
                    if latents_store.COLUMN in self.extra_columns and root not in records:
                        found = _find_latents_record(root, specs[di].local, world.is_local_leader)
                        if found is not None:
                            records[root] = found
                    latent_column = latents_store.COLUMN in self.extra_columns and root in records
                for b in src:
                    bp = decisions[(di, b.bucket)]
                    if bp.excluded or bp.choose == 0:
                        continue
                    if b.foreign is not None:
                        if not self.decode_images and b.foreign.image_encoding != "bytes":
                            raise foreign_tree.ForeignTreeError(
                                f"{b.local}: image column {b.foreign.image!r} is encoded "
                                f"{b.foreign.image_encoding!r}, which streaming decodes on the "
                                "CPU; decoding on the device needs 'bytes': decode on the CPU"
                            )
                        fshape = foreign_tree.run_shape(b.bucket, spec.tier, spec.bucket_spec)
                        self.stream_foreign.append((b.foreign, fshape))
                        shape = fshape or (0, 0)  # 0: as stored
                    else:
                        self.stream_foreign.append(None)
                        shape = same_ratio_shape(
                            parse_bucket_name(b.bucket, spec.bucket_spec),
                            spec.tier,
                            spec.bucket_spec,
                        )
                    self.stream_info.append((di, b.bucket, shape))
                    root = specs[di].root
                    with_latents = self.latents or latent_column
                    self.stream_latent_column.append(latent_column)
                    self.stream_latents.append(
                        _stream_latents(
                            root,
                            b,
                            shape,
                            records,
                            spec.bucket_spec,
                            specs[di].local,
                            world.is_local_leader,
                        )
                        if with_latents
                        else None
                    )
                    per_column = (
                        attached_columns.bucket_columns(cols, b.bucket, b.shards, b.local)
                        if cols is not None and cols.records
                        else {}
                    )
                    self.stream_attached.append((cols, per_column) if per_column else None)
                    # A remote shard's attached files and latents travel with it (reader.py).
                    extras = attached_columns.shard_files(cols, b.bucket, per_column)
                    if with_latents:
                        for base, files in _latent_extras(root, records[root], b).items():
                            extras.setdefault(base, []).extend(files)
                    streams.append(
                        SkipStream(
                            remote=b.remote,
                            local=b.local,
                            choose=bp.choose,
                            skips=b.skips,
                            extras=extras or None,
                        )
                    )
            self._latent_records = {r: v for r, v in records.items() if storage.is_remote(r)}
            super().__init__(
                streams=streams,
                batch_size=spec.device_batch_size,
                shuffle=spec.shuffle,
                shuffle_seed=spec.shuffle_seed,
                num_canonical_nodes=self.plan.num_canonical_nodes,
                batching_method=spec.batching_method,
                replication=spec.replication,
                **streaming_kwargs,
            )
            if self.cache_limit and self.max_shard_size_across_all_streams:
                # A look-ahead past what the cache holds can stall the epoch for good.
                asked = streaming_kwargs.get("predownload")
                most = shard_cache.predownload_within_cache(
                    self.cache_limit,
                    int(self.max_shard_size_across_all_streams),
                    spec.num_workers or 1,
                    asked,
                )
                self.predownload = most if asked is not None else min(self.predownload, most)
        finally:
            if destroy_dist:
                torch.distributed.destroy_process_group()

    def resample_streams(
        self, epoch: int, stream_id: int | None = None
    ) -> tuple[np.ndarray, np.ndarray]:
        """Streaming's resampling, with its per-sample Python loop vectorised (same samples)."""
        with vectorised_sampling():
            return super().resample_streams(epoch, stream_id)

    # Streaming calls this for every sample id of the epoch (after partitioning).
    def get_item(self, sample_id: int, retry: int = 7) -> dict[str, Any]:
        raw = super().get_item(sample_id, retry)
        shard_id, k = self.spanner[sample_id]
        stream = self.stream_per_shard[shard_id]
        dataset = self.dataset_names[self.stream_info[stream][0]]
        if any(self.stream_foreign):
            found = self.stream_foreign[stream]
            if found is not None:
                item = self._foreign_item(raw, shard_id, k, *found)
                item["dataset"] = dataset
                return item
        bucket = parse_bucket_name(raw["bucket"], self.bucket_spec)
        shape = same_ratio_shape(bucket, self.run_tier, self.bucket_spec)
        item: dict[str, Any] = {
            "image": _decode(raw["image"], shape) if self.decode_images else raw["image"],
            "id": raw["id"],
            "tier": self.run_tier,
            "bucket": bucket_name(self.run_tier, *shape),
            "source_bucket": raw["bucket"],
            "dataset": dataset,
            "width": int(raw["width"]),
            "height": int(raw["height"]),
        }
        latent = None
        if self.latents or self.stream_latent_column[stream]:
            latent = self._latent(shard_id, k, stream, self.stream_info[stream][1])
        if self.latents:
            item["latent"] = latent
        att = self.stream_attached[stream]
        for c in self.caption_columns:
            if att is not None and c in att[1]:
                item[c] = self._attached(shard_id, k, stream, c)
                continue
            if c not in raw:
                raise UnknownName(
                    f"caption column {c!r} is not in the export (columns: {sorted(raw)}); "
                    "attach it with python -m prx_data.attach"
                )
            item[c] = raw[c]
        for c in self.extra_columns:
            if c == latents_store.COLUMN and self.stream_latent_column[stream]:
                item[c] = latent.numpy()
                continue
            if att is not None and c in att[1]:
                item[c] = self._attached(shard_id, k, stream, c)
                continue
            if c not in raw and c == latents_store.COLUMN:
                raise UnknownName(
                    f"extra column {c!r}: dataset {dataset!r} has no precomputed latents; "
                    "make them with python -m prx_data.latents EXPORT --vae VAE"
                )
            if c not in raw:
                raise UnknownName(
                    f"extra column {c!r} is not in the export (columns: {sorted(raw)}); "
                    "export it with write_mds --keep-columns, or attach it with python -m "
                    "prx_data.attach"
                )
            item[c] = raw[c]
        return item

    def _attached(self, shard_id: int, k: int, stream: int, name: str) -> Any:
        """The attached column ``name`` of the ``k``-th served sample of a shard."""
        cols, per_column = self.stream_attached[stream]
        reader = self.shards[shard_id]
        stored = reader.stored_index(k) if isinstance(reader, SkipMDSReader) else k
        rec = per_column[name][reader.raw_data.basename]
        return attached_columns.value(cols, name, rec, stored)

    def _latent(self, shard_id: int, k: int, stream: int, bucket: str) -> torch.Tensor:
        """The precomputed latent of the ``k``-th served sample of a shard (its stored index)."""
        root, dtype, one = self.stream_latents[stream]
        reader = self.shards[shard_id]
        stored = reader.stored_index(k) if isinstance(reader, SkipMDSReader) else k
        key = latents_store.shard_key(bucket, reader.raw_data.basename)
        # Shape (the shard's samples, the VAE's grid at this bucket) and dtype checked once per
        # file, finiteness per sample: the file is data, whoever wrote it.
        samples = reader.raw_samples if isinstance(reader, SkipMDSReader) else reader.samples
        cached = None
        if storage.is_remote(root):  # fetched with its shard into the stream's cache folder
            local = self.streams[stream].local
            rec = self._latent_records[root]["shards"][key]
            rel = latents_store.cache_rel(key, str(rec.get("xxh64")))
            cached = (local, os.path.join(local, *rel.split("/")))
        arr = _latent_file(root, key, dtype, (int(samples), *one), cached)
        where = f"{cached[1] if cached else latents_store.npy_path(root, key)} sample {stored}"
        return torch.from_numpy(latents_store.sample_latent(arr[stored], dtype, where))

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
        check_workers(self.plan, info.num_workers if info is not None else 1)
        return super().__iter__()

    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        state["_space"] = None  # workers serve the plan; only the main process resumes
        return state

    def _get_work(self, epoch: int, sample_in_epoch: int) -> np.ndarray:
        """Streaming's partition of the epoch, or the rest of a continued epoch (:mod:`.midepoch`)."""
        cont = self._continued
        if cont is None or epoch != cont.epoch:
            return super()._get_work(epoch, sample_in_epoch)
        w = self._parallel_worker_world
        work = cont.work(w, self.batch_size)
        return work[w.node, w.rank_of_node, w.worker_of_rank].flatten()

    def state_dict(self, num_samples: int, from_beginning: bool) -> dict[str, Any]:
        """Streaming's resume position plus the fingerprint of this epoch's sample space.

        In a continued epoch: the position is the base order's, per stream
        (:data:`midepoch.CONTINUE_KEY`), and streaming's own count restarts at 0.
        """
        obj = super().state_dict(num_samples, from_beginning)
        obj[FINGERPRINT_KEY] = self.fingerprint
        obj[midepoch.LISTS_AT_KEY] = self.lists_at
        cont = self._continued
        if cont is not None and obj["epoch"] == cont.epoch:
            obj[midepoch.CONTINUE_KEY] = cont.state(int(obj["sample_in_epoch"]))
            obj["sample_in_epoch"] = 0
        return obj

    def load_state_dict(self, obj: dict[str, Any]) -> None:
        """Resume, never silently onto a different sample space.

        Refuses a canonical node count that differs from the plan's. When the
        fingerprint differs (a skip list added, removed or changed, other
        weights, another tier or bucket spec, another epoch size), raises
        :class:`ResumeMismatch` naming every change, unless ``on_change`` is
        ``"restart_epoch"``: then the checkpoint's epoch starts over on the
        current sample space and the samples it had already trained repeat;
        or ``"continue"`` when only skip lists were added or grown: the epoch
        goes on in its planned order without what they remove
        (:mod:`prx_data.stream.midepoch`; ``continued_epoch`` says what was left
        out and what remains). A checkpoint written during a continued epoch
        resumes from its per-bucket positions.
        """
        obj = dict(obj)
        cont = obj.pop(midepoch.CONTINUE_KEY, None)
        at = obj.pop(midepoch.LISTS_AT_KEY, None)
        old = obj.get(FINGERPRINT_KEY)
        if cont is not None and cont.get("epoch") != obj.get("epoch"):
            cont = None  # written as the continued epoch ended: the next one is planned as usual
        changed = old is not None and bool(describe_changes(old, self.fingerprint))
        if cont is None and not (changed and self.on_change == "continue"):
            obj, self.restarted_epoch = resume_state(
                obj, self.fingerprint, self.plan, self.on_change, log
            )
            super().load_state_dict(obj)
            return
        if changed and self.on_change != "continue":
            # A continued epoch's checkpoint, and the lists changed again: error or restart.
            obj, self.restarted_epoch = resume_state(
                obj, self.fingerprint, self.plan, self.on_change, log
            )
            super().load_state_dict(obj)
            return
        obj[FINGERPRINT_KEY] = self.fingerprint  # checked above: only the node count is left
        done = int(obj.get("sample_in_epoch", 0))
        obj["sample_in_epoch"] = 0
        super().load_state_dict(resume_state(obj, self.fingerprint, self.plan, "error", log)[0])
        if self._space is None:
            raise RuntimeError("load_state_dict runs in the main process, before iterating")
        specs, sources = self._space
        self._continued = midepoch.build(
            self,
            specs,
            sources,
            self.spec,
            self.plan,
            epoch=int(obj["epoch"]),
            base=cont["base"] if cont is not None else old,
            state=cont,
            sample_in_epoch=done,
            base_at=cont.get("base_at") if cont is not None else at,
        )
        self.continued_epoch = self._continued.report
        if changed:
            log.warning(
                "the data changed since the checkpoint:\n  - %s\ncontinuing epoch %s in its "
                "order: %d samples left out (now skipped), %d remain (%d of them completing "
                "a bucket's last batch), %d carried to the next epoch",
                "\n  - ".join(describe_changes(old, self.fingerprint)),
                obj["epoch"],
                self.continued_epoch["left_out"],
                self.continued_epoch["remaining"],
                self.continued_epoch["filled"],
                self.continued_epoch["carried"],
            )
