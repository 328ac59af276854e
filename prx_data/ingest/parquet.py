"""Parquet sources: Hugging Face dataset exports, LAION-style metadata, any image table.

Column roles are detected from names and types (each can be forced):

- image: a binary column (``image``, ``jpg``, ``png``, ``img``, ``bytes``...)
  or a Hugging Face ``Image`` struct ``{bytes, path}``; else a path column
  (``path``, ``file_name``, ``image_path``...), relative to the parquet file;
  with neither (LAION metadata: ``url`` + ``TEXT``) rows are kept without
  image bytes (``probe_error = missing_image``) so a download job can fill them;
- caption: ``caption``, ``text``, ``TEXT``, ``prompt``...;
- key: ``key``, ``id``, ``__key__``, ``uid``... else ``<file stem>/<row>``;
- embedding: a list of floats named ``embedding``/``clip_embedding``/... ->
  the table's fixed-size ``embedding`` column.

Every other column is kept under its own name (prefixed ``src_`` when it
clashes with a table column such as ``width``).
"""

from __future__ import annotations

import os
import posixpath
from collections import Counter
from dataclasses import asdict, dataclass

import pyarrow as pa
import pyarrow.parquet as pq

from prx_data.core import schema as S
from prx_data.core import storage
from prx_data.core.errors import UsageError
from prx_data.ingest.common import (
    CAPTION_KEYS,
    IMAGE_EXTENSIONS,
    Counts,
    Plan,
    RowBuilder,
    WorkUnit,
    decode_text,
    strip_ext,
)

KIND = "parquet"
DEFAULT_ITEMS_PER_UNIT = 1024

IMAGE_NAMES = ("image", "jpg", "jpeg", "png", "webp", "img", "image_bytes", "bytes")
PATH_NAMES = ("image_path", "path", "file_name", "filename", "filepath", "file")
KEY_NAMES = ("key", "__key__", "id", "uid", "sample_id", "image_id")
EMBEDDING_NAMES = ("embedding", "clip_embedding", "image_embedding", "img_embedding", "clip")
#: Table columns the ingest computes itself; a source column of that name is renamed.
RESERVED = set(S.TABLE_SCHEMA.names) | {S.EMBEDDING, "__notes"}


@dataclass
class Roles:
    """Which source column plays which part (None: absent)."""

    image: str | None = None
    image_is_struct: bool = False  # HF Image feature: struct<bytes, path>
    path: str | None = None
    caption: str | None = None
    key: str | None = None
    embedding: str | None = None
    embedding_dim: int | None = None
    keep: tuple[str, ...] = ()  # other columns, kept as they are (renamed if reserved)


def kept_name(col: str) -> str:
    return f"src_{col}" if col in RESERVED else col


def output_names(names: list[str] | tuple[str, ...], url: str | None = None) -> dict[str, str]:
    """The table column of each kept source column. LAION's upper-case names are lower-cased
    (``URL`` -> ``url``, ``LICENSE`` -> ``license``, ``WIDTH`` -> ``src_width``) so a table fed
    by a LAION parquet and a CSV has one ``url`` column, which export and download read; the
    URL column of a list (``url``) is ``url`` whatever it was called. A name whose lower case
    another shares, or that would take a name already given, keeps its spelling (``src_``
    before it when it clashes); mixed-case names (``aestheticScore``) stay as they are."""
    lower = Counter(n.lower() for n in names)
    out: dict[str, str] = {}
    taken: set[str] = set()
    if url is not None:
        out[url] = "url"
        taken.add("url")
    for n in names:
        if n == url:
            continue
        name = kept_name(n.lower() if n.isupper() and lower[n.lower()] == 1 else n)
        if name in taken:
            name = f"src_{n}"
        out[n] = name
        taken.add(name)
    return out


def _is_binary(t: pa.DataType) -> bool:
    return pa.types.is_binary(t) or pa.types.is_large_binary(t) or pa.types.is_fixed_size_binary(t)


def _is_hf_image(t: pa.DataType) -> bool:
    return pa.types.is_struct(t) and t.get_field_index("bytes") >= 0


def _is_float_list(t: pa.DataType) -> bool:
    return (
        pa.types.is_list(t) or pa.types.is_large_list(t) or pa.types.is_fixed_size_list(t)
    ) and pa.types.is_floating(t.value_type)


def _pick(names: list[str], wanted: tuple[str, ...], ok=lambda n: True) -> str | None:
    lower = {n.lower(): n for n in names}
    for w in wanted:
        for cand in (w, w.lower()):
            if cand in names and ok(cand):
                return cand
            if cand in lower and ok(lower[cand]):
                return lower[cand]
    return None


