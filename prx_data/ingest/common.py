"""Shared pieces of every source reader: work units, counts, caption decoding, row building.

A source is read in two steps so the ingest job can parallelise it:

1. ``plan`` (on the driver, cheap): list the source and cut it into
   :class:`WorkUnit` s (a chunk of files, one tar, one parquet row group...)
   plus the extra metadata columns it will produce;
2. ``load`` (in a Ray task): turn one unit into a table that follows
   :data:`prx_data.core.schema.TABLE_SCHEMA` plus the extra columns, and a
   :class:`Counts` of everything noteworthy (kept-with-a-note or dropped).

Nothing here crashes on bad input: unreadable images are kept with a
``probe_error``; non-UTF-8 captions are decoded with replacement and counted.
"""

from __future__ import annotations

import json
import posixpath
from collections import Counter
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

import pyarrow as pa

from prx_data.core import schema as S
from prx_data.core.imaging import ImageError, probe
from prx_data.core.keys import sha256_hex

#: File extensions taken as images (anything with one of these is ingested;
#: one that then fails to parse is kept with a ``probe_error``).
IMAGE_EXTENSIONS = frozenset(
    {
        "jpg",
        "jpeg",
        "png",
        "webp",
        "gif",
        "bmp",
        "tif",
        "tiff",
        "avif",
        "heic",
        "heif",
        "jxl",
        "jp2",
        "ppm",
        "pgm",
        "pbm",
        "tga",
        "ico",
    }
)
#: Sidecar extensions that carry a caption.
CAPTION_EXTENSIONS = ("txt", "json", "caption", "cap")
#: Keys of a JSON sidecar (or parquet column names) tried in order for the caption.
CAPTION_KEYS = ("caption", "text", "TEXT", "txt", "prompt")
#: Column holding a JSON sidecar's other keys, as JSON text.
METADATA = "metadata"
#: Column with the file (or tar member) the image came from.
SOURCE_FILE = "source_file"


#: Internal column: the notes of each row, counted only if the row is written.
NOTES = "__notes"


class Counts(Counter):
    """Counts by reason. Keys are ``kept:<reason>`` (row written, with a note) or
    ``dropped:<reason>`` (row or unit not written).

    Readers call :meth:`kept` while building a row; the note waits in
    ``pending`` until :class:`RowBuilder` attaches it to that row, so a row
    dropped later (say, its id is already in the table) is not counted twice.
    """

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.pending: list[str] = []

    def kept(self, reason: str, n: int = 1) -> None:
        self.pending.extend([reason] * n)

    def dropped(self, reason: str, n: int = 1) -> None:
        self[f"dropped:{reason}"] += n

    def take_pending(self) -> list[str]:
        out, self.pending = self.pending, []
        return out

    def tally_notes(self, notes: Iterable[list[str] | None]) -> None:
        """Count the notes of the rows that are written."""
        for row in notes:
            for reason in row or ():
                self[f"kept:{reason}"] += 1


@dataclass
class WorkUnit:
    """One independently loadable piece of a source. ``args`` is JSON-able."""

    kind: str
    source: str  # the source name, first part of every id
    args: dict[str, Any] = field(default_factory=dict)

    def to_json(self) -> str:
        return json.dumps({"kind": self.kind, "source": self.source, "args": self.args})

    @staticmethod
    def from_json(text: str) -> WorkUnit:
        d = json.loads(text)
        return WorkUnit(d["kind"], d["source"], d["args"])


@dataclass
class Plan:
    """What ``plan`` returns: the units, the extra columns, and counts found while planning."""

    units: list[WorkUnit]
    extra_fields: list[pa.Field] = field(default_factory=list)
    counts: Counts = field(default_factory=Counts)
    #: Rough bytes per row (mostly the image), to size fragments; None if unknown.
    approx_row_bytes: float | None = None
    #: Called with the job's total counts once all units are loaded, to turn
    #: ``internal:*`` counters into reasons (e.g. keys of a list never found).
    finalize: Callable[[Counter], None] | None = None


def ext_of(name: str) -> str:
    base = posixpath.basename(name)
    return base.rsplit(".", 1)[-1].lower() if "." in base else ""


def strip_ext(name: str) -> str:
    head, base = posixpath.split(name)
    stem = base.rsplit(".", 1)[0] if "." in base else base
    return posixpath.join(head, stem) if head else stem


