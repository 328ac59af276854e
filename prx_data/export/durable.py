"""Durable writes shared by the work units, the pack stage and rewrites.

On a local ``--out`` an attempt writes into its own folder under
``_progress/writing`` (:func:`stage_dir`), fsyncs it and renames it into its
bucket (:func:`publish_parts`), so that the marker written after it vouches
only for durable data. A part's manifest (:func:`write_manifest`) and a unit's
dropped rows (:func:`write_dropped_rows`) are written atomically.
"""

from __future__ import annotations

import io
import os
import posixpath
import uuid
from collections.abc import Mapping

import pyarrow as pa
import pyarrow.parquet as pq

from prx_data.core import storage
from prx_data.core.schema import MANIFEST_NAME
from prx_data.export.naming import INDEX_NAME, WRITING_DIR, ExportError
from prx_data.export.safety import load_index, remove_tree


def create_only_uploads(writer) -> None:
    """Make a remote ``MDSWriter`` create each file only where no object is (store-checked).

    A unit or pack first deletes its folder, so every shard and index it
    uploads is new: uploaded with :func:`prx_data.core.storage.write_new`, a
    writer that lost the export's lease while paused cannot overwrite what the
    run that took over wrote there, and the newer run cannot silently mix with
    it (its own upload is refused, and it fails). Local writers are left alone
    (the ``flock`` is held until the process ends).
    """
    up = writer.cloud_writer
    if not up.remote or not storage.is_remote(up.remote):
        return

    def upload_file(filename: str) -> None:
        local = os.path.join(up.local, filename)
        with open(local, "rb") as f:
            data = f.read()
        try:
            storage.write_new(storage.join(up.remote, filename), data)
        except storage.StoreConflict as e:
            up.prx_refused = e  # streaming's writer reports only "one of the threads failed"
            raise
        up.clear_local(local=local)

    up.upload_file = upload_file


def refused_upload(writers) -> Exception | None:
    """The first upload a store refused among ``writers`` (see :func:`create_only_uploads`)."""
    for w in writers:
        err = getattr(getattr(w, "cloud_writer", None), "prx_refused", None)
        if err is not None:
            return err
    return None


def write_manifest(bucket_dir: str, part: str, id_list: list[str]) -> int:
    """ids.parquet: (shard basename as in the merged index, index in shard, id).

    Returns the part's shard bytes (uncompressed), which the pack stage plans by.
    """
    shard_col, idx_col = [], []
    nbytes = 0
    for shard in load_index(storage.join(bucket_dir, part, INDEX_NAME), in_part=True):
        nbytes += int(shard["raw_data"]["bytes"])
        base = posixpath.join(part, shard["raw_data"]["basename"])
        shard_col += [base] * shard["samples"]
        idx_col += list(range(shard["samples"]))
    if len(shard_col) != len(id_list):
        raise ExportError(
            f"{bucket_dir}/{part}: index has {len(shard_col)} samples, wrote {len(id_list)}"
        )
    table = pa.table(
        {
            "shard": pa.array(shard_col, pa.string()),
            "index": pa.array(idx_col, pa.int32()),
            "id": pa.array(id_list, pa.string()),
        }
    )
    buf = io.BytesIO()
    pq.write_table(table, buf, compression="zstd")
    storage.write_bytes_atomic(storage.join(bucket_dir, part, MANIFEST_NAME), buf.getvalue())
    return nbytes


def stage_dir(out: str, part: str) -> str:
    """A fresh folder for this attempt's parts; earlier attempts' folders are removed."""
    root = os.path.join(out, *WRITING_DIR.split("/"))
    if os.path.isdir(root):
        for name in os.listdir(root):
            if name.startswith(f"{part}."):
                remove_tree(os.path.join(root, name))
    return os.path.join(root, f"{part}.{uuid.uuid4().hex[:8]}")


def fsync(path: str) -> None:
    """Flush a file's data, or a directory's names (a create or rename is not durable until then)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def publish_parts(out: str, stage: str, parts: Mapping[str, str]) -> None:
    """fsync each staged part (files, then folder), rename it into its bucket, fsync the buckets.

    ``parts`` maps each bucket (``<tier>/<ar>``) to the part folder staged as
    ``<stage>/<tier>/<ar>/<part>``. A part already at the target was left by an
    earlier attempt of this unit (the marker is written only after this step)
    and is replaced.
    """
    dirs = {out}
    for name, part in sorted(parts.items()):
        src = os.path.join(stage, *name.split("/"), part)
        for f in sorted(os.listdir(src)):
            fsync(os.path.join(src, f))
        fsync(src)
        bdir = os.path.join(out, *name.split("/"))
        os.makedirs(bdir, exist_ok=True)
        dst = os.path.join(bdir, part)
        remove_tree(dst)
        os.rename(src, dst)
        dirs |= {bdir, os.path.dirname(bdir)}  # the tier and bucket may be new
    for d in sorted(dirs, reverse=True):
        fsync(d)
    remove_tree(stage)


def upload_parts(out: str, stage: str, parts: Mapping[str, str]) -> None:
    """Object storage: PUT each staged part's files under its bucket (each PUT is durable).

    An earlier attempt's objects at the same part are deleted first; the unit's
    marker, written after this, is what vouches for the part. Each file is then
    created only where no object is (:func:`prx_data.core.storage.write_new`,
    checked by the store), as :func:`create_only_uploads` does for a writer
    uploading itself: a unit paused past the export's lease cannot overwrite
    what the run that took over wrote there.
    """
    for name, part in sorted(parts.items()):
        src = os.path.join(stage, *name.split("/"), part)
        dst = storage.join(out, *name.split("/"), part)
        storage.delete(dst)
        for f in sorted(os.listdir(src)):
            with open(os.path.join(src, f), "rb") as fh:
                storage.write_new(storage.join(dst, f), fh.read())
    remove_tree(stage)


DROPPED_SCHEMA = pa.schema([("id", pa.string()), ("reason", pa.string()), ("detail", pa.string())])


def write_dropped_rows(path: str, rows: list[tuple[str, str, str]]) -> None:
    import pyarrow.parquet as pq

    ids, reasons, details = zip(*rows, strict=True) if rows else ((), (), ())
    table = pa.table([list(ids), list(reasons), list(details)], schema=DROPPED_SCHEMA)
    buf = io.BytesIO()
    pq.write_table(table, buf, compression="zstd")
    storage.write_bytes_atomic(path, buf.getvalue())
