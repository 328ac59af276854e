"""``python -m prx_data.skips``: manage skip lists of an export, or rewrite it without them.

Skip lists cost nothing to apply at load time, so they are the default way
to drop samples (dedup, NSFW, opt-outs). Once a large share of an export is
skipped, shards carry dead bytes; ``rewrite`` writes a new export that holds
only the kept samples and no lists, and verifies it sample by sample.

Examples::

    python -m prx_data.skips add out/ optout-2026-11 --ids optout.txt
    python -m prx_data.skips add out/ lowaes --table data.lance --where "aesthetic < 4.5"
    python -m prx_data.skips add out/ manual --indices picks.tsv
    python -m prx_data.skips list out/
    python -m prx_data.skips stats out/ --json
    python -m prx_data.skips remove out/ manual
    python -m prx_data.skips sync out/
    python -m prx_data.skips rewrite out/ out-clean/ --threshold 0.10

A rewrite carries every list it does not apply to the new export, bound by
row id to the new shards (:mod:`prx_data.skips.ops`), together with every
list of the table's registry; the lists it applies are left out, with every
one of their ids (also ids the registry holds and the sidecars do not yet).
"""

from __future__ import annotations

import collections
import json
import logging
import os
import posixpath
import queue
import re
import shutil
import tempfile
import threading
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field

import numpy as np
from tqdm import tqdm

from prx_data.core import confined, storage
from prx_data.core.errors import AlreadyExists, PrxDataError, UsageError
from prx_data.core.schema import MANIFEST_NAME, REPORT_NAME
from prx_data.core.streaming_compat import decompress, reader_from_json
from prx_data.export import durable, idindex, layout, merge, naming
from prx_data.skips import sidecar as skiplist
from prx_data.skips.bind import bind
from prx_data.skips.errors import ListError
from prx_data.skips.export_state import export_lease, resolve, table_of
from prx_data.skips.materialise import materialise
from prx_data.skips.ops import carry, lists_of, lists_text, snapshot_local
from prx_data.skips.reader import SkipMDSReader
from prx_data.skips.sidecar import read_ids_file, read_indices_file  # noqa: F401 (re-exported)

DEFAULT_THRESHOLD = 0.10


# --- rewrite -----------------------------------------------------------------------------------


class RewriteRefused(PrxDataError, RuntimeError):
    """The skipped share is below the threshold (rewriting would buy little)."""


@dataclass
class RewriteResult:
    """What a rewrite did; written as ``report.json`` / ``report.txt`` in the new export."""

    out: str
    samples_in: int
    samples_out: int
    skipped: int
    #: Buckets in the new export.
    buckets: int
    verified: bool
    source: str = ""
    #: Skip lists applied (left out of the new export).
    lists: list[str] = field(default_factory=list)
    #: {bucket: samples in the new export}
    bucket_samples: dict[str, int] = field(default_factory=dict)
    #: Buckets whose every sample was skipped: not written (streaming rejects empty indexes).
    buckets_dropped: list[str] = field(default_factory=list)
    #: Log warnings from streaming during the run, {message: count} (kept off the terminal).
    warnings: dict[str, int] = field(default_factory=dict)
    seconds: float = 0.0
    #: Lists carried to the new export: {list: {ids, samples, shards, share, source}}.
    lists_carried: dict[str, dict] = field(default_factory=dict)
    #: Lists left behind on request (``--drop-lists``).
    lists_dropped: list[str] = field(default_factory=list)
    #: The table the source was exported from, and its list registry (None: none found).
    table: str | None = None
    registry: str | None = None

    def to_dict(self) -> dict:
        # ``buckets`` and ``samples_written`` are what the loader checks an export against
        # (``layout.check_bucket_complete``), as for an export's own report.
        return {
            **asdict(self),
            "buckets": dict(self.bucket_samples),
            "samples_written": self.samples_out,
        }

    def text(self) -> str:
        lines = [
            f"rewrite of {self.source} -> {self.out}",
            f"samples in       {self.samples_in:>10,}",
            f"samples written  {self.samples_out:>10,}",
            f"skipped          {self.skipped:>10,}  (lists: {', '.join(self.lists) or 'none'})",
            "",
            f"{'bucket':<14}{'samples':>10}",
        ]
        lines += [f"{b:<14}{n:>10,}" for b, n in self.bucket_samples.items()]
        for b in self.buckets_dropped:
            lines.append(f"{b:<14}{'dropped':>10}  (every sample was skipped)")
        if self.warnings:
            lines.append("")
            lines.append(f"streaming warnings ({sum(self.warnings.values())}):")
            lines += [f"  {n} x {m}" for m, n in self.warnings.items()]
        if self.lists_carried:
            lines.append("")
            lines.append("skip lists carried (by row id):")
            lines += lists_text(self.lists_carried)
        if self.lists_dropped:
            lines.append(f"skip lists left behind: {', '.join(self.lists_dropped)}")
        if self.registry is None and self.table:
            lines.append(
                f"the list registry of {self.table} was not found from here: only the "
                "export's own lists were carried, as the new export's own (export-only)"
            )
        lines.append("verified sample by sample" if self.verified else "not verified")
        return "\n".join(lines) + "\n"


