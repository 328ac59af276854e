"""``skips rewrite``: a new export without the skipped samples and without lists.

Skip lists cost nothing at load time; once a large share of an export is skipped, shards
carry dead bytes, and ``python -m prx_data.skips rewrite out/ out-clean/`` writes only the
kept samples, checked sample by sample. This module plans and reports; the copying is the
re-shard stage of :mod:`prx_data.skips.repack` (one pack per source part, encoded samples
copied, on driver threads or Ray); which samples leave and how the other lists follow is
:mod:`prx_data.skips.applied`; ``--fold-columns`` is :mod:`prx_data.skips.fold`.

A rewrite carries every list it does not apply to the new export, bound by row id to the
new shards (:mod:`prx_data.skips.ops`), with every list of the table's registry; the lists
it applies are left out, with every one of their ids (registry ids not in sidecars too).
"""

from __future__ import annotations

import json
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field

from prx_data.core import storage
from prx_data.core.errors import PrxDataError, UsageError
from prx_data.core.runtime import place
from prx_data.core.schema import REPORT_NAME
from prx_data.export import layout
from prx_data.export.naming import PROGRESS_DIR
from prx_data.skips import repack
from prx_data.skips.applied import carry_lists, resolve_applied
from prx_data.skips.fold import folded_record, plan_fold
from prx_data.skips.ops import lists_text
from prx_data.skips.repack import RewritePack, RewriteVerifyError  # noqa: F401 (re-exported)
from prx_data.skips.sidecar import read_ids_file, read_indices_file  # noqa: F401 (re-exported)
from prx_data.skips.staging import (  # noqa: F401 (the CLI's and tests' names)
    DEFAULT_MAX_LOCAL_BYTES,
    DISK_ENV,
    META_BYTES,
    RewriteDiskError,
    Staging,
    check_room,
    max_local_bytes,
    parse_bytes,
)
from prx_data.skips.which import table_of

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
    buckets: int  # in the new export
    verified: bool
    source: str = ""
    lists: list[str] = field(default_factory=list)  # skip lists applied (left out)
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
    #: [source parts that keep a sample, parts written]: fewer with ``compact``.
    parts: list[int] = field(default_factory=list)
    #: {column: MDS encoding} folded into the shards (``--fold-columns``): verify accepts them.
    folded_columns: dict[str, str] = field(default_factory=dict)

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
        ]
        if self.parts and self.parts[0] != self.parts[1]:
            lines.append(f"parts packed     {self.parts[0]:>10,} -> {self.parts[1]:,}")
        lines += ["", f"{'bucket':<14}{'samples':>10}"]
        lines += [f"{b:<14}{n:>10,}" for b, n in self.bucket_samples.items()]
        for b in self.buckets_dropped:
            lines.append(f"{b:<14}{'dropped':>10}  (every sample was skipped)")
        if self.warnings:
            lines += ["", f"streaming warnings ({sum(self.warnings.values())}):"]
            lines += [f"  {n} x {m}" for m, n in self.warnings.items()]
        if self.lists_carried:
            lines += ["", "skip lists carried (by row id):"]
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


