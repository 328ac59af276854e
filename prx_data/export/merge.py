"""The steps of the export's end: :func:`merge` (the units' parts, or packs, into each
bucket's ``index.json``; the dropped rows into ``dropped.parquet``) and
:func:`write_report` (``report.txt``, then ``report.json``).

:meth:`prx_data.pipelines.write_mds.ExportSink.on_write_complete` calls them in
order, with the id index and the skip lists between, and checks the run's lease
between steps; each step checks it again right before each of its writes (a
:class:`~prx_data.core.lease.Lease`, never a callback). A bucket's merged index is
written atomically only after every unit is done, and ``report.json`` last of all,
so an export never looks complete before it is. :func:`finalize` runs the same
steps for a tree with no skip lists (sample exports, tests, benchmarks).
"""

from __future__ import annotations

import functools
import io
import json
import os
import posixpath
from collections import Counter
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field

from prx_data.core import storage
from prx_data.core.lease import Lease
from prx_data.core.reports import FailureCounts
from prx_data.core.schema import REPORT_NAME
from prx_data.export.bounded import imap_bounded, io_workers
from prx_data.export.durable import DROPPED_SCHEMA, fsync
from prx_data.export.layout import list_markers
from prx_data.export.naming import (
    DROPPED_DIR,
    DROPPED_NAME,
    FILE_KEYS,
    INDEX_NAME,
    WRITING_DIR,
    ExportError,
)
from prx_data.export.safety import load_index, remove_tree
from prx_data.export.spec import (
    UNLISTED_REASONS,
    ExportConfig,
    UnitResult,
    caption_warnings,
    is_failure,
    published_parts,
    warn,
)


def in_bucket(entries: list[dict], part: str) -> list[dict]:
    """A part's index entries as the bucket's index names them: each file's basename under
    the part's folder (``<part>/shard.NNNNN.mds``). Changes ``entries`` in place."""
    for shard in entries:
        for key in FILE_KEYS:
            if shard.get(key):
                shard[key]["basename"] = posixpath.join(part, shard[key]["basename"])
    return entries


def merge_bucket(
    bucket_dir: str,
    parts: list[str],
    expected: Mapping[str, int] | None = None,
    lease: Lease | None = None,
) -> int:
    """Write the bucket's index.json from its parts' indexes, atomically.

    ``expected`` ({part: samples}, from the work units' results) is checked
    before anything is written: a part whose index disagrees (another run
    rewrote it) fails the merge and leaves no index behind. ``lease`` (the
    export's) is checked right before the write: reading the parts can take long.
    """
    shards = []
    ordered = sorted(parts)
    paths = [storage.join(bucket_dir, part, INDEX_NAME) for part in ordered]
    read = functools.partial(load_index, in_part=True)
    # Reads run in parallel (bounded); entries are joined in part order, so the bytes are the same.
    for part, path, entries in zip(
        ordered, paths, imap_bounded(read, paths, io_workers(bucket_dir)), strict=True
    ):
        if expected is not None:
            n = sum(int(s["samples"]) for s in entries)
            if n != expected.get(part):
                raise ExportError(
                    f"{path}: the part's index holds {n} samples but its work unit wrote "
                    f"{expected.get(part)}; another run changed this export. Start again with "
                    "--overwrite."
                )
        shards += in_bucket(entries, part)
    body = json.dumps({"version": 2, "shards": shards}, sort_keys=True)
    _check(lease)
    storage.write_bytes_atomic(storage.join(bucket_dir, "index.json"), body.encode())
    return sum(s["samples"] for s in shards)