class _QuietStreaming(logging.Handler):
    """Keeps streaming's log warnings off the terminal for a run and counts them for the report.

    Streaming logs per writer/shard (e.g. about existing directories); a
    rewrite opens thousands of writers, so the lines would bury the output.
    """

    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.seen: dict[str, int] = {}
        self._logger = logging.getLogger("streaming")
        self._saved = (self._logger.propagate, list(self._logger.handlers))
        self._logger.propagate = False
        self._logger.handlers = [self]

    def emit(self, record: logging.LogRecord) -> None:
        msg = record.getMessage()
        self.seen[msg] = self.seen.get(msg, 0) + 1

    def summary(self) -> dict[str, int]:
        return dict(sorted(self.seen.items(), key=lambda kv: -kv[1]))

    def close(self) -> None:
        self._logger.propagate, self._logger.handlers = self._saved
        super().close()


#: Default bound on the bytes a rewrite stages on local disk (``--max-local-bytes``).
DEFAULT_MAX_LOCAL_BYTES = 8 << 30
#: Environment setting for the bound when the flag is not given (``8G``, ``500M``, bytes).
DISK_ENV = "PRX_REWRITE_DISK"
#: Source shards fetched at once, within the bound, while the current one is rewritten.
FETCH_THREADS = 4
#: Staged bytes reserved per part for its index and manifest (plus per shard and per id).
_META_BYTES = (8 << 10, 1 << 10, 64)


class RewriteDiskError(PrxDataError, ValueError):
    """One shard needs more local disk than the rewrite may stage."""


class RewriteVerifyError(PrxDataError, AssertionError):
    """A written sample differs from the filtered source: a bug, never bad input."""


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


class _Stopped(Exception):
    """The staging area closed while a fetch waited for room (the rewrite is ending)."""


class Staging:
    """The local directory a rewrite stages shards in, holding at most ``limit`` bytes.

    Every staged file is reserved before it is written and released once it is
    deleted, so a fetch ahead waits for room instead of filling the disk. Each
    write is reported to :meth:`written` (a test hook: it can measure the disk).
    """

    def __init__(self, directory: str, limit: int) -> None:
        self.directory = directory
        self.limit = limit
        self.used = 0
        self.peak = 0
        self._cond = threading.Condition()

    def reserve(self, n: int, stop: threading.Event | None = None) -> None:
        """Wait until ``n`` more bytes fit; raise :class:`_Stopped` once ``stop`` is set."""
        if n > self.limit:  # would wait forever (callers check first, with the shard named)
            raise RewriteDiskError(f"{n:,} bytes do not fit in {self.limit:,} of local disk")
        with self._cond:
            while self.used + n > self.limit:
                if stop is not None and stop.is_set():
                    raise _Stopped
                self._cond.wait(0.1)
            self.used += n
            self.peak = max(self.peak, self.used)

    def release(self, n: int) -> None:
        with self._cond:
            self.used -= n
            self._cond.notify_all()

    def written(self, path: str) -> None:
        """Called after each file written under :attr:`directory`."""


