"""URL lists as img2dataset users bring them: plain text, CSV, TSV, JSON lines and arrays.

Each row becomes a table row without image bytes (``probe_error =
missing_image``), as a LAION-style parquet does, so ``python -m
prx_data.download`` can fill it. Formats:

- ``txt``: one URL per line;
- ``csv`` / ``tsv``: with a header (found when a cell names the URL column:
  ``url``, ``URL``, ``image_url``...) or without one (then the column whose
  first value is an ``http(s)://`` URL is ``url``, and with two columns the
  other is ``caption``, as in CC12M's ``url<TAB>caption``); TSV has no
  quoting (a ``"`` is text), CSV quotes as RFC 4180;
- ``jsonl``: one JSON object per line (``.jsonl``, ``.ndjson``, or ``.json``),
  or one JSON array of objects (read whole, so at most ``JSON_ARRAY_BYTES``).

Any of them may be compressed (``.gz``, ``.bz2``, ``.zst``): found by the
suffix and by the first bytes (a gzip file named ``.tsv`` is decompressed, its
bytes never taken for URLs). A compressed list cannot be seeked, so each of
its units decompresses from the start up to its range; the units of one such
file are capped at ``COMPRESSED_UNITS`` (decompress a very large list first to
spread it wider). A folder holding only URL lists is read as lists
(:class:`UrlListFolder`), not as an image folder.

Column names are normalised: the URL column is ``url`` whatever the file
called it, and the other kept columns are lower-cased (LAION's ``TEXT`` is
the caption, ``LICENSE`` becomes ``license``), unless two differ only by case.

The file is never read whole (a JSON array aside): the driver streams it once
to count lines and cuts it into units of ``items_per_unit`` lines (byte ranges
that start on a line); a load task reads only its range. Ids are stable and
unique per list file: ``<list file name>/<key>``, the name without a
compression suffix (``urls.csv/0`` and ``urls.txt/0`` never collide, and
``urls.tsv.gz`` keeps the ids of ``urls.tsv``); in a folder of lists,
``<folder>/<relative path>/<key>``. The key is the key column's value
(``key``, ``uid``...) when there is one, else the line's number (data lines
from 0, the header not counted; an array's element index). Column types are
inferred from the first lines (integers, floats, strings; JSON lists and
booleans as they are); a later value that does not fit becomes null and is
counted (``bad_value:<column>``). A CSV field may not span lines (a quoted
newline): such a row is cut, and its pieces are dropped and counted.
"""

from __future__ import annotations

import csv
import json
import os
import posixpath
from dataclasses import dataclass

import pyarrow as pa

from prx_data.core import schema as S
from prx_data.core import storage
from prx_data.core.errors import UsageError
from prx_data.ingest.common import CAPTION_KEYS, NOTES, Counts, Plan, WorkUnit
from prx_data.ingest.parquet import KEY_NAMES, RESERVED, output_names

#: URL column names tried in order (LAION, COYO, DataComp, CC12M and img2dataset's ``url``).
URL_NAMES = ("url", "URL", "image_url", "img_url", "src_url")
KINDS = ("txt", "csv", "tsv", "jsonl")
#: The probe error of a row without image bytes (ingest's for every URL row).
MISSING = "missing_image"
EXTENSIONS = {
    "txt": "txt",
    "csv": "csv",
    "tsv": "tsv",
    "jsonl": "jsonl",
    "ndjson": "jsonl",
    "json": "jsonl",
}
#: Lines per work unit (URL rows are small: a unit of this many is a few MiB).
DEFAULT_ITEMS_PER_UNIT = 65536
#: Lines read by the driver to find the header, the roles and the column types.
SAMPLE_LINES = 1000
_BLOCK = 8 * 1024 * 1024


