"""Attach table columns to an export, beside its shards, without rewriting one of them.

Graph (:func:`prx_data.core.runtime.map_units` on driver threads: the work is reads of
manifests and table index pages, never Ray)::

    driver: the export's merged indexes -> one unit per part (its shards that lack a
            current file of some requested column)
      -> unit: read the part's ids.parquet (shard, index, id); look the part's ids up in
         the table (``id IN (...)`` slices, answered by the table's BTREE on ``id``);
         per shard, put each id's values at its stored index (an id the table lacks:
         null, counted); write one file per shard and column (a table column: Arrow
         IPC; a caption column's text embeddings and masks: ``.npy`` tensors)
      -> driver: each column's record rewritten every few units and at the end

Memory is one part's ids and values at a time per thread, never the table or the
export's id list. The files and records are described in :mod:`prx_data.export.attached`.
A rerun computes only the shards whose file is missing, changed, or made from
other shard content (an append's new shards, a re-export's changed ones);
``--replace`` computes them all again (a re-captioned table).
"""

from __future__ import annotations

import base64
import io
import logging
import re
import threading
import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from prx_data.core import confined, storage
from prx_data.core.errors import UsageError
from prx_data.core.flags import REQUIRED, comma_ints, comma_list, flag
from prx_data.core.lease import Lease, LeaseHeld
from prx_data.core.reports import JobReport
from prx_data.core.runtime import Placement, map_units
from prx_data.core.schema import MANIFEST_NAME
from prx_data.export import attached as A
from prx_data.export import bound, bounded, npyfile, safety
from prx_data.export import latents as L
from prx_data.export.layout import (
    check_export_complete,
    list_buckets,
    read_index_entries,
    read_report,
    rel_join,
)

log = logging.getLogger(__name__)

#: Rewrite the records after this many finished units (and at the end).
RECORD_EVERY_UNITS = 64
RECORD_EVERY_S = 30.0
#: Item keys of the loader and the export's own columns: an attached column may not take one.
RESERVED = frozenset(
    (
        "image",
        "id",
        "tier",
        "bucket",
        "source_bucket",
        "dataset",
        "width",
        "height",
        "latent",
        "crop_left",
        "crop_top",
        "crop_right",
        "crop_bottom",
    )
)


class AttachLocked(LeaseHeld):
    """Another attach run holds this export's columns lease (``_columns/.lock``)."""


