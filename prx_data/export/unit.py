"""Lance table -> bucketed Mosaic Data Shards: one work unit.

The job is split into *work units* (a row range of one Lance fragment). Each
unit decodes its rows, buckets them, writes one MDS part per bucket it
touches (``<out>/<tier>/<ar>/<part>/``) plus an ``ids.parquet`` manifest,
and finally a ``_progress/<part>.done`` marker carrying its counts. Units are
deterministic, so a rerun reproduces the same bytes, and a killed run is
finished with ``resume=True``: finished units are kept, half-written parts
are deleted and redone. A unit's data is fsynced before its marker, and a
unit that Ray retries after its worker died replaces what its first attempt
left (:func:`export_unit`).

The job's start, units, completion and failure are
:class:`prx_data.pipelines.write_mds.ExportSink`.
"""

from __future__ import annotations

import os
import tempfile
import time
from collections import Counter

from prx_data.core import storage
from prx_data.core.buckets import (
    BucketSpec,
    assign_bucket,
)
from prx_data.core.imaging import (
    ImageError,
    prepare_with,
)
from prx_data.core.quality import COLUMN as QUALITY_COLUMN
from prx_data.core.quality import is_low_information
from prx_data.core.schema import mds_sample
from prx_data.export.durable import (
    create_only_uploads,
    fsync,
    publish_parts,
    refused_upload,
    stage_dir,
    upload_parts,
    write_dropped_rows,
    write_manifest,
)
from prx_data.export.naming import DROPPED_DIR, content_part_name, ids_digest, marker_path
from prx_data.export.prepare import open_table
from prx_data.export.removals import OPTED_OUT, load_keys, read_columns, removed
from prx_data.export.safety import remove_tree
from prx_data.export.spec import (
    DOWNLOAD_DROP,
    UNLISTED_REASONS,
    AppendUnit,
    ExportConfig,
    UnitResult,
    WorkUnit,
    sample_columns,
)

_DOWNLOAD_STATUS, _DOWNLOAD_ERROR = "download_status", "download_error"


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


def export_unit(cfg: ExportConfig, unit: WorkUnit | AppendUnit) -> UnitResult:
    """Process one work unit end to end; idempotent given the same config.

    A retried unit (Ray reruns it when its worker dies) meets what its first
    attempt left and must still succeed. Each attempt writes its parts into
    its own folder (under ``_progress/writing`` on a local ``--out``, a
    temporary folder for object storage), names each part by the ids it holds
    (:func:`~prx_data.export.naming.content_part_name`), then fsyncs and renames
    them into the buckets, or uploads them after clearing an earlier attempt's
    objects. Either way the marker comes last, after everything it vouches for
    is durable.
    """
    local = not storage.is_remote(cfg.out)
    # Parts are written under the unit's key, then named by the ids they hold (known only
    # once written) and published: renamed into the buckets (local) or uploaded.
    stage = stage_dir(cfg.out, unit.part) if local else tempfile.mkdtemp(prefix="prx-unit-")
    try:
        return _write_unit(cfg, unit, stage)
    finally:
        if not local:
            remove_tree(stage)


def _unit_batches(frag, unit: WorkUnit | AppendUnit, projection: dict, read_cols: list[str]):
    """The unit's rows: a fragment range, or (an append's unit) the rows at its offsets,
    whose ``--filter`` the append's plan has already applied."""
    if isinstance(unit, AppendUnit):
        offsets = unit.offsets()
        for i in range(0, len(offsets), 64):
            yield from frag.take(offsets[i : i + 64], columns=read_cols).to_batches()
        return
    yield from frag.to_batches(
        columns=projection, offset=unit.start, limit=unit.count, batch_size=64
    )


