"""The rewrite's pack stage: one source part copied without its skipped samples, one unit of work.

``skips rewrite`` (:mod:`prx_data.skips.rewrite`) plans one :class:`RewritePack`
per source part that keeps a sample and runs them through
:func:`prx_data.core.runtime.map_units`: driver threads for a small export,
Ray tasks (every CPU of a cluster) otherwise. A pack reads each source shard
through the export's pack code (:func:`prx_data.export.pack.shard_raw`, its
bytes checked against the index, read confined to the export), drops the
skipped indices and feeds the remaining encoded samples to the pack writer
(:func:`prx_data.export.pack.open_writer`): nothing is decoded or re-encoded.

Durability is the export's: a local ``out`` gets the pack staged under
``_progress/writing`` and renamed in; on object storage each closed shard is
uploaded and deleted at once (an earlier attempt's objects are cleared first),
then the index and manifest. The marker ``_progress/packed/<tier>/<ar>/<part>``
comes last and names the plan it wrote, so ``--resume`` keeps marked packs
(:func:`record_plan` keeps a resume to the plan it started). :func:`write_packs`
runs them and merges each bucket's index and the id index from what they wrote.

Local disk stays under a bound (:class:`~prx_data.skips.staging.Staging`): a pack reserves what it
stages (a source shard for the check when the source is remote or compressed, one output shard and
its metadata when ``out`` is remote) before it starts; on Ray each task stages that much at most.
With ``--fold-columns`` each kept row gets the export's latents and attached columns appended
(:mod:`prx_data.skips.fold`).
"""

from __future__ import annotations

import collections
import hashlib
import itertools
import json
import os
import posixpath
import shutil
import tempfile
import uuid
from dataclasses import asdict, dataclass

from prx_data.core import confined, storage
from prx_data.core.errors import AlreadyExists, PrxDataError, UsageError
from prx_data.core.runtime import Placement, Resources, UnitError, map_units
from prx_data.core.schema import MANIFEST_NAME, REPORT_NAME
from prx_data.core.streaming_compat import decompress, reader_from_json
from prx_data.export import durable, idindex, layout, merge, naming
from prx_data.export.naming import PROGRESS_DIR
from prx_data.export.pack import PACKED_DIR, open_writer, part_ids, shard_raw, split_samples
from prx_data.export.safety import load_index, remove_tree
from prx_data.skips.fold import Fold, fold_entry, fold_samples, same_sample
from prx_data.skips.reader import SkipMDSReader
from prx_data.skips.staging import QuietStreaming, Staging

#: The plan a rewrite writes before its first pack; ``resume`` continues only the same plan.
PLAN_NAME = f"{PROGRESS_DIR}/rewrite.json"


class RewriteVerifyError(PrxDataError, AssertionError):
    """A written sample differs from the filtered source: a bug, never bad input."""


class RewritePlanError(PrxDataError, RuntimeError):
    """A pack's marker names another plan: the source or its lists changed since it was written."""


@dataclass(frozen=True)
class RewritePack:
    """Consecutive source parts of ``bucket`` (one, unless the rewrite compacts), written to
    ``out`` as the part ``part`` without the ``skips`` (per shard entry, sorted indices);
    ``stage``: local bytes it may stage."""

    bucket: str
    part: str
    #: (source part, basename in it, samples) of each shard, as the bucket's merged index says.
    shards: tuple
    skips: tuple
    samples: int
    stage: int

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> RewritePack:
        shards, skips = (tuple(tuple(x) for x in d[k]) for k in ("shards", "skips"))
        return cls(**{**d, "shards": shards, "skips": skips})

    @property
    def digest(self) -> str:
        """What the marker records: a rerun writes a pack only from the same plan."""
        text = json.dumps(self.to_dict(), sort_keys=True, default=list)
        return hashlib.sha256(text.encode()).hexdigest()


def shard_format(entry: dict) -> tuple:
    """What one writer must share with every shard it copies: columns, compression, hashes, limit."""
    hashes = sorted((entry["raw_data"].get("hashes") or {}).keys())
    names, encodings = entry["column_names"], entry["column_encodings"]
    return (tuple(names), tuple(encodings), entry.get("compression"), tuple(hashes)) + (
        entry.get("size_limit"),
    )


def pack_part(parts: list[str], compact: bool = False) -> str:
    """The part a pack writes: its source part's name; compacting, the content name of the
    parts' union as the export's pack stage names a pack (else the first part's name)."""
    digests = [naming.name_digest(p) for p in parts]
    if not compact or None in digests:
        return parts[0]
    return naming.content_pack_name(naming.combine_digests(digests))