#: Compression suffixes and the pyarrow codec of each.
COMPRESSIONS = {"gz": "gzip", "gzip": "gzip", "bz2": "bz2", "zst": "zstd", "zstd": "zstd"}
#: Leading bytes of each codec's stream (how a compressed file named ``.tsv`` is found).
MAGIC = ((b"\x1f\x8b", "gzip"), (b"BZh", "bz2"), (b"\x28\xb5\x2f\xfd", "zstd"))
#: Most units one compressed list is cut into (each decompresses from the file's start).
COMPRESSED_UNITS = 16
#: Largest JSON array read (it is parsed whole, by the driver for its layout and by one task).
JSON_ARRAY_BYTES = 256 << 20


def list_name(path: str) -> str:
    """The file's name without a compression suffix (``urls.tsv.gz`` -> ``urls.tsv``)."""
    base = posixpath.basename(path.rstrip("/"))
    head, _, ext = base.rpartition(".")
    return head if head and ext.lower() in COMPRESSIONS else base


def _kind_of(path: str) -> str | None:
    base = list_name(path).lower()
    return EXTENSIONS.get(base.rsplit(".", 1)[-1]) if "." in base else None


def _is_file(path: str) -> bool:
    return storage.is_remote(path) or os.path.isfile(path)


def _open_raw(path: str):
    fs, p = storage.filesystem(path)
    return fs.open_input_file(p)


def codec_of(path: str) -> str | None:
    """The compression of ``path`` by its first bytes (the suffix alone can lie both ways)."""
    with _open_raw(path) as f:
        head = f.read(4)
    for magic, codec in MAGIC:
        if head.startswith(magic):
            if not pa.Codec.is_available(codec):
                raise UsageError(
                    f"{path!r} is {codec}-compressed and this pyarrow lacks {codec}: "
                    "decompress it first"
                )
            return codec
    ext = posixpath.basename(path).rpartition(".")[2].lower()
    if ext in COMPRESSIONS:
        raise UsageError(
            f"{path!r} is named .{ext} but is not {COMPRESSIONS[ext]}-compressed: rename it"
        )
    return None


def _open(path: str, codec: str | None = None):
    """The file's bytes, decompressed when ``codec`` is given."""
    raw = _open_raw(path)
    return pa.CompressedInputStream(raw, codec) if codec else raw


def _sample(path: str, nbytes: int = 1 << 20, codec: str | None = None) -> bytes:
    with _open(path, codec) as f:
        return f.read(nbytes)


def _lines(data: bytes) -> list[str]:
    text = data.decode("utf-8", errors="replace")
    if text.startswith("\ufeff"):
        text = text[1:]
    return text.splitlines()


# --- parsing one line ---------------------------------------------------------


def _split(kind: str, lines: list[str]) -> list[list[str] | None]:
    """Cells of each line (None for a line the CSV reader cannot parse)."""
    if kind == "txt":
        return [[line.strip()] for line in lines]
    if kind == "tsv":
        return [line.split("\t") for line in lines]
    out: list[list[str] | None] = []
    for line in lines:
        try:
            out.append(next(csv.reader([line], strict=True), []))
        except csv.Error:
            out.append(None)
    return out


def _is_url(text: object) -> bool:
    return isinstance(text, str) and text.strip().lower().startswith(("http://", "https://"))


def _pick(names: list[str], wanted: tuple[str, ...]) -> str | None:
    lower = {n.lower(): n for n in names}
    for w in wanted:
        if w in names:
            return w
        if w.lower() in lower:
            return lower[w.lower()]
    return None


# --- types ----------------------------------------------------------------------------


def _infer_text_type(values: list[str]) -> pa.DataType:
    """int64, float64 or string: the narrowest that every non-empty sample value fits."""
    present = [v for v in values if v not in ("", None)]
    if not present:
        return pa.string()
    for t, conv in ((pa.int64(), int), (pa.float64(), float)):
        try:
            for v in present:
                conv(v)
            return t
        except ValueError:
            continue
    return pa.string()


def _infer_json_type(values: list) -> pa.DataType:
    present = [v for v in values if v is not None]
    if not present:
        return pa.string()
    if any(isinstance(v, dict) for v in present):
        return pa.string()  # nested objects are kept as JSON text
    try:
        t = pa.array(present).type
    except (pa.ArrowInvalid, pa.ArrowTypeError):
        return pa.string()
    if pa.types.is_null(t) or pa.types.is_struct(t):
        return pa.string()
    return t


