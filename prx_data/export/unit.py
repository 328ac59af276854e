"""Lance table -> bucketed Mosaic Data Shards: the work unit, the merge and the report.

The job is split into *work units* (a row range of one Lance fragment). Each
unit decodes its rows, buckets them, writes one MDS part per bucket it
touches (``<out>/<tier>/<ar>/<part>/``) plus an ``ids.parquet`` manifest,
and finally a ``_progress/<part>.done`` marker carrying its counts. Units are
deterministic, so a rerun reproduces the same bytes, and a killed run is
finished with ``resume=True``: finished units are kept, half-written parts
are deleted and redone. A bucket's merged ``index.json`` is written
atomically only after every unit is done, and ``report.json`` last of all,
so an export never looks complete before it is.

The Ray Data graph that schedules the units lives in ``pipelines.write_mds``.
"""

from __future__ import annotations

import json
import time
from collections import Counter
from dataclasses import asdict, dataclass, field

import pyarrow as pa

from prx_data.core import storage
from prx_data.core.buckets import DEFAULT_TIERS, BucketSpec, assign_bucket
from prx_data.core.imaging import DEFAULT_JPEG_QUALITY, ImageError, prepare_with
from prx_data.core.quality import COLUMN as QUALITY_COLUMN
from prx_data.core.quality import is_low_information
from prx_data.core.schema import MDS_COLUMNS, REPORT_NAME
from prx_data.export.layout import (
    CONFIG_NAME,
    PROGRESS_DIR,
    ExportError,
    list_markers,
    list_top,
    looks_like_export,
    marker_path,
    merge_bucket,
    part_name,
    write_manifest,
)


@dataclass(frozen=True)
class ExportConfig:
    table: str
    out: str
    tiers: tuple[int, ...] = DEFAULT_TIERS
    #: Caption columns to carry; None = every ``caption*`` string column except ``*_status``.
    caption_columns: tuple[str, ...] | None = None
    image_format: str = "jpeg"
    quality: int = DEFAULT_JPEG_QUALITY
    #: JPEG chroma subsampling: -1 = Pillow default (4:2:0), 0 = 4:4:4, 2 = 4:2:0.
    subsampling: int = -1
    use_draft: bool = True
    #: Resize/encode path: "pillow" (draft + Lanczos) or "vips" (libvips thumbnail).
    codec: str = "pillow"
    #: Resampling filter of the pillow codec (``core.imaging.RESAMPLE``): lanczos, or a
    #: faster, softer one (bicubic, hamming, bilinear, box); see docs/ARCHITECTURE.md.
    resample: str = "lanczos"
    compression: str | None = None
    hashes: tuple[str, ...] = ()
    size_limit: int = 1 << 26
    rows_per_task: int = 1000
    #: Plan at least this many work units, so that a small table still keeps every core
    #: busy (None: ``rows_per_task`` alone). ``pipelines.write_mds`` sets it from the
    #: cluster's CPUs when the export starts, and the pinned config keeps it for resumes.
    min_units: int | None = None
    #: Optional Lance SQL filter applied before bucketing (e.g. ``label = 'visual'``).
    filter: str | None = None
    max_caption_chars: int = 20000
    #: Pinned table version (set by :func:`prepare_output`), so a resume reads the same rows.
    table_version: int | None = None

    def fingerprint(self) -> dict:
        """Everything that determines the output bytes (for resume checks)."""
        d = asdict(self)
        d.pop("out")
        return d


@dataclass(frozen=True)
class WorkUnit:
    fragment_id: int
    start: int
    count: int

    @property
    def part(self) -> str:
        return part_name(self.fragment_id, self.start)


