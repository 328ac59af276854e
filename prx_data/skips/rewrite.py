"""``skips rewrite``: a new export without the skipped samples and without lists.

Skip lists cost nothing at load time; once a large share of an export is
skipped, shards carry dead bytes, and ``python -m prx_data.skips rewrite out/
out-clean/`` writes only the kept samples, checked sample by sample. This
module plans and reports; the copying is the re-shard stage of
:mod:`prx_data.skips.repack` (one pack per source part, encoded samples copied
by the export's pack code, on driver threads or Ray like the export).

A rewrite carries every list it does not apply to the new export, bound by
row id to the new shards (:mod:`prx_data.skips.ops`), together with every
list of the table's registry; the lists it applies are left out, with every
one of their ids (also ids the registry holds and the sidecars do not yet).
"""

from __future__ import annotations

import hashlib
import json
import posixpath
import shutil
import tempfile
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field

import numpy as np

from prx_data.core import storage
from prx_data.core.errors import AlreadyExists, PrxDataError, UsageError
from prx_data.core.runtime import Placement, Resources, UnitError, map_units, place
from prx_data.core.schema import REPORT_NAME
from prx_data.export import idindex, layout, merge
from prx_data.export.naming import PROGRESS_DIR
from prx_data.skips import repack
from prx_data.skips import sidecar as skiplist
from prx_data.skips.bind import bind
from prx_data.skips.errors import ListError
from prx_data.skips.export_state import export_lease
from prx_data.skips.materialise import materialise
from prx_data.skips.ops import carry, lists_of, lists_text, snapshot_local
from prx_data.skips.repack import (  # noqa: F401 (the CLI's and tests' names)
    DEFAULT_MAX_LOCAL_BYTES,
    DISK_ENV,
    META_BYTES,
    PLAN_NAME,
    RewriteDiskError,
    RewritePack,
    RewriteVerifyError,
    Staging,
    max_local_bytes,
)
from prx_data.skips.sidecar import read_ids_file, read_indices_file  # noqa: F401 (re-exported)
from prx_data.skips.which import resolve, table_of

DEFAULT_THRESHOLD = 0.10
#: Rewrites whose kept shards total at most this many bytes run on driver threads under
#: ``engine="auto"`` (starting Ray costs more than copying them); larger ones on Ray.
DRIVER_BYTES = 256 << 20


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


def plan_packs(root: str, out: str, skips_of: dict[str, dict], verify: bool):
    """One :class:`RewritePack` per source part that keeps a sample, in bucket and part order.

    Returns (packs, samples in, samples skipped, shard bytes of the packs). A
    pack's ``stage`` is the local disk it holds: a source shard to check when the
    source is remote or compressed, and for a remote ``out`` one output shard
    (never larger than its source part nor than the size limit; twice when it
    is compressed, as it is checked decompressed) plus the part's index and manifest.
    """
    remote_in, remote_out = storage.is_remote(root), storage.is_remote(out)
    packs, total, skipped, nbytes = [], 0, 0, 0
    for bucket, skips in skips_of.items():
        parts: dict[str, list] = {}
        for e in layout.read_index_entries(root, bucket, export_columns=True):
            part, _, base = e["raw_data"]["basename"].rpartition("/")
            if not part or "/" in part:
                raise UsageError(
                    f"{root}/{bucket}: shard {e['raw_data']['basename']!r} is not inside a part "
                    "directory; not an export written by prx_data.write_mds"
                )
            skip = skips.get(e["raw_data"]["basename"])
            parts.setdefault(part, []).append((base, e, () if skip is None else skip.tolist()))
        for part, items in parts.items():
            n = sum(int(e["samples"]) for _, e, _ in items)
            dead = sum(len(s) for _, _, s in items)
            total, skipped = total + n, skipped + dead
            if n == dead:  # no empty part: its shard-less index would only add noise
                continue
            raw = [int(e["raw_data"]["bytes"]) for _, e, _ in items]
            first = items[0][1]
            zipped = bool(first.get("zip_data"))
            stage = max(raw) if verify and (remote_in or zipped) else 0
            one = min(sum(raw), int(first.get("size_limit") or sum(raw)))
            if remote_out:
                meta = META_BYTES[0] + META_BYTES[1] * len(items) + META_BYTES[2] * n
                stage += (2 if zipped else 1) * one + meta
            elif zipped and verify:
                stage += one
            nbytes += sum(raw)
            packs.append(
                RewritePack(
                    bucket,
                    part,
                    tuple((base, int(e["samples"])) for base, e, _ in items),
                    tuple(tuple(int(i) for i in s) for _, _, s in items),
                    n - dead,
                    stage,
                )
            )
    return packs, total, skipped, nbytes


def check_room(root: str, packs: list[RewritePack], limit: int) -> None:
    """Refuse, before anything is written, a bound that one pack's staging does not fit in."""
    for p in packs:
        if p.stage > limit:
            raise RewriteDiskError(
                f"{root}/{p.bucket}/{p.part}: one shard needs {p.stage:,} bytes of local disk (a "
                f"source shard and its output) but the rewrite may stage {limit:,}; raise "
                f"--max-local-bytes (or {DISK_ENV})"
            )