def _type_name(t: pa.DataType) -> str:
    return str(t)


def _type_from_name(name: str) -> pa.DataType:
    simple = {
        "int64": pa.int64(),
        "double": pa.float64(),
        "string": pa.string(),
        "bool": pa.bool_(),
    }
    if name in simple:
        return simple[name]
    if name.startswith("list<item: ") and name.endswith(">"):
        return pa.list_(_type_from_name(name[len("list<item: ") : -1]))
    return pa.string()


def _convert(value, t: pa.DataType, json_values: bool):
    """``value`` as type ``t``; raises ValueError when it does not fit."""
    if value is None or value == "":
        return None
    if not json_values:
        if pa.types.is_integer(t):
            return int(value)
        if pa.types.is_floating(t):
            return float(value)
        return value
    if pa.types.is_string(t):
        if isinstance(value, str):
            return value
        return json.dumps(value, ensure_ascii=False, sort_keys=True)
    try:
        return pa.scalar(value, t).as_py()
    except (pa.ArrowInvalid, pa.ArrowTypeError, TypeError, OverflowError) as e:
        raise ValueError(str(e)) from None


# --- roles --------------------------------------------------------------------------


@dataclass(frozen=True)
class Layout:
    """How the lines of a file map to columns (JSON-able; travels in every unit)."""

    kind: str
    header: bool
    names: tuple[str, ...]  # column names (csv/tsv: by position; jsonl: keys)
    url: str
    caption: str | None
    key: str | None
    keep: tuple[tuple[str, str], ...]  # (column, its type's name)
    #: The table column of each kept column (``URL`` -> ``url``, ``LICENSE`` -> ``license``).
    out: tuple[str, ...] = ()
    #: ``jsonl`` holding one JSON array instead of an object per line.
    array: bool = False

    def to_json(self) -> dict:
        return {
            "kind": self.kind,
            "header": self.header,
            "names": list(self.names),
            "url": self.url,
            "caption": self.caption,
            "key": self.key,
            "keep": [list(k) for k in self.keep],
            "out": list(self.out),
            "array": self.array,
        }

    @staticmethod
    def from_json(d: dict) -> Layout:
        return Layout(
            d["kind"],
            d["header"],
            tuple(d["names"]),
            d["url"],
            d["caption"],
            d["key"],
            tuple((a, b) for a, b in d["keep"]),
            tuple(d.get("out") or ()),
            bool(d.get("array")),
        )


def kept_name(col: str) -> str:
    return f"src_{col}" if col in RESERVED else col


def _json_array(path: str, codec: str | None) -> list:
    """The objects of a file holding one JSON array (read whole: at most JSON_ARRAY_BYTES)."""
    data = _sample(path, JSON_ARRAY_BYTES + 1, codec)
    if len(data) > JSON_ARRAY_BYTES:
        raise UsageError(
            f"{path!r} is a JSON array over {JSON_ARRAY_BYTES >> 20} MiB, read whole; write one "
            "object per line (jq -c '.[]' FILE > FILE.jsonl) and ingest that"
        )
    try:
        value = json.loads(data.decode("utf-8-sig", errors="replace"))
    except ValueError as e:
        raise UsageError(f"{path!r} is not valid JSON: {e}") from None
    if not isinstance(value, list):
        raise UsageError(f"{path!r} holds one JSON value that is not an array of objects")
    return value


