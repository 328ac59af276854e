"""Attached columns beside an export: where they live, their record, the checked read.

A column attached to an export (``python -m prx_data.attach``) is one file per
MDS shard, ``_columns/<name>/<tier>/<ar>/<part>/shard.NNNNN.<ext>``, holding a
row per stored sample of the shard, in the shard's sample order. The shards,
their indexes, skip lists and id index stay as they are: a new caption or score
column is written once, beside them. A column's files are of one of two kinds,
which its producer chooses and its record names (``kind``):

* ``arrow`` (table columns: captions, scores, labels): an Arrow IPC file with one
  field named ``<name>``, because a table column can be any Arrow type (strings
  with nulls, lists, numbers); the format gives a schema checked before a value is
  read. zstd-compressed; small enough to be read whole (:data:`MAX_FILE_BYTES`).
* ``npy`` (computed fixed-shape tensors: text embeddings ``[L, D]`` and their
  attention masks ``[L]``): a ``.npy`` of ``[samples, *shape]`` in the record's
  storage ``dtype`` (bfloat16 as ``uint16`` bits, float16, float32; masks
  ``uint8``), as precomputed latents are stored (:mod:`prx_data.export.npyfile`).
  A shard of a real encoder's embeddings is gigabytes (T5-XXL: 256 x 4096 values a
  caption), so the loader maps the file and reads the served sample's row only;
  its size cap is the record's byte count. Records written before this kind
  existed have no ``kind`` and are ``arrow``; they are still served.

``_columns/<name>/record`` (JSON text; not ``*.json``, which streaming's
``merge_index`` would take for an index) names the column's kind and Arrow type
(``arrow``) or storage dtype and per-sample shape (``npy``), where it came from
(the table, its version, the source column; for text columns the encoder) and
binds each file to the shard it was made from (:mod:`prx_data.export.bound`): a
file made from other shard content, or whose bytes changed, is refused in one line.
"""

from __future__ import annotations

import base64
import re
from collections.abc import Iterable, Mapping
from typing import Any

import pyarrow as pa

from prx_data.core import confined, storage
from prx_data.core.errors import PrxDataError
from prx_data.export import bound, npyfile
from prx_data.export.layout import ShardInfo
from prx_data.export.naming import COLUMNS_DIR

RECORD_BASENAME = "record"
RECORD_FORMAT = "prx-data attached column"
RECORD_VERSION = 1
#: The attach job's own lease (one run per export; skip-list updates go on meanwhile).
LOCK_NAME = f"{COLUMNS_DIR}/.lock"
#: The kinds of files a column may have (:func:`kind_of`); each is also its files' extension.
ARROW, NPY = "arrow", "npy"
KINDS = (ARROW, NPY)
#: Storage dtypes of an ``npy`` column: floats (embeddings) and ``uint8`` (masks).
NPY_DTYPES = (*npyfile.DTYPES, "uint8")
#: Largest record read back (a million shards at ~300 bytes each).
MAX_RECORD_BYTES = 1 << 30
#: Largest ``arrow`` column file read whole (a shard's captions of a few thousand samples);
#: an ``npy`` file is mapped, its size is the record's.
MAX_FILE_BYTES = 1 << 30
#: A column's name: a file-name part and an item key (no dots, slashes or leading digit).
NAME_RE = re.compile(r"[A-Za-z_][A-Za-z0-9_]{0,127}")
JOB = "python -m prx_data.attach"


class AttachedError(PrxDataError, ValueError):
    """An attached column that is missing, stale, foreign or malformed; one line says what to do."""


def check_name(name: str) -> str:
    if not isinstance(name, str) or not NAME_RE.fullmatch(name):
        raise AttachedError(
            f"{name!r}: not an attached column name (letters, digits and _, not starting with "
            "a digit)"
        )
    return name


def record_rel(name: str) -> str:
    return f"{COLUMNS_DIR}/{check_name(name)}/{RECORD_BASENAME}"


def shard_key(bucket: str, basename: str) -> str:
    return bound.shard_key(bucket, basename, AttachedError)


def file_rel(name: str, key: str, kind: str = ARROW) -> str:
    """Path of a shard's column file (of ``kind``, its extension) relative to the export root."""
    return bound.file_rel(f"{COLUMNS_DIR}/{check_name(name)}", key, _ext(kind))


def file_path(root: str, name: str, key: str, kind: str = ARROW) -> str:
    return storage.join(root, *file_rel(name, key, kind).split("/"))


