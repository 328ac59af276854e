"""``skips rewrite --fold-columns``: an export's latents and attached columns as real MDS columns.

Latents (``_latents/``, :mod:`prx_data.export.latents`) and attached columns
(``_columns/<name>/``, :mod:`prx_data.export.attached`) live beside the shards,
which only our loader merges. A team on another trainer (Photoroom PRX's
``StreamingProcessedDataset``, any plain ``streaming.StreamingDataset``) reads
shard columns only, so the rewrite can fold them in: each kept sample's MDS row
gets the extra columns appended (the row's size header and body are extended;
the JPEG bytes and every other column are copied as they are, never decoded).

Names and encodings, as PRX reads them:

* ``img_latent`` (``ndarray:float32``, ``ndarray:float16`` for float16 latents):
  PRX takes it as VAE *moments*, mean and std concatenated on the channel axis
  (``torch.chunk(moments, 2)``), samples ``mean + std * noise`` and then applies
  the VAE's ``scaling_factor * (x - shift_factor)``. Our latents are stored
  already scaled, so the fold writes ``[x / scaling_factor + shift_factor, 0]``
  (``[2C, H/f, W/f]``): PRX's sample is then our latent again.
* every attached column under its own name (text embeddings
  ``latent_<caption>_<encoder>`` and ``attention_mask_<caption>_<encoder>``
  included): strings as ``str`` (a null as ``""``, which PRX treats as an empty
  caption), integers and floats as the MDS scalar of their width (a float null as
  NaN; an integer null is refused), lists and
  nested lists of numbers as ``ndarray:<dtype>`` (of booleans, such as attention
  masks, ``ndarray:uint8``), anything else as ``json``. A computed ``npy`` column
  (text embeddings and masks) folds as ``ndarray``: float16 as ``float16``,
  bfloat16 and float32 as ``float32`` (MDS has no bfloat16), ``uint8`` masks as
  ``uint8``; read a row at a time from its map, after its xxh64 is checked.

Never ``pkl``: every encoding here decodes without running code.
"""

from __future__ import annotations

import functools
import hashlib
import json
from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np

from prx_data.core import storage
from prx_data.core.errors import PrxDataError
from prx_data.export import attached, bound, latents, layout

#: The shard column PRX reads precomputed VAE moments from.
LATENT_COLUMN = "img_latent"


class FoldError(PrxDataError, ValueError):
    """A latent set or attached column that cannot be folded; one line says what to do."""


@dataclass(frozen=True)
class FoldColumn:
    """One column a rewrite folds: its MDS ``name`` and ``encoding``, and where it comes from
    (``source``: ``latents`` or the attached column's name)."""

    name: str
    encoding: str
    source: str
    #: sha256 of the record the plan read: a worker reads it again and refuses another one.
    stamp: str = ""


@dataclass(frozen=True)
class Fold:
    """What every pack of a folding rewrite appends (travels to Ray workers with the job)."""

    columns: tuple[FoldColumn, ...]
    #: The latents' storage dtype, scaling and shift factors (None: no latents folded).
    latent: tuple | None = None

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(c.name for c in self.columns)


def _json_writable(t) -> bool:
    """Whether ``json`` can write every value of Arrow type ``t`` as ``to_pylist`` gives it
    (no timestamps, dates, times, durations, decimals or bytes, at any depth)."""
    import pyarrow as pa

    if (
        pa.types.is_string(t)
        or pa.types.is_large_string(t)
        or pa.types.is_integer(t)
        or pa.types.is_floating(t)
        or pa.types.is_boolean(t)
        or pa.types.is_null(t)
    ):
        return True
    if pa.types.is_list(t) or pa.types.is_large_list(t) or pa.types.is_fixed_size_list(t):
        return _json_writable(t.value_type)
    if pa.types.is_dictionary(t):  # categoricals: to_pylist gives their values
        return _json_writable(t.value_type)
    if pa.types.is_map(t):  # to_pylist gives (key, item) pairs
        return _json_writable(t.key_type) and _json_writable(t.item_type)
    if pa.types.is_struct(t):
        return all(_json_writable(t.field(i).type) for i in range(t.num_fields))
    return False