def layout_of(
    path: str,
    kind: str,
    *,
    url_column: str | None = None,
    caption_column: str | None = None,
    key_column: str | None = None,
    codec: str | None = None,
) -> Layout:
    """Read the first lines: header or not, the URL/caption/key columns, the others' types."""
    lines = [ln for ln in _lines(_sample(path, codec=codec))[: SAMPLE_LINES + 1] if ln.strip()]
    if not lines:
        raise UsageError(f"{path!r} has no lines: nothing to ingest")
    array = kind == "jsonl" and lines[0].lstrip().startswith("[")
    if kind == "jsonl":
        if array:
            rows = [r for r in _json_array(path, codec)[:SAMPLE_LINES] if isinstance(r, dict)]
        else:
            rows = []
            for ln in lines[:SAMPLE_LINES]:
                try:
                    obj = json.loads(ln)
                except ValueError:
                    continue
                if isinstance(obj, dict):
                    rows.append(obj)
        if not rows:
            raise UsageError(
                f"{path!r} holds no JSON object " + ("in its array" if array else "per line")
            )
        names: list[str] = []
        for r in rows:
            names.extend(k for k in r if k not in names)
        columns = {n: [r.get(n) for r in rows] for n in names}
        header = False
    else:
        cells = [c for c in _split(kind, lines) if c is not None]
        first = cells[0] if cells else []
        wanted = (url_column,) if url_column else URL_NAMES
        header = kind != "txt" and (
            any(c in wanted for c in first)
            or (url_column is None and any(c.lower() in ("url", "image_url") for c in first))
            or (
                len(cells) > 1
                and not any(_is_url(c) for c in first)
                and any(_is_url(c) for c in cells[1])
            )
        )
        if header:
            names = [c.strip() for c in first]
            body = cells[1:]
        else:
            body = cells
            width = len(first)
            at = next((i for i, c in enumerate(first) if _is_url(c)), 0)
            names = [f"column_{i}" for i in range(width)]
            names[at] = "url"
            if width == 2:
                names[1 - at] = "caption"
        if len(set(names)) != len(names):
            raise UsageError(f"{path!r} has repeated column names in its header: {names}")
        columns = {
            n: [row[i] if i < len(row) else "" for row in body[:SAMPLE_LINES]]
            for i, n in enumerate(names)
        }
    url_column = _given(url_column, names)
    caption_column = _given(caption_column, names)
    key_column = _given(key_column, names)
    for given, what in ((url_column, "URL"), (caption_column, "caption"), (key_column, "key")):
        if given is not None and given not in names:
            raise UsageError(
                f"{what} column {given!r} is not in {path!r}; it has {names}"
                + ("" if header or kind == "jsonl" else " (no header: url, caption, column_N)")
            )
    url = url_column or _pick(names, URL_NAMES)
    if url is None:
        raise UsageError(
            f"{path!r} has no URL column (looked for {', '.join(URL_NAMES)} in {names}); "
            "name it with --url-col"
        )
    caption = caption_column or _pick([n for n in names if n != url], CAPTION_KEYS)
    key = key_column or _pick([n for n in names if n not in (url, caption)], KEY_NAMES)
    keep = []
    for n in names:
        if n in (caption, key):
            continue
        if n == url:
            t = pa.string()
        elif kind == "jsonl":
            t = _infer_json_type(columns[n])
        else:
            t = _infer_text_type(columns[n])
        keep.append((n, _type_name(t)))
    renamed = output_names([n for n, _ in keep], url)
    out = tuple(renamed[n] for n, _ in keep)
    return Layout(kind, header, tuple(names), url, caption, key, tuple(keep), out, array)


def _given(column: str | None, names: list[str]) -> str | None:
    """A column the user named, matched case-insensitively when only its case differs."""
    if column is None or column in names:
        return column
    same = [n for n in names if n.lower() == column.lower()]
    return same[0] if len(same) == 1 else column


def extra_fields(layout: Layout) -> list[pa.Field]:
    out = layout.out or tuple(kept_name(n) for n, _ in layout.keep)
    return [pa.field(o, _type_from_name(t)) for o, (_, t) in zip(out, layout.keep, strict=True)]


# --- plan (driver) and load (task) ---------------------------------------------------------