@dataclass(frozen=True)
class RewriteJob:
    """What every pack of one rewrite shares (travels to Ray workers with the task)."""

    root: str
    out: str
    verify: bool
    limit: int
    work_dir: str | None = None
    fold: Fold | None = None  # ``--fold-columns``: what each sample gets as MDS columns
    columns: bool | frozenset = True  # the source's ``export_columns`` (folded ones included)


def marker_path(out: str, pack: RewritePack) -> str:
    return storage.join(out, *PACKED_DIR.split("/"), *pack.bucket.split("/"), pack.part)


def check_destination(out: str) -> None:
    """Refuse any ``out`` with something in it: a rewrite never deletes, and a report or
    index left there would make a rewrite killed part-way look like a complete export."""
    import pyarrow.fs as pafs

    fs, p = storage.filesystem(out)
    kind = fs.get_file_info(p).type
    if kind == pafs.FileType.NotFound:
        return
    if kind != pafs.FileType.Directory:
        raise AlreadyExists(f"{out} is a file; choose an empty destination directory")
    found = fs.get_file_info(pafs.FileSelector(p, recursive=False, allow_not_found=True))
    if found:
        names = sorted(posixpath.basename(i.path.rstrip("/")) for i in found)
        what = "an export" if REPORT_NAME in names else ", ".join(names[:5])
        raise AlreadyExists(f"{out} is not empty (it holds {what}); choose an empty destination")


def record_plan(root: str, out: str, packs: list, resume: bool, fold: Fold | None = None) -> None:
    """Record the plan in ``out`` before the first pack; a resume continues only that plan."""
    path = storage.join(out, *PLAN_NAME.split("/"))
    digest = hashlib.sha256("".join(p.digest for p in packs).encode()).hexdigest()
    folds = {"fold": [list(c.__dict__.values()) for c in fold.columns]} if fold else {}
    record = json.dumps({"source": root, "plan": digest, **folds}, sort_keys=True).encode()
    if resume:
        if layout.is_complete(out):
            raise AlreadyExists(f"{out} is a finished rewrite; there is nothing to resume")
        try:
            have = storage.read_bytes(path)
        except FileNotFoundError:
            raise UsageError(
                f"{out} holds no unfinished rewrite to resume; rewrite into an empty destination"
            ) from None
        if have != record:
            raise UsageError(
                f"{out} is an unfinished rewrite of another plan (the source, its lists or the "
                "options changed since); rewrite into an empty destination instead"
            )
        return
    storage.write_bytes_atomic(path, record)


def write_packs(
    job: RewriteJob, packs: list[RewritePack], placement: Placement, progress: bool = True
) -> tuple[dict[str, dict[str, int]], dict[str, int]]:
    """Write every pack where ``placement`` says, then each bucket's merged index and the id index.

    Returns ``{bucket: {part: samples}}`` and streaming's warnings ``{message: count}``.
    Driver threads stage in one temporary directory under the run's bound; a Ray
    task stages in its own.
    """
    per_bucket: dict[str, dict[str, int]] = {}
    warnings: dict[str, int] = {}
    quiet = QuietStreaming()
    work = None if placement.on_ray else tempfile.mkdtemp(prefix="prx-rewrite-", dir=job.work_dir)
    try:
        task = RewriteTask(job, None if work is None else Staging(work, job.limit))
        for r in _run(task, packs, placement, progress):
            per_bucket.setdefault(r["bucket"], {})[r["part"]] = r["samples"]
            for m, n in r.get("warnings", {}).items():
                warnings[m] = warnings.get(m, 0) + n
        for bucket in sorted(per_bucket):  # the parts' indexes read back from ``out``
            merge.merge_bucket(
                storage.join(job.out, *bucket.split("/")), sorted(per_bucket[bucket])
            )
        idindex.write_id_index(job.out)  # before the lists, which bind their ids through it
    finally:
        if work is not None:
            shutil.rmtree(work, ignore_errors=True)
        quiet.close()
    for m, n in quiet.seen.items():
        warnings[m] = warnings.get(m, 0) + n
    return per_bucket, warnings


def _run(task: RewriteTask, packs: list, placement: Placement, progress: bool):
    """The packs' results as they finish; a pack's own error comes back as itself on threads."""
    try:
        yield from map_units(
            task,
            [p.to_dict() for p in packs],
            placement,
            Resources(num_cpus=1, env=storage.storage_env() or None),
            desc="rewrite",
            progress=progress,
            total=sum(p.samples for p in packs),
            weight=lambda r: r["samples"],
            unit_name="sample",
        )
    except UnitError as e:
        if isinstance(e.__cause__, PrxDataError):
            raise e.__cause__ from None
        raise