@dataclass
class ExportReport(FailureCounts):
    table: str
    out: str
    table_version: int | None
    rows_read: int
    samples_written: int
    buckets: dict[str, int]
    tiers: dict[str, int]
    dropped: dict[str, int]
    notes: dict[str, int]
    units: int
    seconds: float
    #: Problems worth a look that did not stop the export (e.g. no captions at all).
    warnings: list[str] = field(default_factory=list)
    #: Skip lists applied from the table's ledger: {list: {ids, samples, shards}}.
    lists: dict[str, dict] = field(default_factory=dict)
    #: What the last ``--append`` added (rows by kind, versions); empty for a plain export.
    append: dict = field(default_factory=dict)

    counted = "rows"
    job_label = "write_mds"

    @property
    def failed(self) -> int:
        """Rows dropped for a broken, empty or undecodable image (not by ``--filter`` or size)."""
        return sum(n for reason, n in self.dropped.items() if is_failure(reason))

    @property
    def total(self) -> int:
        return self.rows_read

    @property
    def report_path(self) -> str:
        return f"{self.out.rstrip('/')}/{REPORT_NAME}"

    def failure_details(self, report_json: str | None = None) -> str:
        return f"the dropped counts by reason in {self.report_path}"

    def to_dict(self) -> dict:
        return asdict(self)

    def text(self) -> str:
        return self.table_text()

    def table_text(self) -> str:
        lines = [
            f"export of {self.table} (version {self.table_version}) -> {self.out}",
            f"rows read        {self.rows_read:>10,}",
            f"samples written  {self.samples_written:>10,}",
            f"dropped/failed   {sum(self.dropped.values()):>10,}",
            "",
            f"{'bucket':<14}{'samples':>10}{'share':>9}",
        ]
        total = max(self.samples_written, 1)
        for tier in sorted(self.tiers, key=int):
            for name in sorted(b for b in self.buckets if b.split("/")[0] == tier):
                n = self.buckets[name]
                lines.append(f"{name:<14}{n:>10,}{n / total:>9.1%}")
            lines.append(
                f"{'  tier ' + tier:<14}{self.tiers[tier]:>10,}{self.tiers[tier] / total:>9.1%}"
            )
        if self.dropped:
            lines += ["", f"{'dropped: reason':<24}{'rows':>10}"]
            for reason, n in sorted(self.dropped.items(), key=lambda kv: -kv[1]):
                lines.append(f"  {reason:<22}{n:>10,}")
        if self.notes:
            lines += ["", f"{'kept, with notes':<24}{'rows':>10}"]
            for reason, n in sorted(self.notes.items(), key=lambda kv: -kv[1]):
                lines.append(f"  {reason:<22}{n:>10,}")
        if self.warnings:
            lines += ["", "warnings:"] + [f"  {w}" for w in self.warnings]
        if self.lists:
            lines += ["", "skip lists applied (bound by row id):"]
            for n, v in self.lists.items():
                share = v.get("share", 0.0)
                lines.append(
                    f"  {n}: {v['ids']:,} ids, {v['samples']:,} samples skipped in "
                    f"{v['shards']} shards ({100 * share:.1f}%; from {v.get('source') or '?'})"
                    + (
                        "  WARNING: above 10% (undo a trial with --drop-list " + n + ")"
                        if share > 0.10
                        else ""
                    )
                )
        if self.append:
            a = self.append
            c = a.get("counts", {})
            lines += [
                "",
                f"last append: table version {a.get('base_version')} -> {a.get('version')} "
                f"({a.get('units', 0)} units, {a.get('seconds', 0.0):.1f} s)",
                "  "
                + ", ".join(
                    f"{k} {c.get(k, 0):,}"
                    for k in ("new", "changed", "re_added", "deleted", "filtered", "no_digest")
                ),
            ]
        rate = self.rows_read / self.seconds if self.seconds else 0.0
        lines += ["", f"{self.units} work units in {self.seconds:.1f} s ({rate:,.1f} rows/s)"]
        return "\n".join(lines)


def done_parts(out: str) -> dict[str, UnitResult]:
    """Results of the work units that finished (their markers), by part name."""
    results = {}
    # 10^5 markers on object storage: read in parallel (bounded), kept in listing order.
    for text in imap_bounded(storage.read_bytes, list_markers(out), io_workers(out)):
        r = UnitResult.from_json(text.decode())
        results[r.part] = r
    return results


def _check(lease: Lease | None) -> None:
    """Raise if the run lost its lease (see :meth:`prx_data.core.lease.Lease.check`)."""
    if lease is not None:
        lease.check()


@dataclass(frozen=True)
class Merged:
    """What :func:`merge` wrote: samples by bucket, and the parts ``dropped.parquet`` lacks."""

    buckets: dict[str, int]
    #: Parts whose dropped rows are missing (units finished by an older version).
    unlisted: tuple[str, ...] = ()


def merge(
    cfg: ExportConfig,
    results: Mapping[str, UnitResult],
    packs: Mapping[str, Mapping[str, int]] | None = None,
    lease: Lease | None = None,
) -> Merged:
    """Merge every bucket (checked against the units' counts), then the dropped rows.

    ``packs`` ({bucket: {pack: samples}}, from :mod:`prx_data.export.pack`)
    names the part directories the buckets hold once packed, in place of the
    units' parts. Each merged index is durable (fsync, locally) before the
    report can name it; the units' staging folder goes once every bucket is merged.
    """
    per_part: dict[str, dict[str, int]] = {}
    counts: Counter = Counter()
    for name, parts in published_parts(results).items():
        per_part[name] = {part: r.buckets[name] for part, r in parts.items()}
        counts[name] += sum(per_part[name].values())
    if packs is not None:
        per_part = {name: dict(packed) for name, packed in packs.items()}
    for name, parts in sorted(per_part.items()):
        merged = merge_bucket(storage.join(cfg.out, name), list(parts), expected=parts, lease=lease)
        if merged != counts[name]:
            raise ExportError(
                f"bucket {name}: merged index has {merged} samples, expected {counts[name]}"
            )
        if not storage.is_remote(cfg.out):  # the index is durable before the report names it
            fsync(storage.join(cfg.out, name))
    if not storage.is_remote(cfg.out):
        remove_tree(os.path.join(cfg.out, *WRITING_DIR.split("/")))
    unlisted = merge_dropped(cfg, results, lease)
    return Merged(dict(sorted(counts.items())), tuple(unlisted))