def mds_encoding(t, name: str = "") -> str:
    """The MDS encoding an attached column of Arrow type ``t`` is folded as; a type no
    encoding takes is refused here, before any shard is written."""
    import pyarrow as pa

    if pa.types.is_string(t) or pa.types.is_large_string(t):
        return "str"
    if pa.types.is_integer(t) or pa.types.is_floating(t):
        return str(t.to_pandas_dtype().__name__) if pa.types.is_floating(t) else str(t)
    inner = t
    while (
        pa.types.is_list(inner)
        or pa.types.is_large_list(inner)
        or (pa.types.is_fixed_size_list(inner))
    ):
        inner = inner.value_type
    if inner is not t and pa.types.is_boolean(inner):  # attention masks
        return "ndarray:uint8"
    if inner is not t and (pa.types.is_integer(inner) or pa.types.is_floating(inner)):
        return f"ndarray:{np.dtype(inner.to_pandas_dtype()).name}"
    if not _json_writable(t):
        raise FoldError(
            f"column {name or '?'!r} is of Arrow type {t}, which no MDS encoding holds (json "
            "writes strings, numbers, booleans and lists or structs of them); cast it in the "
            "table (e.g. a timestamp to its ISO string) and attach it again with --replace"
        )
    return "json"


def npy_encoding(dtype: str) -> str:
    """The MDS encoding an ``npy`` attached column of storage ``dtype`` is folded as."""
    return "ndarray:float32" if dtype == "bfloat16" else f"ndarray:{dtype}"


def plan_fold(root: str, buckets: list[str]) -> Fold:
    """The columns to fold from ``root``: its latents and every attached column, each checked
    current for every shard of ``buckets`` (a stale set is refused in one line)."""
    cols, latent = [], None
    record = latents.read_record(root)
    if record is not None:
        _local_only(root, "its latents")
        dtype, vae = record["dtype"], record.get("vae") or {}
        for bucket in buckets:
            stale = latents.stale_shards(record, bucket, layout.read_index(root, bucket))
            if stale:
                raise FoldError(
                    f"{root}: the latents of {len(stale)} shard(s) are missing or stale (first: "
                    f"{stale[0]}); run python -m prx_data.latents {root} --vae VAE first"
                )
        scale, shift = (
            float(vae.get("scaling_factor") or 1.0),
            float(vae.get("shift_factor") or 0.0),
        )
        latent = (dtype, scale, shift)
        enc = "ndarray:float16" if dtype == "float16" else "ndarray:float32"
        cols.append(FoldColumn(LATENT_COLUMN, enc, "latents", _stamp(record)))
    for name in attached.list_columns(root):
        rec = attached.read_record(root, name)
        if attached.kind_of(rec) == attached.NPY:
            _local_only(root, f"column {name!r}")
            enc = npy_encoding(attached.npy_spec(rec)[0])
        else:
            enc = mds_encoding(attached.type_of(str(rec.get("type", ""))), name)
        for bucket in buckets:
            attached.require_current(root, name, rec, bucket, layout.read_index(root, bucket))
        cols.append(FoldColumn(name, enc, name, _stamp(rec)))
    if not cols:
        raise FoldError(
            f"{root}: no latents and no attached columns to fold; run python -m prx_data.latents "
            "or python -m prx_data.attach first, or leave out --fold-columns"
        )
    return Fold(tuple(cols), latent)


def _local_only(root: str, what: str) -> None:
    """``.npy`` files (latents, computed columns) are hashed and mapped in place, which an
    object store does not allow: refuse such a fold of a remote export before any work."""
    if storage.is_remote(root):
        raise FoldError(
            f"{root}: {what} are .npy files, folded from a local export only; copy the export "
            "to local disk (or run the rewrite where it lives), then fold; --out may be remote"
        )


