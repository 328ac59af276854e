"""The pack stage on a fabricated export: shards per bucket before/after, and its speed.

Fabricates an export in the exporter's layout (13 buckets of tier 512,
``--parts`` unit parts per bucket of ``--per-part`` samples each, written by
``streaming.MDSWriter`` with real noise JPEGs of about ``--kb`` KB, manifests
and unit markers), then runs the real pack stage (``prx_data.pipelines.write_mds.run_packs``,
on driver threads, or on Ray with ``--ray``) and compares its throughput with
a plain copy of the same shard files (``shutil.copyfile``, fsync per file, like
the pack's durability). Prints shards per bucket before and after, MB/s of
both, and their ratio.

    python benchmarks/bench_pack.py                      # ~250 MB, 8 MiB packs
    python benchmarks/bench_pack.py --shard-size 67108864 --parts 200
"""

from __future__ import annotations

import argparse
import io
import os
import shutil
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import numpy as np  # noqa: E402

TIER = 512


def _jpeg(width: int, height: int, kb: int, seed: int) -> bytes:
    """A JPEG of noise at about ``kb`` KB (quality searched coarsely)."""
    from PIL import Image

    rng = np.random.default_rng(seed)
    base = rng.integers(0, 256, (height // 8, width // 8, 3), dtype=np.uint8)
    img = Image.fromarray(base).resize((width, height), Image.BILINEAR)
    best = b""
    for q in (95, 90, 80, 70, 60, 50, 40, 30):
        buf = io.BytesIO()
        img.save(buf, "JPEG", quality=q)
        best = buf.getvalue()
        if len(best) <= kb * 1024:
            break
    return best


def fabricate(root: str, parts: int, per_part: int, kb: int) -> dict:
    from streaming import MDSWriter

    from prx_data.core.buckets import DEFAULT_SPEC, bucket_name
    from prx_data.core.schema import MDS_COLUMNS
    from prx_data.core.storage import write_bytes_atomic
    from prx_data.export import durable, naming, safety
    from prx_data.export.spec import DEFAULT_HASHES, UnitResult

    safety.write_export_marker(root)
    columns = {**MDS_COLUMNS, "caption": "str"}
    results = {
        naming.part_name(0, u * 1000): UnitResult(part=naming.part_name(0, u * 1000))
        for u in range(parts)
    }
    n = 0
    for b, (w, h) in enumerate(DEFAULT_SPEC.shapes(TIER)):
        bucket = bucket_name(TIER, w, h)
        image = _jpeg(w, h, kb, b)
        bdir = os.path.join(root, *bucket.split("/"))
        for part, r in results.items():
            ids = []
            with MDSWriter(
                out=os.path.join(bdir, part), columns=columns, hashes=list(DEFAULT_HASHES)
            ) as wr:
                for _ in range(per_part):
                    sid = f"{n:012d}"
                    n += 1
                    ids.append(sid)
                    wr.write(
                        {
                            "image": image,
                            "id": sid,
                            "width": w,
                            "height": h,
                            "crop_left": 0.0,
                            "crop_top": 0.0,
                            "crop_right": float(w),
                            "crop_bottom": float(h),
                            "tier": TIER,
                            "bucket": bucket,
                            "caption": f"photo {sid}",
                        }
                    )
            r.bucket_bytes[bucket] = durable.write_manifest(bdir, part, ids)
            r.buckets[bucket] = per_part
            r.written += per_part
            r.rows += per_part
    for r in results.values():
        write_bytes_atomic(naming.marker_path(root, r.part), r.to_json().encode())
    return results


def shard_files(root: str) -> list[str]:
    from prx_data.export import layout

    return [os.path.join(root, rel) for rel in layout.list_suffix(root, ".mds")]


def per_bucket(files: list[str], root: str) -> float:
    buckets = {os.path.relpath(f, root).split(os.sep)[1] for f in files}
    return len(files) / max(1, len(buckets))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--parts", type=int, default=60, help="unit parts per bucket")
    p.add_argument("--per-part", type=int, default=8, help="samples per part")
    p.add_argument("--kb", type=int, default=40, help="JPEG size per sample")
    p.add_argument("--shard-size", type=int, default=8 << 20)
    p.add_argument("--ray", action="store_true", help="pack on Ray tasks, not driver threads")
    p.add_argument("--work", default=None)
    args = p.parse_args()

    import prx_data.pipelines.write_mds as pipeline

    from prx_data.export import pack
    from prx_data.export.spec import ExportConfig

    work = tempfile.mkdtemp(dir=args.work)
    root = os.path.join(work, "export")
    try:
        t = time.perf_counter()
        results = fabricate(root, args.parts, args.per_part, args.kb)
        print(f"fabricated in {time.perf_counter() - t:.1f} s")
        before = shard_files(root)
        nbytes = sum(os.path.getsize(f) for f in before)
        print(
            f"before: {len(before)} shards, {per_bucket(before, root):.1f} per bucket, "
            f"{nbytes / 1e6:.0f} MB, median {np.median([os.path.getsize(f) for f in before]) / 1e6:.2f} MB"
        )
        # The copy baseline: the same files, one read and one write each, fsynced.
        dst = os.path.join(work, "copy")
        os.makedirs(dst)
        t = time.perf_counter()
        for i, f in enumerate(before):
            out = os.path.join(dst, f"{i}.mds")
            shutil.copyfile(f, out)
            fd = os.open(out, os.O_RDONLY)
            os.fsync(fd)
            os.close(fd)
        copy_s = time.perf_counter() - t
        shutil.rmtree(dst)
        cfg = ExportConfig(
            table="(bench)",
            out=root,
            tiers=(TIER,),
            caption_columns=("caption",),
            shard_size=args.shard_size,
        )
        plan = pack.plan_packs(root, results, args.shard_size)
        if args.ray:  # Ray started before the clock: its start-up is not the pack's
            from prx_data.core.runtime import ensure_ray

            ensure_ray(num_cpus=2)
            pipeline.DRIVER_PACK_BYTES = -1
        t = time.perf_counter()
        pipeline.run_packs(cfg, plan, num_cpus=2 if args.ray else None)
        pack_s = time.perf_counter() - t
        after = shard_files(root)
        sizes = [os.path.getsize(f) for f in after]
        print(
            f"after:  {len(after)} shards, {per_bucket(after, root):.1f} per bucket, "
            f"median {np.median(sizes) / 1e6:.2f} MB ({len(plan)} packs, shard size {args.shard_size / 2**20:.0f} MiB)"
        )
        mbs = nbytes / 1e6
        print(
            f"pack  {pack_s:6.2f} s  {mbs / pack_s:7.0f} MB/s  ({'ray' if args.ray else 'driver threads'})"
        )
        print(f"copy  {copy_s:6.2f} s  {mbs / copy_s:7.0f} MB/s")
        print(f"pack / copy throughput: {copy_s / pack_s:.2f}")
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