def _ext(kind: str) -> str:
    if kind not in KINDS:
        raise AttachedError(f"{kind!r}: not a kind of attached column file ({', '.join(KINDS)})")
    return kind


def kind_of(record: Mapping[str, Any]) -> str:
    """The kind of a column's files as its record names it (none: ``arrow``, as records
    written before ``npy`` existed)."""
    kind = record.get("kind", ARROW)
    if kind not in KINDS:
        raise AttachedError(
            f"column {record.get('column')!r}: its record names files of kind {kind!r}, which "
            f"this prx-data does not read; run {JOB} again with --replace"
        )
    return str(kind)


def npy_body(dtype: str, shape: Iterable[int]) -> dict[str, Any]:
    """The record fields of an ``npy`` column: storage dtype and one sample's shape."""
    return {"kind": NPY, "dtype": dtype, "shape": [int(x) for x in shape]}


def arrow_body(t: pa.DataType) -> dict[str, Any]:
    """The record fields of an ``arrow`` column: its Arrow type."""
    return {"kind": ARROW, "type": type_text(t)}


def storage_of(record: Mapping[str, Any]) -> dict[str, Any]:
    """What a record says of its files (kind, and type or dtype and shape): a rerun keeps a
    column's files only when this is what it would write."""
    if kind_of(record) == NPY:
        dtype, shape = npy_spec(record)
        return npy_body(dtype, shape)
    return {"kind": ARROW, "type": str(record.get("type", ""))}


def npy_spec(record: Mapping[str, Any]) -> tuple[str, tuple[int, ...]]:
    """``(storage dtype, one sample's shape)`` of an ``npy`` column's record, checked."""
    dtype, shape = record.get("dtype"), record.get("shape")
    if (
        dtype not in NPY_DTYPES
        or not isinstance(shape, list)
        or not all(isinstance(x, int) and 0 < x < 1 << 31 for x in shape)
    ):
        raise AttachedError(
            f"column {record.get('column')!r}: its record names no valid dtype and shape "
            f"({dtype!r}, {shape!r}); run {JOB} again with --replace"
        )
    return str(dtype), tuple(shape)


def cache_rel(name: str, basename: str, digest: str, kind: str = ARROW) -> str:
    """Where a remote export's column file of shard ``basename`` lies in the node's cache,
    relative to the cached bucket folder (named by its digest: a changed file is another
    file, never a stale copy)."""
    stem = basename.split(".mds", 1)[0]
    if not re.fullmatch(r"[0-9a-f]{1,32}", str(digest)):
        raise AttachedError(f"{digest!r}: not an xxh64 digest of an attached column file")
    return f"{COLUMNS_DIR}/{check_name(name)}/{stem}.{digest}.{_ext(kind)}"


def encode(name: str, values: pa.Array) -> bytes:
    """The IPC file bytes of one shard's column (zstd-compressed buffers)."""
    table = pa.table({name: values})
    sink = pa.BufferOutputStream()
    options = pa.ipc.IpcWriteOptions(compression="zstd")
    with pa.ipc.new_file(sink, table.schema, options=options) as w:
        w.write_table(table)
    return sink.getvalue().to_pybytes()


def type_text(t: pa.DataType) -> str:
    """An Arrow type as the record keeps it (its IPC schema, base64): compared exactly."""
    return base64.b64encode(pa.schema([("v", t)]).serialize().to_pybytes()).decode()


def type_of(text: str) -> pa.DataType:
    try:
        return pa.ipc.read_schema(pa.py_buffer(base64.b64decode(text))).field(0).type
    except (ValueError, TypeError, pa.ArrowInvalid, IndexError):
        raise AttachedError(f"{text[:40]!r}: not an Arrow type of an attached column") from None


def decode(data: bytes, name: str, want: pa.DataType, samples: int, where: str) -> pa.Array:
    """One shard's column from its IPC bytes, after checking its schema and length."""
    try:
        reader = pa.ipc.open_file(pa.py_buffer(data))
        schema = reader.schema
    except (pa.ArrowInvalid, OSError, ValueError) as e:
        raise AttachedError(f"{where}: not an Arrow IPC file ({e}); run {JOB} again") from None
    if schema.names != [name] or schema.field(0).type != want:
        raise AttachedError(
            f"{where}: holds {schema}, the record says one field {name}: {want}; run {JOB} again"
        )
    try:
        table = reader.read_all()
    except (pa.ArrowInvalid, OSError, ValueError) as e:
        raise AttachedError(f"{where}: unreadable ({e}); run {JOB} again") from None
    if table.num_rows != samples:
        raise AttachedError(
            f"{where}: {table.num_rows} rows, its shard holds {samples} samples; run {JOB} again"
        )
    return table.column(0).combine_chunks()