def merge_dropped(
    cfg: ExportConfig, results: Mapping[str, UnitResult], lease: Lease | None = None
) -> list[str]:
    """``dropped.parquet``: the units' dropped rows in part order (only units that dropped any).

    Returns the parts whose list is missing (units finished by an older version).
    """
    import pyarrow.parquet as pq

    buf = io.BytesIO()
    missing = []
    parts = [
        p for p in sorted(results) if any(k not in UNLISTED_REASONS for k in results[p].dropped)
    ]

    def read(part: str) -> tuple[str, bytes | None]:
        path = storage.join(cfg.out, *DROPPED_DIR.split("/"), f"{part}.parquet")
        try:
            return path, storage.read_bytes(path)
        except FileNotFoundError:
            return path, None

    with pq.ParquetWriter(buf, DROPPED_SCHEMA, compression="zstd") as writer:
        # Reads in parallel (bounded), written in part order: the same bytes as one by one.
        for part, (path, data) in zip(
            parts, imap_bounded(read, parts, io_workers(cfg.out)), strict=True
        ):
            r = results[part]
            if data is None:
                missing.append(part)
                continue
            table = pq.read_table(io.BytesIO(data))
            expected = sum(v for k, v in r.dropped.items() if k not in UNLISTED_REASONS)
            if table.num_rows != expected:
                raise ExportError(
                    f"{path}: {table.num_rows} rows, its work unit dropped {expected}"
                )
            writer.write_table(table.cast(DROPPED_SCHEMA))
    _check(lease)
    storage.write_bytes_atomic(storage.join(cfg.out, DROPPED_NAME), buf.getvalue())
    return missing


def write_report(
    cfg: ExportConfig,
    results: Mapping[str, UnitResult],
    merged: Merged,
    seconds: float,
    lists: Mapping[str, dict] | None = None,
    lease: Lease | None = None,
    append: Mapping | None = None,
) -> ExportReport:
    """The last step: ``report.txt``, then ``report.json`` (the export is complete).

    ``lists`` is what the skip lists' materialisation returned (the report's
    ``lists``). Warnings worth a look (no captions, blank caption columns,
    dropped rows an older version did not list) are issued and kept in the report.
    """
    dropped: Counter = Counter()
    notes: Counter = Counter()
    rows = written = 0
    for r in results.values():
        rows += r.rows
        written += r.written
        dropped.update(r.dropped)
        notes.update(r.notes)
    tiers: Counter = Counter()
    for name, n in merged.buckets.items():
        tiers[name.split("/")[0]] += n
    found = caption_warnings(cfg.table, cfg.caption_columns)
    if merged.unlisted:
        found.append(
            f"{DROPPED_NAME} lacks the dropped rows of {len(merged.unlisted)} unit(s) finished "
            f"by an older version (e.g. {merged.unlisted[0]}); they are counted in the report"
        )
    for c in cfg.caption_columns or ():
        blank = notes.get(f"{c}_missing", 0) + notes.get(f"{c}_empty", 0)
        if written and blank >= written:
            found.append(f"caption column {c!r} is null or empty in every exported sample")
    warn(found)
    report = ExportReport(
        table=cfg.table,
        out=cfg.out,
        table_version=cfg.table_version,
        rows_read=rows,
        samples_written=written,
        buckets=dict(merged.buckets),
        tiers=dict(sorted(tiers.items(), key=lambda kv: int(kv[0]))),
        dropped=dict(sorted(dropped.items())),
        notes=dict(sorted(notes.items())),
        units=len(results),
        seconds=round(seconds, 3),
        warnings=found,
        lists=dict(lists or {}),
        append=dict(append or {}),
    )
    _check(lease)
    storage.write_bytes_atomic(storage.join(cfg.out, "report.txt"), report.table_text().encode())
    _check(lease)
    storage.write_bytes_atomic(
        storage.join(cfg.out, REPORT_NAME), json.dumps(report.to_dict(), indent=2).encode()
    )
    return report


def finalize(
    cfg: ExportConfig,
    results: Mapping[str, UnitResult],
    seconds: float,
    packs: Mapping[str, Mapping[str, int]] | None = None,
    lease: Lease | None = None,
) -> ExportReport:
    """The export's end for a tree without skip lists: merge, id index, report.

    For sample exports, tests and benchmarks. The exporter's own end is
    :meth:`prx_data.pipelines.write_mds.ExportSink.on_write_complete`, which
    runs the same steps with the pack stage before and the skip lists between.
    """
    from prx_data.export.idindex import write_id_index

    merged = merge(cfg, results, packs, lease)
    write_id_index(cfg.out, sorted(merged.buckets), check=lease.check if lease else lambda: None)
    return write_report(cfg, results, merged, seconds, lease=lease)
