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
comes last and names the plan it wrote, so ``--resume`` keeps marked packs.

Local disk stays under a bound (:class:`Staging`): a pack reserves what it
stages (a source shard for the check when the source is remote or compressed,
one output shard and its metadata when ``out`` is remote) before it starts, so
driver threads wait for room instead of filling the disk; on Ray each task
stages at most that much on its node.
"""

from __future__ import annotations

import collections
import hashlib
import json
import logging
import os
import re
import shutil
import tempfile
import threading
import uuid
from dataclasses import asdict, dataclass

from prx_data.core import confined, storage
from prx_data.core.errors import PrxDataError, UsageError
from prx_data.core.schema import MANIFEST_NAME
from prx_data.core.streaming_compat import decompress, reader_from_json
from prx_data.export import durable, naming
from prx_data.export.naming import PROGRESS_DIR
from prx_data.export.pack import PACKED_DIR, open_writer, part_ids, shard_raw, split_samples
from prx_data.export.safety import load_index, remove_tree
from prx_data.skips.reader import SkipMDSReader

#: Default bound on the bytes a rewrite stages on local disk (``--max-local-bytes``).
DEFAULT_MAX_LOCAL_BYTES = 8 << 30
#: Environment setting for the bound when the flag is not given (``8G``, ``500M``, bytes).
DISK_ENV = "PRX_REWRITE_DISK"
#: The plan a rewrite writes before its first pack; ``resume`` continues only the same plan.
PLAN_NAME = f"{PROGRESS_DIR}/rewrite.json"
#: Staged bytes reserved per pack for its index and manifest (plus per shard and per id).
META_BYTES = (8 << 10, 1 << 10, 64)


class RewriteDiskError(PrxDataError, ValueError):
    """One shard needs more local disk than the rewrite may stage."""


class RewriteVerifyError(PrxDataError, AssertionError):
    """A written sample differs from the filtered source: a bug, never bad input."""


class RewritePlanError(PrxDataError, RuntimeError):
    """A pack's marker names another plan: the source or its lists changed since it was written."""


def parse_bytes(text: str, what: str = "size") -> int:
    """``8G``, ``500M``, ``64k`` (binary units) or a plain byte count; positive."""
    units = {"": 1, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40}
    m = re.fullmatch(r"([0-9]+(?:\.[0-9]+)?)([kmgt]?)(?:i?b)?", text.strip().lower())
    value = int(float(m.group(1)) * units[m.group(2)]) if m else 0
    if value <= 0:
        raise UsageError(f"{what} {text!r} is not a positive size (e.g. 8G, 500M, 1048576)")
    return value


def max_local_bytes(value: int | str | None = None) -> int:
    """The staging bound: ``value``, else ``PRX_REWRITE_DISK``, else 8 GiB."""
    if value is None:
        raw = os.environ.get(DISK_ENV)
        return parse_bytes(raw, DISK_ENV) if raw else DEFAULT_MAX_LOCAL_BYTES
    return value if isinstance(value, int) and value > 0 else parse_bytes(str(value))


class Staging:
    """The local directory a rewrite stages files in, holding at most ``limit`` bytes.

    A pack reserves its room before it starts and releases it at its end, so
    concurrent packs wait for room instead of filling the disk. Each staged
    write is reported to :meth:`written` (a test hook: it can measure the disk).
    """

    def __init__(self, directory: str, limit: int) -> None:
        self.directory = directory
        self.limit = limit
        self.used = 0
        self._cond = threading.Condition()

    def reserve(self, n: int) -> None:
        if n > self.limit:  # would wait forever (the plan checks first, with the shard named)
            raise RewriteDiskError(f"{n:,} bytes do not fit in {self.limit:,} of local disk")
        with self._cond:
            while self.used + n > self.limit:
                self._cond.wait()
            self.used += n

    def release(self, n: int) -> None:
        with self._cond:
            self.used -= n
            self._cond.notify_all()

    def written(self, path: str) -> None:
        """Called after each file written under :attr:`directory`."""