def _record_args(name: str) -> dict[str, Any]:
    return {
        "fmt": RECORD_FORMAT,
        "version": RECORD_VERSION,
        "error": AttachedError,
        "job": JOB,
        "args": f"--table TABLE --columns {name}",
    }


def read_record(root: str, name: str) -> dict[str, Any] | None:
    """The record of column ``name`` of the export at ``root``, or None when it has none."""
    record = bound.read_record(
        root, record_rel(name), max_bytes=MAX_RECORD_BYTES, **_record_args(name)
    )
    return None if record is None else _named(record, root, name)


def parse_record(raw: bytes, root: str, name: str) -> dict[str, Any]:
    """A record's bytes read elsewhere (a node's cache of a remote export), checked the same
    way as :func:`read_record` checks them."""
    record = bound.parse_record(raw, root, record_rel(name), **_record_args(name))
    return _named(record, root, name)


def _named(record: dict[str, Any], root: str, name: str) -> dict[str, Any]:
    if record.get("column") != name:
        raise AttachedError(
            f"{storage.join(root, record_rel(name))}: a record of column "
            f"{record.get('column')!r}, not {name!r}; run {JOB} again"
        )
    return record


def write_record(root: str, name: str, body: Mapping[str, Any], shards: Mapping[str, dict]) -> None:
    head = {"format": RECORD_FORMAT, "version": RECORD_VERSION, "column": name, **body}
    bound.write_record(root, record_rel(name), {**head, "shards": shards})


def list_columns(root: str) -> list[str]:
    """Names of the columns attached to the export (those with a record)."""
    base = storage.join(root, COLUMNS_DIR)
    names = set()
    for rel in storage.list_files(base):
        bits = rel.replace("\\", "/").split("/")
        if len(bits) == 2 and bits[1] == RECORD_BASENAME and NAME_RE.fullmatch(bits[0]):
            names.add(bits[0])
    return sorted(names)


def all_columns(root: str) -> list[str]:
    """The export's attached columns as the loader finds them: :func:`list_columns` and
    ``img_latent`` (:data:`prx_data.export.latents.COLUMN`) when the export has latents."""
    from prx_data.export import latents

    names = set(list_columns(root))
    if storage.exists(storage.join(root, *latents.RECORD_NAME.split("/"))):
        names.add(latents.COLUMN)
    return sorted(names)


def stale_shards(record: Mapping[str, Any], bucket: str, shards: Iterable[ShardInfo]) -> list[str]:
    """Shards of ``bucket`` whose column file is missing or was made from other shard data."""
    return bound.stale_shards(record.get("shards") or {}, bucket, shards, AttachedError)


def require_current(
    root: str, name: str, record: Mapping[str, Any], bucket: str, shards: Iterable[ShardInfo]
) -> None:
    """Refuse, in one line, a column set made from other shards than ``bucket`` holds now."""
    stale = stale_shards(record, bucket, shards)
    if stale:
        raise AttachedError(
            f"{root}: column {name!r} was not made from the current data of {len(stale)} "
            f"shard(s) (first: {stale[0]}); run {JOB} {root} --table TABLE --columns {name}"
        )


def read_file(
    root: str, name: str, key: str, rec: Mapping[str, Any], want: pa.DataType, path: str
) -> pa.Array:
    """One shard's column at ``path`` (inside ``root``), read confined (a regular file, capped
    at the size the record names), its bytes checked against the record's xxh64, its schema
    and length against the record and the shard."""
    size = int(rec.get("bytes", -1))
    if size < 0:
        raise AttachedError(f"{root}: column {name!r} records no size for {key}; run {JOB}")
    try:
        data = confined.read(root, path, min(size, MAX_FILE_BYTES))
    except FileNotFoundError:
        raise AttachedError(f"{path}: missing; run {JOB} {root} --columns {name}") from None
    except confined.UnsafeFileError as e:
        raise AttachedError(f"{e}; run {JOB} {root} --columns {name} again") from None
    if len(data) != size or bound.xxh64(data) != rec.get("xxh64"):
        raise AttachedError(
            f"{path}: its bytes differ from what the column's record names (a foreign or "
            f"changed file); run {JOB} {root} --columns {name} --replace"
        )
    return decode(data, name, want, int(rec["samples"]), path)