def _staged_bytes(root: str, entry: dict) -> int:
    """Local bytes a source shard takes while it is read (0: read in place)."""
    if not storage.is_remote(root) and not entry.get("zip_data"):
        return 0
    return int(entry["raw_data"]["bytes"])


def _materialize(root: str, bucket: str, entry: dict, tmp: str) -> str:
    """A local directory holding this shard's raw file (downloaded / decompressed if needed)."""
    raw = entry["raw_data"]["basename"]
    if not storage.is_remote(root) and not entry.get("zip_data"):
        return os.path.join(root, *bucket.split("/"))
    dest = os.path.join(tmp, *bucket.split("/"))
    path = os.path.join(dest, *raw.split("/"))
    os.makedirs(os.path.dirname(path), exist_ok=True)
    local_raw = storage.join(root, *bucket.split("/"), *raw.split("/"))
    # Read confined to the export, no more than the index declares (a link out or a FIFO is refused).
    if entry.get("zip_data"):
        zip_data = entry["zip_data"]
        zpath = storage.join(root, *bucket.split("/"), *zip_data["basename"].split("/"))
        data = decompress(entry["compression"], confined.read(root, zpath, int(zip_data["bytes"])))
    else:
        data = confined.read(root, local_raw, int(entry["raw_data"]["bytes"]))
    with open(path, "wb") as f:
        f.write(data)
    return dest


class _Fetcher:
    """Source shards of one bucket, fetched ahead in order, each reserved in the bound first.

    Iterating yields ``(entry, reader, release)``; calling ``release`` deletes
    the staged file and frees its room. Reservations are taken in shard order,
    so the shard the rewrite waits for is always the oldest one and never
    starves (each shard alone fits: checked before anything is written).
    """

    def __init__(self, root: str, bucket: str, entries: list[dict], staging: Staging) -> None:
        self.root, self.bucket, self.staging = root, bucket, staging
        self.tmp = os.path.join(staging.directory, "in")
        self.pool = ThreadPoolExecutor(FETCH_THREADS, thread_name_prefix="rewrite-fetch")
        self.stop = threading.Event()
        self.ready: queue.Queue = queue.Queue()
        self.room = threading.Semaphore(2 * FETCH_THREADS)  # readers waiting, also unstaged
        self.thread = threading.Thread(target=self._schedule, args=(entries,), daemon=True)
        self.thread.start()

    def _schedule(self, entries: list[dict]) -> None:
        try:
            for entry in entries:
                n = _staged_bytes(self.root, entry)
                while not self.room.acquire(timeout=0.1):
                    if self.stop.is_set():
                        raise _Stopped
                self.staging.reserve(n, self.stop)
                self.ready.put((entry, n, self.pool.submit(self._get, entry)))
        except _Stopped:
            return
        except BaseException as e:  # noqa: BLE001 - handed to the consumer
            self.ready.put(e)
        self.ready.put(None)

    def _get(self, entry: dict):
        directory = _materialize(self.root, self.bucket, entry, self.tmp)
        if _staged_bytes(self.root, entry):
            self.staging.written(os.path.join(directory, *entry["raw_data"]["basename"].split("/")))
        return directory, reader_from_json(directory, None, entry)

    def __iter__(self):
        while True:
            item = self.ready.get()
            if item is None:
                return
            if isinstance(item, BaseException):
                raise item
            entry, n, future = item
            directory, reader = future.result()
            self.room.release()

            def release(entry=entry, n=n, directory=directory) -> None:
                if n:
                    path = os.path.join(directory, *entry["raw_data"]["basename"].split("/"))
                    if os.path.exists(path):
                        os.remove(path)
                    self.staging.release(n)

            yield entry, reader, release

    def close(self) -> None:
        self.stop.set()
        self.thread.join()
        self.pool.shutdown(wait=True, cancel_futures=True)