def fold_entry(fold: Fold, entry: dict) -> dict:
    """``entry`` (a source shard's index entry) with the folded columns after its own."""
    taken = set(entry["column_names"]) & set(fold.names)
    if taken:
        raise FoldError(
            f"the export's shards already have column(s) {sorted(taken)}; fold them once"
        )
    return {
        **entry,
        "column_names": [*entry["column_names"], *fold.names],
        "column_encodings": [*entry["column_encodings"], *(c.encoding for c in fold.columns)],
    }


def _stamp(record: dict) -> str:
    return hashlib.sha256(json.dumps(record, sort_keys=True).encode()).hexdigest()


@functools.lru_cache(maxsize=16)
def _record(root: str, source: str, stamp: str) -> tuple:
    """A source's record (and an attached column's Arrow type), read once per process and
    plan (a record holds every shard: read per shard, a large export would read it millions
    of times); one that changed since the plan read it is refused."""
    rec = latents.read_record(root) if source == "latents" else attached.read_record(root, source)
    if rec is None or _stamp(rec) != stamp:
        raise FoldError(
            f"{root}: the record of {source!r} changed while the rewrite ran; rewrite again "
            "into an empty destination once the latents or attach job is done"
        )
    if source == "latents" or attached.kind_of(rec) == attached.NPY:
        return rec, None
    return rec, attached.type_of(str(rec.get("type", "")))


def _values(root: str, fold: Fold, col: FoldColumn, key: str, entry: dict) -> list:
    """One shard's values of ``col``, one per stored sample, as ``mds_encode`` takes them."""
    n = int(entry["samples"])
    rec, want = _record(root, col.source, col.stamp)
    shard = (rec.get("shards") or {}).get(key)
    if shard is None:
        raise FoldError(f"{root}: {col.source!r} has no file for {key}")
    if col.source == "latents":
        return _latents(root, fold, key, shard, n)
    if want is None:
        return _npy_rows(root, col, rec, key, shard)
    path = attached.file_path(root, col.source, key)
    values = attached.read_file(root, col.source, key, shard, want, path).to_pylist()
    if col.encoding == "str":
        return ["" if v is None else v for v in values]
    if col.encoding.startswith("float"):  # a null as NaN, as our loader serves it
        return [float("nan") if v is None else v for v in values]
    if col.encoding != "json" and any(v is None for v in values):
        raise FoldError(
            f"{root}: column {col.source!r} has nulls in {key}; MDS {col.encoding} has no null. "
            "Fill them in the table and attach the column again"
        )
    if col.encoding.startswith("ndarray:"):
        return [np.asarray(v, dtype=col.encoding.split(":")[1]) for v in values]
    return values


def _npy_rows(root: str, col: FoldColumn, record: dict, key: str, shard: dict):
    """One shard's ``npy`` column a row at a time, as ``col.encoding`` takes it, after its
    bytes are checked against the record (hashed through a map, never copied whole)."""
    name = col.source
    dtype, shape = attached.npy_spec(record)
    path = attached.file_path(root, name, key, attached.NPY)
    base = storage.join(root, attached.COLUMNS_DIR, name)
    redo = f"{attached.JOB} {root} --table TABLE --columns {name} --replace"
    if bound.file_digest(base, path, int(shard.get("bytes", 0))) != shard.get("xxh64"):
        raise FoldError(
            f"{path}: missing, or its bytes differ from what the column's record names; run {redo}"
        )
    arr = attached.open_npy(root, name, shard, dtype, shape, (base, path))
    out = np.dtype(col.encoding.split(":")[1])
    for i in range(int(shard["samples"])):
        yield attached.npy_row(arr, i, dtype, f"{path} sample {i}").astype(out, copy=False)


