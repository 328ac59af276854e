"""What an append costs beyond its new rows, at 10^6 and 10^7 rows.

``write_mds --append`` compares the table with the export's row record
(``_progress/rows.lance``: id, sha256) by id before it exports anything
(:func:`prx_data.export.append.diff`); every full export ends by writing that record
(:func:`~prx_data.export.append.write_record`). Both scale with the table, not with the
rows added, and both read only ``id`` and ``sha256``. This times them on Lance tables
of ``--rows`` rows holding just those two columns (no images: the image column is not
read by either), with 1 % new rows, 0.1 % changed digests and 0.1 % deleted ids:

  record   ``write_record`` of the table (what the last export wrote)
  diff     ``table_side`` + ``baseline`` (the record) + ``diff``, as ``run_append`` calls them

The figures feed the 10^6-row append estimate in ``benchmarks/results/append.md``
(the full exports there run at a measured rows/s; a real 10^6-row export of photos is
about 7 hours on the 2-core machine).

  python benchmarks/bench_append_diff.py --rows 1000000 --rows 10000000 \\
      --json benchmarks/results/append-diff.json
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import shutil
import sys
import tempfile
import time

import numpy as np
import pyarrow as pa

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from prx_data.export import append as A  # noqa: E402
from prx_data.export.spec import ExportConfig  # noqa: E402


def _batches(ids: np.ndarray, salt: np.ndarray):
    step = 1 << 18
    for lo in range(0, len(ids), step):
        i, s = ids[lo : lo + step], salt[lo : lo + step]
        yield pa.record_batch(
            {
                "id": pa.array([f"row{k:010d}" for k in i]),
                "sha256": pa.array(
                    [f"{(k * 2654435761 + t) % (1 << 61):064x}" for k, t in zip(i, s, strict=True)]
                ),
            }
        )


def _write(uri: str, ids: np.ndarray, salt: np.ndarray) -> None:
    import lance

    schema = pa.schema([("id", pa.string()), ("sha256", pa.string())])
    reader = pa.RecordBatchReader.from_batches(schema, _batches(ids, salt))
    lance.write_dataset(reader, uri, max_rows_per_file=1 << 22)


def one(rows: int, work: str) -> dict:
    import lance

    rng = np.random.default_rng(rows)
    old_ids = np.arange(rows, dtype=np.int64)
    deleted = rng.choice(rows, rows // 1000, replace=False)
    keep = np.ones(rows, bool)
    keep[deleted] = False
    new_ids = np.concatenate([old_ids[keep], np.arange(rows, rows + rows // 100)])
    salt = np.zeros(len(new_ids), np.int64)
    salt[rng.choice(int(keep.sum()), rows // 1000, replace=False)] = 1  # changed images
    table = os.path.join(work, f"t{rows}.lance")
    _write(table, new_ids, salt)
    old = os.path.join(work, f"old{rows}.lance")
    _write(old, old_ids, np.zeros(rows, np.int64))
    out = os.path.join(work, f"out{rows}")
    os.makedirs(os.path.join(out, "_progress"), exist_ok=True)

    t = time.perf_counter()
    A.write_record(out, lance.dataset(old))  # what the last export wrote
    record_s = time.perf_counter() - t

    ds = lance.dataset(table)
    cfg = ExportConfig(table=table, out=out)
    t = time.perf_counter()
    seen, source = A.baseline(out, cfg, None)
    d = A.diff(A.table_side(ds, None), seen, ds.count_rows() + rows)
    diff_s = time.perf_counter() - t
    want = {"new": rows // 100, "changed": rows // 1000, "deleted": rows // 1000}
    got = {k: d.counts[k] for k in want}
    assert got == want and source == "record", (got, want, source)
    return {
        "rows": rows,
        "record_s": round(record_s, 2),
        "diff_s": round(diff_s, 2),
        "diff_rows_per_s": round((len(new_ids) + rows) / diff_s),
        "counts": got,
        "peak_rss_mb": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024),
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rows", type=int, action="append", help="table rows (repeatable)")
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    with open("/proc/loadavg") as f:
        load0 = f.read().split()[:3]
    work = tempfile.mkdtemp(prefix="bench-append-diff-")
    try:
        runs = [one(n, work) for n in (args.rows or [1_000_000])]
    finally:
        shutil.rmtree(work, ignore_errors=True)
    with open("/proc/loadavg") as f:
        load1 = f.read().split()[:3]
    res = {
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "machine": f"{platform.machine()}, {os.cpu_count()} CPUs (shared)",
        "loadavg": [load0, load1],
        "runs": runs,
    }
    print(json.dumps(res, indent=1))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(res, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