def _write_unit(cfg: ExportConfig, unit: WorkUnit | AppendUnit, stage: str) -> UnitResult:
    """:func:`export_unit` with its parts staged in ``stage`` (a local folder)."""
    from prx_data.core.streaming_compat import mds_writer

    MDSWriter = mds_writer()  # noqa: N806 (a class); not all of `streaming`: see mds_writer
    t0 = time.perf_counter()
    spec, encode = BucketSpec(tiers=tuple(cfg.tiers)), cfg.encode
    ds = open_table(cfg.table, cfg.table_version)
    frag = ds.get_fragment(unit.fragment_id)
    caption_cols = list(cfg.caption_columns or ())
    wanted = ["id", "image", "width", "height", "probe_error", QUALITY_COLUMN, *caption_cols]
    wanted += [_DOWNLOAD_STATUS, _DOWNLOAD_ERROR]
    wanted += [c for c in cfg.keep_columns if c not in wanted]
    available = set(ds.schema.names)
    optouts = load_keys(cfg.out)
    wanted += [c for c in read_columns(optouts, available) if c not in wanted]
    read_cols = [c for c in wanted if c in available]
    local = not storage.is_remote(cfg.out)
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
    columns = sample_columns(cfg, ds.schema)
    kept = {c: columns[c] for c in cfg.keep_columns}

    projection = {c: c for c in read_cols}
    filtering = bool(cfg.filter) and not isinstance(unit, AppendUnit)
    if filtering:
        # Evaluate the filter as a projected column so that the unit's row range stays
        # exactly the fragment rows [start, start + count) whatever the filter keeps.
        projection["_keep"] = f"coalesce(({cfg.filter}), false)"
    batches = _unit_batches(frag, unit, projection, read_cols)
    try:
        for batch in batches:
            out_rows = removed(optouts, batch)
            for row, opted_out in zip(batch.to_pylist(), out_rows, strict=True):
                result.rows += 1
                if opted_out:
                    drop(row, OPTED_OUT)
                    continue
                if filtering and not row["_keep"]:
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
                        encode, data, b.width, b.height, src_size=(int(w), int(h))
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
                    writer = MDSWriter(
                        out=os.path.join(stage, *b.name.split("/"), unit.part),
                        columns=columns,
                        compression=cfg.compression,
                        hashes=list(cfg.hashes) or None,
                        size_limit=cfg.size_limit,
                    )
                    create_only_uploads(writer)
                    writers[b.name] = writer
                    ids[b.name] = []
                writer.write(sample)
                ids[b.name].append(sample["id"])
                result.written += 1
                q = row.get(QUALITY_COLUMN)  # written, but blank: see prx_data.quality
                if q and is_low_information(q["std"], q["entropy"], q["flat"]):
                    notes["blank"] += 1
    except Exception:
        refused = refused_upload(writers.values())
        if refused is not None:
            raise refused from None
        raise
    finally:
        try:
            for writer in writers.values():
                writer.finish()
        except Exception:
            refused = refused_upload(writers.values())
            if refused is not None:
                raise refused from None
            raise
    salt = unit.salt if isinstance(unit, AppendUnit) else 0
    for name, id_list in ids.items():
        bdir = os.path.join(stage, *name.split("/"))
        part = content_part_name(ids_digest(id_list) + salt)
        os.rename(os.path.join(bdir, unit.part), os.path.join(bdir, part))
        result.bucket_bytes[name] = write_manifest(bdir, part, id_list)
        result.buckets[name] = len(id_list)
        result.parts[name] = part
    if ids:
        (publish_parts if local else upload_parts)(cfg.out, stage, result.parts)
    result.dropped = dict(dropped)
    result.notes = dict(notes)
    if listed:
        path = storage.join(cfg.out, *DROPPED_DIR.split("/"), f"{unit.part}.parquet")
        write_dropped_rows(path, listed)
        if local:
            fsync(os.path.dirname(path))
    result.seconds = time.perf_counter() - t0
    storage.write_bytes_atomic(marker_path(cfg.out, unit.part), result.to_json().encode())
    return result
