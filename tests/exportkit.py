"""Test-only fabrication of small export trees in the layout of ``python -m prx_data.write_mds``.

This is a test double for the exporter's *pixels only*: it writes solid-colour
JPEGs of the exact bucket shape with ``streaming.MDSWriter`` instead of
decoding a Lance table, so the streaming tests run in milliseconds. Everything
that defines the tree (part names, ``ids.parquet`` manifests, the merged
bucket index) comes from :mod:`prx_data.export.layout`, the module the real
exporter and the rewrite use, and the tree is completed the way the exporter
completes it (export marker, one progress marker per part, then
:func:`prx_data.export.unit.finalize` merges the buckets and writes
``report.json``), so the loader accepts it as a finished export. Layout (see
docs/ARCHITECTURE.md):

    <root>/report.json, dropped.parquet, _progress/export.marker, _progress/<part>.done
    <root>/<tier>/<ar>/index.json
    <root>/<tier>/<ar>/<part>/index.json, shard.NNNNN.mds, ids.parquet
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
from prx_data.core.schema import MDS_COLUMNS
from prx_data.export import layout
from prx_data.export.unit import ExportConfig, UnitResult, done_parts, finalize


@dataclass
class FakeExport:
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


def make_export(
    root: str,
    buckets: Mapping[str, int],
    *,
    name: str = "ds",
    samples_per_part: int = 16,
    samples_per_shard: int | None = None,
    caption_columns: Sequence[str] = ("caption",),
    hashes: Sequence[str] = ("sha1", "xxh64"),
    compression: str | None = None,
) -> FakeExport:
    """Write ``buckets`` ({"512/1.000": n_samples}) under ``root`` and return the ids.

    Each bucket gets ``ceil(n / samples_per_part)`` parts named ``f0-<start>``;
    ``samples_per_shard`` splits a part into several shards (by MDS size limit).
    Ids are ``<name>/<bucket>/<i>``; the pixel colour encodes ``i``.
    """
    out = FakeExport(root)
    results = done_parts(root) if os.path.isdir(os.path.join(root, layout.PROGRESS_DIR)) else {}
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
            part = layout.part_name(0, start)
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
                    sample = {
                        "image": _jpeg(bucket.width, bucket.height, colour),
                        "id": sid,
                        "width": bucket.width * 2,
                        "height": bucket.height * 2,
                        "crop_left": 0.0,
                        "crop_top": 0.0,
                        "crop_right": float(bucket.width * 2),
                        "crop_bottom": float(bucket.height * 2),
                        "tier": bucket.tier,
                        "bucket": bucket_name,
                    }
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
            layout.write_manifest(bdir, part, [r[2] for r in shard_rows])
            r = results.setdefault(part, UnitResult(part=part))
            r.buckets[bucket_name] = len(shard_rows)
            r.written += len(shard_rows)
        out.ids[bucket_name] = ids
    layout.write_export_marker(root)
    for r in results.values():
        r.rows = r.written
        storage.write_bytes_atomic(layout.marker_path(root, r.part), r.to_json().encode())
    cfg = ExportConfig(
        table="(fabricated by tests.exportkit)",
        out=root,
        caption_columns=tuple(caption_columns),
        hashes=tuple(hashes),
    )
    finalize(cfg, results, 0.0)  # merges every bucket and writes report.json, as the exporter
    return out


def upload_tree(local_root: str, remote_root: str) -> None:
    """Copy a local export tree to an ``s3://`` URI (for the remote tests)."""
    from prx_data.core import storage

    for rel in storage.list_files(local_root):
        with open(os.path.join(local_root, rel), "rb") as f:
            storage.write_bytes_atomic(
                storage.join(remote_root, rel.replace(os.sep, "/")), f.read()
            )


# --- rank simulation ---------------------------------------------------------------------------


@dataclass
class RankRun:
    """What one simulated rank saw: per batch its ids and the one image shape."""

    batches: list[list[str]]
    shapes: list[tuple[int, ...]]
    state: dict | None = None


def _collate(samples: list[dict]) -> dict:
    shapes = {tuple(s["image"].shape) for s in samples}
    return {"id": [s["id"] for s in samples], "shapes": shapes}


def run_rank(
    datasets,
    *,
    rank: int,
    world_size: int,
    batch_size: int,
    num_workers: int = 0,
    stop_after: int | None = None,
    state: dict | None = None,
    **kwargs,
) -> RankRun:
    """Run one rank of a ``world_size``-rank job in this process, one rank per node.

    Streaming reads the world from ``RANK``/``WORLD_SIZE``/``LOCAL_WORLD_SIZE``;
    torch.distributed is not started (streaming only needs it for barriers,
    and every simulated rank is its own node's leader). ``stop_after`` stops
    after that many batches and returns the loader's resumption state.
    """
    import gc
    from unittest import mock

    import streaming.base.dataset as sd
    from streaming import StreamingDataLoader
    from streaming.base.util import clean_stale_shared_memory

    from prx_data.stream import dataset as ps

    env = {
        "RANK": str(rank),
        "WORLD_SIZE": str(world_size),
        "LOCAL_WORLD_SIZE": "1",
        "LOCAL_RANK": "0",
    }
    clean_stale_shared_memory()
    with (
        mock.patch.dict(os.environ, env),
        mock.patch.object(sd, "maybe_init_dist", lambda: False),
        mock.patch.object(ps, "maybe_init_dist", lambda: False),
    ):
        ds = loader = None
        try:
            ds = ps.BucketedDataset(
                datasets, batch_size=batch_size, num_workers=num_workers, **kwargs
            )
            if state is not None:
                ds.load_state_dict(state)
            loader = StreamingDataLoader(
                ds, batch_size=batch_size, num_workers=num_workers, collate_fn=_collate
            )
            run = RankRun([], [])
            for b in loader:
                run.batches.append(b["id"])
                run.shapes.append(tuple(sorted(b["shapes"])))
                if stop_after is not None and len(run.batches) == stop_after:
                    break
            if stop_after is not None:
                run.state = loader.state_dict()
        finally:
            del loader, ds
            gc.collect()
    clean_stale_shared_memory()
    return run