@dataclass(frozen=True)
class AttachConfig:
    """One attach run: table columns joined by id onto an export (fields carry their flags)."""

    out: str = flag(
        REQUIRED, "out", metavar="OUT", help="Export root (python -m prx_data.write_mds --out)."
    )
    table: str = flag(REQUIRED, "--table", help="Lance table the columns come from.")
    columns: tuple[str, ...] = flag(
        REQUIRED,
        "--columns",
        type=comma_list,
        help="Comma-separated table columns to attach (each becomes an attached column of the "
        "same name, which the loader serves as extra_columns or a caption column).",
    )
    id_column: str = flag("id", "--id-column", help="The table's id column (default: %(default)s).")
    table_version: int | None = flag(
        None, "--table-version", type=int, help="Read this version of the table (default: latest)."
    )
    replace: bool = flag(
        False,
        "--replace",
        help="Compute every shard again (without it a rerun computes only shards whose file is "
        "missing, changed, or made from other shard data).",
    )
    tiers: tuple[int, ...] | None = flag(
        None, "--tiers", type=comma_ints, help="Comma-separated tiers to attach to (default: all)."
    )
    progress: bool = flag(False, "--progress", help="Show a progress bar over parts.")
    text_encoder: str | None = flag(
        None,
        "--text-encoder",
        help="Encode the --columns captions with this transformers text encoder (local folder "
        "or hub id) instead of attaching them: each caption column C gives the attached "
        "columns latent_C_<encoder> ([max_length, hidden] in --text-dtype) and "
        "attention_mask_C_<encoder> (uint8 [max_length]), one .npy per shard, bound to the "
        "encoder's weights digest (text_encoder.source: precomputed in the trainer).",
    )
    text_dtype: str = flag(
        "bfloat16",
        "--text-dtype",
        choices=npyfile.DTYPES,
        help="Storage dtype of the text embeddings (default: %(default)s, what PRX trains in; "
        "float32 doubles the bytes). The loader serves them as float32.",
    )
    encoder_name: str | None = flag(
        None,
        "--encoder-name",
        help="The <encoder> part of the text columns' names (default: the encoder path's last "
        "part, lower case).",
    )
    max_length: int = flag(
        256, "--max-length", type=int, help="Tokens per caption, padded (default: %(default)s)."
    )
    layer: int = flag(
        -1, "--layer", type=int, help="Hidden state to store: -1 the last (default: %(default)s)."
    )
    text_batch: int = flag(
        64, "--text-batch", type=int, help="Captions per encoder call (default: %(default)s)."
    )

    def outputs(self) -> dict[str, str]:
        """Each attached column this run writes and the table column it comes from."""
        if self.text_encoder is None:
            return {c: c for c in self.columns}
        label = self.encoder_name or A.encoder_label(self.text_encoder)
        return {n: c for c in self.columns for n in A.text_names(c, label)}

    def __post_init__(self) -> None:
        if not self.columns:
            raise UsageError("--columns: name at least one table column")
        if self.text_encoder is not None and (self.max_length <= 0 or self.text_batch <= 0):
            raise UsageError("--max-length and --text-batch: must be positive")
        if self.text_dtype not in npyfile.DTYPES:
            raise UsageError(
                f"--text-dtype {self.text_dtype!r}: one of {', '.join(npyfile.DTYPES)}"
            )
        if self.encoder_name is not None and not re.fullmatch(
            r"[a-z0-9_]{1,64}", self.encoder_name
        ):
            raise UsageError(f"--encoder-name {self.encoder_name!r}: lower-case letters, digits, _")
        self.outputs()  # names checked
        for c in self.columns:
            A.check_name(c)
            if c in RESERVED:
                raise UsageError(f"--columns {c}: a key every loader item has; rename it first")
            if c == L.COLUMN:
                raise UsageError(
                    f"--columns {c}: the export's precomputed latents, made by python -m "
                    "prx_data.latents (or attach --vae); rename the table column first"
                )
        if len(set(self.columns)) != len(self.columns):
            raise UsageError(f"--columns {','.join(self.columns)}: a column named twice")


@dataclass
class AttachReport(JobReport):
    """What a run wrote and what it found already done."""

    out: str
    table: str = ""
    table_version: int = 0
    columns: list = field(default_factory=list)
    shards: int = 0
    samples: int = 0
    written_shards: int = 0
    skipped_shards: int = 0
    #: Samples whose id the table does not hold (their value is null), per column run.
    missing_ids: int = 0
    #: Bytes of the files written, and of the values they hold (Arrow buffers, uncompressed;
    #: tensors in their storage dtype).
    bytes_written: int = 0
    column_bytes: int = 0
    seconds: float = 0.0
    #: Every attached column of the export after the run (``img_latent`` if it has latents).
    attached: list = field(default_factory=list)

    counted = "shards"
    job_label = "attach"

    @property
    def total(self) -> int:
        return self.shards

    def text(self) -> str:
        ratio = self.bytes_written / self.column_bytes if self.column_bytes else 0.0
        return (
            f"attached {', '.join(self.columns)} of {self.table} (version {self.table_version}) "
            f"to {self.out}: {self.shards:,} shards, {self.samples:,} samples; wrote "
            f"{self.written_shards:,} shards ({self.bytes_written:,} bytes, {ratio:.2f} x the "
            f"values' bytes), already done {self.skipped_shards:,}; {self.missing_ids:,} "
            f"sample(s) whose id the table lacks are null; {self.seconds:.1f}s; the export's "
            f"attached columns: {', '.join(self.attached) or 'none'}"
        )


def _open_table(cfg: AttachConfig):
    from prx_data.table.lance_ops import open_table

    ds = open_table(cfg.table, version=cfg.table_version)
    names = set(ds.schema.names)
    missing = [c for c in (cfg.id_column, *cfg.columns) if c not in names]
    if missing:
        raise UsageError(
            f"{cfg.table}: no column(s) {', '.join(missing)} (columns: {', '.join(sorted(names))})"
        )
    try:
        indexed = any(cfg.id_column in (i.get("fields") or ()) for i in ds.list_indices())
    except (AttributeError, TypeError, ValueError, OSError):
        indexed = True  # cannot tell: say nothing
    if not indexed:
        log.warning(
            "%s has no scalar index on %r: each part's ids are looked up by a scan of the "
            "table; build it (ingest does: ds.create_scalar_index(%r, 'BTREE'))",
            cfg.table,
            cfg.id_column,
            cfg.id_column,
        )
    return ds


