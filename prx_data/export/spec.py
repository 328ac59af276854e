"""The export's value types: its settings (:class:`ExportConfig`), a work unit and
what it reports, the drop policy, and the columns a sample carries.
"""

from __future__ import annotations

import json
import shlex
import warnings
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field, fields

import pyarrow as pa

from prx_data.core.buckets import (
    DEFAULT_TIERS,
    DROP_ASPECT_RATIO,
    DROP_TOO_SMALL,
)
from prx_data.core.flags import REQUIRED, comma_ints, comma_list, flag, option_name
from prx_data.core.imaging import (
    CODECS,
    DEFAULT_CODEC,
    DEFAULT_JPEG_QUALITY,
    DRAFT_MARGIN,
    RESAMPLE,
    EncodeSpec,
)
from prx_data.core.schema import MDS_COLUMNS
from prx_data.export.naming import ExportError, part_name

#: Drop reasons that are choices, not problems: counted, but not listed in dropped.parquet.
UNLISTED_REASONS = frozenset({"filtered"})
#: Shard content hash recorded in every index by default (streaming's xxh64: fast, and
#: what sidecars bind to and ``python -m prx_data.verify --deep`` checks).
DEFAULT_HASHES = ("xxh64",)
#: Where the codecs' speed against fidelity is measured.
CODECS_RESULTS = "benchmarks/results/codecs.md"