def _check_empty_destination(out: str) -> None:
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


def rewrite_export(
    root: str,
    out: str,
    *,
    names: Sequence[str] | None = None,
    threshold: float = DEFAULT_THRESHOLD,
    force: bool = False,
    verify: bool = True,
    drop_lists: Sequence[str] = (),
    max_local: int | str | None = None,
    work_dir: str | None = None,
    table: str | None = None,
    ledger: str | None = None,
) -> RewriteResult:
    """Write ``out``: the export at ``root`` without the samples of the lists it applies.

    Parts, columns, compression, hashes and size limits are kept; shards and
    ``ids.parquet`` manifests are rebuilt. Refused unless the skipped share
    (union of ``names``, all lists by default) is at least ``threshold`` or
    ``force``. Every other list (of the export and of the table's registry) is
    carried to ``out`` by row id; a list whose ids cannot be recovered makes it
    refuse, naming the list, unless it is in ``drop_lists``. With ``verify``,
    every sample of the new export is compared to the filtered view of the old one.

    Buckets are rewritten one after another and shard by shard: at most
    ``max_local`` bytes (:func:`max_local_bytes`) are staged in ``work_dir``
    (the system's temp directory by default) at once. A remote source shard is
    fetched, read and deleted; a new shard for a remote ``out`` is checked,
    uploaded and deleted as soon as the writer closes it. Anything in ``out``
    before ``report.json`` (written last) is an unfinished rewrite.
    """
    _check_empty_destination(out)
    t0 = time.monotonic()
    buckets = layout.list_buckets(root)
    # Every list as ids, before anything is written: one that cannot be recovered refuses.
    source_table = table_of(root)
    # Only the user's --table/--ledger lets what a (possibly received) export holds be written
    # into a ledger; otherwise the ledger is read, and the old export's own entries stay the
    # new export's own.
    trusted = bool(table or ledger)
    try:
        reg = resolve(root, table, ledger=ledger) if trusted else resolve(root)
    except ListError:
        if trusted:
            raise
        reg = None  # the ledger is not found from here: the new export's lists are its own
    # Every list as the log's state, before anything is written: one that cannot be recovered
    # (a corrupt sidecar of a list the log does not hold) refuses.
    carried = lists_of(root, reg, drop=drop_lists)
    known = set(carried)
    total = skipped = 0
    plan = []
    samples: dict[str, int] = {}
    room: dict[str, tuple[int, int]] = {}  # {bucket: (largest staged source, output room)}
    remote_out = storage.is_remote(out)
    applied: set[str] = set()
    for bucket in buckets:
        # Before anything is written; the raw entries once, for the local disk it needs too.
        entries = layout.read_index_entries(root, bucket, export_columns=True)
        room[bucket] = _room(root, bucket, entries, remote_out)
        shards = [layout.ShardInfo.from_index_entry(e) for e in entries]
        del entries
        listing = skiplist.list_sidecars(root, bucket, shards)
        known |= set(listing)
        applied |= set(listing) if names is None else set(names) & set(listing)
        skips = skiplist.load_skips(root, bucket, shards, names, listing=listing)
        plan.append((bucket, skips))
        samples[bucket] = sum(s.samples for s in shards)
    applied |= known if names is None else set(names) & known
    # An applied list leaves with all its ids, also those its sidecars do not hold yet.
    extra = bind(
        root,
        {n: carried[n]["id"].combine_chunks() for n in sorted(applied) if n in carried},
    )
    by_bucket = dict(plan)  # the same skip dicts as in ``plan``: one pass over the positions
    for b in extra.values():
        for (bk, shard), idx in b.positions.items():
            skips = by_bucket.get(bk)
            if skips is None:
                continue
            old = skips.get(shard)
            skips[shard] = (
                idx.astype(np.uint32) if old is None else np.union1d(old, idx).astype(np.uint32)
            )
    for bucket, skips in plan:
        total += samples[bucket]
        skipped += sum(len(v) for v in skips.values())
    share = skipped / total if total else 0.0
    if share < threshold and not force:
        raise RewriteRefused(
            f"only {share:.1%} of {total} samples are skipped (threshold {threshold:.0%}); skip lists "
            "cost nothing at load time. Pass --force to rewrite anyway."
        )
    limit = max_local_bytes(max_local)
    for bucket, need in room.items():
        _check_room(root, bucket, need, limit)
    work = tempfile.mkdtemp(prefix="prx-rewrite-", dir=work_dir)
    staging = Staging(work, limit)
    written = 0
    per_bucket: dict[str, int] = {}
    dropped: list[str] = []
    quiet = _QuietStreaming()
    try:
        bar = tqdm(total=total - skipped, desc="rewrite", unit="sample")
        for bucket, skips in plan:
            n = _rewrite_bucket(root, out, bucket, skips, staging, verify, bar)
            if n:
                per_bucket[bucket] = n
                written += n
            else:
                # Streaming refuses an index with no shards: every sample was skipped, so the
                # bucket is left out and the report says so.
                dropped.append(bucket)
        bar.close()
        idindex.write_id_index(out)  # before the lists, which bind their ids through it
        # The lists, re-bound by row id to the new shards (after every bucket): the source's
        # export-only entries go to the registry where newer, then the log is materialised.
        with export_lease(out) as lease:
            if reg is not None and trusted:
                carry(root, reg, drop=drop_lists)
            else:
                snapshot_local(root, out, lease, drop=drop_lists)
            done = materialise(out, reg, lease, full=True)
        lists_carried = {n: v for n, v in done.items() if n not in applied}
    finally:
        shutil.rmtree(work, ignore_errors=True)
        quiet.close()
    result = RewriteResult(
        out,
        total,
        written,
        skipped,
        len(buckets) - len(dropped),
        verify,
        source=root,
        lists=sorted(applied),
        bucket_samples=dict(sorted(per_bucket.items())),
        buckets_dropped=dropped,
        warnings=quiet.summary(),
        seconds=round(time.monotonic() - t0, 3),
        lists_carried=lists_carried,
        lists_dropped=sorted(set(drop_lists)),
        table=source_table,
        registry=reg.uri if reg is not None else None,
    )
    storage.write_bytes_atomic(storage.join(out, "report.txt"), result.text().encode())
    storage.write_bytes_atomic(
        storage.join(out, REPORT_NAME), json.dumps(result.to_dict(), indent=2).encode()
    )
    return result