def _lookup(ds: Any, rows: int, id_column: str, columns: list[str], ids: pa.Array) -> pa.Table:
    """``id_column`` and ``columns`` of the rows whose id is in ``ids`` (unique strings).

    Sorted slices, one ``id IN (...)`` query each, sized as the id index sizes its
    own (:func:`prx_data.export.idindex.slice_ids`); a request that is a large share of
    the table is one streamed scan instead (:data:`~prx_data.export.idindex.SCAN_RATIO`).
    """
    from prx_data.export.idindex import SCAN_RATIO, slice_ids

    want = [id_column, *columns]
    if len(ids) * SCAN_RATIO > rows:
        hits = [
            b.filter(pc.is_in(b[id_column], value_set=ids))
            for b in ds.to_batches(columns=want, batch_size=1 << 17)
        ]
        hits = [pa.Table.from_batches([b]) for b in hits if b.num_rows]
    else:
        ids = ids.take(pc.sort_indices(ids))
        step = slice_ids(len(ids), rows)
        hits = [
            ds.to_table(columns=want, filter=pc.field(id_column).isin(ids.slice(i, step)))
            for i in range(0, len(ids), step)
        ]
    schema = ds.schema
    if not hits:
        return pa.table({c: pa.array([], schema.field(c).type) for c in want})
    return pa.concat_tables(hits).combine_chunks()


class PartAttacher:
    """Computes one part's column files; one per run, shared by the driver's threads."""

    def __init__(
        self,
        cfg: AttachConfig,
        ds: Any,
        stores: dict[str, dict[str, Any]],
        embedder: TextEmbedder | None = None,
    ) -> None:
        self.cfg, self.ds, self.stores, self.embedder = cfg, ds, stores, embedder
        self.sources = cfg.outputs()
        self.rows = ds.count_rows()

    def _values(self, found: pa.Table, pos: pa.Array, todo: list[str]) -> dict[str, Any]:
        """The shard's values of each column in ``todo``: the table's (Arrow), or its
        captions' embeddings and masks (stored tensors; one encoder pass per caption column)."""
        out: dict[str, Any] = {}
        for src in dict.fromkeys(self.sources[n] for n in todo):
            values = found[src].take(pos)
            if self.embedder is None:
                out[src] = values
            else:
                latent, mask = self.embedder(values)
                names = [n for n, s in self.sources.items() if s == src]
                out.update(zip(names, (latent, mask), strict=True))
        return out

    def __call__(self, unit: dict[str, Any]) -> dict[str, list[dict[str, Any]]]:
        root, bucket, part = self.cfg.out, unit["bucket"], unit["part"]
        path = rel_join(root, f"{bucket}/{part}/{MANIFEST_NAME}")
        try:
            data = confined.read(root, path, confined.MANIFEST_MAX_BYTES)
        except FileNotFoundError:
            raise A.AttachedError(
                f"{path}: missing manifest, so ids cannot be joined; check the tree with "
                f"python -m prx_data.verify {root}"
            ) from None
        m = pq.read_table(io.BytesIO(data), columns=["shard", "index", "id"])
        safety.check_manifest_shards(path, part, m["shard"])
        ids = m["id"].combine_chunks().cast(pa.string())
        found = _lookup(
            self.ds,
            self.rows,
            self.cfg.id_column,
            list(dict.fromkeys(self.sources.values())),
            pc.unique(pc.drop_null(ids)),
        )
        found_ids = found[self.cfg.id_column].combine_chunks().cast(pa.string())
        out = []
        for entry, todo in unit["shards"]:
            basename = entry["raw_data"]["basename"]
            key = A.shard_key(bucket, basename)
            n = int(entry["samples"])
            rows = m.filter(pc.equal(m["shard"], basename))
            order = pc.sort_indices(rows["index"])
            index = rows["index"].take(order).to_numpy()
            if len(index) != n or (n and not np.array_equal(index, np.arange(n))):
                raise A.AttachedError(
                    f"{path}: {len(index)} rows for {basename}, not one per each of its {n} "
                    f"samples; check the tree with python -m prx_data.verify {root}"
                )
            pos = pc.index_in(rows["id"].take(order).cast(pa.string()), value_set=found_ids)
            missing = pos.null_count
            binding = bound.shard_binding(entry)
            computed = self._values(found, pos, todo)
            for i, name in enumerate(todo):
                values, kind = computed[name], self.stores[name]["kind"]
                if kind == A.NPY:  # the file's bytes (npyfile.allocate): written as they are
                    data = values.tobytes() if storage.is_remote(root) else memoryview(values)
                else:
                    data = A.encode(name, values)
                digest, nbytes = bound.write_file(root, A.file_path(root, name, key, kind), data)
                del data
                out.append(
                    {
                        "column": name,
                        "key": key,
                        "missing": missing if i == 0 else 0,  # a sample counts once
                        "value_bytes": values.nbytes,
                        "record": {
                            **binding,
                            "xxh64": digest,
                            "bytes": nbytes,
                            "missing_ids": missing,
                        },
                    }
                )
        return {"files": out}