class RewriteTask:
    """Writes one :class:`RewritePack` (a ``map_units`` function): returns its counts.

    Driver threads share the run's :class:`Staging`; a Ray task stages in a
    temporary directory of its own, removed when it ends.
    """

    def __init__(self, job: RewriteJob, staging: Staging | None = None) -> None:
        self.job, self.staging = job, staging

    def __getstate__(self) -> dict:
        return {"job": self.job, "staging": None}  # the staging area is the driver's

    def __call__(self, unit: dict) -> dict:
        pack = RewritePack.from_dict(unit)
        marker = marker_path(self.job.out, pack)
        try:
            done = json.loads(storage.read_bytes(marker))
        except FileNotFoundError:
            done = None
        if done is not None:
            if done.get("digest") != pack.digest:
                raise RewritePlanError(
                    f"{marker}: written from another plan (the source or its lists changed "
                    "since); rewrite into an empty destination instead"
                )
            return {"bucket": pack.bucket, "part": pack.part, "samples": done["samples"]}
        quiet = None if QuietStreaming.active() else QuietStreaming()
        staging, own = self.staging, self.staging is None
        if own:
            wd = self.job.work_dir
            work = wd if wd and os.path.isdir(wd) else None
            staging = Staging(tempfile.mkdtemp(prefix="prx-rewrite-", dir=work), self.job.limit)
        staging.reserve(pack.stage)
        try:
            _write(self.job, pack, staging)
        finally:
            staging.release(pack.stage)
            if own:
                shutil.rmtree(staging.directory, ignore_errors=True)
            if quiet is not None:
                quiet.close()
        storage.write_bytes_atomic(
            marker, json.dumps({"samples": pack.samples, "digest": pack.digest}).encode()
        )
        if not storage.is_remote(self.job.out):
            durable.fsync(os.path.dirname(marker))
        return {
            "bucket": pack.bucket,
            "part": pack.part,
            "samples": pack.samples,
            "warnings": quiet.seen if quiet is not None else {},
        }


def _write(job: RewriteJob, pack: RewritePack, staging: Staging) -> None:
    remote_out = storage.is_remote(job.out)
    tier, ar = pack.bucket.split("/")
    if remote_out:
        storage.delete(storage.join(job.out, tier, ar, pack.part))  # an earlier attempt's objects
        stage = os.path.join(staging.directory, uuid.uuid4().hex[:12])
    else:
        stage = durable.stage_dir(job.out, f"{tier}-{ar}-{pack.part}")
    local_bucket = os.path.join(stage, tier, ar)
    pdir = os.path.join(local_bucket, pack.part)
    sources = _sources(job, pack)

    def read(path: str, max_bytes: int) -> bytes:
        return confined.read(job.root, path, max_bytes)

    check = _ShardCheck(job, pack, pdir, staging, remote_out)
    first, fold = sources[0][2][0], job.fold
    writer = open_writer(pdir, fold_entry(fold, first) if fold else first, on_shard=check)
    try:
        with writer:
            for part, src, entries, skips in sources:
                for entry, skip in zip(entries, skips, strict=True):
                    raw = shard_raw(src, entry, read)
                    if job.verify:
                        check.expect(src, entry, skip, raw)
                    kept = split_samples(raw, skip)
                    if fold:  # the shard's rows re-encoded with the folded columns (not the image)
                        kept = fold_samples(job.root, fold, pack.bucket, part, entry, kept, skip)
                    for sample in kept:
                        writer.write(sample)
                    del raw, kept
        ids = []
        for part, src, entries, skips in sources:
            dead = {
                (e["raw_data"]["basename"], i)
                for e, skip in zip(entries, skips, strict=True)
                for i in skip
            }
            keys = (
                (e["raw_data"]["basename"], i) for e in entries for i in range(int(e["samples"]))
            )
            got = part_ids(src, part, entries, read)
            ids += [i for i, key in zip(got, keys, strict=True) if key not in dead]
        check.done(ids)
        durable.write_manifest(local_bucket, pack.part, ids)
        if remote_out:
            for name in (naming.INDEX_NAME, MANIFEST_NAME):
                path = os.path.join(pdir, name)
                staging.written(path)
                with open(path, "rb") as f:
                    storage.write_bytes_atomic(
                        storage.join(job.out, tier, ar, pack.part, name), f.read()
                    )
        else:
            durable.publish_parts(job.out, stage, {pack.bucket: pack.part})
    finally:
        if remote_out:
            shutil.rmtree(stage, ignore_errors=True)
        else:
            remove_tree(stage)