class QuietStreaming(logging.Handler):
    """Keeps streaming's log warnings off the terminal for a run and counts them for the report.

    Streaming logs per writer (e.g. about existing directories); a rewrite
    opens one writer per part, so the lines would bury the output. The driver
    holds one for the run; a pack on a Ray worker holds its own and reports its counts.
    """

    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.seen: dict[str, int] = {}
        self._logger = logging.getLogger("streaming")
        self._saved = (self._logger.propagate, list(self._logger.handlers))
        self._logger.propagate = False
        self._logger.handlers = [self]

    @staticmethod
    def active() -> bool:
        return any(isinstance(h, QuietStreaming) for h in logging.getLogger("streaming").handlers)

    def emit(self, record: logging.LogRecord) -> None:
        msg = record.getMessage()
        self.seen[msg] = self.seen.get(msg, 0) + 1

    def close(self) -> None:
        self._logger.propagate, self._logger.handlers = self._saved
        super().close()


@dataclass(frozen=True)
class RewritePack:
    """One source part of ``bucket``, written to ``out`` as the part of the same name without
    the ``skips`` (per shard entry, sorted indices); ``stage``: local bytes it may stage."""

    bucket: str
    part: str
    #: (basename in the part, samples) of each shard, as the bucket's merged index says.
    shards: tuple
    skips: tuple
    samples: int
    stage: int

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> RewritePack:
        return cls(
            **{
                **d,
                "shards": tuple(tuple(x) for x in d["shards"]),
                "skips": tuple(tuple(x) for x in d["skips"]),
            }
        )

    @property
    def digest(self) -> str:
        """What the marker records: a rerun writes a pack only from the same plan."""
        text = json.dumps(self.to_dict(), sort_keys=True, default=list)
        return hashlib.sha256(text.encode()).hexdigest()


@dataclass(frozen=True)
class RewriteJob:
    """What every pack of one rewrite shares (travels to Ray workers with the task)."""

    root: str
    out: str
    verify: bool
    limit: int
    work_dir: str | None = None


def marker_path(out: str, pack: RewritePack) -> str:
    return storage.join(out, *PACKED_DIR.split("/"), *pack.bucket.split("/"), pack.part)


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
            work = (
                self.job.work_dir
                if self.job.work_dir and os.path.isdir(self.job.work_dir)
                else None
            )
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
    src = storage.join(job.root, tier, ar, pack.part)

    def read(path: str, max_bytes: int) -> bytes:
        return confined.read(job.root, path, max_bytes)

    # The part's own index, checked (the exporter's columns only) and held to the merged index
    # the skips were bound through.
    index = storage.join(src, naming.INDEX_NAME)
    entries = load_index(index, in_part=True, export_columns=True, root=job.root)
    if tuple((e["raw_data"]["basename"], int(e["samples"])) for e in entries) != pack.shards:
        raise RewritePlanError(
            f"{index}: the part's shards differ from the bucket's merged index; the source "
            "changed while it was read, or is not an export written by prx_data.write_mds"
        )
    check = _ShardCheck(job, pack, pdir, staging, remote_out)
    writer = open_writer(pdir, entries[0], on_shard=check)
    try:
        with writer:
            for entry, skip in zip(entries, pack.skips, strict=True):
                raw = shard_raw(src, entry, read)
                if job.verify:
                    check.expect(src, entry, skip, raw)
                for sample in split_samples(raw, skip):
                    writer.write(sample)
                del raw
        dead = {
            (name, i) for (name, _), skip in zip(pack.shards, pack.skips, strict=True) for i in skip
        }
        keys = ((name, i) for name, n in pack.shards for i in range(n))
        ids = [
            i
            for i, key in zip(part_ids(src, pack.part, entries, read), keys, strict=True)
            if key not in dead
        ]
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

    def _staged(self, name: str, data: bytes) -> str:
        """A directory of its own under the staging area holding ``data`` as ``name``."""
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
            for i in range(n):
                got = reader.get_item(i)
                if not self.pending or got != self.pending.popleft():
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
