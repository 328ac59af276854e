"""Column jobs and ingest at scale: per-row cost, bytes written, append cost vs table size.

In one run:

1. **Column job** (:mod:`prx_data.columns.runner`) with a zero-cost model
   (the value is the image's length, plus an ``ok`` status) over tables of
   ``--sizes`` rows (id + a tiny image bytes column, written directly with
   ``lance.write_dataset``, ``--rows-per-fragment`` rows per fragment); the
   new columns are an 8-byte hash-like value and a status.
   Reported per size: seconds, per-row cost (µs), the ratio of the largest
   size's per-row cost to the smallest's (target <= 1.3), and the bytes the
   job added to the table directory (every file: data, manifests,
   transactions, checkpoints) over the final size of the new columns' data
   files (target <= 2). Ray is started before the clock.
2. **Legacy write-back** (``--legacy-sizes``, off by default): the same
   zero-cost values written the old way, ``update_column`` every 2,000 rows,
   to show the growth the runner removes.
3. **Ingest**: appending ``--append-rows`` new rows (a parquet source of tiny
   JPEGs) to an empty table and to a table of ``--base-rows`` rows (built
   with ``lance.write_dataset`` plus the id index ingest maintains); the
   ratio of the two times (target <= 1.3). ``append_known_source`` appends
   the same number of new ids under a source name the table already has, so
   every unit looks its ids up in the table (the worst case).

Usage::

    python benchmarks/bench_columns.py --sizes 50000,1000000 --base-rows 1000000
"""

from __future__ import annotations

import argparse
import io
import json
import os
import sys
import tempfile
import time
from pathlib import Path

import lance
import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
from PIL import Image

from prx_data.core.runtime import RunOptions

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from prx_data.pipelines.ingest import ingest, update_id_index  # noqa: E402

from prx_data.columns import runner as R  # noqa: E402
from prx_data.core import schema as S  # noqa: E402
from prx_data.core.runtime import ensure_ray  # noqa: E402

OUTPUTS = pa.schema([pa.field("zc", pa.uint64()), pa.field("zc_status", pa.string())])


def zero_cost(batch: pa.Table) -> pa.Table:
    """The model that costs nothing: an 8-byte hash-like value per row (think pHash) and ``ok``.

    The value is a multiplicative hash of the row address (of the image
    length when there is none), so it does not compress away and the new
    column has a realistic size.
    """
    if "_rowaddr" in batch.column_names:
        key = batch["_rowaddr"].to_numpy()
    else:
        key = np.array([len(b) for b in batch["image"].to_pylist()], np.uint64)
    with np.errstate(over="ignore"):
        value = key.astype(np.uint64) * np.uint64(0x9E3779B97F4A7C15)
    return pa.table(
        {
            "zc": pa.array(value, pa.uint64()),
            "zc_status": pa.array(["ok"] * batch.num_rows, pa.string()),
        }
    )


def dir_bytes(path: str) -> int:
    total = 0
    for root, _, files in os.walk(path):
        for f in files:
            total += os.path.getsize(os.path.join(root, f))
    return total


def make_small_table(uri: str, rows: int, per_fragment: int) -> None:
    rng = np.random.default_rng(rows)
    blobs = [rng.bytes(16) for _ in range(256)]
    for start in range(0, rows, 250_000):
        n = min(250_000, rows - start)
        t = pa.table(
            {
                "id": pa.array([f"b/{i:09d}" for i in range(start, start + n)]),
                "image": pa.array([blobs[i % 256] for i in range(n)], pa.large_binary()),
            }
        )
        lance.write_dataset(
            t, uri, mode="append" if start else "create", max_rows_per_file=per_fragment
        )


def new_columns_bytes(uri: str, names: list[str]) -> int:
    """Bytes of the data files that hold only the given columns, in the final version."""
    ds = lance.dataset(uri)
    ids = {ds.lance_schema.field(n).id() for n in names}
    total = 0
    for frag in ds.get_fragments():
        for f in frag.metadata.data_files():
            fields = {i for i in f.field_ids() if i >= 0}
            if fields and fields <= ids:
                total += f.file_size_bytes or 0
    return total


