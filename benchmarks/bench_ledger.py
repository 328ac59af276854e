"""The corpus ledger at scale: an opt-out of 10^3 ids against a ledger of L entries and an
export (and table) of N samples.

Usage: ``python benchmarks/bench_ledger.py [--samples N] [--ledger L] [--work DIR] [--out F]``.

Fabricated, so only the ledger's own costs are measured:

* the export has the real layout (indexes, manifests, id index; no shard files, which
  no list operation reads), built as ``bench_scale`` builds it;
* the table beside it holds one row per exported sample (same ids, 32 random bytes as the
  image, their sha256) so :func:`prx_data.skips.content.expand` scans a table of N rows;
* the ledger (``_prx_ledger.lance`` beside the table) is written directly with Lance in
  batches of 10^6: L opt-out entries of ids the export does not hold, each with a sha256.

Measured, each in a fresh process (time, and peak resident memory as ``VmHWM`` growth):
``optout`` (:func:`prx_data.skips.optout.add_optout` of 10^3 ids: expand, ledger append,
materialise into the export), ``optout_keys`` (:meth:`Ledger.optout_keys`: the key set an
export applies), ``keyset_of`` (:meth:`KeySet.of` alone on the entries' columns),
``expand`` (of 10^3 ids over the table) and the write-time filter
(:func:`prx_data.export.removals.removed` over 10^5-row batches of the table against the
ledger's key set, against reading those batches alone: ``filter_ratio``).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

import numpy as np
import pyarrow as pa

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
sys.path.insert(0, REPO)
sys.path.insert(0, HERE)

BATCH = 1_000_000
OPTOUT = 1_000


def _hwm_mb() -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024
    return 0.0


def _rss_mb() -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return 0.0


def _hex(raw: np.ndarray) -> pa.Array:
    """(n, 32) uint8 -> the n lowercase hex strings, without a per-row loop."""
    digits = np.frombuffer(b"0123456789abcdef", np.uint8)
    out = np.empty((raw.shape[0], 64), np.uint8)
    out[:, 0::2] = digits[raw >> 4]
    out[:, 1::2] = digits[raw & 15]
    n = raw.shape[0]
    offsets = pa.array(np.arange(0, 64 * (n + 1), 64, dtype=np.int32))
    return pa.Array.from_buffers(
        pa.string(), n, [None, offsets.buffers()[1], pa.py_buffer(out.tobytes())]
    )


def _ids(prefix: str, lo: int, hi: int) -> pa.Array:
    import pyarrow.compute as pc

    nums = pa.array(np.arange(lo, hi, dtype=np.int64)).cast(pa.string())
    return pc.binary_join_element_wise(prefix, pc.utf8_lpad(nums, 12, "0"), "")


def fabricate(work: str, n: int, entries: int) -> dict:
    import bench_scale as BS
    import lance

    from prx_data.core.buckets import DEFAULT_SPEC
    from prx_data.core.schema import TABLE_SCHEMA
    from prx_data.export.merge import done_parts
    from prx_data.export.spec import ExportConfig
    from prx_data.skips import place as PL
    from prx_data.skips.export_state import ExportState, write_state
    from prx_data.skips.log import LOG_SCHEMA
    from prx_data.skips.ops import sync

    res = {}
    root = os.path.join(work, "export")
    data = os.path.join(work, "data")
    os.makedirs(data, exist_ok=True)
    table = os.path.join(data, "photos.lance")
    t0 = time.perf_counter()
    nb = len(DEFAULT_SPEC.shapes(BS.TIER))
    BS.fabricate(root, n, -(-n // nb), work, 0, shard_files=False)
    cfg = ExportConfig(table="(bench)", out=root, caption_columns=("caption",), tiers=(BS.TIER,))
    BS.finalize_timed(cfg, done_parts(root), n, {})
    res["fabricate_export_s"] = round(time.perf_counter() - t0, 1)

    t0 = time.perf_counter()
    rng = np.random.default_rng(0)

    def table_batches():
        for lo in range(0, n, BATCH):
            hi = min(n, lo + BATCH)
            k = hi - lo
            raw = rng.integers(0, 256, (k, 32), dtype=np.uint8)
            import hashlib

            digests = np.frombuffer(
                b"".join(hashlib.sha256(r).digest() for r in raw), np.uint8
            ).reshape(k, 32)
            offsets = pa.array(np.arange(0, 32 * (k + 1), 32, dtype=np.int32))
            images = pa.Array.from_buffers(
                pa.binary(), k, [None, offsets.buffers()[1], pa.py_buffer(raw.tobytes())]
            )
            ids = pa.array([BS._sid(i) for i in range(lo, hi)], pa.string())
            cols = {f.name: pa.nulls(k, f.type) for f in TABLE_SCHEMA}
            cols.update(id=ids, image=images, sha256=_hex(digests), source=pa.array(["b"] * k))
            yield pa.RecordBatch.from_pydict(cols, schema=TABLE_SCHEMA)

    lance.write_dataset(
        pa.RecordBatchReader.from_batches(TABLE_SCHEMA, table_batches()), table, mode="create"
    )
    res["fabricate_table_s"] = round(time.perf_counter() - t0, 1)

    t0 = time.perf_counter()
    uri = PL.default_ledger_uri(table)
    schema = LOG_SCHEMA.with_metadata(
        {
            PL.LEDGER_ID_KEY.decode(): "bench" + "0" * 27,
            PL.LOG_ID_KEY.decode(): "benchlog" + "0" * 24,
            PL.HOME_KEY.decode(): PL.canonical(uri),
        }
    )

    def ledger_batches():
        import datetime as dt

        at = pa.scalar(dt.datetime(2026, 12, 1, tzinfo=dt.UTC), LOG_SCHEMA.field("at").type)
        for lo in range(0, entries, BATCH):
            hi = min(entries, lo + BATCH)
            k = hi - lo
            cols = {
                "seq": pa.array(np.ones(k, np.int64)),
                "base": pa.array(np.ones(k, np.int64)),
                "kind": pa.array(np.zeros(k, np.int8)),
                "list": pa.array(["optout-old"] * k, pa.string()),
                "id": _ids("gone/", lo, hi),
                "op": pa.array(["add"] * k, pa.string()),
                "at": pa.array([at.as_py()] * k, LOG_SCHEMA.field("at").type),
                "command": pa.array(["optout"] * k, pa.string()),
                "reason": pa.nulls(k, pa.string()),
                "export": pa.array([""] * k, pa.string()),
                "host": pa.array(["bench"] * k, pa.string()),
                "sha256": _hex(rng.integers(0, 256, (k, 32), dtype=np.uint8)),
                "phash": pa.array(rng.integers(1, 2**62, k, dtype=np.int64)),
                "optout": pa.array(np.ones(k, bool)),
            }
            yield pa.RecordBatch.from_pydict(cols, schema=schema)

    lance.write_dataset(
        pa.RecordBatchReader.from_batches(schema, ledger_batches()), uri, mode="create"
    )
    res["fabricate_ledger_s"] = round(time.perf_counter() - t0, 1)
    write_state(root, ExportState())  # bound at the first sync
    t0 = time.perf_counter()
    sync(root, table)
    res["first_sync_s"] = round(time.perf_counter() - t0, 1)
    return res


def measure(what: str, work: str, n: int) -> dict:
    """One measurement in this (fresh) process."""
    import bench_scale as BS
    import lance

    from prx_data.core.keys import KeySet
    from prx_data.export.removals import removed
    from prx_data.skips import ledger as LG
    from prx_data.skips import place as PL
    from prx_data.skips.content import expand

    table = os.path.join(work, "data", "photos.lance")
    root = os.path.join(work, "export")
    rng = np.random.default_rng(1)
    pick = [BS._sid(int(i)) for i in rng.choice(n, OPTOUT, replace=False)]
    led = LG.Ledger(PL.default_ledger_uri(table))
    out: dict = {}
    if what == "filter":
        keys = led.optout_keys()
        ds = lance.dataset(table)
        cols = ["id", "sha256"]
        t0 = time.perf_counter()
        rows = sum(b.num_rows for b in ds.to_batches(columns=cols, batch_size=100_000))
        base = time.perf_counter() - t0
        t0 = time.perf_counter()
        hit = 0
        for b in ds.to_batches(columns=cols, batch_size=100_000):
            hit += sum(removed(keys, b))
        filt = time.perf_counter() - t0
        return {
            "rows": rows,
            "removed": hit,
            "read_s": round(base, 3),
            "read_and_filter_s": round(filt, 3),
            "filter_us_per_row": round((filt - base) / rows * 1e6, 3),
            "filter_ratio": round(filt / base, 2),
        }
    base = _rss_mb()
    t0 = time.perf_counter()
    if what == "optout":
        from prx_data.skips.optout import add_optout

        r = add_optout(root, "optout-bench", pick, table=table)
        out["samples_in_list"] = r.samples_in_list
    elif what == "optout_keys":
        out["keys"] = len(led.optout_keys())
    elif what == "keyset_of":
        t = led.optout_entries()
        base = _rss_mb()
        t0 = time.perf_counter()
        out["keys"] = len(KeySet.of(t["id"], t["sha256"], t["phash"]))
    elif what == "expand":
        e = expand([table], pick)
        out["found"] = len(e.keys)
    else:
        raise SystemExit(f"unknown measurement {what}")
    out["s"] = round(time.perf_counter() - t0, 2)
    out["peak_add_mb"] = round(_hwm_mb() - base, 0)
    return out


def _child(what: str, work: str, n: int) -> dict:
    env = {**os.environ, "PYTHONPATH": REPO + os.pathsep + os.environ.get("PYTHONPATH", "")}
    p = subprocess.run(
        [sys.executable, __file__, "--measure", what, "--work", work, "--samples", str(n)],
        env=env,
        capture_output=True,
        text=True,
        check=False,
    )
    if p.returncode:
        return {"error": p.stderr.strip().splitlines()[-1] if p.stderr.strip() else p.returncode}
    return json.loads(p.stdout.strip().splitlines()[-1])


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--samples", type=int, default=1_000_000)
    ap.add_argument("--ledger", type=int, default=10_000_000)
    ap.add_argument("--work", default=None)
    ap.add_argument("--measure", default=None)
    ap.add_argument("--only", default="optout,optout_keys,keyset_of,expand,filter")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    if args.measure:
        print(json.dumps(measure(args.measure, args.work, args.samples)))
        return 0
    import shutil

    work = tempfile.mkdtemp(prefix="prx-ledger-bench-", dir=args.work)
    res: dict = {"samples": args.samples, "ledger_entries": args.ledger, "optout_ids": OPTOUT}
    res["load_avg_1m_start"] = os.getloadavg()[0]
    try:
        res.update(fabricate(work, args.samples, args.ledger))
        for what in args.only.split(","):
            res[what] = _child(what, work, args.samples)
            print(what, res[what], file=sys.stderr, flush=True)
        res["load_avg_1m_end"] = os.getloadavg()[0]
    finally:
        shutil.rmtree(work, ignore_errors=True)
    print(json.dumps(res, indent=1))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(res, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