def _check_output(cfg: AttachConfig) -> None:
    from prx_data.export import adopt

    if adopt.is_foreign_tree(cfg.out):
        raise UsageError(
            f"{cfg.out}: an MDS tree another writer made; attach joins by the id manifests of "
            "an export of ours (python -m prx_data.write_mds)"
        )
    check_export_complete(
        cfg.out, read_report(cfg.out), count_markers=not storage.is_remote(cfg.out)
    )
    if cfg.tiers is not None:
        have = sorted({int(b.split("/")[0]) for b in list_buckets(cfg.out)})
        missing = [int(t) for t in cfg.tiers if int(t) not in have]
        if missing:
            raise UsageError(
                f"--tiers {','.join(map(str, missing))}: {cfg.out} has no such tier; its tiers: "
                f"{','.join(map(str, have)) or 'none'}"
            )


def _source(cfg: AttachConfig, ds: Any, name: str) -> dict[str, Any]:
    return {"table": cfg.table, "table_version": int(ds.version), "table_column": name}


def run_attach(cfg: AttachConfig) -> AttachReport:
    """Attach ``cfg.columns`` of ``cfg.table`` to every shard of ``cfg.out`` that lacks them.

    Returns:
        The :class:`AttachReport`: shards written and skipped, ids the table lacks, bytes.

    Raises:
        AttachedError: a column recorded with another Arrow type (without ``replace``), or a
            manifest that does not match its shards.
        UsageError: a foreign or unfinished export, a column the table lacks.
    """
    t0 = time.monotonic()
    _check_output(cfg)
    ds = _open_table(cfg)
    outs = cfg.outputs()
    embedder = None if cfg.text_encoder is None else TextEmbedder(cfg)
    stores = (
        {n: A.arrow_body(ds.schema.field(c).type) for n, c in outs.items()}
        if embedder is None
        else dict(zip(outs, embedder.stores * len(cfg.columns), strict=True))
    )
    report = AttachReport(
        out=cfg.out, table=cfg.table, table_version=int(ds.version), columns=list(cfg.columns)
    )
    lock = storage.join(cfg.out, *A.LOCK_NAME.split("/"))
    if not storage.is_remote(cfg.out):
        import os

        os.makedirs(os.path.dirname(lock), exist_ok=True)
    with Lease(lock, what="attach run", error=AttachLocked):
        records = {n: _previous(cfg, n, stores[n], embedder) for n in outs}
        units, keys = _plan(cfg, records, report)
        for c in outs:  # files of shards the export no longer has
            gone = [k for k in records[c] if k not in keys]
            for k in gone:
                confined.confined(storage.join(cfg.out, A.COLUMNS_DIR)).delete(
                    A.file_path(cfg.out, c, k, stores[c]["kind"])
                )
                del records[c][k]
        work = PartAttacher(cfg, ds, stores, embedder)

        def save() -> None:
            for i, (n, c) in enumerate(outs.items()):
                source = _source(cfg, ds, c)
                if embedder is not None:
                    source.update(embedder.source(i % 2))
                body = {**stores[n], "source": source}
                A.write_record(cfg.out, n, body, records[n])

        last, since = time.monotonic(), 0
        try:
            threads = Placement(threads=bounded.io_workers(cfg.out), reason="local")
            for result in map_units(
                work, units, threads, desc="attach", progress=cfg.progress, unit_name="part"
            ):
                rs = result["files"]
                for r in rs:
                    records[r["column"]][r["key"]] = r["record"]
                    report.missing_ids += int(r["missing"])
                    report.bytes_written += int(r["record"]["bytes"])
                    report.column_bytes += int(r["value_bytes"])
                report.written_shards += len({r["key"] for r in rs})
                since += 1
                if since >= RECORD_EVERY_UNITS or time.monotonic() - last > RECORD_EVERY_S:
                    save()
                    last, since = time.monotonic(), 0
        finally:
            save()
    report.attached = A.all_columns(cfg.out)
    report.seconds = time.monotonic() - t0
    return report