def column_job(root: Path, rows: int, per_fragment: int, engine: str) -> dict:
    uri = str(root / f"cols-{rows}.lance")
    make_small_table(uri, rows, per_fragment)
    before = dir_bytes(uri)
    job = R.ColumnJob(
        table=uri,
        outputs=OUTPUTS,
        read_columns=["image"],
        steps=[R.Step(zero_cost, batch_size=8192)],
        where="zc_status IS NULL",
        run=RunOptions(engine=engine, progress=False),
        batch_size=8192,
        count_column="zc_status",
    )
    t0 = time.perf_counter()
    rep = R.run_column_job(job)
    secs = time.perf_counter() - t0
    assert rep.rows == rows and rep.counts == {"ok": rows}, rep.summary()
    added = dir_bytes(uri) - before
    final = new_columns_bytes(uri, OUTPUTS.names)
    import shutil

    shutil.rmtree(uri, ignore_errors=True)
    return {
        "rows": rows,
        "fragments": rep.fragments,
        "commits": rep.commits,
        "seconds": round(secs, 2),
        "us_per_row": round(secs / rows * 1e6, 3),
        "bytes_added_to_table": added,
        "new_column_bytes": final,
        "bytes_ratio": round(added / final, 3),
    }


def legacy_job(root: Path, rows: int, per_fragment: int, flush_rows: int = 2000) -> dict:
    """The write-back the jobs used before: update_column every ``flush_rows`` rows."""
    from prx_data.table.lance_ops import update_column

    uri = str(root / f"legacy-{rows}.lance")
    make_small_table(uri, rows, per_fragment)
    before = dir_bytes(uri)
    t0 = time.perf_counter()
    ds = lance.dataset(uri)
    for batch in ds.to_batches(
        columns=["id", "image"], batch_size=flush_rows, with_row_address=True
    ):
        vals = pa.Table.from_batches([batch])
        out = zero_cost(vals)
        for col in OUTPUTS.names:
            update_column(uri, col, pa.table({"id": vals["id"], col: out[col]}))
    secs = time.perf_counter() - t0
    added = dir_bytes(uri) - before
    final = new_columns_bytes(uri, OUTPUTS.names[:1]) + new_columns_bytes(uri, OUTPUTS.names[1:])
    return {
        "rows": rows,
        "seconds": round(secs, 2),
        "us_per_row": round(secs / rows * 1e6, 3),
        "bytes_added_to_table": added,
        "new_column_bytes": final,
        "bytes_ratio": round(added / max(final, 1), 3),
    }


def tiny_jpegs(k: int = 64) -> list[bytes]:
    rng = np.random.default_rng(1)
    out = []
    for _ in range(k):
        buf = io.BytesIO()
        Image.fromarray(rng.integers(0, 255, (16, 16, 3), dtype=np.uint8)).save(buf, "JPEG")
        out.append(buf.getvalue())
    return out


def append_source(path: Path, rows: int, start: int) -> None:
    imgs = tiny_jpegs()
    pq.write_table(
        pa.table(
            {
                "key": [f"{i:09d}" for i in range(start, start + rows)],
                "image": [imgs[i % len(imgs)] for i in range(rows)],
                "caption": [f"row {i}" for i in range(start, start + rows)],
            }
        ),
        path,
        row_group_size=8192,
    )


def base_table(uri: str, rows: int) -> None:
    """A table of ``rows`` rows as ingest leaves it (contract schema, id index)."""
    imgs = tiny_jpegs()
    for start in range(0, rows, 250_000):
        n = min(250_000, rows - start)
        t = pa.table(
            {
                S.ID: [f"base/{i:09d}" for i in range(start, start + n)],
                S.IMAGE: pa.array([imgs[i % len(imgs)] for i in range(n)], pa.large_binary()),
                S.WIDTH: pa.array([16] * n, pa.int32()),
                S.HEIGHT: pa.array([16] * n, pa.int32()),
                S.FORMAT: ["jpeg"] * n,
                S.SOURCE: ["base"] * n,
                S.CAPTION: [f"row {i}" for i in range(start, start + n)],
                S.PROBE_ERROR: pa.nulls(n, pa.string()),
            },
            schema=S.TABLE_SCHEMA,
        )
        lance.write_dataset(t, uri, mode="append" if start else "create")
    if rows:
        update_id_index(uri)