def _room(root: str, bucket: str, entries: list[dict], remote_out: bool) -> tuple[int, int]:
    """(largest source shard staged, room held for the output) of one bucket, in bytes.

    A source shard is staged when it is remote or compressed. For a remote
    ``out``, one finished output shard is on disk at a time (never larger than
    its source part nor than the size limit), twice when it is compressed (it
    is checked decompressed), plus the part's index and manifest.
    """
    source = max((_staged_bytes(root, e) for e in entries), default=0)
    out = 0
    if remote_out:
        for items in _parts(root, bucket, entries).values():
            first = items[0]
            raw = sum(int(e["raw_data"]["bytes"]) for e in items)
            one = min(raw, int(first.get("size_limit") or raw))
            samples = sum(int(e["samples"]) for e in items)
            meta = _META_BYTES[0] + _META_BYTES[1] * len(items) + _META_BYTES[2] * samples
            out = max(out, (2 if first.get("compression") else 1) * one + meta)
    return source, out


def _check_room(root: str, bucket: str, need: tuple[int, int], limit: int) -> None:
    """Refuse a bound that one shard of ``bucket`` and its output do not fit in."""
    if sum(need) > limit:
        raise RewriteDiskError(
            f"{root}/{bucket}: one shard needs {sum(need):,} bytes of local disk (a "
            f"{need[0]:,}-byte source shard and {need[1]:,} bytes for its output) but the "
            f"rewrite may stage {limit:,}; raise --max-local-bytes (or {DISK_ENV})"
        )