def _cut(
    path: str, lines_per_unit: int, codec: str | None = None
) -> tuple[list[tuple[int, int, int]], int]:
    """(byte start, byte end, first line number) per unit, and the file's line count.

    One streaming pass finding newlines with numpy: memory is one block, and
    the Python work is per block and per unit, not per line. For a compressed
    file the offsets are in the decompressed stream.
    """
    import numpy as np

    units: list[tuple[int, int, int]] = []
    start = 0  # byte offset of the current unit
    unit_first = 0  # line number of its first line
    line = 0  # lines ended so far
    offset = 0
    last = b""
    with _open(path, codec) as f:
        while True:
            block = f.read(_BLOCK)
            if not block:
                break
            ends = np.flatnonzero(np.frombuffer(block, np.uint8) == 10)
            # Line numbers (1-based count) at each newline of this block.
            counts = line + 1 + np.arange(len(ends))
            cut = ends[(counts - unit_first) % lines_per_unit == 0]
            for at in cut.tolist():
                stop = offset + at + 1
                units.append((start, stop, unit_first))
                start = stop
                unit_first += lines_per_unit
            line += len(ends)
            offset += len(block)
            last = block[-1:]
    if offset > start:
        units.append((start, offset, unit_first))
    if offset and last != b"\n":
        line += 1
    return units, line


