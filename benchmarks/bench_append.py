"""``write_mds --append`` of a few new rows against a full re-export of the same table.

A fabricated Lance table (``--rows`` rows, ``--new`` of them added as a new fragment
after a first export): its first version is exported, then the second version is added
with ``--append`` (timed), and the same second version is exported from scratch
(timed). The ratio append / full is the figure; both exports write the same
samples, checked. Images: a pool of distinct 448x448 photo-like JPEGs repeated
across rows (tier 512: every row is decoded, resized and encoded, as in a real export).

Both runs take the job's own path for their size (threads of this process up to
``--driver-rows``, else a local Ray started once and reused): what ``write_mds`` and
``write_mds --append`` would do.

  python benchmarks/bench_append.py --rows 20000 --new 0.01 \\
      --md benchmarks/results/append.md --json benchmarks/results/append.json
"""

from __future__ import annotations

import argparse
import io
import json
import os
import platform
import shutil
import tempfile
import time

import numpy as np


def _jpeg(seed: int, size: int = 448) -> bytes:
    from PIL import Image, ImageFilter

    rng = np.random.default_rng(seed)
    small = rng.integers(0, 255, (size // 16, size // 16, 3), dtype=np.uint8)
    img = Image.fromarray(small).resize((size, size), Image.BICUBIC)
    img = img.filter(ImageFilter.DETAIL)
    buf = io.BytesIO()
    img.save(buf, "JPEG", quality=90)
    return buf.getvalue()


def make_rows(start: int, stop: int, pool: list[bytes]):
    import pyarrow as pa

    from prx_data.core.keys import sha256_hex
    from prx_data.core.schema import TABLE_SCHEMA

    digests = [sha256_hex(p) for p in pool]
    n = stop - start
    k = np.arange(start, stop) % len(pool)
    cols = {
        "id": [f"row{i:09d}" for i in range(start, stop)],
        "image": [pool[j] for j in k],
        "width": [448] * n,
        "height": [448] * n,
        "format": ["JPEG"] * n,
        "source": ["bench"] * n,
        "caption": [f"a photo-like test image {i}" for i in range(start, stop)],
        "probe_error": [None] * n,
        "sha256": [digests[j] for j in k],
    }
    return pa.table({c: cols.get(c, [None] * n) for c in TABLE_SCHEMA.names}, schema=TABLE_SCHEMA)


def main(argv: list[str] | None = None) -> int:
    import lance
    from prx_data.pipelines.append import run_append
    from prx_data.pipelines.write_mds import run_export

    from prx_data.core.runtime import RunOptions
    from prx_data.export.spec import ExportConfig

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rows", type=int, default=20_000)
    p.add_argument("--new", type=float, default=0.01, help="share of rows added (default 1%%)")
    p.add_argument("--pool", type=int, default=256, help="distinct images")
    p.add_argument("--work", default=None, help="scratch folder (default: a temp dir)")
    p.add_argument("--json", default=None)
    p.add_argument("--md", default=None)
    args = p.parse_args(argv)

    work = args.work or tempfile.mkdtemp(prefix="bench-append-")
    os.makedirs(work, exist_ok=True)
    table = os.path.join(work, "t.lance")
    base_rows = args.rows - int(round(args.rows * args.new))
    pool = [_jpeg(s) for s in range(args.pool)]
    t0 = time.perf_counter()
    for lo in range(0, base_rows, 4096):
        lance.write_dataset(
            make_rows(lo, min(base_rows, lo + 4096), pool),
            table,
            mode="create" if lo == 0 else "append",
            max_rows_per_file=1 << 20,
        )
    v1 = lance.dataset(table).version
    lance.write_dataset(make_rows(base_rows, args.rows, pool), table, mode="append")
    v2 = lance.dataset(table).version
    made = time.perf_counter() - t0
    run = RunOptions(progress=False)

    def cfg(out: str, **kw) -> ExportConfig:
        return ExportConfig(table=table, out=out, tiers=(512,), **kw)

    appended, full = os.path.join(work, "appended"), os.path.join(work, "full")
    t = time.perf_counter()
    run_export(cfg(appended, table_version=v1), run)
    base_s = time.perf_counter() - t
    t = time.perf_counter()
    rep_a = run_append(cfg(appended, append=True), run)
    append_s = time.perf_counter() - t
    t = time.perf_counter()
    rep_f = run_export(cfg(full), run)
    full_s = time.perf_counter() - t
    assert rep_a.samples_written == rep_f.samples_written == args.rows, (
        rep_a.samples_written,
        rep_f.samples_written,
    )
    result = {
        "rows": args.rows,
        "new_rows": args.rows - base_rows,
        "table_versions": [v1, v2],
        "table_build_s": round(made, 2),
        "base_export_s": round(base_s, 2),
        "append_s": round(append_s, 2),
        "full_reexport_s": round(full_s, 2),
        "ratio_append_over_full": round(append_s / full_s, 4),
        "append_units": rep_a.append.get("units"),
        "machine": f"{platform.machine()}, {os.cpu_count()} CPUs (shared)",
        "date": time.strftime("%Y-%m-%d"),
    }
    print(json.dumps(result, indent=2))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)
    if args.md:
        with open(args.md, "a") as f:
            f.write(
                f"| {result['date']} | {args.rows:,} | {result['new_rows']:,} | "
                f"{append_s:.1f} | {full_s:.1f} | {result['ratio_append_over_full']:.3f} | "
                f"{result['machine']} |\n"
            )
    if not args.work:
        shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