def _parts(root: str, bucket: str, entries: list[dict]) -> dict[str, list[dict]]:
    """The bucket's shard entries by part directory, in index order."""
    parts: dict[str, list[dict]] = {}
    for entry in entries:
        part = posixpath.dirname(entry["raw_data"]["basename"])
        if not part:
            raise UsageError(
                f"{root}/{bucket}: shard {entry['raw_data']['basename']!r} is not inside a "
                "part directory; not an export written by prx_data.write_mds"
            )
        parts.setdefault(part, []).append(entry)
    return parts


def _rewrite_bucket(
    root: str, out: str, bucket: str, skips: dict, staging: Staging, verify: bool, bar
) -> int:
    """Write ``bucket``'s kept samples to ``out``, shard by shard; returns how many.

    Each new shard is compared, sample by sample, with the kept samples of the
    source read through the skip-aware reader (``verify``), then moved to a
    remote ``out``. The bucket's index is merged once its parts are all written.
    """
    import streaming

    remote_out = storage.is_remote(out)
    # Checked (again: it may have changed since the plan) before any reader exists: the
    # exporter's columns only, so no encoding can run code.
    entries = layout.read_index_entries(root, bucket, export_columns=True)
    kept_parts = {
        part: items
        for part, items in _parts(root, bucket, entries).items()
        # No empty part: its shard-less index would only add noise.
        if sum(e["samples"] - len(skips.get(e["raw_data"]["basename"], ())) for e in items)
    }
    if not kept_parts:
        return 0
    bucket_out = (
        os.path.join(staging.directory, "out", *bucket.split("/"))
        if remote_out
        else os.path.join(out, *bucket.split("/"))
    )
    # The output's room is held for the whole bucket, before any source shard is reserved:
    # the shard the writer waits for then always fits (reservations are in shard order).
    need = _room(root, bucket, entries, remote_out)
    _check_room(root, bucket, need, staging.limit)  # the index may have changed since the plan
    staging.reserve(need[1])
    sink = _sink_class(streaming.MDSWriter)
    fetcher = _Fetcher(root, bucket, [e for items in kept_parts.values() for e in items], staging)
    shards = iter(fetcher)
    count = 0
    try:
        for part, items in kept_parts.items():
            first = items[0]
            columns = dict(zip(first["column_names"], first["column_encodings"], strict=True))
            pdir = os.path.join(bucket_out, *part.split("/"))
            ids: list[str] = []
            check = _ShardCheck(pdir, staging, verify, f"{out}/{bucket}/{part}")
            remote_part = storage.join(out, *bucket.split("/"), *part.split("/"))

            def on_shard(entry: dict, n: int, check=check, remote_part=remote_part) -> None:
                path = check(entry, n)
                if remote_out:
                    rel = os.path.relpath(path, check.pdir).replace(os.sep, "/")
                    with open(path, "rb") as f:
                        storage.write_bytes_atomic(storage.join(remote_part, rel), f.read())
                    os.remove(path)

            with sink(
                on_shard=on_shard,
                out=pdir,
                columns=columns,
                compression=first.get("compression"),
                hashes=list((first["raw_data"].get("hashes") or {}).keys()) or None,
                size_limit=first.get("size_limit") or (1 << 26),
            ) as w:
                for _ in items:
                    entry, reader, release = next(shards)
                    skip = skips.get(entry["raw_data"]["basename"])
                    dead = set() if skip is None else set(skip.tolist())
                    if verify:
                        view = reader if skip is None else SkipMDSReader.wrap(reader, skip)
                        check.expect([view.get_item(i) for i in range(view.samples)])
                    for i in range(reader.samples):
                        if i in dead:
                            continue
                        sample = reader.get_item(i)
                        w.write(sample)
                        ids.append(sample.get("id", ""))
                        bar.update()
                    release()
            check.done()
            durable.write_manifest(bucket_out, part, ids)
            if remote_out:
                for name in (naming.INDEX_NAME, MANIFEST_NAME):
                    path = os.path.join(pdir, name)
                    staging.written(path)
                    with open(path, "rb") as f:
                        storage.write_bytes_atomic(storage.join(remote_part, name), f.read())
                shutil.rmtree(pdir)
            count += len(ids)
    finally:
        fetcher.close()
        staging.release(need[1])
    # Reads the parts' indexes back from ``out`` (in parallel when remote): the same bytes.
    merge.merge_bucket(storage.join(out, *bucket.split("/")), sorted(kept_parts))
    if remote_out:
        shutil.rmtree(bucket_out, ignore_errors=True)
    return count


