"""Lance table -> bucketed Mosaic Data Shards: the work unit, the merge and the report.

The job is split into *work units* (a row range of one Lance fragment). Each
unit decodes its rows, buckets them, writes one MDS part per bucket it
touches (``<out>/<tier>/<ar>/<part>/``) plus an ``ids.parquet`` manifest,
and finally a ``_progress/<part>.done`` marker carrying its counts. Units are
deterministic, so a rerun reproduces the same bytes, and a killed run is
finished with ``resume=True``: finished units are kept, half-written parts
are deleted and redone. A bucket's merged ``index.json`` is written
atomically only after every unit is done, and ``report.json`` last of all,
so an export never looks complete before it is. A unit's data is fsynced before
its marker, and a unit that Ray retries after its worker died replaces what its
first attempt left (:func:`export_unit`).

The Ray Data graph that schedules the units lives in ``prx_data.pipelines.write_mds``.
"""

from __future__ import annotations

import io
import json
import os
import time
import uuid
import warnings
from collections import Counter
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass, field, replace

import pyarrow as pa

from prx_data.core import storage
from prx_data.core.buckets import (
    DEFAULT_TIERS,
    DROP_ASPECT_RATIO,
    DROP_TOO_SMALL,
    BucketSpec,
    assign_bucket,
)
from prx_data.core.errors import NotFound
from prx_data.core.imaging import (
    DEFAULT_CODEC,
    DEFAULT_JPEG_QUALITY,
    DRAFT_MARGIN,
    ImageError,
    prepare_with,
)
from prx_data.core.quality import COLUMN as QUALITY_COLUMN
from prx_data.core.quality import is_low_information
from prx_data.core.reports import FailureCounts
from prx_data.core.schema import MDS_COLUMNS, REPORT_NAME, is_job_column, mds_sample
from prx_data.export.layout import (
    CONFIG_NAME,
    DROPPED_DIR,
    DROPPED_NAME,
    LEASE_NAME,
    LOCK_NAME,
    MARKER_NAME,
    PROGRESS_DIR,
    WRITING_DIR,
    ExportError,
    describe_foreign,
    foreign_entries,
    imap_bounded,
    io_workers,
    list_markers,
    list_top,
    marker_path,
    merge_bucket,
    part_name,
    remove_tree,
    write_export_marker,
    write_manifest,
)
from prx_data.table.pins import export_pin, pin, unpin

#: Table columns the exporter cannot do without.
REQUIRED_COLUMNS = ("id", "image", "width", "height")

#: Drop reasons that are choices, not problems: counted, but not listed in dropped.parquet.
UNLISTED_REASONS = frozenset({"filtered"})

#: Shard content hash recorded in every index by default (streaming's xxh64: fast, and
#: what sidecars bind to and ``python -m prx_data.verify --deep`` checks).
DEFAULT_HASHES = ("xxh64",)