def timed_ingest(source: str, uri: str, base_rows: int) -> float:
    if base_rows:
        base_table(uri, base_rows)
    else:
        lance.write_dataset(S.TABLE_SCHEMA.empty_table(), uri, mode="create")
    t0 = time.perf_counter()
    rep = ingest([source], uri, progress=False)
    secs = time.perf_counter() - t0
    assert rep.rows_written and rep.rows_in_table == base_rows + rep.rows_written, rep.format()
    import shutil

    shutil.rmtree(uri, ignore_errors=True)
    return secs


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument(
        "--sizes",
        default="50000,1000000",
        help="comma-separated table sizes for the column job (default: %(default)s)",
    )
    p.add_argument(
        "--rows-per-fragment",
        type=int,
        default=100_000,
        help="fragment size of the column-job tables (default: %(default)s)",
    )
    p.add_argument(
        "--engine", choices=R.ENGINES, default="ray", help="column job engine (default: ray)"
    )
    p.add_argument(
        "--legacy-sizes",
        default="",
        help="also time the old update_column-every-2000-rows write-back at these sizes",
    )
    p.add_argument(
        "--base-rows", type=int, default=1_000_000, help="rows already in the table (ingest)"
    )
    p.add_argument("--append-rows", type=int, default=100_000, help="rows appended (ingest)")
    p.add_argument("--repeats", type=int, default=2, help="timed ingest runs, best kept")
    p.add_argument("--cpus", type=int, default=2, help="local Ray CPUs (default: %(default)s)")
    p.add_argument("--skip-ingest", action="store_true", help="only the column job")
    p.add_argument("--skip-columns", action="store_true", help="only the ingest")
    p.add_argument("--json", default=None, help="also write the results to this file")
    p.add_argument("--dir", default=None, help="work folder (default: a temp folder)")
    args = p.parse_args(argv)

    root = Path(args.dir or tempfile.mkdtemp(prefix="bench_columns_"))
    root.mkdir(parents=True, exist_ok=True)
    ensure_ray(num_cpus=args.cpus)
    out: dict = {"cpus": args.cpus, "engine": args.engine}
    if not args.skip_columns:
        column_job(root, 2000, 1000, args.engine)  # warm-up: Ray workers, imports
        runs = [
            column_job(root, int(n), args.rows_per_fragment, args.engine)
            for n in args.sizes.split(",")
        ]
        out["column_job"] = runs
        out["column_job_cost_ratio"] = round(runs[-1]["us_per_row"] / runs[0]["us_per_row"], 3)
        if len(runs) > 1:  # the cost of one more row, free of the job's fixed start-up cost
            out["column_job_marginal_us_per_row"] = round(
                (runs[-1]["seconds"] - runs[0]["seconds"])
                / (runs[-1]["rows"] - runs[0]["rows"])
                * 1e6,
                3,
            )
        out["column_job_max_bytes_ratio"] = max(r["bytes_ratio"] for r in runs)
        if args.legacy_sizes:
            out["legacy_update_column"] = [
                legacy_job(root, int(n), args.rows_per_fragment)
                for n in args.legacy_sizes.split(",")
            ]
    if not args.skip_ingest:
        src = root / "new.parquet"
        append_source(src, args.append_rows, 0)
        known = root / "known.parquet"  # new keys, under the base table's source name
        append_source(known, args.append_rows, args.base_rows)
        warm = root / "warm.parquet"
        append_source(warm, 1000, 0)
        ingest([str(warm)], str(root / "warm.lance"), mode="overwrite", progress=False)
        times: dict[str, list[float]] = {"empty": [], "base": [], "known_source": []}
        for r in range(args.repeats):
            times["empty"].append(timed_ingest(str(src), str(root / f"e{r}.lance"), 0))
            times["base"].append(timed_ingest(str(src), str(root / f"b{r}.lance"), args.base_rows))
            times["known_source"].append(
                timed_ingest(f"base={known}", str(root / f"k{r}.lance"), args.base_rows)
            )
        best = {k: min(v) for k, v in times.items()}
        out["ingest"] = {
            "append_rows": args.append_rows,
            "base_rows": args.base_rows,
            "seconds": {k: [round(x, 2) for x in v] for k, v in times.items()},
            "append_to_base_vs_empty": round(best["base"] / best["empty"], 3),
            "append_known_source_vs_empty": round(best["known_source"] / best["empty"], 3),
        }
    print(json.dumps(out, indent=2))
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=2))
    if not args.dir:
        import shutil

        shutil.rmtree(root, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