def detect_roles(
    schema: pa.Schema,
    *,
    image_column: str | None = None,
    path_column: str | None = None,
    caption_column: str | None = None,
    key_column: str | None = None,
    embedding_column: str | None = None,
) -> Roles:
    names = schema.names
    for given in (image_column, path_column, caption_column, key_column, embedding_column):
        if given is not None and given not in names:
            raise UsageError(f"column {given!r} not in the source; it has {names}")
    types = {f.name: f.type for f in schema}
    image = image_column or _pick(
        names, IMAGE_NAMES, lambda n: _is_binary(types[n]) or _is_hf_image(types[n])
    )
    if image is None:
        image = next((n for n in names if _is_hf_image(types[n])), None)
    path = path_column
    if path is None and image is None:
        path = _pick(
            names,
            PATH_NAMES,
            lambda n: pa.types.is_string(types[n]) or pa.types.is_large_string(types[n]),
        )
    caption = caption_column or _pick(
        names,
        CAPTION_KEYS,
        lambda n: (
            pa.types.is_string(types[n])
            or pa.types.is_large_string(types[n])
            or _is_binary(types[n])
        ),
    )
    key = key_column or _pick(names, KEY_NAMES, lambda n: not _is_binary(types[n]))
    embedding = embedding_column or _pick(
        names, EMBEDDING_NAMES, lambda n: _is_float_list(types[n])
    )
    dim = None
    if embedding is not None:
        t = types[embedding]
        if not _is_float_list(t):
            raise UsageError(f"embedding column {embedding!r} is {t}, not a list of floats")
        if pa.types.is_fixed_size_list(t):
            dim = t.list_size
    used = {image, path, caption, key, embedding} - {None}
    keep = tuple(n for n in names if n not in used)
    return Roles(
        image=image,
        image_is_struct=image is not None and _is_hf_image(types[image]),
        path=path,
        caption=caption,
        key=key,
        embedding=embedding,
        embedding_dim=dim,
        keep=keep,
    )


def extra_fields(schema: pa.Schema, roles: Roles) -> list[pa.Field]:
    fields = []
    out = output_names(roles.keep)
    for n in roles.keep:
        t = schema.field(n).type
        if pa.types.is_null(t):
            t = pa.string()
        fields.append(pa.field(out[n], t))
    if roles.path is not None:
        fields.append(pa.field("source_file", pa.string()))
    if roles.embedding is not None and roles.embedding_dim:
        fields.append(pa.field(S.EMBEDDING, pa.list_(pa.float32(), roles.embedding_dim)))
    return fields


def embedding_dim(batch_column: pa.ChunkedArray | pa.Array) -> int | None:
    for v in batch_column.to_pylist():
        if v:
            return len(v)
    return None


def rows_from_batch(
    batch: pa.Table,
    roles: Roles,
    rows: RowBuilder,
    counts: Counts,
    *,
    key_prefix: str,
    start: int,
    base_dir: str | None,
) -> None:
    """Add one row per record of ``batch`` to ``rows`` according to ``roles``."""
    n = batch.num_rows
    col = {name: batch[name].to_pylist() for name in batch.column_names}
    out = output_names(roles.keep)
    for i in range(n):
        image = None
        error = None
        extra: dict = {}
        if roles.image is not None:
            value = col[roles.image][i]
            if roles.image_is_struct and isinstance(value, dict):
                image = value.get("bytes")
                if image is None and value.get("path") and base_dir is not None:
                    image, error = _read_path(base_dir, value["path"])
            else:
                image = value
        elif roles.path is not None:
            rel = col[roles.path][i]
            extra["source_file"] = rel
            if rel:
                image, error = _read_path(base_dir, rel)
        if roles.path is not None and "source_file" not in extra:
            extra["source_file"] = col[roles.path][i]
        caption = (
            decode_text(col[roles.caption][i], counts)
            if roles.caption
            else decode_text(None, counts)
        )
        if roles.key is not None and col[roles.key][i] is not None:
            key = str(col[roles.key][i])
        else:
            key = f"{key_prefix}/{start + i}" if key_prefix else str(start + i)
        for name in roles.keep:
            extra[out[name]] = col[name][i]
        if roles.embedding is not None:
            vec = col[roles.embedding][i]
            if vec is not None and roles.embedding_dim and len(vec) != roles.embedding_dim:
                counts.kept("embedding_bad_length")
                vec = None
            extra[S.EMBEDDING] = vec
        rows.add(key, image, caption, error=error, **extra)


def _read_path(base_dir: str | None, rel: str) -> tuple[bytes | None, str | None]:
    path = (
        rel
        if (os.path.isabs(rel) or storage.is_remote(rel) or base_dir is None)
        else storage.join(base_dir, rel)
    )
    try:
        if storage.is_remote(path):
            return storage.read_bytes(path), None
        with open(path, "rb") as f:
            return f.read(), None
    except OSError as e:
        return None, f"read_error:{type(e).__name__}"


# --- parquet files ---------------------------------------------------------------


def _files(path: str) -> list[str]:
    if path.endswith(".parquet") or (not storage.is_remote(path) and os.path.isfile(path)):
        return [path]
    return [storage.join(path, p) for p in storage.list_files(path, ".parquet")]