def _previous(
    cfg: AttachConfig, name: str, want: dict[str, Any], embedder: TextEmbedder | None = None
) -> dict[str, dict]:
    """The shards a column's record holds, when it may be kept (same kind and type or dtype
    and shape and, for text columns, same encoder; no ``replace``).

    With ``replace``, the files of another kind the record names (the Arrow text columns of
    an earlier version, the ``.npy`` ones being written now) are deleted first: the new
    files take other names, and verify would find the old ones stray."""
    record = A.read_record(cfg.out, name)
    if record is None:
        return {}
    had = A.storage_of(record)
    if cfg.replace:
        if had["kind"] != want["kind"]:
            box = confined.confined(storage.join(cfg.out, A.COLUMNS_DIR))
            for key in record.get("shards") or {}:
                box.delete(
                    A.file_path(cfg.out, name, bound.check_key(key, A.AttachedError), had["kind"])
                )
        return {}
    if embedder is not None:
        had_enc = (record.get("source") or {}).get("text_encoder") or {}
        diff = A.text_encoder_differences(had_enc, embedder.identity)
        if diff:
            raise A.AttachedError(
                f"{cfg.out}: column {name!r} was made by another text encoder "
                f"({'; '.join(diff)}); pass --replace to compute it again"
            )
    if had != want:
        raise A.AttachedError(
            f"{cfg.out}: column {name!r} is attached as {_described(had)}, this run writes "
            f"{_described(want)}; pass --replace to compute it again"
        )
    return dict(record.get("shards") or {})


def _described(store: dict[str, Any]) -> str:
    """A record's storage fields in words: ``npy bfloat16 [256, 2304]`` or the Arrow type."""
    if store["kind"] == A.NPY:
        return f"npy {store['dtype']} {store['shape']}"
    return f"arrow {A.type_of(store['type'])}"


def _plan(
    cfg: AttachConfig, records: dict[str, dict[str, dict]], report: AttachReport
) -> tuple[list[dict[str, Any]], set[str]]:
    """Units (one per part with work) and every shard key of the export."""
    wanted = None if cfg.tiers is None else {int(t) for t in cfg.tiers}
    # One listing per column: a recorded file must be there with the size its record names
    # (the loader and verify --deep check its digest).
    outs = list(cfg.outputs())
    kinds = {c: A.NPY if cfg.text_encoder is not None else A.ARROW for c in outs}
    sizes = {
        c: storage.file_sizes(storage.join(cfg.out, A.COLUMNS_DIR, c)) if records[c] else {}
        for c in outs
    }
    units: list[dict[str, Any]] = []
    keys: set[str] = set()
    for bucket in list_buckets(cfg.out):
        entries = read_index_entries(cfg.out, bucket)
        chosen = wanted is None or int(bucket.split("/")[0]) in wanted
        by_part: dict[str, list] = {}
        for e in entries:
            key = A.shard_key(bucket, e["raw_data"]["basename"])
            clash = set(outs) & set(e.get("column_names") or ())
            if clash:
                raise UsageError(
                    f"--columns {','.join(sorted(clash))}: already a column of the shards of "
                    f"{cfg.out}/{bucket}; the loader serves it from there"
                )
            keys.add(key)
            if not chosen:
                continue
            report.shards += 1
            report.samples += int(e["samples"])
            binding = bound.shard_binding(e)
            todo = [
                c
                for c in outs
                if not bound.matches(records[c].get(key), binding)
                or sizes[c].get(A.file_rel(c, key, kinds[c]).split("/", 2)[2])
                != records[c][key].get("bytes")
            ]
            if todo:
                by_part.setdefault(key.split("/")[2], []).append((e, todo))
            else:
                report.skipped_shards += 1
        units += [{"bucket": bucket, "part": p, "shards": s} for p, s in sorted(by_part.items())]
    return units, keys