def plan_packs(
    root: str, out: str, skips_of: dict[str, dict], verify: bool, shard_size: int | None = None
):
    """The :class:`RewritePack` s of the kept samples, in bucket and part order.

    One per source part that keeps a sample; with ``shard_size`` (``--compact``),
    a bucket's consecutive parts of one format are packed up to that many kept
    bytes (small appended parts become shards of the recommended size).
    Returns (packs, samples in, samples skipped, shard bytes of the packs). A
    pack's ``stage`` is the local disk it holds: a source shard to check when
    the source is remote or compressed, and for a remote ``out`` one output
    shard (at most its sources and the size limit; twice when compressed, as it
    is checked decompressed) plus its index and manifest.
    """
    remote_in, remote_out = storage.is_remote(root), storage.is_remote(out)
    packs, total, skipped, nbytes = [], 0, 0, 0

    def pack(bucket: str, group: list) -> RewritePack:
        items = [(part, *item) for part, its in group for item in its]
        raw = [int(e["raw_data"]["bytes"]) for _, _, e, _ in items]
        first, n = items[0][2], sum(int(e["samples"]) for _, _, e, _ in items)
        zipped = bool(first.get("zip_data"))
        stage = max(raw) if verify and (remote_in or zipped) else 0
        one = min(sum(raw), int(first.get("size_limit") or sum(raw)))
        if remote_out:
            stage += (2 if zipped else 1) * one
            stage += META_BYTES[0] + META_BYTES[1] * len(items) + META_BYTES[2] * n
        elif zipped and verify:
            stage += one
        skips = tuple(tuple(int(i) for i in s) for *_, s in items)
        return RewritePack(
            bucket,
            repack.pack_part([part for part, _ in group], bool(shard_size)),
            tuple((part, base, int(e["samples"])) for part, base, e, _ in items),
            skips,
            n - sum(len(s) for s in skips),
            stage,
        )

    columns = layout.export_columns(root)
    for bucket, skips in skips_of.items():
        parts: dict[str, list] = {}
        for e in layout.read_index_entries(root, bucket, export_columns=columns):
            part, _, base = e["raw_data"]["basename"].rpartition("/")
            if not part or "/" in part:
                raise UsageError(
                    f"{root}/{bucket}: shard {e['raw_data']['basename']!r} is not inside a part "
                    "directory; not an export written by prx_data.write_mds"
                )
            skip = skips.get(e["raw_data"]["basename"])
            parts.setdefault(part, []).append((base, e, () if skip is None else skip.tolist()))
        group: list = []
        size = 0
        for part, items in parts.items():
            n = sum(int(e["samples"]) for _, e, _ in items)
            dead = sum(len(s) for _, _, s in items)
            total, skipped = total + n, skipped + dead
            if n == dead:  # no empty part: its shard-less index would only add noise
                continue
            part_bytes = sum(int(e["raw_data"]["bytes"]) for _, e, _ in items)
            nbytes += part_bytes
            kept = part_bytes * (n - dead) // n
            fmt = repack.shard_format(items[0][1])
            if (
                group
                and shard_size
                and size + kept <= shard_size
                and fmt == repack.shard_format(group[0][1][0][1])
            ):
                group.append((part, items))
                size += kept
                continue
            packs += [pack(bucket, group)] if group else []
            group, size = [(part, items)], kept
        if group:
            packs.append(pack(bucket, group))
    return packs, total, skipped, nbytes


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
    compact: int | str | None = None,
    fold_columns: bool = False,
) -> RewriteResult:
    """Write ``out``: the export at ``root`` without the samples of the lists it applies.

    Parts, columns, compression, hashes and size limits are kept; shards and ``ids.parquet``
    manifests are rebuilt. Refused unless the skipped share (union of ``names``, all lists by
    default) is at least ``threshold`` or ``force``. Every other list (of the export and of the
    table's registry) is carried to ``out`` by row id; a list whose ids cannot be recovered
    makes it refuse, naming it, unless it is in ``drop_lists``. With ``verify``, every sample
    of the new export is compared to the filtered view of the old one.

    One pack per source part (:mod:`prx_data.skips.repack`) runs where ``engine`` places it
    (:func:`prx_data.core.runtime.place`: driver threads up to :data:`DRIVER_BYTES`, else
    Ray); at most ``max_local`` bytes (:func:`max_local_bytes`) are staged in ``work_dir`` at
    once. Anything in ``out`` before ``report.json`` (written last) is an unfinished rewrite,
    which ``resume`` finishes (same source, lists and options).

    ``compact`` (bytes, or ``64M``; ``--compact``) packs consecutive parts of a
    bucket together up to that size (:func:`plan_packs`), whatever is skipped:
    the threshold does not apply. Nor with ``fold_columns`` (``--fold-columns``), which writes
    the export's latents and attached columns into each kept sample (:mod:`prx_data.skips.fold`).
    """
    if not resume:
        repack.check_destination(out)
    t0 = time.monotonic()
    buckets = layout.list_buckets(root)
    source_table = table_of(root)
    # Every list as ids, before anything is written: one that cannot be recovered refuses.
    applied = resolve_applied(root, buckets, names, table, ledger, drop_lists)
    reg = applied.reg
    limit = max_local_bytes(max_local)
    size = None if compact is None else parse_bytes(str(compact), "--compact")
    packs, total, skipped, nbytes = plan_packs(root, out, applied.skips_of, verify, size)
    fold = plan_fold(root, buckets) if fold_columns else None
    share = skipped / total if total else 0.0
    if share < threshold and not force and size is None and fold is None:
        raise RewriteRefused(
            f"only {share:.1%} of {total} samples are skipped (threshold {threshold:.0%}); skip lists "
            "cost nothing at load time. Pass --force to rewrite anyway."
        )
    check_room(root, packs, limit)
    repack.record_plan(root, out, packs, resume, fold)
    placement = place(
        engine, size=nbytes, small=DRIVER_BYTES, ray_address=ray_address, num_cpus=num_cpus
    )
    job = repack.RewriteJob(root, out, verify, limit, work_dir, fold, layout.export_columns(root))
    per_bucket, warnings = repack.write_packs(job, packs, placement, progress)
    dropped = [b for b in buckets if b not in per_bucket]  # every sample skipped
    # The lists, re-bound by row id to the new shards (after every bucket).
    lists_carried = carry_lists(root, out, applied, drop_lists)
    counts = {b: sum(v.values()) for b, v in sorted(per_bucket.items())}
    result = RewriteResult(
        out,
        total,
        sum(counts.values()),
        skipped,
        len(counts),
        verify,
        source=root,
        lists=sorted(applied.names),
        parts=[len({(p.bucket, s[0]) for p in packs for s in p.shards}), len(packs)],
        bucket_samples=counts,
        buckets_dropped=dropped,
        warnings=dict(sorted(warnings.items(), key=lambda kv: -kv[1])),
        seconds=round(time.monotonic() - t0, 3),
        lists_carried=lists_carried,
        lists_dropped=sorted(set(drop_lists)),
        table=source_table,
        registry=reg.uri if reg is not None else None,
        folded_columns=folded_record(root, fold),
    )
    storage.write_bytes_atomic(storage.join(out, "report.txt"), result.text().encode())
    storage.write_bytes_atomic(
        storage.join(out, REPORT_NAME), json.dumps(result.to_dict(), indent=2).encode()
    )
    storage.delete(storage.join(out, PROGRESS_DIR))  # the plan and pack markers: done with
    return result