@dataclass(frozen=True)
class ExportConfig:
    """The export's settings, each spelled once: its ``write_mds`` flag, help and default
    are the field's (:func:`prx_data.core.flags.flag`)."""

    table: str = flag(REQUIRED, "--table", help="Lance table URI (local path or s3://...).")
    out: str = flag(REQUIRED, "--out", help="Output root: local directory or s3:// / gs:// URI.")
    tiers: tuple[int, ...] = flag(
        DEFAULT_TIERS,
        "--tiers",
        type=comma_ints,
        help="Comma-separated resolution tiers (default: 512,1024,2048,4096).",
    )
    #: None: every ``caption*`` string column except a column job's ``*_status`` / ``*_error``.
    caption_columns: tuple[str, ...] | None = flag(
        None,
        "--caption-columns",
        type=comma_list,
        help="Comma-separated caption columns to carry (default: every caption* column).",
    )
    keep_columns: tuple[str, ...] = flag(
        (),
        "--keep-columns",
        type=comma_list,
        metavar="A,B,...",
        help="Comma-separated table columns to copy into every sample with their types "
        "(similarity, punsafe, aesthetic, url...): floats as float64 (null: NaN); integers, "
        "booleans, strings and lists of numbers or strings as json. A training config's "
        "data.extra_columns (or BucketedDataset(extra_columns=...)) hands them to the batches.",
    )
    image_format: str = flag(
        "jpeg",
        "--format",
        choices=("jpeg", "png"),
        help="Sample encoding: JPEG (default) or lossless PNG for artifact-sensitive data.",
    )
    quality: int = flag(
        DEFAULT_JPEG_QUALITY, "--quality", type=int, help="JPEG quality (default: %(default)s)."
    )
    subsampling: int = flag(
        -1,
        "--subsampling",
        type=int,
        choices=(-1, 0, 1, 2),
        help="JPEG chroma subsampling: -1 Pillow default (4:2:0), 0 = 4:4:4, 1 = 4:2:2, 2 = 4:2:0.",
    )
    codec: str = flag(
        DEFAULT_CODEC,
        "--codec",
        choices=CODECS,
        help="Resize/encode path. vips-reduce (default): JPEG draft to >= --draft-margin x "
        "the target, libvips' SIMD Lanczos3 over the exact crop box (OpenCV bicubic to enlarge), "
        "encoded through OpenCV (the same bytes as Pillow's); pillow: "
        "the same with Pillow's Lanczos (slower, same fidelity); vips: libvips thumbnail "
        f"(crops on whole pixels). Speed against fidelity: {CODECS_RESULTS}.",
    )
    resample: str = flag(
        "lanczos",
        "--resample",
        choices=tuple(RESAMPLE),
        help="Resampling filter (default: lanczos). The others are Pillow's, faster "
        f"and softer (measured frontier: {CODECS_RESULTS}).",
    )
    use_draft: bool = flag(
        True,
        "--no-draft",
        negate=True,
        help="Always decode at full size (default: JPEG DCT-domain downscale to >= "
        "--draft-margin x the target).",
    )
    draft_margin: float = flag(
        DRAFT_MARGIN,
        "--draft-margin",
        type=float,
        help="Decode/reduce to no less than this multiple of the bucket before the Lanczos "
        "pass (default: %(default)s). Smaller margins lose fidelity on detailed photos for "
        f"little or no speed ({CODECS_RESULTS}).",
    )
    keep_heap: bool = flag(
        True,
        "--release-buffers",
        negate=True,
        help="Let the export's Ray workers return each image's decode buffers to the system "
        "at once (default: they keep up to 256 MB of freed buffers for the next image "
        "instead of page-faulting them afresh; prx_data.core.heap).",
    )
    compression: str | None = flag(
        None,
        "--compression",
        help="MDS shard compression, e.g. zstd, zstd:7, br (default: none; JPEG does not "
        "compress).",
    )
    hashes: tuple[str, ...] = flag(
        DEFAULT_HASHES,
        "--hashes",
        type=comma_list,
        help="Comma-separated shard hashes to record in each index; skip lists bind to them "
        "and `verify --deep` checks them (default: xxh64; pass '' for none).",
    )
    size_limit: int = flag(
        1 << 26,
        "--size-limit",
        type=int,
        help="Maximum shard size in bytes before a new shard starts (default: 64 MiB).",
    )
    shard_size: int = flag(
        1 << 26,
        "--shard-size",
        type=int,
        help="Target bytes of a bucket's shards: once the work units are done, each bucket's "
        "parts are packed into shards of about this size, copying the encoded samples "
        "(default: 64 MiB, Mosaic's recommended 50-100 MB; 0 keeps one small part per unit "
        "and bucket). Shards still end at --size-limit.",
    )
    rows_per_task: int = flag(
        1000,
        "--rows-per-task",
        type=int,
        help="Most rows per work unit (a row range of one Lance fragment). Smaller = finer "
        "progress and resume, larger = fewer, bigger shards (default: %(default)s).",
    )
    #: None: ``prx_data.pipelines.write_mds`` sets it from the cluster's CPUs when the export
    #: starts, and the pinned config keeps it for resumes.
    min_units: int | None = flag(
        None,
        "--min-units",
        type=int,
        help="Plan at least this many work units, so that small tables use every core "
        "(default: prx_data.pipelines.write_mds.UNITS_PER_CPU per CPU of the cluster, "
        "recorded so that --resume plans the same "
        "units; give a number for an export whose parts do not depend on the cluster).",
    )
    filter: str | None = flag(
        None,
        "--filter",
        help="Lance SQL filter applied before bucketing; rows that fail it are counted as "
        "'filtered' (e.g. \"label = 'visual'\").",
    )
    ledger: str | None = flag(
        None,
        "--ledger",
        metavar="URI",
        help="The corpus ledger whose opt-outs the export leaves out while it writes, and whose "
        "lists it follows (default: $PRX_LEDGER, else _prx_ledger.lance beside --table). An "
        "--overwrite or --resume must name the ledger the export already follows.",
    )
    max_caption_chars: int = flag(
        20000,
        "--max-caption-chars",
        type=int,
        help="Longer captions are truncated and counted (default: %(default)s).",
    )
    append: bool = flag(
        False,
        "--append",
        help="Add to the complete export at --out the rows of the table it does not hold yet "
        "(by id), as new parts of the same buckets; rows deleted since go to its 'deleted' "
        "skip list, a row whose image changed is exported again and its old sample skipped "
        "('replaced'). Old shards are never touched. With --resume: finish a killed append.",
    )
    #: Pinned table version (set by :func:`~prx_data.export.prepare.prepare_output`), so a resume reads the same rows.
    table_version: int | None = None

    def fingerprint(self) -> dict:
        """Everything that determines the output bytes (for resume checks)."""
        d = asdict(self)
        d.pop("out")
        d.pop("ledger")  # checked against the ledger the export records, not as a setting
        d.pop("append")  # how this run adds to the export, not what a sample holds
        d.pop("keep_heap")  # how a worker manages memory, not what it writes
        return d

    def sample_settings(self) -> dict:
        """What decides a sample's bytes and where it goes: the settings an append must share
        with the export it adds to (not the unit plan, the pack size or the version read)."""
        d = self.fingerprint()
        for k in ("table_version", "rows_per_task", "min_units", "shard_size"):
            d.pop(k)
        return d

    @property
    def encode(self) -> EncodeSpec:
        """The encode settings as the codec paths take them (``image_format`` is ``fmt``)."""
        names = [f.name for f in fields(EncodeSpec) if f.name != "fmt"]
        return EncodeSpec(fmt=self.image_format, **{n: getattr(self, n) for n in names})


def resume_flags(previous: dict) -> str:
    """The ``write_mds`` flags that give back the interrupted run's settings, where one does.

    A default that changed between releases (``--codec``: ``pillow`` before
    ``vips-reduce``) otherwise refuses a resume with no flag named.
    """
    return " ".join(
        f"{option_name(ExportConfig, k)} {shlex.quote(str(v))}"
        for k, v in previous.items()
        if option_name(ExportConfig, k)
        and isinstance(v, (str, int, float))
        and not isinstance(v, bool)
    )