class TextEmbedder:
    """A frozen text encoder (the trainer's :class:`~prx_data.train.text_encoder.TextEncoder`,
    float32, on CUDA when there is one) turning a shard's captions into fixed-shape
    embeddings [max_length, hidden], stored in ``--text-dtype``, and masks [max_length]
    (``uint8``); a null caption is "".

    Each encoder batch is checked finite and converted to the storage dtype as it comes, so
    a shard is held once, in its stored size (a float32 copy of a shard of T5-XXL
    embeddings would be several GB). Calls are serialised (one encoder, shared by the
    driver's threads, whose reads go on).
    """

    def __init__(self, cfg: AttachConfig) -> None:
        import torch

        from prx_data.train.text_encoder import TextEncoder
        from prx_data.train.vae import weights_digest

        device = "cuda" if torch.cuda.is_available() else "cpu"
        self.encoder = TextEncoder.from_pretrained(
            cfg.text_encoder,
            max_length=cfg.max_length,
            dtype="float32",
            layer=cfg.layer,
            device=device,
        )
        self.batch, self.dtype = cfg.text_batch, cfg.text_dtype
        self.lock = threading.Lock()
        length, hidden = cfg.max_length, self.encoder.hidden_size
        self.shapes = ((length, hidden), (length,))
        self.stores = (A.npy_body(self.dtype, self.shapes[0]), A.npy_body("uint8", self.shapes[1]))
        self.identity = {
            "name_or_path": cfg.text_encoder,
            "weights": weights_digest(cfg.text_encoder, setting="--text-encoder"),
            "max_length": length,
            "layer": cfg.layer,
            "hidden_size": hidden,
        }
        self.empty = self._encode([""])

    def _encode(self, texts: list[str]) -> tuple[tuple, tuple]:
        """Stored embeddings [n, L, D] and uint8 masks [n, L] of ``texts``, each as
        ``(tensor, the bytes of its .npy file)`` (:func:`~prx_data.export.npyfile.allocate`)."""
        n = len(texts)
        feats, feats_file = npyfile.allocate((n, *self.shapes[0]), self.dtype)
        masks, masks_file = npyfile.allocate((n, *self.shapes[1]), "uint8")
        with self.lock:
            for i in range(0, n, self.batch):
                f, m = self.encoder.encode(texts[i : i + self.batch])
                f = f.float().cpu().numpy()
                stored = npyfile.to_stored(f, self.dtype, A.AttachedError)
                if not (
                    np.isfinite(f).all()
                    and np.isfinite(npyfile.from_stored(stored, self.dtype)).all()
                ):
                    raise A.AttachedError(
                        f"{self.identity['name_or_path']}: the text encoder gave NaN or infinite "
                        f"embeddings (in {self.dtype}); run it in float32, store float32 or "
                        "bfloat16 (--text-dtype), or check its weights"
                    )
                feats[i : i + len(f)] = stored
                masks[i : i + len(f)] = m.cpu().numpy().astype(np.uint8)
        return (feats, feats_file), (masks, masks_file)

    def __call__(self, captions: pa.Array) -> tuple[np.ndarray, np.ndarray]:
        """The ``.npy`` file bytes (``uint8``) of a shard's embeddings and of its masks."""
        texts = ["" if t is None else str(t) for t in captions.to_pylist()]
        (_, feats), (_, masks) = self._encode(texts)
        return feats, masks

    def source(self, which: int) -> dict[str, Any]:
        """The record's ``source`` additions of the latent (0) or mask (1) column: the encoder
        and the value of the empty caption (what caption dropout trains on), as served (the
        embedding at its storage precision, in float32)."""
        arr = self.empty[which][0][0]
        if which == 0:
            arr = npyfile.from_stored(arr, self.dtype)
        return {
            "text_encoder": dict(self.identity),
            "empty": {
                "dtype": arr.dtype.str,
                "shape": list(arr.shape),
                "data": base64.b64encode(np.ascontiguousarray(arr).tobytes()).decode(),
            },
        }
