"""The export's value types: its settings (:class:`ExportConfig`), a work unit and
what it reports, the drop policy, and the columns a sample carries.
"""

from __future__ import annotations

import json
import warnings
from dataclasses import asdict, dataclass, field

import pyarrow as pa

from prx_data.core.buckets import (
    DEFAULT_TIERS,
    DROP_ASPECT_RATIO,
    DROP_TOO_SMALL,
)
from prx_data.core.imaging import (
    DEFAULT_CODEC,
    DEFAULT_JPEG_QUALITY,
    DRAFT_MARGIN,
)
from prx_data.core.schema import MDS_COLUMNS
from prx_data.export.naming import ExportError, part_name

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


def is_failure(reason: str) -> bool:
    """Whether a drop reason counts toward ``--max-error-rate`` (not a choice, not a download)."""
    return reason not in POLICY_DROPS and not reason.startswith(DOWNLOAD_DROP)


def caption_warnings(table: str, caption_columns: tuple[str, ...] | None) -> list[str]:
    if not caption_columns:
        return [
            f"table {table} has no caption column: samples carry no text "
            "(add one with `python -m prx_data.caption`, or pass --caption-columns)"
        ]
    return []


def warn(messages: list[str]) -> None:
    for m in messages:
        warnings.warn(m, UserWarning, stacklevel=3)


def normalise(cfg: ExportConfig) -> ExportConfig:
    d = asdict(cfg)
    for k in ("tiers", "hashes", "caption_columns", "keep_columns"):
        if d[k] is not None:
            d[k] = tuple(d[k])
    return ExportConfig(**d)


def sample_columns(cfg: ExportConfig, schema: pa.Schema | None = None) -> dict[str, str]:
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