def record_plan(root: str, out: str, packs: list[RewritePack], resume: bool) -> None:
    """Record the plan in ``out`` before the first pack; a resume continues only that plan."""
    path = storage.join(out, *PLAN_NAME.split("/"))
    digest = hashlib.sha256("".join(p.digest for p in packs).encode()).hexdigest()
    record = json.dumps({"source": root, "plan": digest}, sort_keys=True).encode()
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
    resume: bool = False,
    engine: str = "auto",
    ray_address: str | None = None,
    num_cpus: int | None = None,
    progress: bool = True,
) -> RewriteResult:
    """Write ``out``: the export at ``root`` without the samples of the lists it applies.

    Parts, columns, compression, hashes and size limits are kept; shards and
    ``ids.parquet`` manifests are rebuilt. Refused unless the skipped share
    (union of ``names``, all lists by default) is at least ``threshold`` or
    ``force``. Every other list (of the export and of the table's registry) is
    carried to ``out`` by row id; a list whose ids cannot be recovered makes it
    refuse, naming the list, unless it is in ``drop_lists``. With ``verify``,
    every sample of the new export is compared to the filtered view of the old one.

    One pack per source part (:mod:`prx_data.skips.repack`) runs where
    ``engine`` places it (:func:`prx_data.core.runtime.place`: driver threads
    up to :data:`DRIVER_BYTES`, else Ray); at most ``max_local`` bytes
    (:func:`max_local_bytes`) are staged in ``work_dir`` at once. Anything in
    ``out`` before ``report.json`` (written last) is an unfinished rewrite,
    which ``resume`` finishes (same source, lists and options).
    """
    if not resume:
        check_destination(out)
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
    skips_of: dict[str, dict] = {}
    applied: set[str] = set()
    for bucket in buckets:
        shards = layout.read_index(root, bucket, export_columns=True)
        listing = skiplist.list_sidecars(root, bucket, shards)
        known |= set(listing)
        applied |= set(listing) if names is None else set(names) & set(listing)
        skips_of[bucket] = skiplist.load_skips(root, bucket, shards, names, listing=listing)
    applied |= known if names is None else set(names) & known
    # An applied list leaves with all its ids, also those its sidecars do not hold yet.
    extra = bind(
        root,
        {n: carried[n]["id"].combine_chunks() for n in sorted(applied) if n in carried},
    )
    for b in extra.values():
        for (bk, shard), idx in b.positions.items():
            skips = skips_of.get(bk)
            if skips is not None:
                old = skips.get(shard)
                skips[shard] = idx if old is None else np.union1d(old, idx)
    limit = max_local_bytes(max_local)
    packs, total, skipped, nbytes = plan_packs(root, out, skips_of, verify)
    share = skipped / total if total else 0.0
    if share < threshold and not force:
        raise RewriteRefused(
            f"only {share:.1%} of {total} samples are skipped (threshold {threshold:.0%}); skip lists "
            "cost nothing at load time. Pass --force to rewrite anyway."
        )
    check_room(root, packs, limit)
    record_plan(root, out, packs, resume)
    placement = place(
        engine, size=nbytes, small=DRIVER_BYTES, ray_address=ray_address, num_cpus=num_cpus
    )
    per_bucket: dict[str, dict[str, int]] = {}
    warnings: dict[str, int] = {}
    quiet = repack.QuietStreaming()
    work = None if placement.on_ray else tempfile.mkdtemp(prefix="prx-rewrite-", dir=work_dir)
    try:
        task = repack.RewriteTask(
            repack.RewriteJob(root, out, verify, limit, work_dir),
            None if work is None else Staging(work, limit),
        )
        for r in _run(task, packs, placement, progress):
            per_bucket.setdefault(r["bucket"], {})[r["part"]] = r["samples"]
            for m, n in r.get("warnings", {}).items():
                warnings[m] = warnings.get(m, 0) + n
        dropped = [b for b in buckets if b not in per_bucket]  # every sample skipped
        for bucket in buckets:
            if bucket in per_bucket:  # the parts' indexes read back from ``out``: the same bytes
                merge.merge_bucket(
                    storage.join(out, *bucket.split("/")), sorted(per_bucket[bucket])
                )
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
        if work is not None:
            shutil.rmtree(work, ignore_errors=True)
        quiet.close()
    for m, n in quiet.seen.items():
        warnings[m] = warnings.get(m, 0) + n
    counts = {b: sum(v.values()) for b, v in sorted(per_bucket.items())}
    result = RewriteResult(
        out,
        total,
        sum(counts.values()),
        skipped,
        len(counts),
        verify,
        source=root,
        lists=sorted(applied),
        bucket_samples=counts,
        buckets_dropped=dropped,
        warnings=dict(sorted(warnings.items(), key=lambda kv: -kv[1])),
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
    storage.delete(storage.join(out, PROGRESS_DIR))  # the plan and pack markers: done with
    return result


def _run(task: repack.RewriteTask, packs: list, placement: Placement, progress: bool):
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