def _sources(job: RewriteJob, pack: RewritePack) -> list[tuple[str, str, list, list]]:
    """(part, its directory, its index entries, their skips) of each source part of ``pack``.

    Each part's own index is checked (the exporter's columns only), held to the
    merged index the skips were bound through, and to the first part's format.
    """
    tier, ar = pack.bucket.split("/")
    out, fmt = [], None
    for part, group in itertools.groupby(
        zip(pack.shards, pack.skips, strict=True), key=lambda x: x[0][0]
    ):
        group = list(group)
        src = storage.join(job.root, tier, ar, part)
        index = storage.join(src, naming.INDEX_NAME)
        entries = load_index(index, in_part=True, export_columns=job.columns, root=job.root)
        want = [(base, n) for (_, base, n), _ in group]
        fmt = fmt or shard_format(entries[0])
        if [(e["raw_data"]["basename"], int(e["samples"])) for e in entries] != want or any(
            shard_format(e) != fmt for e in entries
        ):
            raise RewritePlanError(
                f"{index}: the part's shards differ from the bucket's merged index; the source "
                "changed while it was read, or is not an export written by prx_data.write_mds"
            )
        out.append((part, src, entries, [skip for _, skip in group]))
    return out


class _ShardCheck:
    """Sees each new shard as it closes: compares it, sample by sample, with the source's kept
    samples read through the skip-aware reader (``verify``), then moves it to a remote ``out``.

    ``expect`` queues the filtered view of each source shard (read before the
    shard is released; about a shard's worth waits in memory); the new shard is
    read back with streaming's reader, as a loader would.
    """

    def __init__(self, job, pack, pdir: str, staging: Staging, remote_out: bool) -> None:
        self.job, self.pack, self.pdir, self.staging = job, pack, pdir, staging
        self.remote_out = remote_out
        self.pending: collections.deque = collections.deque()
        self.ids: list[str] = []
        self.n = 0

    def _staged(self, name: str, data: bytes) -> str:  # a folder of its own, ``data`` as ``name``
        where = os.path.join(self.staging.directory, uuid.uuid4().hex[:12])
        path = os.path.join(where, *name.split("/"))
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(path, "wb") as f:
            f.write(data)
        self.staging.written(path)
        return where

    def expect(self, src: str, entry: dict, skip, raw: bytes) -> None:
        """Queue the kept samples of one source shard (``raw``: its uncompressed bytes)."""
        where = staged = None
        if storage.is_remote(self.job.root) or entry.get("zip_data"):
            where = staged = self._staged(entry["raw_data"]["basename"], raw)
        try:
            reader = reader_from_json(where or src, None, entry)
            view = SkipMDSReader.wrap(reader, list(skip)) if skip else reader
            self.pending.extend(view.get_item(i) for i in range(view.samples))
        finally:
            if staged is not None:
                shutil.rmtree(staged, ignore_errors=True)

    def __call__(self, entry: dict, n: int) -> None:
        raw = entry["raw_data"]["basename"]
        zipped = (entry.get("zip_data") or {}).get("basename")
        path = os.path.join(self.pdir, *(zipped or raw).split("/"))
        if self.remote_out:
            self.staging.written(path)
        if self.job.verify:
            self._compare(entry, n, path, zipped)
        if self.remote_out:
            tier, ar = self.pack.bucket.split("/")
            with open(path, "rb") as f:
                dest = storage.join(self.job.out, tier, ar, self.pack.part, zipped or raw)
                storage.write_bytes_atomic(dest, f.read())
            os.remove(path)

    def _compare(self, entry: dict, n: int, path: str, zipped: str | None) -> None:
        staged = None
        if zipped:
            with open(path, "rb") as f:
                raw = decompress(entry["compression"], f.read())
            staged = self._staged(entry["raw_data"]["basename"], raw)
            del raw
        try:
            reader = reader_from_json(staged or self.pdir, None, entry)
            folded = self.job.fold.names if self.job.fold else ()
            for i in range(n):  # the source's own columns, byte for byte
                got = {k: v for k, v in reader.get_item(i).items() if k not in folded}
                if not self.pending or not same_sample(got, self.pending.popleft()):
                    self._fail()
                self.ids.append(got.get("id", ""))
                self.n += 1
        finally:
            if staged is not None:
                shutil.rmtree(staged, ignore_errors=True)

    def done(self, ids: list[str]) -> None:
        if self.job.verify and (self.pending or self.ids != ids):
            self._fail()

    def _fail(self):
        where = f"{self.job.out}/{self.pack.bucket}/{self.pack.part}"
        raise RewriteVerifyError(f"{where}: sample {self.n} differs from the filtered source")