@dataclass(frozen=True)
class ExportConfig:
    table: str
    out: str
    tiers: tuple[int, ...] = DEFAULT_TIERS
    #: Caption columns to carry; None = every ``caption*`` string column except a column
    #: job's ``*_status`` / ``*_error``.
    caption_columns: tuple[str, ...] | None = None
    image_format: str = "jpeg"
    quality: int = DEFAULT_JPEG_QUALITY
    #: JPEG chroma subsampling: -1 = Pillow default (4:2:0), 0 = 4:4:4, 2 = 4:2:0.
    subsampling: int = -1
    use_draft: bool = True
    #: JPEGs are DCT-downscaled while decoding, other formats box-reduced, to no less than
    #: this multiple of the bucket before the Lanczos pass. On the real-photo benchmark,
    #: 1.0 scores 30.9 dB on the worst detailed photo against 33.3 for 1.5 (an
    #: img2dataset-style loop: 20.5), for no speed with the default codec (1.3x with
    #: ``pillow``); see docs/ARCHITECTURE.md, Codecs.
    draft_margin: float = DRAFT_MARGIN
    #: Resize/encode path (``core.imaging.CODECS``): "vips-reduce" (draft + libvips'
    #: Lanczos3 over the exact box), "pillow" (draft + Pillow's Lanczos) or "vips"
    #: (libvips thumbnail).
    codec: str = DEFAULT_CODEC
    #: Resampling filter of the pillow codecs (``core.imaging.RESAMPLE``): lanczos, or a
    #: faster, softer one (bicubic, hamming, bilinear, box); see docs/ARCHITECTURE.md.
    resample: str = "lanczos"
    compression: str | None = None
    hashes: tuple[str, ...] = DEFAULT_HASHES
    size_limit: int = 1 << 26
    #: Target bytes of a bucket's shards: after the units, consecutive parts of a bucket
    #: are packed into shards of about this size (``prx_data.export.pack``); 0 keeps one
    #: part per unit and bucket. Shards still end at ``size_limit``.
    shard_size: int = 1 << 26
    rows_per_task: int = 1000
    #: Plan at least this many work units, so that a small table still keeps every core
    #: busy (None: ``rows_per_task`` alone). ``prx_data.pipelines.write_mds`` sets it from the
    #: cluster's CPUs when the export starts, and the pinned config keeps it for resumes.
    min_units: int | None = None
    #: Optional Lance SQL filter applied before bucketing (e.g. ``label = 'visual'``).
    filter: str | None = None
    max_caption_chars: int = 20000
    #: Table columns copied into every sample with their types (``similarity``,
    #: ``punsafe``, a URL...): floats as MDS ``float64`` (null: NaN); integers, booleans,
    #: strings and lists of numbers or strings as ``json`` (null stays null).
    keep_columns: tuple[str, ...] = ()
    #: Pinned table version (set by :func:`prepare_output`), so a resume reads the same rows.
    table_version: int | None = None

    def fingerprint(self) -> dict:
        """Everything that determines the output bytes (for resume checks)."""
        d = asdict(self)
        d.pop("out")
        return d


#: Settings a ``write_mds`` flag of the same name (dashes for underscores) sets to one value.
_FLAG_SETTINGS = (
    "codec",
    "resample",
    "draft_margin",
    "quality",
    "subsampling",
    "compression",
    "size_limit",
    "shard_size",
    "rows_per_task",
    "min_units",
    "max_caption_chars",
)