def _merge_units(units: list[tuple[int, int, int]], most: int) -> list[tuple[int, int, int]]:
    """At most ``most`` units of contiguous ranges (a compressed file's units each decompress
    from the start: more of them would cost more than they spread)."""
    if len(units) <= most:
        return units
    per = -(-len(units) // most)
    return [
        (units[i][0], units[min(i + per, len(units)) - 1][1], units[i][2])
        for i in range(0, len(units), per)
    ]


class UrlListReader:
    """The reader of one URL-list format (a module-like object for :data:`READERS`)."""

    def __init__(self, kind: str):
        self.KIND = kind

    def detect(self, path: str) -> bool:
        if _kind_of(path) != self.KIND or not _is_file(path):
            return False
        if list_name(path).lower().endswith(".txt") and not storage.is_remote(path):
            # A caption sidecar next to images is a folder's business; a URL list starts with one.
            return _starts_with_url(path)
        return True

    def plan(
        self,
        path: str,
        source: str | None = None,
        *,
        url_column: str | None = None,
        caption_column: str | None = None,
        key_column: str | None = None,
        items_per_unit: int = DEFAULT_ITEMS_PER_UNIT,
    ) -> Plan:
        if not _is_file(path):
            raise UsageError(f"{path!r} is not a file: a {self.KIND} URL list is one file")
        return plan_files(
            [(path, "")],
            self.KIND,
            source or list_name(path) or self.KIND,
            url_column=url_column,
            caption_column=caption_column,
            key_column=key_column,
            items_per_unit=items_per_unit,
        )

    def load(self, unit: WorkUnit, counts: Counts) -> pa.Table:
        return load(unit, counts)


def _starts_with_url(path: str) -> bool:
    codec = codec_of(path)
    first = next((ln for ln in _lines(_sample(path, 4096, codec)) if ln.strip()), "")
    return _is_url(first)


def plan_files(
    files: list[tuple[str, str]],
    kind: str | None,
    source: str,
    *,
    url_column: str | None = None,
    caption_column: str | None = None,
    key_column: str | None = None,
    items_per_unit: int = DEFAULT_ITEMS_PER_UNIT,
) -> Plan:
    """Plan URL lists ``(path, id prefix)`` under one source name; ``kind`` None: each file's
    own (a folder of lists may mix them). Ids are ``<source>/<prefix><key>``."""
    units: list[WorkUnit] = []
    fields: dict[str, pa.Field] = {}
    size = lines_total = 0
    for path, prefix in files:
        file_kind = kind or _kind_of(path)
        if file_kind is None:
            raise UsageError(f"cannot tell the URL list format of {path!r}; pass --format")
        codec = codec_of(path)
        layout = layout_of(
            path,
            file_kind,
            url_column=url_column,
            caption_column=caption_column,
            key_column=key_column,
            codec=codec,
        )
        for f in extra_fields(layout):
            if f.name in fields and fields[f.name].type != f.type:
                if pa.types.is_string(fields[f.name].type):
                    continue
                if not pa.types.is_string(f.type):
                    raise UsageError(
                        f"column {f.name!r} is {fields[f.name].type} in one list and {f.type} "
                        f"in {path!r}; ingest them separately"
                    )
            fields[f.name] = f
        if layout.array:
            ranges, lines = [(0, 0, 0)], 0
        else:
            ranges, lines = _cut(path, max(1, items_per_unit), codec)
            if codec is not None:
                ranges = _merge_units(ranges, COMPRESSED_UNITS)
        ends = [first for _, _, first in ranges[1:]] + [lines]
        units.extend(
            WorkUnit(
                file_kind,
                source,
                {
                    "file": path,
                    "start": a,
                    "end": b,
                    "line": first,
                    "rows": max(0, end - first),  # lines: how the ingest job sizes its work
                    "layout": layout.to_json(),
                    "codec": codec,
                    "prefix": prefix,
                },
            )
            for (a, b, first), end in zip(ranges, ends, strict=True)
        )
        size += ranges[-1][1] if ranges else 0
        lines_total += lines
    approx = size / lines_total if lines_total else None
    return Plan(units, list(fields.values()), Counts(), approx)


def _read_range(path: str, start: int, end: int, codec: str | None = None) -> bytes:
    with _open(path, codec) as f:
        if codec is None:
            f.seek(start)
        else:  # a compressed stream is read from its start
            left = start
            while left:
                got = len(f.read(min(left, _BLOCK)))
                if not got:
                    break
                left -= got
        return f.read(end - start)


def load(unit: WorkUnit, counts: Counts) -> pa.Table:
    """The rows of one line range, built column by column (no per-row table machinery)."""
    a = unit.args
    layout = Layout.from_json(a["layout"])
    codec = a.get("codec")
    texts: list = []
    not_utf8 = set()
    if layout.array:  # the elements themselves, parsed once (the file is capped)
        texts = _json_array(a["file"], codec)
    else:
        lines = _read_range(a["file"], a["start"], a["end"], codec).split(b"\n")
        if lines and lines[-1] == b"":
            lines.pop()
        for pos, raw in enumerate(lines):
            try:
                texts.append(raw.decode("utf-8").removesuffix("\r"))
            except UnicodeDecodeError:
                texts.append(raw.decode("utf-8", errors="replace").removesuffix("\r"))
                not_utf8.add(pos)
    first_line = a["line"]
    if first_line == 0 and texts and isinstance(texts[0], str) and texts[0].startswith("\ufeff"):
        texts[0] = texts[0][1:]
    skip_header = layout.header and first_line == 0
    types = {n: _type_from_name(t) for n, t in layout.keep}
    strings = {n for n, t in types.items() if pa.types.is_string(t)}
    json_values = layout.kind == "jsonl"
    cells = None if json_values else _split(layout.kind, texts)
    index = {n: i for i, n in enumerate(layout.names)}
    width = len(layout.names)
    ids: list[str] = []
    captions: list[str | None] = []
    notes: list[list[str]] = []
    extra: dict[str, list] = {n: [] for n in types}
    prefix = f"{unit.source}/{a.get('prefix') or ''}"
    for pos, text in enumerate(texts):
        if skip_header and pos == 0:
            continue
        if layout.array:
            obj = text
        elif not text.strip():
            counts.dropped("blank_line")
            continue
        if json_values:
            if not layout.array:
                try:
                    obj = json.loads(text)
                except ValueError:
                    counts.dropped("bad_json_line")
                    continue
            if not isinstance(obj, dict):
                counts.dropped("bad_json_line")
                continue
            get = obj.get
        else:
            row = cells[pos]
            if row is None or (layout.kind != "txt" and len(row) != width):
                counts.dropped("bad_row")
                continue
            get = lambda n, _row=row: _row[index[n]] if n in index else None  # noqa: E731
        url = get(layout.url)
        if not isinstance(url, str) or not url.strip():
            counts.dropped("no_url")
            continue
        row_notes = ["line_not_utf8"] if pos in not_utf8 else []
        for name, t in types.items():
            if name == layout.url:
                extra[name].append(url.strip())
                continue
            value = get(name)
            if name in strings and (value is None or isinstance(value, str)):
                extra[name].append(value or None)
                continue
            try:
                extra[name].append(_convert(value, t, json_values))
            except ValueError:
                row_notes.append(f"bad_value:{name}")
                extra[name].append(None)
        caption = get(layout.caption) if layout.caption else None
        if caption is not None and not isinstance(caption, str):
            caption = json.dumps(caption, ensure_ascii=False)
        caption = caption.strip() if caption else None
        if not caption:
            caption = None
            row_notes.append("caption_missing")
        row_notes.append(f"probe_error:{MISSING}")
        key_value = get(layout.key) if layout.key else None
        if key_value in (None, ""):
            key_value = first_line + pos - (1 if layout.header else 0)
        ids.append(prefix + str(key_value))
        captions.append(caption)
        notes.append(row_notes)
    n = len(ids)
    given = {
        S.ID: pa.array(ids, pa.string()),
        S.SOURCE: pa.array([unit.source] * n, pa.string()),
        S.CAPTION: pa.array(captions, pa.string()),
        S.PROBE_ERROR: pa.array([MISSING] * n, pa.string()),
    }
    arrays = [
        given[f.name].cast(f.type) if f.name in given else pa.nulls(n, f.type)
        for f in S.TABLE_SCHEMA
    ]
    fields = list(S.TABLE_SCHEMA)
    for f, (name, t) in zip(extra_fields(layout), types.items(), strict=True):
        arrays.append(pa.array(extra[name], t))
        fields.append(f)
    arrays.append(pa.array(notes, pa.list_(pa.string())))
    fields.append(pa.field(NOTES, pa.list_(pa.string())))
    return pa.Table.from_arrays(arrays, schema=pa.schema(fields))


class UrlListFolder:
    """A folder holding only URL lists (img2dataset's ``--url_list`` folder): each file is read
    as its format says, ids ``<folder>/<relative path>/<key>``. Detected before the image
    folder reader, which would find no image in it."""

    KIND = "urllists"

    @staticmethod
    def _lists(root: str) -> list[str] | None:
        from prx_data.ingest import folder

        if not folder.is_folder(root):
            return None
        files = folder._list(root)
        if not files or any(_kind_of(rel) is None for rel in files):
            return None
        return files

    def detect(self, path: str) -> bool:
        files = self._lists(path)
        if not files:
            return False
        txt = [r for r in files if _kind_of(r) == "txt"]
        return not txt or _starts_with_url(posixpath.join(path.rstrip("/"), txt[0]))

    def plan(
        self,
        path: str,
        source: str | None = None,
        *,
        url_column: str | None = None,
        caption_column: str | None = None,
        key_column: str | None = None,
        items_per_unit: int = DEFAULT_ITEMS_PER_UNIT,
    ) -> Plan:
        root = path.rstrip("/") or "/"
        files = self._lists(root)
        if not files:
            raise UsageError(
                f"{path!r} is not a folder of URL lists (.txt, .csv, .tsv, .jsonl, .json, "
                "optionally .gz/.bz2/.zst) and nothing else"
            )
        return plan_files(
            [
                (
                    posixpath.join(root, rel),
                    posixpath.join(posixpath.dirname(rel), list_name(rel)) + "/",
                )
                for rel in files
            ],
            None,
            source or posixpath.basename(root) or self.KIND,
            url_column=url_column,
            caption_column=caption_column,
            key_column=key_column,
            items_per_unit=items_per_unit,
        )

    def load(self, unit: WorkUnit, counts: Counts) -> pa.Table:
        return load(unit, counts)


READERS = (*(UrlListReader(k) for k in KINDS), UrlListFolder())
