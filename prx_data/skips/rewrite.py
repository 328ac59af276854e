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
row id to the new shards (:mod:`prx_data.skips.lists`), together with every
list of the table's registry; the lists it applies are left out, with every
one of their ids (also ids the registry holds and the sidecars do not yet).
"""

from __future__ import annotations

import json
import logging
import os
import posixpath
import shutil
import tempfile
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field

import numpy as np
from tqdm import tqdm

from prx_data.core import storage
from prx_data.core.errors import PrxDataError
from prx_data.core.schema import REPORT_NAME
from prx_data.core.streaming_compat import decompress, reader_from_json
from prx_data.export import idindex, layout
from prx_data.skips import lists as idlists
from prx_data.skips import sidecar as skiplist
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
    #: Lists carried to the new export: {list: {ids, samples, shards}} (bound by row id).
    lists_carried: dict[str, dict[str, int]] = field(default_factory=dict)
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
            lines += idlists.lists_text(self.lists_carried)
        if self.lists_dropped:
            lines.append(f"skip lists left behind: {', '.join(self.lists_dropped)}")
        if self.registry is None and self.table:
            lines.append(
                f"the list registry of {self.table} was not found from here: only the "
                "export's own lists were carried (run `skips sync` on the new export later)"
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


def _materialize(root: str, bucket: str, entry: dict, tmp: str) -> str:
    """A local directory holding this shard's raw file (downloaded / decompressed if needed)."""
    raw = entry["raw_data"]["basename"]
    if not storage.is_remote(root) and not entry.get("zip_data"):
        return os.path.join(root, *bucket.split("/"))
    dest = os.path.join(tmp, *bucket.split("/"))
    path = os.path.join(dest, *raw.split("/"))
    os.makedirs(os.path.dirname(path), exist_ok=True)
    local_raw = storage.join(root, *bucket.split("/"), *raw.split("/"))
    if entry.get("zip_data"):
        zbase = entry["zip_data"]["basename"]
        data = decompress(
            entry["compression"],
            storage.read_bytes(storage.join(root, *bucket.split("/"), *zbase.split("/"))),
        )
    else:
        data = storage.read_bytes(local_raw)
    with open(path, "wb") as f:
        f.write(data)
    return dest


def _readers(root: str, bucket: str, tmp: str):
    """(entry, MDS reader) for every shard of a bucket, in index order.

    The index is checked (again: it may have changed since the plan) before any
    reader exists: the exporter's columns only, so no encoding can run code.
    """
    for entry in layout.read_index_entries(root, bucket, export_columns=True):
        yield entry, reader_from_json(_materialize(root, bucket, entry, tmp), None, entry)


def _check_empty_destination(out: str) -> None:
    """Refuse any ``out`` with something in it: a rewrite never deletes, and a report or
    index left there would make a rewrite killed part-way look like a complete export."""
    import pyarrow.fs as pafs

    fs, p = storage.filesystem(out)
    kind = fs.get_file_info(p).type
    if kind == pafs.FileType.NotFound:
        return
    if kind != pafs.FileType.Directory:
        raise FileExistsError(f"{out} is a file; choose an empty destination directory")
    found = fs.get_file_info(pafs.FileSelector(p, recursive=False, allow_not_found=True))
    if found:
        names = sorted(posixpath.basename(i.path.rstrip("/")) for i in found)
        what = "an export" if REPORT_NAME in names else ", ".join(names[:5])
        raise FileExistsError(f"{out} is not empty (it holds {what}); choose an empty destination")