@dataclass(frozen=True)
class WorkUnit:
    fragment_id: int
    start: int
    count: int

    @property
    def part(self) -> str:
        """The unit's key (:func:`~prx_data.export.naming.part_name`): its marker, dropped rows
        and staging folder. Its part folders are named by content (:attr:`UnitResult.parts`)."""
        return part_name(self.fragment_id, self.start)


#: What an append's parts add to their ids' digest (:func:`append_salt`).
_APPEND_SALT_PERSON = b"prx-append"


def append_salt(version: int) -> int:
    """What the parts an append writes at table ``version`` add to their ids' digest.

    A row whose image changed is exported again under its id, so an appended part may hold
    exactly the ids of an old part of its bucket; the salt keeps its name (and its packs')
    apart from every old one, the same on every rerun and resume of that append."""
    import hashlib

    d = hashlib.blake2b(str(int(version)).encode(), digest_size=8, person=_APPEND_SALT_PERSON)
    return int.from_bytes(d.digest(), "little")


@dataclass(frozen=True)
class AppendUnit:
    """A work unit of ``write_mds --append``: rows of one fragment, taken by offset.

    ``runs`` are ``[start, stop)`` ranges of row offsets in the fragment (its live rows,
    as :meth:`lance.LanceFragment.take` counts them): new rows usually arrive as whole
    fragments, so a unit is one run. ``start`` is the unit's first row in the append's
    plan, ``version`` the table version the append reaches: together its key.
    """

    fragment_id: int
    start: int
    count: int
    runs: tuple[tuple[int, int], ...]
    version: int

    @property
    def part(self) -> str:
        """The unit's key: its marker, dropped rows and staging folder (``a<version>-f...``)."""
        return f"a{self.version:06d}-{part_name(self.fragment_id, self.start)}"

    @property
    def salt(self) -> int:
        return append_salt(self.version)

    def offsets(self) -> list[int]:
        return [i for a, b in self.runs for i in range(a, b)]

    def to_json(self) -> str:
        return json.dumps(asdict(self), sort_keys=True)

    @classmethod
    def from_json(cls, text: str | bytes) -> AppendUnit:
        d = json.loads(text)
        return cls(**{**d, "runs": tuple(tuple(r) for r in d["runs"])})


@dataclass
class UnitResult:
    #: The unit's key (:attr:`WorkUnit.part`), which names its marker.
    part: str
    rows: int = 0
    written: int = 0
    buckets: dict[str, int] = field(default_factory=dict)
    #: Shard bytes (uncompressed) of the unit's part in each bucket: what the pack plans by.
    bucket_bytes: dict[str, int] = field(default_factory=dict)
    dropped: dict[str, int] = field(default_factory=dict)
    notes: dict[str, int] = field(default_factory=dict)
    seconds: float = 0.0
    #: The part folder the unit wrote in each bucket, named by the ids it holds
    #: (:func:`~prx_data.export.naming.content_part_name`). Absent from the markers of
    #: older versions, whose parts are named :attr:`part` in every bucket.
    parts: dict[str, str] = field(default_factory=dict)

    def part_in(self, bucket: str) -> str:
        """The name of the unit's part folder in ``bucket``."""
        return self.parts.get(bucket, self.part)

    def to_json(self) -> str:
        return json.dumps(asdict(self), sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> UnitResult:
        return cls(**json.loads(text))


def published_parts(results: Mapping[str, UnitResult]) -> dict[str, dict[str, UnitResult]]:
    """``{bucket: {part folder: its unit's result}}``, refusing two units with one folder.

    Parts are named by the ids they hold, so two units name the same folder
    only when the table repeats row ids (or, about once in 2**64, by chance):
    the second would replace the first's samples. Refused in one line.
    """
    out: dict[str, dict[str, UnitResult]] = {}
    for key in sorted(results):
        r = results[key]
        for bucket in r.buckets:
            name = r.part_in(bucket)
            seen = out.setdefault(bucket, {})
            if name in seen:
                raise ExportError(
                    f"work units {seen[name].part} and {r.part} both wrote part {name} of "
                    f"bucket {bucket}: the table repeats row ids across them. Make ids unique "
                    "(python -m prx_data.dedup, or re-ingest), then export with --overwrite"
                )
            seen[name] = r
    return out


def kept_parts(results: Mapping[str, UnitResult]) -> set[str]:
    """``<tier>/<ar>/<part>`` of every part the finished units wrote (what a resume keeps)."""
    return {f"{b}/{r.part_in(b)}" for r in results.values() for b in r.buckets}


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