@dataclass
class UnitResult:
    part: str
    rows: int = 0
    written: int = 0
    buckets: dict[str, int] = field(default_factory=dict)
    dropped: dict[str, int] = field(default_factory=dict)
    notes: dict[str, int] = field(default_factory=dict)
    seconds: float = 0.0

    def to_json(self) -> str:
        return json.dumps(asdict(self), sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> UnitResult:
        return cls(**json.loads(text))


@dataclass
class ExportReport:
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

    def to_dict(self) -> dict:
        return asdict(self)

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
        rate = self.rows_read / self.seconds if self.seconds else 0.0
        lines += ["", f"{self.units} work units in {self.seconds:.1f} s ({rate:,.1f} rows/s)"]
        return "\n".join(lines)


# --- planning ----------------------------------------------------------------


def open_table(uri: str, version: int | None = None):
    import lance

    try:
        return lance.dataset(uri, version=version)
    except (ValueError, OSError) as e:
        raise ExportError(
            f"cannot open Lance table {uri!r}: {e}. Create one with `python -m prx_data.ingest DIR --table {uri}`."
        ) from None


def resolve_caption_columns(schema: pa.Schema, wanted: tuple[str, ...] | None) -> tuple[str, ...]:
    names = set(schema.names)
    if wanted is None:
        return tuple(
            n
            for n in schema.names
            if n.startswith("caption")
            and not n.endswith("_status")
            and pa.types.is_string(schema.field(n).type)
            | pa.types.is_large_string(schema.field(n).type)
        )
    missing = [c for c in wanted if c not in names]
    if missing:
        raise ExportError(f"caption column(s) {missing} not in the table; it has {sorted(names)}")
    return wanted


def plan_units(cfg: ExportConfig) -> list[WorkUnit]:
    """Cut every fragment into equal row ranges, from fragment metadata alone.

    A unit holds at most ``rows_per_task`` rows and at most ``ceil(rows /
    min_units)``, so a table of a few hundred rows still makes ``min_units``
    units. Only the manifest is read (``count_rows`` of a fragment is its
    physical rows less its deletions): no data file, no image bytes, so a
    10^8-row table plans in the time it takes to list its fragments. The plan
    depends only on the pinned table version and the settings, so reruns and
    resumes make the same units with the same part names.
    """
    ds = open_table(cfg.table, cfg.table_version)
    sizes = [(frag.fragment_id, frag.count_rows()) for frag in ds.get_fragments()]
    per_unit = max(1, cfg.rows_per_task)
    total = sum(n for _, n in sizes)
    if (cfg.min_units or 0) > 0 and total:
        per_unit = min(per_unit, -(-total // cfg.min_units))
    units = []
    for fragment_id, n in sizes:
        k = -(-n // per_unit)
        for i in range(k):
            start, end = i * n // k, (i + 1) * n // k
            units.append(WorkUnit(fragment_id, start, end - start))
    return units


# --- output location -----------------------------------------------------------


def prepare_output(
    cfg: ExportConfig, *, overwrite: bool = False, resume: bool = False
) -> ExportConfig:
    """Check the output location, pin the table version, record the config.

    Returns the config with ``table_version`` pinned. Never deletes anything
    unless ``overwrite`` is set, and then only a directory that looks like an
    export.
    """
    if overwrite and resume:
        raise ExportError("--overwrite and --resume are mutually exclusive")
    entries = list_top(cfg.out)
    config_path = storage.join(cfg.out, CONFIG_NAME)
    if entries and resume:
        if not storage.exists(config_path):
            raise ExportError(f"{cfg.out} has no interrupted export to resume (no {CONFIG_NAME})")
        previous = _normalise(
            ExportConfig(**{**json.loads(storage.read_bytes(config_path)), "out": cfg.out})
        )
        ds = open_table(cfg.table, previous.table_version)
        caps = resolve_caption_columns(ds.schema, cfg.caption_columns)
        now = _normalise(
            ExportConfig(
                **{
                    **asdict(cfg),
                    "table_version": previous.table_version,
                    "caption_columns": caps,
                    # an automatic unit count (None) stays the one the run started with
                    "min_units": previous.min_units if cfg.min_units is None else cfg.min_units,
                }
            )
        )
        if now.fingerprint() != previous.fingerprint():
            old = previous.fingerprint()
            diff = {k: (old[k], v) for k, v in now.fingerprint().items() if old[k] != v}
            raise ExportError(
                f"cannot resume {cfg.out}: options differ from the interrupted run {diff} "
                "(previous, now). Rerun with the same options, or use --overwrite to start again."
            )
        return now
    if entries:
        complete = REPORT_NAME in entries
        if not overwrite:
            if complete:
                hint = "it holds a complete export; pass --overwrite to replace it"
            elif PROGRESS_DIR in entries:
                hint = "it holds an interrupted export; pass --resume to finish it or --overwrite to start again"
            else:
                hint = "choose an empty directory"
            raise ExportError(f"output {cfg.out} is not empty: {hint}")
        if not looks_like_export(entries, cfg.tiers):
            raise ExportError(
                f"refusing to --overwrite {cfg.out}: it contains entries that are not part of an export "
                f"({[e for e in entries if not looks_like_export([e], cfg.tiers)][:5]})"
            )
        for e in entries:
            storage.delete(storage.join(cfg.out, e))
    ds = open_table(cfg.table, cfg.table_version)
    caps = resolve_caption_columns(ds.schema, cfg.caption_columns)
    pinned = ExportConfig(**{**asdict(cfg), "table_version": ds.version, "caption_columns": caps})
    pinned = _normalise(pinned)
    storage.write_bytes_atomic(config_path, json.dumps(asdict(pinned), sort_keys=True).encode())
    return pinned


def _normalise(cfg: ExportConfig) -> ExportConfig:
    d = asdict(cfg)
    for k in ("tiers", "hashes", "caption_columns"):
        if d[k] is not None:
            d[k] = tuple(d[k])
    return ExportConfig(**d)


def done_parts(out: str) -> dict[str, UnitResult]:
    """Results of the work units that finished (their markers), by part name."""
    results = {}
    for path in list_markers(out):
        r = UnitResult.from_json(storage.read_bytes(path).decode())
        results[r.part] = r
    return results


# --- one work unit -------------------------------------------------------------


def _columns(cfg: ExportConfig) -> dict[str, str]:
    cols = dict(MDS_COLUMNS)
    for c in cfg.caption_columns or ():
        if c in cols:
            raise ExportError(f"caption column {c!r} clashes with a built-in sample column")
        cols[c] = "str"
    return cols


def _clean_caption(value, limit: int, notes: Counter, column: str) -> str:
    if value is None:
        notes[f"{column}_missing"] += 1
        return ""
    if not isinstance(value, str):
        value = str(value)
    if not value.strip():
        notes[f"{column}_empty"] += 1
        return ""
    if len(value) > limit:
        notes[f"{column}_truncated"] += 1
        value = value[:limit]
    return value


def export_unit(cfg: ExportConfig, unit: WorkUnit) -> UnitResult:
    """Process one work unit end to end; idempotent given the same config."""
    from streaming import MDSWriter

    t0 = time.perf_counter()
    spec = BucketSpec(tiers=tuple(cfg.tiers))
    ds = open_table(cfg.table, cfg.table_version)
    frag = ds.get_fragment(unit.fragment_id)
    caption_cols = list(cfg.caption_columns or ())
    wanted = ["id", "image", "width", "height", "probe_error", QUALITY_COLUMN, *caption_cols]
    available = set(ds.schema.names)
    read_cols = [c for c in wanted if c in available]
    result = UnitResult(part=unit.part)
    dropped: Counter = Counter()
    notes: Counter = Counter()
    writers: dict[str, MDSWriter] = {}
    ids: dict[str, list[str]] = {}
    columns = _columns(cfg)

    projection = {c: c for c in read_cols}
    if cfg.filter:
        # Evaluate the filter as a projected column so that the unit's row range stays
        # exactly the fragment rows [start, start + count) whatever the filter keeps.
        projection["_keep"] = f"coalesce(({cfg.filter}), false)"
    batches = frag.to_batches(
        columns=projection, offset=unit.start, limit=unit.count, batch_size=64
    )
    try:
        for batch in batches:
            for row in batch.to_pylist():
                result.rows += 1
                if cfg.filter and not row["_keep"]:
                    dropped["filtered"] += 1
                    continue
                if row.get("probe_error"):
                    dropped[str(row["probe_error"])] += 1
                    continue
                data = row.get("image")
                w, h = row.get("width"), row.get("height")
                if not data:
                    dropped["empty_file"] += 1
                    continue
                if not w or not h:
                    dropped["unknown_size"] += 1
                    continue
                assignment = assign_bucket(int(w), int(h), spec)
                if assignment.bucket is None:
                    dropped[assignment.reason or "unbucketed"] += 1
                    continue
                b = assignment.bucket
                try:
                    prepared = prepare_with(
                        cfg.codec,
                        data,
                        b.width,
                        b.height,
                        src_size=(int(w), int(h)),
                        fmt=cfg.image_format,
                        quality=cfg.quality,
                        use_draft=cfg.use_draft,
                        subsampling=cfg.subsampling,
                        resample=cfg.resample,
                    )
                except ImageError as e:
                    dropped[e.reason] += 1
                    continue
                sample = {
                    "image": prepared.data,
                    "id": str(row["id"]),
                    "width": int(w),
                    "height": int(h),
                    "crop_left": prepared.crop_box[0],
                    "crop_top": prepared.crop_box[1],
                    "crop_right": prepared.crop_box[2],
                    "crop_bottom": prepared.crop_box[3],
                    "tier": b.tier,
                    "bucket": b.name,
                }
                for c in caption_cols:
                    sample[c] = _clean_caption(row.get(c), cfg.max_caption_chars, notes, c)
                writer = writers.get(b.name)
                if writer is None:
                    writer = MDSWriter(
                        out=storage.join(cfg.out, b.name, unit.part),
                        columns=columns,
                        compression=cfg.compression,
                        hashes=list(cfg.hashes) or None,
                        size_limit=cfg.size_limit,
                    )
                    writers[b.name] = writer
                    ids[b.name] = []
                writer.write(sample)
                ids[b.name].append(sample["id"])
                result.written += 1
                q = row.get(QUALITY_COLUMN)  # written, but blank: see prx_data.quality
                if q and is_low_information(q["std"], q["entropy"], q["flat"]):
                    notes["blank"] += 1
    finally:
        for writer in writers.values():
            writer.finish()
    for name, id_list in ids.items():
        write_manifest(storage.join(cfg.out, name), unit.part, id_list)
        result.buckets[name] = len(id_list)
    result.dropped = dict(dropped)
    result.notes = dict(notes)
    result.seconds = time.perf_counter() - t0
    storage.write_bytes_atomic(marker_path(cfg.out, unit.part), result.to_json().encode())
    return result


# --- merge and report ---------------------------------------------------------


def finalize(cfg: ExportConfig, results: dict[str, UnitResult], seconds: float) -> ExportReport:
    per_bucket: dict[str, list[str]] = {}
    counts: Counter = Counter()
    dropped: Counter = Counter()
    notes: Counter = Counter()
    rows = written = 0
    for r in results.values():
        rows += r.rows
        written += r.written
        dropped.update(r.dropped)
        notes.update(r.notes)
        for name, n in r.buckets.items():
            per_bucket.setdefault(name, []).append(r.part)
            counts[name] += n
    for name, parts in sorted(per_bucket.items()):
        merged = merge_bucket(storage.join(cfg.out, name), parts)
        if merged != counts[name]:
            raise ExportError(
                f"bucket {name}: merged index has {merged} samples, expected {counts[name]}"
            )
    tiers: Counter = Counter()
    for name, n in counts.items():
        tiers[name.split("/")[0]] += n
    report = ExportReport(
        table=cfg.table,
        out=cfg.out,
        table_version=cfg.table_version,
        rows_read=rows,
        samples_written=written,
        buckets=dict(sorted(counts.items())),
        tiers=dict(sorted(tiers.items(), key=lambda kv: int(kv[0]))),
        dropped=dict(sorted(dropped.items())),
        notes=dict(sorted(notes.items())),
        units=len(results),
        seconds=round(seconds, 3),
    )
    storage.write_bytes_atomic(storage.join(cfg.out, "report.txt"), report.table_text().encode())
    storage.write_bytes_atomic(
        storage.join(cfg.out, REPORT_NAME), json.dumps(report.to_dict(), indent=2).encode()
    )
    return report