def decode_text(raw: bytes | str | None, counts: Counts) -> str | None:
    """Caption bytes to text: UTF-8 (BOM stripped), else replacement characters + a count.

    Empty or whitespace-only captions become null and are counted.
    """
    if raw is None:
        counts.kept("caption_missing")
        return None
    if isinstance(raw, bytes):
        try:
            text = raw.decode("utf-8-sig")
        except UnicodeDecodeError:
            text = raw.decode("utf-8", errors="replace")
            counts.kept("caption_not_utf8")
    else:
        text = raw
    text = text.strip()
    if not text:
        counts.kept("caption_empty")
        return None
    return text


def caption_from_json(raw: bytes, counts: Counts) -> tuple[str | None, str | None]:
    """(caption, other keys as JSON text) from a JSON sidecar; bad JSON is counted."""
    try:
        text = raw.decode("utf-8-sig")
    except UnicodeDecodeError:
        text = raw.decode("utf-8", errors="replace")
        counts.kept("caption_not_utf8")
    try:
        obj = json.loads(text)
    except ValueError:
        counts.kept("bad_sidecar_json")
        counts.kept("caption_missing")
        return None, None
    if not isinstance(obj, dict):
        counts.kept("bad_sidecar_json")
        counts.kept("caption_missing")
        return None, None
    caption = None
    rest = dict(obj)
    for k in CAPTION_KEYS:
        if k in obj:
            caption = rest.pop(k)
            break
    if caption is not None and not isinstance(caption, str):
        caption = json.dumps(caption, ensure_ascii=False)
    caption = decode_text(caption, counts)
    meta = json.dumps(rest, ensure_ascii=False, sort_keys=True) if rest else None
    return caption, meta


def probe_columns(data: bytes | None) -> tuple[int | None, int | None, str | None, str | None]:
    """(width, height, format, probe_error) from the image header."""
    if data is None:
        return None, None, None, "missing_image"
    try:
        info = probe(data)
    except ImageError as e:
        return None, None, None, e.reason
    except Exception as e:  # any parser bug must not stop an ingest
        return None, None, None, f"probe_failed:{type(e).__name__}"
    return info.width, info.height, info.format, None


class RowBuilder:
    """Collects rows for one unit and turns them into an Arrow table."""

    def __init__(self, source: str, counts: Counts):
        self.source = source
        self.counts = counts
        self.columns: dict[str, list] = {n: [] for n in S.TABLE_SCHEMA.names}
        self.extra: dict[str, list] = {}
        self.notes: list[list[str]] = []
        self.n = 0

    def add(
        self,
        key: str,
        image: bytes | None,
        caption: str | None,
        error: str | None = None,
        **extra: Any,
    ) -> None:
        """One row; ``error`` (e.g. the image could not be read) overrides the probe."""
        w, h, fmt, err = probe_columns(image) if error is None else (None, None, None, error)
        if err is not None:
            self.counts.kept(f"probe_error:{err}")
        self.notes.append(self.counts.take_pending())
        c = self.columns
        c[S.ID].append(f"{self.source}/{key}")
        c[S.IMAGE].append(image)
        c[S.WIDTH].append(w)
        c[S.HEIGHT].append(h)
        c[S.FORMAT].append(fmt)
        c[S.SOURCE].append(self.source)
        c[S.CAPTION].append(caption)
        c[S.PROBE_ERROR].append(err)
        c[S.SHA256].append(sha256_hex(image) if image else None)
        for name, value in extra.items():
            col = self.extra.get(name)
            if col is None:
                col = self.extra[name] = [None] * self.n
            col.append(value)
        self.n += 1
        for col in self.extra.values():
            if len(col) < self.n:
                col.append(None)

    def table(self, extra_fields: Iterable[pa.Field] = ()) -> pa.Table:
        arrays = [pa.array(self.columns[f.name], f.type) for f in S.TABLE_SCHEMA]
        fields = list(S.TABLE_SCHEMA)
        for f in extra_fields:
            if f.name in self.extra:
                arrays.append(pa.array(self.extra[f.name], f.type))
                fields.append(f)
        arrays.append(pa.array(self.notes, pa.list_(pa.string())))
        fields.append(pa.field(NOTES, pa.list_(pa.string())))
        return pa.Table.from_arrays(arrays, schema=pa.schema(fields))


def conform(table: pa.Table, schema: pa.Schema) -> pa.Table:
    """Reorder/cast ``table`` to ``schema``; columns it lacks become nulls, others go."""
    arrays = []
    for f in schema:
        if f.name in table.column_names:
            col = table[f.name]
            if col.type != f.type:
                col = col.cast(f.type)
            arrays.append(col)
        else:
            arrays.append(pa.nulls(table.num_rows, f.type))
    return pa.Table.from_arrays(arrays, schema=schema)
