"""Small sample exports in the layout of ``python -m prx_data.write_mds``, for demos and docs.

:func:`make_sample_export` writes solid-colour JPEGs of each bucket's exact
shape with ``streaming.MDSWriter``, so a notebook or a smoke run can stream,
mix and skip without a Lance table or real photos (the colour encodes the
sample's number, so a test can check pixels survived). Everything that
defines the tree (part names, ``ids.parquet`` manifests, the merged bucket
index) comes from :mod:`prx_data.export.layout`, as in the real exporter, and
the tree is completed the way the exporter completes it (export marker, one
progress marker per part, then :func:`prx_data.export.merge.finalize` merges the
buckets and writes ``report.json``), so the loader accepts it::

    <root>/report.json, dropped.parquet, _progress/export.marker, _progress/<part>.done
    <root>/<tier>/<ar>/index.json
    <root>/<tier>/<ar>/<part>/index.json, shard.NNNNN.mds, ids.parquet

For real data, export a Lance table with ``python -m prx_data.write_mds``.
"""

from __future__ import annotations

import io
import json
import os
import shutil
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from PIL import Image
from streaming import MDSWriter

from prx_data.core import storage
from prx_data.core.buckets import parse_bucket_name
from prx_data.core.schema import MDS_COLUMNS, mds_sample
from prx_data.export import durable, naming, safety
from prx_data.export.merge import done_parts, finalize
from prx_data.export.spec import ExportConfig, UnitResult

__all__ = [
    "make_sample_export",
]


@dataclass
class SampleExport:
    """What was written: ids per bucket in merged-index order, and the shard of each id."""

    root: str
    ids: dict[str, list[str]] = field(default_factory=dict)
    #: id -> (bucket, shard basename as in the merged index, index within the shard)
    where: dict[str, tuple[str, str, int]] = field(default_factory=dict)

    def all_ids(self) -> set[str]:
        return {i for ids in self.ids.values() for i in ids}


def _jpeg(width: int, height: int, colour: tuple[int, int, int]) -> bytes:
    buf = io.BytesIO()
    Image.new("RGB", (width, height), colour).save(buf, "JPEG", quality=90)
    return buf.getvalue()


def make_sample_export(
    root: str,
    buckets: Mapping[str, int],
    *,
    name: str = "ds",
    samples_per_part: int = 16,
    samples_per_shard: int | None = None,
    caption_columns: Sequence[str] = ("caption",),
    hashes: Sequence[str] = ("sha1", "xxh64"),
    compression: str | None = None,
) -> SampleExport:
    """Write ``buckets`` ({"512/1.000": n_samples}) under ``root`` and return the ids.

    Each bucket gets ``ceil(n / samples_per_part)`` parts named ``f0-<start>``;
    ``samples_per_shard`` splits a part into several shards (by MDS size limit).
    Ids are ``<name>/<bucket>/<i>``; the pixel colour encodes ``i``.
    """
    out = SampleExport(root)
    results = done_parts(root) if os.path.isdir(os.path.join(root, naming.PROGRESS_DIR)) else {}
    for r in results.values():  # buckets made again by this call are counted again below
        for b in buckets:
            r.written -= r.buckets.pop(b, 0)
    columns = dict(MDS_COLUMNS)
    for c in caption_columns:
        columns[c] = "str"
    for bucket_name, n in buckets.items():
        bucket = parse_bucket_name(bucket_name)
        bdir = os.path.join(root, bucket_name)
        if os.path.exists(bdir):
            shutil.rmtree(bdir)
        # Solid colours compress to a fixed size per shape, so a size limit gives exact shard sizes.
        proto = _jpeg(bucket.width, bucket.height, (1, 2, 3))
        size_limit = None
        if samples_per_shard:
            size_limit = samples_per_shard * (len(proto) + 400) + 64
        ids: list[str] = []
        parts: list[str] = []
        for start in range(0, n, samples_per_part):
            part = naming.part_name(0, start)
            parts.append(part)
            pdir = os.path.join(bdir, part)
            shard_rows: list[tuple[str, int, str]] = []
            kw = {"size_limit": size_limit} if size_limit else {}
            with MDSWriter(
                out=pdir, columns=columns, compression=compression, hashes=list(hashes), **kw
            ) as w:
                for i in range(start, min(n, start + samples_per_part)):
                    sid = f"{name}/{bucket_name}/{i}"
                    colour = (i % 251, (i // 251) % 251, 7)
                    sample = mds_sample(
                        image=_jpeg(bucket.width, bucket.height, colour),
                        id=sid,
                        width=bucket.width * 2,
                        height=bucket.height * 2,
                        crop_box=(0.0, 0.0, float(bucket.width * 2), float(bucket.height * 2)),
                        tier=bucket.tier,
                        bucket=bucket_name,
                    )
                    for c in caption_columns:
                        sample[c] = f"{c} of {sid}"
                    w.write(sample)
                    ids.append(sid)
            # Recover which shard each sample went to from the part's own index.
            with open(os.path.join(pdir, "index.json")) as f:
                shards = json.load(f)["shards"]
            k = start
            for sh in shards:
                base = f"{part}/{sh['raw_data']['basename']}"
                for j in range(sh["samples"]):
                    sid = f"{name}/{bucket_name}/{k}"
                    shard_rows.append((base, j, sid))
                    out.where[sid] = (bucket_name, base, j)
                    k += 1
            durable.write_manifest(bdir, part, [r[2] for r in shard_rows])
            r = results.setdefault(part, UnitResult(part=part))
            r.buckets[bucket_name] = len(shard_rows)
            r.written += len(shard_rows)
        out.ids[bucket_name] = ids
    safety.write_export_marker(root)
    for r in results.values():
        r.rows = r.written
        storage.write_bytes_atomic(naming.marker_path(root, r.part), r.to_json().encode())
    cfg = ExportConfig(
        table="(sample export: prx_data.export.sample)",
        out=root,
        caption_columns=tuple(caption_columns),
        hashes=tuple(hashes),
    )
    finalize(cfg, results, 0.0)  # merges every bucket and writes report.json, as the exporter
    return out