def resume_flags(previous: dict) -> str:
    """The ``write_mds`` flags that give back the interrupted run's settings, where one does.

    A default that changed between releases (``--codec``: ``pillow`` before
    ``vips-reduce``) otherwise refuses a resume with no flag named.
    """
    return " ".join(
        f"--{k.replace('_', '-')} {v}"
        for k, v in previous.items()
        if k in _FLAG_SETTINGS and isinstance(v, (str, int, float)) and not isinstance(v, bool)
    )


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
    #: Shard bytes (uncompressed) of the unit's part in each bucket: what the pack plans by.
    bucket_bytes: dict[str, int] = field(default_factory=dict)
    dropped: dict[str, int] = field(default_factory=dict)
    notes: dict[str, int] = field(default_factory=dict)
    seconds: float = 0.0

    def to_json(self) -> str:
        return json.dumps(asdict(self), sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> UnitResult:
        return cls(**json.loads(text))


#: Drop reasons that are choices, not failures: they never count toward --max-error-rate.
POLICY_DROPS = frozenset({"filtered", "unbucketed", DROP_TOO_SMALL, DROP_ASPECT_RATIO})
#: Prefix of the drop reason of a row whose download failed (``download:http_404``): the
#: download job's reason, judged by that job's own error rate rather than the export's.
DOWNLOAD_DROP = "download:"
_DOWNLOAD_STATUS, _DOWNLOAD_ERROR = "download_status", "download_error"


def is_failure(reason: str) -> bool:
    """Whether a drop reason counts toward ``--max-error-rate`` (not a choice, not a download)."""
    return reason not in POLICY_DROPS and not reason.startswith(DOWNLOAD_DROP)


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
    #: Skip lists applied from the table's registry: {list: {ids, samples, shards}}.
    lists: dict[str, dict] = field(default_factory=dict)

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
        rate = self.rows_read / self.seconds if self.seconds else 0.0
        lines += ["", f"{self.units} work units in {self.seconds:.1f} s ({rate:,.1f} rows/s)"]
        return "\n".join(lines)


# --- planning ----------------------------------------------------------------


def open_table(uri: str, version: int | None = None):
    """:func:`prx_data.table.lance_ops.open_table`, failing as an :class:`ExportError`."""
    from prx_data.table import lance_ops

    try:
        return lance_ops.open_table(uri, version=version)
    except NotFound as e:
        raise ExportError(str(e)) from None


def check_table_columns(uri: str, schema: pa.Schema) -> None:
    """Refuse a table the exporter would turn into nothing but drops."""
    missing = [c for c in REQUIRED_COLUMNS if c not in schema.names]
    if missing:
        raise ExportError(
            f"table {uri} has no {', '.join(repr(c) for c in missing)} column(s) (it has "
            f"{sorted(schema.names)}); every row would be dropped. Ingest images with "
            "`python -m prx_data.ingest`, which writes id, image, width and height."
        )


def caption_warnings(table: str, caption_columns: tuple[str, ...] | None) -> list[str]:
    if not caption_columns:
        return [
            f"table {table} has no caption column: samples carry no text "
            "(add one with `python -m prx_data.caption`, or pass --caption-columns)"
        ]
    return []


def resolve_caption_columns(schema: pa.Schema, wanted: tuple[str, ...] | None) -> tuple[str, ...]:
    names = set(schema.names)
    if wanted is None:
        return tuple(
            n
            for n in schema.names
            if n.startswith("caption")
            and not is_job_column(n)
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


def check_out_location(out: str) -> None:
    """A local ``--out`` must be a directory (or not exist yet, under a directory)."""
    if storage.is_remote(out):
        return
    path = os.path.abspath(out)
    if os.path.exists(path) and not os.path.isdir(path):
        raise ExportError(f"--out {out} is a file, not a directory; choose a directory")
    parent = path
    while not os.path.exists(parent):
        parent = os.path.dirname(parent)
    if not os.path.isdir(parent):
        raise ExportError(f"--out {out}: {parent} is a file, not a directory")


def prepare_output(
    cfg: ExportConfig, *, overwrite: bool = False, resume: bool = False
) -> ExportConfig:
    """Check the output location, pin the table version, record the config.

    Returns the config with ``table_version`` pinned. Never deletes anything
    unless ``overwrite`` is set, and resumes nothing, unless the tree is
    provably an export of ours (:func:`layout.foreign_entries`). The caller
    holds the run lock (:class:`prx_data.export.lock.ExportLock`).
    """
    if overwrite and resume:
        raise ExportError("--overwrite and --resume are mutually exclusive")
    check_out_location(cfg.out)
    entries = [e for e in list_top(cfg.out) if e not in (LOCK_NAME, LEASE_NAME)]
    config_path = storage.join(cfg.out, CONFIG_NAME)
    if entries and (resume or overwrite):
        foreign = foreign_entries(cfg.out)
        if foreign:
            flag = "--resume" if resume else "--overwrite"
            raise ExportError(
                f"refusing to {flag} {cfg.out}: it is not provably an export written by "
                f"prx_data.write_mds, so nothing was touched. Found: {describe_foreign(foreign)}"
            )
    if entries and resume:
        if not storage.exists(config_path):
            raise ExportError(
                f"{cfg.out} has no interrupted export to resume (no {CONFIG_NAME}: it was stopped "
                "before it started, e.g. while --overwrite deleted the old tree); start it again "
                "with --overwrite"
            )
        previous = _normalise(
            ExportConfig(**{**json.loads(storage.read_bytes(config_path)), "out": cfg.out})
        )
        ds = _open_pinned(cfg, previous.table_version)
        pin_table_version(cfg, ds)
        check_table_columns(cfg.table, ds.schema)
        caps = resolve_caption_columns(ds.schema, cfg.caption_columns)
        _columns(replace(cfg, caption_columns=caps), ds.schema)
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
            diff = {k: (old.get(k), v) for k, v in now.fingerprint().items() if old.get(k) != v}
            flags = resume_flags({k: was for k, (was, _) in diff.items()})
            raise ExportError(
                f"cannot resume {cfg.out}: options differ from the interrupted run {diff} "
                "(previous, now). Rerun with the same options"
                + (f" (here: {flags})" if flags else "")
                + ", or use --overwrite to start again."
            )
        _warn(caption_warnings(cfg.table, caps))
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
    ds = open_table(cfg.table, cfg.table_version)
    check_table_columns(cfg.table, ds.schema)
    caps = resolve_caption_columns(ds.schema, cfg.caption_columns)
    _columns(replace(cfg, caption_columns=caps), ds.schema)
    if entries:  # only after every check: a refused run deletes nothing
        _clear_export(cfg.out, entries)
    pinned = ExportConfig(**{**asdict(cfg), "table_version": ds.version, "caption_columns": caps})
    pinned = _normalise(pinned)
    pin_table_version(pinned, ds)
    write_export_marker(cfg.out)
    storage.write_bytes_atomic(config_path, json.dumps(asdict(pinned), sort_keys=True).encode())
    _warn(caption_warnings(cfg.table, caps))
    return pinned


def _open_pinned(cfg: ExportConfig, version: int | None):
    """The table at the version an interrupted export read, or why it cannot be resumed."""
    try:
        return open_table(cfg.table, version)
    except ExportError:
        open_table(cfg.table)  # no table at all: that error
        raise ExportError(
            f"cannot resume {cfg.out}: version {version} of {cfg.table}, which it was "
            "exporting, no longer exists (old versions were cleaned up while it was paused "
            "and untagged); start again with --overwrite"
        ) from None


def pin_table_version(cfg: ExportConfig, ds) -> None:
    """Tag the version the export reads, so that ``table compact --cleanup`` keeps it.

    The tag is named after ``cfg.out`` (:func:`prx_data.table.pins.export_pin`):
    a resume or an ``--overwrite`` of the same output reuses it, and
    :func:`release_table_version` removes it once the report is written.
    """
    try:
        pin(ds, export_pin(cfg.out), ds.version, job="export", out=cfg.out)
    except OSError as e:  # e.g. read-only access to the table: export anyway, and say so
        _warn(
            [
                f"could not tag version {ds.version} of {cfg.table} ({e}); a `python -m "
                "prx_data.table compact --cleanup` before this export finishes would make "
                "it impossible to --resume"
            ]
        )


def release_table_version(cfg: ExportConfig) -> None:
    """Remove the export's tag (the export is complete; its version may be cleaned up)."""
    try:
        unpin(open_table(cfg.table), export_pin(cfg.out))
    except (ExportError, OSError) as e:  # the export is done; a left tag only keeps old files
        _warn([f"could not remove tag {export_pin(cfg.out)} from {cfg.table}: {e}"])


def _clear_export(out: str, entries: list[str]) -> None:
    """Delete an export of ours for ``--overwrite``, so that a kill part-way never looks complete.

    The report goes first, then ``_progress`` (config and unit markers) except
    the export marker, then everything else: an interrupted overwrite leaves a
    tree that the loader and ``verify`` call unfinished, that ``--resume``
    refuses (no config), and that a second ``--overwrite`` still recognises.
    On object storage ``_progress`` goes as one prefix and the marker is
    written again at once (a kill inside that one PUT leaves a tree
    ``--overwrite`` refuses as unproven, never a complete-looking one).
    """
    first = [e for e in (REPORT_NAME, "report.txt") if e in entries]
    for e in first:
        storage.delete(storage.join(out, e))
    if PROGRESS_DIR in entries:
        progress = storage.join(out, PROGRESS_DIR)
        if storage.is_remote(out):
            storage.delete(progress)
            write_export_marker(out)
        else:
            keep = MARKER_NAME.split("/")[-1]
            for name in sorted(os.listdir(progress)):
                if name != keep:
                    storage.delete(os.path.join(progress, name))
    for e in entries:
        if e not in first and e != PROGRESS_DIR:
            storage.delete(storage.join(out, e))


def _warn(messages: list[str]) -> None:
    for m in messages:
        warnings.warn(m, UserWarning, stacklevel=3)


def _normalise(cfg: ExportConfig) -> ExportConfig:
    d = asdict(cfg)
    for k in ("tiers", "hashes", "caption_columns", "keep_columns"):
        if d[k] is not None:
            d[k] = tuple(d[k])
    return ExportConfig(**d)


def done_parts(out: str) -> dict[str, UnitResult]:
    """Results of the work units that finished (their markers), by part name."""
    results = {}
    # 10^5 markers on object storage: read in parallel (bounded), kept in listing order.
    for text in imap_bounded(storage.read_bytes, list_markers(out), io_workers(out)):
        r = UnitResult.from_json(text.decode())
        results[r.part] = r
    return results


# --- one work unit -------------------------------------------------------------


def _columns(cfg: ExportConfig, schema: pa.Schema | None = None) -> dict[str, str]:
    cols = dict(MDS_COLUMNS)
    for c in cfg.caption_columns or ():
        if c in cols:
            raise ExportError(f"caption column {c!r} clashes with a built-in sample column")
        cols[c] = "str"
    if cfg.keep_columns:
        if schema is None:
            raise ExportError("--keep-columns needs the table's schema")  # a caller's bug
        cols.update(keep_column_encodings(schema, cfg.keep_columns, tuple(cols)))
    return cols


def _kept_type(t: pa.DataType) -> str | None:
    """The MDS encoding of a kept column of type ``t`` (None: not one we carry)."""
    if pa.types.is_floating(t):
        return "float64"
    if (
        pa.types.is_integer(t)
        or pa.types.is_boolean(t)
        or pa.types.is_string(t)
        or pa.types.is_large_string(t)
    ):
        return "json"
    if pa.types.is_list(t) or pa.types.is_large_list(t) or pa.types.is_fixed_size_list(t):
        v = t.value_type
        if pa.types.is_integer(v) or pa.types.is_floating(v) or pa.types.is_boolean(v):
            return "json"
        if pa.types.is_string(v) or pa.types.is_large_string(v):
            return "json"
    return None


def keep_column_encodings(
    schema: pa.Schema, names: tuple[str, ...], taken: tuple[str, ...] = tuple(MDS_COLUMNS)
) -> dict[str, str]:
    """MDS encoding of each ``--keep-columns`` column; a missing, clashing or unsupported one
    is refused in one line before anything is written."""
    out: dict[str, str] = {}
    for name in names:
        if name in taken or name in out:
            raise ExportError(
                f"--keep-columns {name!r} clashes with a sample column ({', '.join(taken)}) "
                "or is named twice"
            )
        if name not in schema.names:
            raise ExportError(
                f"--keep-columns {name!r} is not in the table; it has {sorted(schema.names)}"
            )
        t = schema.field(name).type
        enc = _kept_type(t)
        if enc is None:
            raise ExportError(
                f"--keep-columns {name!r} is {t}: only numbers, booleans, strings and lists of "
                "numbers or strings are carried into samples (leave it out, or cast it in a "
                "new column)"
            )
        out[name] = enc
    return out


def _kept_value(value, encoding: str):
    if encoding == "float64":
        return float("nan") if value is None else float(value)
    return value


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


def _probe_drop(row: dict) -> tuple[str, str]:
    """(reason, detail) of a row with a probe error: the download's reason for a URL row."""
    error = str(row["probe_error"])
    status = row.get(_DOWNLOAD_STATUS)
    if error == "missing_image" and status not in (None, "ok"):
        why = row.get(_DOWNLOAD_ERROR) or status
        return f"{DOWNLOAD_DROP}{why}", f"download {status}: {why}"
    if error == "missing_image":
        return error, "no image bytes (a URL row not downloaded yet: python -m prx_data.download)"
    return error, "the image header could not be read"


def export_unit(cfg: ExportConfig, unit: WorkUnit) -> UnitResult:
    """Process one work unit end to end; idempotent given the same config.

    A retried unit (Ray reruns it when its worker dies) meets what its first
    attempt left and must still succeed. On a local ``--out`` each attempt
    writes its parts into its own folder under ``_progress/writing``, fsyncs
    them and renames them into the buckets; on object storage (no rename) it
    clears its own part before writing it. Either way the marker comes last,
    after everything it vouches for is durable.
    """
    from prx_data.core.streaming_compat import mds_writer

    MDSWriter = mds_writer()  # noqa: N806 (a class); not all of `streaming`: see mds_writer
    t0 = time.perf_counter()
    spec = BucketSpec(tiers=tuple(cfg.tiers))
    ds = open_table(cfg.table, cfg.table_version)
    frag = ds.get_fragment(unit.fragment_id)
    caption_cols = list(cfg.caption_columns or ())
    wanted = ["id", "image", "width", "height", "probe_error", QUALITY_COLUMN, *caption_cols]
    wanted += [_DOWNLOAD_STATUS, _DOWNLOAD_ERROR]
    wanted += [c for c in cfg.keep_columns if c not in wanted]
    available = set(ds.schema.names)
    read_cols = [c for c in wanted if c in available]
    result = UnitResult(part=unit.part)
    dropped: Counter = Counter()
    listed: list[tuple[str, str, str]] = []  # (id, reason, detail) for dropped.parquet

    def drop(row: dict, reason: str, detail: str = "") -> None:
        dropped[reason] += 1
        if reason not in UNLISTED_REASONS:
            listed.append((str(row.get("id")), reason, detail))

    notes: Counter = Counter()
    writers: dict[str, MDSWriter] = {}
    ids: dict[str, list[str]] = {}
    columns = _columns(cfg, ds.schema)
    kept = {c: columns[c] for c in cfg.keep_columns}
    local = not storage.is_remote(cfg.out)
    stage = _stage_dir(cfg.out, unit.part) if local else cfg.out

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
                    drop(row, "filtered")
                    continue
                if row.get("probe_error"):
                    drop(row, *_probe_drop(row))
                    continue
                data = row.get("image")
                w, h = row.get("width"), row.get("height")
                if not data:
                    drop(row, "empty_file")
                    continue
                if not w or not h:
                    drop(row, "unknown_size", f"width={w} height={h}")
                    continue
                assignment = assign_bucket(int(w), int(h), spec)
                if assignment.bucket is None:
                    drop(row, assignment.reason or "unbucketed", f"{w}x{h}")
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
                        draft_margin=cfg.draft_margin,
                        subsampling=cfg.subsampling,
                        resample=cfg.resample,
                    )
                except ImageError as e:
                    drop(row, e.reason, e.detail)
                    continue
                sample = mds_sample(
                    image=prepared.data,
                    id=str(row["id"]),
                    width=w,
                    height=h,
                    crop_box=prepared.crop_box,
                    tier=b.tier,
                    bucket=b.name,
                )
                for c in caption_cols:
                    sample[c] = _clean_caption(row.get(c), cfg.max_caption_chars, notes, c)
                for c, enc in kept.items():
                    sample[c] = _kept_value(row.get(c), enc)
                writer = writers.get(b.name)
                if writer is None:
                    if not local:  # an earlier attempt's shards, index or manifest
                        storage.delete(storage.join(cfg.out, b.name, unit.part))
                    writer = MDSWriter(
                        out=storage.join(stage, b.name, unit.part),
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
        result.bucket_bytes[name] = write_manifest(storage.join(stage, name), unit.part, id_list)
        result.buckets[name] = len(id_list)
    if local and ids:
        _publish_parts(cfg.out, stage, unit.part, sorted(ids))
    result.dropped = dict(dropped)
    result.notes = dict(notes)
    if listed:
        path = storage.join(cfg.out, *DROPPED_DIR.split("/"), f"{unit.part}.parquet")
        _write_dropped_rows(path, listed)
        if local:
            _fsync(os.path.dirname(path))
    result.seconds = time.perf_counter() - t0
    storage.write_bytes_atomic(marker_path(cfg.out, unit.part), result.to_json().encode())
    return result


# --- staging and durability (local --out) ------------------------------------------


def _stage_dir(out: str, part: str) -> str:
    """A fresh folder for this attempt's parts; earlier attempts' folders are removed."""
    root = os.path.join(out, *WRITING_DIR.split("/"))
    if os.path.isdir(root):
        for name in os.listdir(root):
            if name.startswith(f"{part}."):
                remove_tree(os.path.join(root, name))
    return os.path.join(root, f"{part}.{uuid.uuid4().hex[:8]}")


def _fsync(path: str) -> None:
    """Flush a file's data, or a directory's names (a create or rename is not durable until then)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _publish_parts(out: str, stage: str, part: str, buckets: list[str]) -> None:
    """fsync each staged part (files, then folder), rename it into its bucket, fsync the buckets.

    A part already at the target was left by an earlier attempt of this unit
    (the marker is written only after this step) and is replaced.
    """
    dirs = {out}
    for name in buckets:
        src = os.path.join(stage, *name.split("/"), part)
        for f in sorted(os.listdir(src)):
            _fsync(os.path.join(src, f))
        _fsync(src)
        bdir = os.path.join(out, *name.split("/"))
        os.makedirs(bdir, exist_ok=True)
        dst = os.path.join(bdir, part)
        remove_tree(dst)
        os.rename(src, dst)
        dirs |= {bdir, os.path.dirname(bdir)}  # the tier and bucket may be new
    for d in sorted(dirs, reverse=True):
        _fsync(d)
    remove_tree(stage)


# --- merge and report ---------------------------------------------------------


DROPPED_SCHEMA = pa.schema([("id", pa.string()), ("reason", pa.string()), ("detail", pa.string())])


def _write_dropped_rows(path: str, rows: list[tuple[str, str, str]]) -> None:
    import pyarrow.parquet as pq

    ids, reasons, details = zip(*rows, strict=True) if rows else ((), (), ())
    table = pa.table([list(ids), list(reasons), list(details)], schema=DROPPED_SCHEMA)
    buf = io.BytesIO()
    pq.write_table(table, buf, compression="zstd")
    storage.write_bytes_atomic(path, buf.getvalue())


def _merge_dropped(
    cfg: ExportConfig, results: dict[str, UnitResult], check: Callable[[], None]
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
    check()
    storage.write_bytes_atomic(storage.join(cfg.out, DROPPED_NAME), buf.getvalue())
    return missing


def finalize(
    cfg: ExportConfig,
    results: dict[str, UnitResult],
    seconds: float,
    lists_hook: Callable[[], dict[str, dict[str, int]]] | None = None,
    check: Callable[[], None] = lambda: None,
    packs: Mapping[str, Mapping[str, int]] | None = None,
) -> ExportReport:
    """Merge every bucket (checked against the units' counts), then the dropped rows and report.

    The id index (:func:`prx_data.export.idindex.write_id_index`) is built
    from the merged buckets' manifests. ``lists_hook`` runs after it and before the report is
    written (the skip lists, which live a layer above, bind to the merged
    indexes); what it returns goes into the report's ``lists``. ``check`` (the
    run lock's) runs before every write: a lost lease stops the run there.
    ``packs`` ({bucket: {pack: samples}}, from :mod:`prx_data.export.pack`) names
    the part directories the buckets hold once packed, in place of the units' parts.
    """
    per_bucket: dict[str, list[str]] = {}
    per_part: dict[str, dict[str, int]] = {}
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
            per_part.setdefault(name, {})[r.part] = n
            counts[name] += n
    if packs is not None:
        per_part = {name: dict(packed) for name, packed in packs.items()}
        per_bucket = {name: list(packed) for name, packed in per_part.items()}
    for name, parts in sorted(per_bucket.items()):
        merged = merge_bucket(
            storage.join(cfg.out, name), parts, expected=per_part[name], check=check
        )
        if merged != counts[name]:
            raise ExportError(
                f"bucket {name}: merged index has {merged} samples, expected {counts[name]}"
            )
        if not storage.is_remote(cfg.out):  # the index is durable before the report names it
            _fsync(storage.join(cfg.out, name))
    if not storage.is_remote(cfg.out):
        remove_tree(os.path.join(cfg.out, *WRITING_DIR.split("/")))
    # The id index, before the lists bind their ids through it and the report names it done.
    from prx_data.export.idindex import write_id_index

    write_id_index(cfg.out, sorted(per_bucket), check=check)
    tiers: Counter = Counter()
    for name, n in counts.items():
        tiers[name.split("/")[0]] += n
    unlisted = _merge_dropped(cfg, results, check)
    found = caption_warnings(cfg.table, cfg.caption_columns)
    if unlisted:
        found.append(
            f"{DROPPED_NAME} lacks the dropped rows of {len(unlisted)} unit(s) finished by an "
            f"older version (e.g. {unlisted[0]}); they are counted in the report"
        )
    for c in cfg.caption_columns or ():
        blank = notes.get(f"{c}_missing", 0) + notes.get(f"{c}_empty", 0)
        if written and blank >= written:
            found.append(f"caption column {c!r} is null or empty in every exported sample")
    _warn(found)
    lists = lists_hook() if lists_hook is not None else {}
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
        warnings=found,
        lists=lists,
    )
    check()
    storage.write_bytes_atomic(storage.join(cfg.out, "report.txt"), report.table_text().encode())
    check()
    storage.write_bytes_atomic(
        storage.join(cfg.out, REPORT_NAME), json.dumps(report.to_dict(), indent=2).encode()
    )
    return report