def open_npy(
    root: str, name: str, rec: Mapping[str, Any], dtype: str, shape: tuple[int, ...], where: tuple
) -> Any:
    """One shard's ``npy`` column, memory-mapped after its checks
    (:func:`prx_data.export.npyfile.open_npy`: confined to ``where[0]``, the file
    ``where[1]``, exactly the record's ``bytes``, its header the record's dtype and
    ``[samples, *shape]``). Nothing but the header is read here."""
    base, path = where
    return npyfile.open_npy(
        base,
        path,
        dtype,
        (int(rec["samples"]), *shape),
        nbytes=int(rec.get("bytes", -1)),
        error=AttachedError,
        what=f"file of attached column {name!r}",
        redo=f"{JOB} {root} --table TABLE --columns {name}",
    )


def npy_row(arr: Any, i: int, dtype: str, where: str) -> Any:
    """Row ``i`` of a mapped ``npy`` column as served: floats as float32 (a bfloat16 row
    from its bits), refused when not finite; masks as ``uint8``. Reads that row only."""
    import numpy as np

    if dtype == "uint8":
        return np.array(arr[i], dtype=np.uint8)
    out = npyfile.from_stored(arr[i], dtype)
    if not np.isfinite(out).all():
        raise AttachedError(f"{where}: holds NaN or infinite values; run {JOB} again --replace")
    return out


#: Computed text-encoder columns, named as PRX's ``StreamingProcessedDataset`` reads them.
TEXT_PREFIXES = ("latent", "attention_mask")


def encoder_label(name_or_path: str) -> str:
    """The ``<encoder>`` part of a text column's name from an encoder's path or hub id
    (its last path part, lower case, other characters as ``_``): ``t5gemma`` for
    ``google/t5gemma``."""
    base = str(name_or_path).rstrip("/").rsplit("/", 1)[-1].lower()
    return re.sub(r"[^a-z0-9_]", "_", base) or "encoder"


def text_names(caption: str, encoder: str) -> tuple[str, str]:
    """``(latent_<caption>_<encoder>, attention_mask_<caption>_<encoder>)``: the attached
    columns holding a caption column's embeddings [L, D] and attention masks [L]."""
    return tuple(check_name(f"{p}_{caption}_{encoder}") for p in TEXT_PREFIXES)  # type: ignore[return-value]


def empty_value(record: Mapping[str, Any]) -> Any:
    """The value a text column's record keeps for the empty caption (caption dropout), as a
    numpy array of the column's shape, or None when the record is not a text column's."""
    import numpy as np

    empty = (record.get("source") or {}).get("empty")
    if not isinstance(empty, Mapping):
        return None
    try:
        arr = np.frombuffer(base64.b64decode(str(empty["data"])), dtype=np.dtype(empty["dtype"]))
        return arr.reshape([int(x) for x in empty["shape"]])
    except (KeyError, ValueError, TypeError):
        raise AttachedError(
            f"column {record.get('column')!r}: its record's empty-caption value is malformed; "
            f"run {JOB} again with --replace"
        ) from None


def fixed_numpy(arr: pa.Array, where: str) -> Any:
    """A (nested) fixed-size-list column as one numpy array [rows, *shape], its floats
    checked finite: how the loader serves stored embeddings and masks."""
    import numpy as np

    shape = []
    flat: pa.Array = arr
    while pa.types.is_fixed_size_list(flat.type):
        if flat.null_count:
            raise AttachedError(f"{where}: a null in a fixed-shape column; run {JOB} again")
        shape.append(flat.type.list_size)
        flat = flat.flatten()
    out = flat.to_numpy(zero_copy_only=False).reshape(len(arr), *shape)
    if out.dtype.kind == "f" and not np.isfinite(out).all():
        raise AttachedError(f"{where}: holds NaN or infinite values; run {JOB} again --replace")
    return out


def text_encoder_differences(had: Mapping[str, Any], want: Mapping[str, Any]) -> list[str]:
    """What differs between a text column's recorded encoder and ``want`` (``key a -> b``):
    the weights digest, max length and layer; empty when the embeddings are this encoder's."""
    return [
        f"{k} {had.get(k)!r} -> {want[k]!r}"
        for k in ("weights", "max_length", "layer")
        if had.get(k) != want[k]
    ]