def _sink_class(base: type) -> type:
    """``base`` (streaming's ``MDSWriter``) handing each shard it closes to ``on_shard``."""

    class _Sink(base):
        def __init__(self, *, on_shard, **kwargs) -> None:
            self._on_shard = on_shard
            super().__init__(**kwargs)

        def flush_shard(self) -> None:
            n = len(self.new_samples)
            super().flush_shard()
            self._on_shard(self.shards[-1], n)

    return _Sink


class _ShardCheck:
    """Compares each new shard, sample by sample, with the source's kept samples in order.

    ``expect`` queues the filtered source view of each source shard (read
    before the staged file is deleted; about a shard's worth waits in memory); a new shard is read back from
    disk with streaming's reader, as a loader would. A mismatch, a missing or an
    extra sample raises :class:`RewriteVerifyError`.
    """

    def __init__(self, pdir: str, staging: Staging, enabled: bool, where: str) -> None:
        self.pdir, self.staging, self.enabled, self.where = pdir, staging, enabled, where
        self.pending: collections.deque = collections.deque()
        self.sources: collections.deque = collections.deque()
        self.n = 0

    def expect(self, samples) -> None:
        self.sources.append(samples)

    def _next_expected(self):
        while True:
            if self.pending:
                return self.pending.popleft()
            if not self.sources:
                return _MISSING
            self.pending.extend(self.sources.popleft())

    def __call__(self, entry: dict, n: int) -> str:
        """Check a closed shard; returns its file on disk (raw, or compressed)."""
        raw = entry["raw_data"]["basename"]
        zipped = (entry.get("zip_data") or {}).get("basename")
        path = os.path.join(self.pdir, *(zipped or raw).split("/"))
        self.staging.written(path)
        if not self.enabled:
            return path
        check_dir, raw_path = self.pdir, None
        if zipped:
            check_dir = os.path.join(self.staging.directory, "check")
            raw_path = os.path.join(check_dir, *raw.split("/"))
            os.makedirs(os.path.dirname(raw_path), exist_ok=True)
            with open(path, "rb") as f, open(raw_path, "wb") as g:
                g.write(decompress(entry["compression"], f.read()))
            self.staging.written(raw_path)
        try:
            reader = reader_from_json(check_dir, None, entry)
            for i in range(n):
                want = self._next_expected()
                if want is _MISSING or reader.get_item(i) != want:
                    self._fail()
                self.n += 1
        finally:
            if raw_path is not None:
                os.remove(raw_path)
        return path

    def done(self) -> None:
        if self.enabled and self._next_expected() is not _MISSING:
            self._fail()

    def _fail(self):
        raise RewriteVerifyError(f"{self.where}: sample {self.n} differs from the filtered source")


_MISSING = object()


# --- CLI ---------------------------------------------------------------------------------------