def detect(path: str) -> bool:
    """A ``.parquet`` path, or a folder with parquet files (top level or one below, as in
    Hugging Face exports' ``data/``) and no images or tars beside them."""
    if path.endswith(".parquet"):
        return True
    if storage.is_remote(path) or not os.path.isdir(path) or path.rstrip("/").endswith(".lance"):
        return False
    names: list[str] = []
    with os.scandir(path) as it:
        for entry in it:
            if entry.is_dir() and not entry.name.startswith("."):
                names.extend(os.listdir(entry.path))
            else:
                names.append(entry.name)
    exts = {n.rsplit(".", 1)[-1].lower() for n in names if "." in n}
    return "parquet" in exts and not exts & (IMAGE_EXTENSIONS | {"tar"})


def _open(path: str) -> pq.ParquetFile:
    """The file with its footer read; on a remote store under :func:`storage.with_deadline`."""
    if storage.is_remote(path):
        fs, p = storage.filesystem(path)
        return storage.with_deadline(path, "open", lambda: pq.ParquetFile(fs.open_input_file(p)))
    return pq.ParquetFile(path)


def _read_row_groups(pf: pq.ParquetFile, path: str, groups: list[int]) -> pa.Table:
    """``pf.read_row_groups``; on a remote store a stalled read fails instead of hanging."""
    if storage.is_remote(path):
        return storage.with_deadline(path, "read", lambda: pf.read_row_groups(groups))
    return pf.read_row_groups(groups)


def plan(
    path: str,
    source: str | None = None,
    *,
    image_column: str | None = None,
    path_column: str | None = None,
    caption_column: str | None = None,
    key_column: str | None = None,
    embedding_column: str | None = None,
    items_per_unit: int = DEFAULT_ITEMS_PER_UNIT,
) -> Plan:
    files = _files(path)
    if not files:
        raise UsageError(f"no parquet files at {path!r}")
    root = path if not path.endswith(".parquet") else posixpath.dirname(path)
    source = source or posixpath.basename(strip_ext(path.rstrip("/"))) or "parquet"
    first = _open(files[0])
    schema = first.schema_arrow
    roles = detect_roles(
        schema,
        image_column=image_column,
        path_column=path_column,
        caption_column=caption_column,
        key_column=key_column,
        embedding_column=embedding_column,
    )
    if roles.embedding is not None and roles.embedding_dim is None:
        sample = (
            first.read_row_group(0, columns=[roles.embedding]) if first.num_row_groups else None
        )
        roles.embedding_dim = embedding_dim(sample[roles.embedding]) if sample is not None else None
    units: list[WorkUnit] = []
    total_rows = total_bytes = 0
    for f in files:
        pf = first if f == files[0] else _open(f)
        if pf.schema_arrow.names != schema.names:
            raise UsageError(f"{f} has columns {pf.schema_arrow.names}, unlike {files[0]}")
        # Positional keys: "<row>" for one file, "<file without extension>/<row>" for a folder.
        prefix = "" if len(files) == 1 and f == path else strip_ext(posixpath.relpath(f, root))
        start = 0
        md = pf.metadata
        groups: list[int] = []
        group_rows = 0
        for rg in range(md.num_row_groups):
            nrows = md.row_group(rg).num_rows
            total_rows += nrows
            total_bytes += md.row_group(rg).total_byte_size
            groups.append(rg)
            group_rows += nrows
            if group_rows >= items_per_unit:
                units.append(_unit(source, f, groups, start, prefix, roles, group_rows))
                start += group_rows
                groups, group_rows = [], 0
        if groups:
            units.append(_unit(source, f, groups, start, prefix, roles, group_rows))
    approx = total_bytes / total_rows if total_rows else None
    return Plan(units, extra_fields(schema, roles), Counts(), approx)


def _unit(
    source: str, file: str, groups: list[int], start: int, prefix: str, roles: Roles, rows: int
) -> WorkUnit:
    return WorkUnit(
        KIND,
        source,
        {
            "file": file,
            "row_groups": groups,
            "start": start,
            "rows": rows,  # how the ingest job sizes its staging tasks
            "prefix": prefix,
            "roles": asdict(roles),
        },
    )


def load(unit: WorkUnit, counts: Counts) -> pa.Table:
    a = unit.args
    roles = Roles(**{**a["roles"], "keep": tuple(a["roles"]["keep"])})
    pf = _open(a["file"])
    table = _read_row_groups(pf, a["file"], a["row_groups"])
    rows = RowBuilder(unit.source, counts)
    base_dir = (
        posixpath.dirname(a["file"])
        if storage.is_remote(a["file"])
        else os.path.dirname(os.path.abspath(a["file"]))
    )
    rows_from_batch(
        table, roles, rows, counts, key_prefix=a["prefix"], start=a["start"], base_dir=base_dir
    )
    return rows.table(extra_fields(pf.schema_arrow, roles))