def _latents(root: str, fold: Fold, key: str, shard: dict, n: int):
    """One shard's latents as PRX's moments, a sample at a time (a shard's float32 copy would
    hold hundreds of MB), after checking the file's bytes against the record."""
    dtype, scale, shift = fold.latent
    most = int(shard.get("npy_bytes", 0)) or 1 << 40
    if latents.npy_digest(root, key, most) != shard.get("xxh64"):
        raise FoldError(
            f"{latents.npy_rel(key)}: missing, or its bytes differ from the latents record; run "
            f"python -m prx_data.latents {root} --vae VAE --replace"
        )
    stored = latents.load_npy(root, key, dtype, (n, *shard.get("shape", [n])[1:]))
    out = np.float16 if dtype == "float16" else np.float32
    for i in range(n):
        x = latents.sample_latent(stored[i], dtype, f"{latents.npy_rel(key)}[{i}]")
        x = x / np.float32(scale) + np.float32(shift)
        yield np.concatenate([x, np.zeros_like(x)], axis=0).astype(out)


def shard_extras(root: str, fold: Fold, bucket: str, part: str, entry: dict) -> Iterator[list]:
    """Per stored sample of one source shard (``entry``: from its part's own index): the
    encoded value of each folded column, in :attr:`Fold.columns` order."""
    from prx_data.core.streaming_compat import mds_encode

    key = latents.shard_key(bucket, f"{part}/{entry['raw_data']['basename']}")
    per_col = [_values(root, fold, c, key, entry) for c in fold.columns]
    encs = [c.encoding for c in fold.columns]
    for row in zip(*per_col, strict=True):  # a row at a time: a shard's tensors are GBs
        yield [mds_encode(e, v) for e, v in zip(encs, row, strict=True)]


def fold_samples(
    root: str, fold: Fold, bucket: str, part: str, entry: dict, samples, skip
) -> Iterator[bytes]:
    """The kept encoded ``samples`` of one source shard (``skip``: its left-out indices), each
    re-encoded with the folded columns: streaming's writer orders a row's columns by name
    (a size for each variable-size column, then the data), so each row is cut into its
    columns' bytes (never decoded) and put together again in the new columns' order."""
    from prx_data.core.streaming_compat import get_mds_encoded_size as size_of

    names = [*entry["column_names"], *fold.names]
    sizes = [size_of(e) for e in [*entry["column_encodings"], *(c.encoding for c in fold.columns)]]
    old, order = len(entry["column_names"]), sorted(range(len(names)), key=names.__getitem__)
    head = 4 * sum(x is None for x in sizes[:old])
    dead = set(int(i) for i in skip)
    extras = (
        x for i, x in enumerate(shard_extras(root, fold, bucket, part, entry)) if i not in dead
    )
    for sample, extra in zip(samples, extras, strict=True):
        var = iter(np.frombuffer(sample, np.uint32, head // 4).tolist())
        datums, at = [], head
        for n in sizes[:old]:
            n = next(var) if n is None else n
            datums.append(sample[at : at + n])
            at += n
        datums += extra
        lens = [len(datums[i]) for i in order if sizes[i] is None]
        body = b"".join(datums[i] for i in order)
        yield type(sample)(np.array(lens, np.uint32).tobytes() + body)


def folded_record(root: str, fold: Fold | None) -> dict[str, str]:
    """{column: encoding} a rewrite's report names as folded: those ``fold`` writes and those
    a folded source already held (:func:`prx_data.export.safety.folded_columns`)."""
    had = layout.export_columns(root)
    names = dict(had) if isinstance(had, frozenset) else {}
    new = {c.name: c.encoding for c in (fold.columns if fold else ())}
    return dict(sorted({**names, **new}.items()))


def same_sample(a: dict, b: dict) -> bool:
    """Whether two decoded samples hold the same values: a folded export's arrays compared as
    arrays (dtype, shape, values) and a NaN equal to a NaN (a float column's null)."""
    if a.keys() != b.keys():
        return False
    for k, x in a.items():
        y = b[k]
        if isinstance(x, np.ndarray) or isinstance(y, np.ndarray):
            same = isinstance(x, np.ndarray) and isinstance(y, np.ndarray) and x.dtype == y.dtype
            if not (same and x.shape == y.shape and np.array_equal(x, y, equal_nan=True)):
                return False
        elif x != y and not (isinstance(x, float) and isinstance(y, float) and x != x and y != y):
            return False
    return True