def rewrite_export(
    root: str,
    out: str,
    *,
    names: Sequence[str] | None = None,
    threshold: float = DEFAULT_THRESHOLD,
    force: bool = False,
    verify: bool = True,
    drop_lists: Sequence[str] = (),
) -> RewriteResult:
    """Write ``out``: the export at ``root`` without the samples of the lists it applies.

    Parts, columns, compression, hashes and size limits are kept; shards and
    ``ids.parquet`` manifests are rebuilt. Refused unless the skipped share
    (union of ``names``, all lists by default) is at least ``threshold`` or
    ``force``. Every other list (of the export and of the table's registry) is
    carried to ``out`` by row id; a list whose ids cannot be recovered makes it
    refuse, naming the list, unless it is in ``drop_lists``. With ``verify``,
    every sample of the new export is compared to the filtered view of the old one.
    """
    from streaming import MDSWriter

    _check_empty_destination(out)
    t0 = time.monotonic()
    buckets = layout.list_buckets(root)
    # Every list as ids, before anything is written: one that cannot be recovered refuses.
    carried = idlists.collect(root, drop=drop_lists)
    source_table = idlists.table_of(root)
    try:
        reg = idlists.registry_for(root)
    except idlists.ListError:
        reg = None  # the table is not found from here: carry the export's own lists
    registered = reg.effective() if reg is not None else {}
    known = set(carried) | set(registered)
    total = skipped = 0
    plan = []
    samples: dict[str, int] = {}
    applied: set[str] = set()
    for bucket in buckets:
        shards = layout.read_index(root, bucket, export_columns=True)  # before anything is written
        listing = skiplist.list_sidecars(root, bucket, shards)
        known |= set(listing)
        applied |= set(listing) if names is None else set(names) & set(listing)
        skips = skiplist.load_skips(root, bucket, shards, names, listing=listing)
        plan.append((bucket, skips))
        samples[bucket] = sum(s.samples for s in shards)
    applied |= known if names is None else set(names) & known
    # An applied list leaves with all its ids, also those its sidecars do not hold yet.
    extra = idlists.bind(
        root,
        {
            n: idlists.merge_store(carried.get(n), registered.get(n))["id"].combine_chunks()
            for n in sorted(applied)
        },
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
    remote_out = storage.is_remote(out)
    work = tempfile.mkdtemp(prefix="prx-rewrite-")
    stage = os.path.join(work, "out") if remote_out else out
    written = 0
    per_bucket: dict[str, int] = {}
    dropped: list[str] = []
    quiet = _QuietStreaming()
    try:
        bar = tqdm(total=total - skipped, desc="rewrite", unit="sample")
        for bucket, skips in plan:
            bucket_out = os.path.join(stage, *bucket.split("/"))
            parts: dict[str, list] = {}
            for entry, reader in _readers(root, bucket, os.path.join(work, "in")):
                part = posixpath.dirname(entry["raw_data"]["basename"])
                if not part:
                    raise ValueError(
                        f"{root}/{bucket}: shard {entry['raw_data']['basename']!r} is not inside a "
                        "part directory; not an export written by prx_data.write_mds"
                    )
                parts.setdefault(part, []).append((entry, reader))
            kept_parts = []
            for part, items in parts.items():
                kept = sum(
                    reader.samples - len(skips.get(entry["raw_data"]["basename"], ()))
                    for entry, reader in items
                )
                if not kept:  # no empty part: its shard-less index would only add noise
                    continue
                kept_parts.append(part)
                first = items[0][0]
                columns = dict(zip(first["column_names"], first["column_encodings"], strict=True))
                pdir = os.path.join(bucket_out, *part.split("/"))
                ids: list[str] = []
                with MDSWriter(
                    out=pdir,
                    columns=columns,
                    compression=first.get("compression"),
                    hashes=list((first["raw_data"].get("hashes") or {}).keys()) or None,
                    size_limit=first.get("size_limit") or (1 << 26),
                ) as w:
                    for entry, reader in items:
                        skip = skips.get(entry["raw_data"]["basename"])
                        dead = set() if skip is None else set(skip.tolist())
                        keep = [i for i in range(reader.samples) if i not in dead]
                        for i in keep:
                            sample = reader.get_item(i)
                            w.write(sample)
                            ids.append(sample.get("id", ""))
                            written += 1
                            bar.update()
                layout.write_manifest(bucket_out, part, ids)
                per_bucket[bucket] = per_bucket.get(bucket, 0) + len(ids)
            if kept_parts:
                layout.merge_bucket(bucket_out, sorted(kept_parts))
            else:
                # Streaming refuses an index with no shards: every sample was skipped, so the
                # bucket is left out and the report says so.
                dropped.append(bucket)
        bar.close()
        if verify:
            _verify(root, stage, plan, os.path.join(work, "in"), SkipMDSReader, set(dropped))
        idindex.write_id_index(stage)  # before the lists, which bind their ids through it
        # The lists not applied, re-bound by row id to the new shards.
        lists_carried = idlists.sync_lists(stage, reg, carried=carried, skip=applied)
        if remote_out:
            for rel in storage.list_files(stage):
                if rel == os.path.join(layout.LISTS_DIR, layout.LISTS_LOCK_NAME):
                    continue  # the local lock file; object storage uses a lease
                with open(os.path.join(stage, rel), "rb") as f:
                    storage.write_bytes_atomic(storage.join(out, *rel.split(os.sep)), f.read())
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


def _verify(root: str, new_root: str, plan, tmp: str, skip_reader, dropped=frozenset()) -> None:
    """Every sample of the new export equals the next kept sample of the old one, in order.

    A dropped bucket must have had nothing to keep.
    """
    for bucket, skips in plan:

        def old_samples(bucket=bucket, skips=skips):
            for entry, reader in _readers(root, bucket, tmp):
                skip = skips.get(entry["raw_data"]["basename"])
                view = reader if skip is None else skip_reader.wrap(reader, skip)
                for i in range(view.samples):
                    yield view.get_item(i)

        def new_samples(bucket=bucket):
            if bucket in dropped:
                return
            for _entry, reader in _readers(new_root, bucket, tmp):
                for i in range(reader.samples):
                    yield reader.get_item(i)

        sentinel = object()
        olds, news = old_samples(), new_samples()
        n = 0
        while True:
            a, b = next(olds, sentinel), next(news, sentinel)
            if a is sentinel and b is sentinel:
                break
            if a is sentinel or b is sentinel or a != b:
                raise AssertionError(
                    f"{new_root}/{bucket}: sample {n} differs from the filtered source"
                )
            n += 1


# --- CLI ---------------------------------------------------------------------------------------
