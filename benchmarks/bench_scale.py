"""How the jobs around an export grow with its size: seconds and growth exponents.

Fabricates exports in the exporter's own layout (``prx_data.export.layout``):
13 buckets of tier 512, one part per work unit per bucket (``--per-part``
samples each, 40 by default: a 1,000-row unit spread over 25 buckets), one
shard per part, ``ids.parquet`` manifests, one ``_progress`` marker per unit,
then the real :func:`prx_data.export.merge.finalize`. Pixels are cached: one
JPEG per bucket, encoded once (``--image-px`` 8 by default: an 8x8 JPEG, 723 bytes
per sample, so 10^7 samples are 7 GB; the loaders keep images encoded). Shard
files are built with numpy from one sample encoded by ``streaming.MDSWriter``
itself (a template whose fixed-width id is patched in per row), manifests from
Arrow buffers; no Python object per sample. The bench checks once that a
fabricated part is byte-identical to one ``MDSWriter`` writes, and its manifest
equal to ``durable.write_manifest``'s.

For each size (each in a fresh process) it times, where the operation exists:

  pack       the pack stage: each bucket's parts into shards of ``--shard-size``
             (driver threads, no Ray start-up); the later operations see packed trees
  finalize   merge every pack index into the bucket indexes, write the report
  id_index   its share spent building the id index (``_ids.lance``, BTREE on id)
  id_index_fresh  the id index built again in a fresh process: its peak memory over the
             imports, after writing the table and after the BTREE
  resume     resume planning: tree check, unit markers, stale-part sweep
  skips_add  ``skips add --ids`` with 1% of the ids
  holdout    building a 1% hold-out skip set for every bucket (what each rank does)
  loader     init + first batch + resident memory of one process, BucketedDataset
             against plain ``streaming.StreamingDataset`` over the same buckets; then
             the first batch through a ``StreamingDataLoader`` of ``--workers`` workers
             and each worker's RSS and PSS
  rewrite    ``skips rewrite --force`` (``--no-rewrite-above N`` skips it at large N)
  optout     an opt-out of 10^4 ids (``prx_data.optout``)
  optout_fresh  another 10^4 ids in a fresh process: its peak memory over the imports,
             and that peak so far after each step (index open, each query, sidecars)
  verify     ``python -m prx_data.verify`` (in process, with the sidecar check)

plus the peak resident memory each one added, and then prints, per operation,
the growth exponent ``log(t2/t1) / log(n2/n1)`` between consecutive sizes.

Also: seconds in CPU time of the process (their exponents are less disturbed by a
loaded machine), ``BENCH_SCALE_PROFILE=pack,resume,first_batch_bucketed`` for a
cProfile of those steps (all threads), markdown tables (``--markdown``), and
``--e2e N``: ``python -m prx_data.write_mds`` of an N-row Lance table and each
bucket's median shard against ``--shard-size``.

    python benchmarks/bench_scale.py                       # 10^4 and 10^5 (smoke)
    python benchmarks/bench_scale.py --sizes 1e5 1e6 1e7 --no-rewrite-above 1e6
    python benchmarks/bench_scale.py --from-json a.json b.json --markdown t.md
    python benchmarks/bench_scale.py --e2e 1e5 --shard-size 16777216
    python benchmarks/bench_scale.py --only idindex --sizes 1e5 1e6 1e7

``--only idindex`` fabricates a tree of the packed shape (shards of about
``--shard-size``, no pack stage) without shard files, and runs only what binds ids
to shards: the id index build (in ``finalize`` and in a fresh process), ``skips add``,
``optout`` and ``optout_fresh``. 10^7 samples take about a minute instead of 12.
"""

from __future__ import annotations

import argparse
import io
import json
import math
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from contextlib import contextmanager

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import numpy as np  # noqa: E402

TIER = 512
ID_WIDTH = 12
OPS = (
    "fabricate",
    "resume",
    "pack",
    "finalize",
    "id_index",
    "id_index_fresh",
    "skips_add",
    "holdout",
    "loader_bucketed",
    "loader_plain",
    "rewrite",
    "optout",
    "optout_fresh",
    "verify",
)


# --- fabrication -----------------------------------------------------------------------------


def _sid(i: int) -> str:
    return f"{i:0{ID_WIDTH}d}"


class BucketTemplate:
    """One bucket's encoded sample with a placeholder id, and its shard/index templates."""

    def __init__(self, bucket: str, width: int, height: int, work: str, px: int = 0) -> None:
        from PIL import Image
        from streaming import MDSWriter

        from prx_data.core.schema import MDS_COLUMNS
        from prx_data.export.spec import DEFAULT_HASHES

        buf = io.BytesIO()
        # px > 0: a tiny px x px JPEG (a few hundred bytes) stands in for the bucket shape,
        # so that 10^7 samples fit on one disk; the loaders below keep images encoded.
        size = (px, px) if px else (width, height)
        Image.new("RGB", size, (120, 130, 140)).save(buf, "JPEG", quality=90)
        self.bucket = bucket
        self.columns = {**MDS_COLUMNS, "caption": "str"}
        self.hashes = list(DEFAULT_HASHES)
        self.sample = {
            "image": buf.getvalue(),
            "id": "",
            "width": width * 2,
            "height": height * 2,
            "crop_left": 0.0,
            "crop_top": 0.0,
            "crop_right": float(width * 2),
            "crop_bottom": float(height * 2),
            "tier": TIER,
            "bucket": bucket,
            "caption": f"a cached photo in {bucket}",
        }
        w = MDSWriter(out=os.path.join(work, "tmpl"), columns=self.columns, hashes=self.hashes)
        self.config_data = w.config_data
        self.config = w.get_config()
        marker = "#" * ID_WIDTH
        enc = w.encode_sample({**self.sample, "id": marker})
        w.finish()
        shutil.rmtree(os.path.join(work, "tmpl"))
        self.cut = enc.index(marker.encode())
        self.encoded = np.frombuffer(enc, np.uint8)
        self.sample_size = len(enc)

    def shard(self, start: int, n: int) -> bytes:
        """The MDS shard of samples ``start .. start + n - 1``: template rows with ids patched in."""
        offsets = np.arange(n + 1, dtype=np.uint32) * np.uint32(self.sample_size)
        offsets += np.uint32(4 + 4 * (n + 1) + len(self.config_data))
        body = np.tile(self.encoded, (n, 1))
        body[:, self.cut : self.cut + ID_WIDTH] = _id_digits(start, n)
        return np.uint32(n).tobytes() + offsets.tobytes() + self.config_data + body.tobytes()

    def write_part(self, bdir: str, part: str, start: int, n: int, shard_file: bool = True) -> int:
        """One part: its shard, index and manifest. ``shard_file=False`` leaves the shard file
        out (its index entry is still exact: bytes and hashes of the shard it would hold)."""
        from streaming.base.hashing import get_hash

        pdir = os.path.join(bdir, part)
        os.makedirs(pdir, exist_ok=True)
        data = self.shard(start, n)
        if shard_file:
            with open(os.path.join(pdir, "shard.00000.mds"), "wb") as f:
                f.write(data)
        raw = {
            "basename": "shard.00000.mds",
            "bytes": len(data),
            "hashes": {a: get_hash(a, data) for a in self.hashes},
        }
        entry = {"samples": n, "raw_data": raw, "zip_data": None, **self.config}
        with open(os.path.join(pdir, "index.json"), "w") as f:
            json.dump({"version": 2, "shards": [entry]}, f, sort_keys=True)
        write_manifest(bdir, part, start, n)
        return len(data)

    def check_against_mdswriter(self, work: str) -> None:
        """A fabricated part must be byte-identical to what MDSWriter writes for the same samples."""
        from streaming import MDSWriter

        from prx_data.export import durable

        ids = [_sid(i) for i in range(7)]
        real = os.path.join(work, "check-real")
        with MDSWriter(out=real, columns=self.columns, hashes=self.hashes) as w:
            for i in ids:
                w.write({**self.sample, "id": i})
        fake = os.path.join(work, "check-fake")
        self.write_part(fake, "p", 0, len(ids))
        os.rename(os.path.join(fake, "p", "ids.parquet"), os.path.join(fake, "fab.parquet"))
        durable.write_manifest(fake, "p", ids)
        import pyarrow.parquet as pq

        a, b = (pq.read_table(os.path.join(fake, x)) for x in ("fab.parquet", "p/ids.parquet"))
        if not a.equals(b):
            raise SystemExit("fabricated ids.parquet differs from durable.write_manifest's")
        for name in ("shard.00000.mds", "index.json"):
            with (
                open(os.path.join(real, name), "rb") as a,
                open(os.path.join(fake, "p", name), "rb") as b,
            ):
                if a.read() != b.read():
                    raise SystemExit(f"fabricated {name} differs from MDSWriter's: fix the bench")
        shutil.rmtree(real)
        shutil.rmtree(fake)


def _id_digits(start: int, n: int) -> np.ndarray:
    """The fixed-width ids ``start .. start + n - 1`` as an (n, ID_WIDTH) array of ASCII digits."""
    a = np.arange(start, start + n, dtype=np.int64)[:, None]
    p = 10 ** np.arange(ID_WIDTH - 1, -1, -1, dtype=np.int64)
    return ((a // p) % 10 + 48).astype(np.uint8)


def write_manifest(bdir: str, part: str, start: int, n: int) -> None:
    """``durable.write_manifest``'s ids.parquet for one fabricated part, built from arrays.

    Same schema, compression and atomic write; checked once against the real one.
    """
    import pyarrow as pa
    import pyarrow.parquet as pq

    from prx_data.core.storage import write_bytes_atomic
    from prx_data.export import layout

    offsets = pa.py_buffer((np.arange(n + 1, dtype=np.int32) * ID_WIDTH).tobytes())
    ids = pa.StringArray.from_buffers(n, offsets, pa.py_buffer(_id_digits(start, n).tobytes()))
    table = pa.table(
        {
            "shard": pa.repeat(pa.scalar(f"{part}/shard.00000.mds", pa.string()), n),
            "index": pa.array(np.arange(n, dtype=np.int32)),
            "id": ids,
        }
    )
    buf = io.BytesIO()
    pq.write_table(table, buf, compression="zstd")
    write_bytes_atomic(os.path.join(bdir, part, layout.MANIFEST_NAME), buf.getvalue())


def fabricate(
    root: str, n: int, per_part: int, work: str, px: int = 0, shard_files: bool = True
) -> dict:
    """An export of ``n`` samples in the real layout, without its merged indexes yet.

    ``shard_files=False`` writes every index and manifest but no shard file: enough for
    the jobs that bind ids to shards (id index, ``skips add``, opt-out), which never
    read a shard (``--only idindex``).
    """
    from prx_data.core.buckets import DEFAULT_SPEC, bucket_name
    from prx_data.core.storage import write_bytes_atomic
    from prx_data.export import naming, safety
    from prx_data.export.spec import UnitResult

    shapes = DEFAULT_SPEC.shapes(TIER)
    templates = [BucketTemplate(bucket_name(TIER, w, h), w, h, work, px) for w, h in shapes]
    templates[0].check_against_mdswriter(work)
    safety.write_export_marker(root)
    per_unit = per_part * len(templates)
    units = -(-n // per_unit)
    next_id = 0
    for u in range(units):
        part = naming.part_name(u // 100, (u % 100) * per_unit)
        result = UnitResult(part=part)
        for t in templates:
            k = min(per_part, n - next_id)
            if k <= 0:
                break
            bdir = os.path.join(root, *t.bucket.split("/"))
            result.bucket_bytes[t.bucket] = t.write_part(bdir, part, next_id, k, shard_files)
            next_id += k
            result.buckets[t.bucket] = k
            result.written += k
        result.rows = result.written
        write_bytes_atomic(naming.marker_path(root, part), result.to_json().encode())
    return {
        "units": units,
        "parts": sum(1 for _ in _parts(root)),
        "buckets": len(templates),
        "sample_bytes": templates[0].sample_size,
    }


def _parts(root: str):
    for tier in os.listdir(root):
        if tier.isdigit():
            for ar in os.listdir(os.path.join(root, tier)):
                for part in os.listdir(os.path.join(root, tier, ar)):
                    if part.startswith("f"):
                        yield part


# --- measuring -------------------------------------------------------------------------------


def _rss_mb() -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return float("nan")


@contextmanager
def measured(results: dict, name: str):
    """Seconds (wall, and CPU of this process: what a loaded machine disturbs less) and the
    peak resident memory added (sampled every 10 ms) of one operation."""
    start = _rss_mb()
    peak = [start]
    stop = threading.Event()

    def sample() -> None:
        while not stop.wait(0.01):
            peak[0] = max(peak[0], _rss_mb())

    th = threading.Thread(target=sample, daemon=True)
    th.start()
    prof = _Profile() if name in os.environ.get("BENCH_SCALE_PROFILE", "").split(",") else None
    t, cpu = time.perf_counter(), time.process_time()
    try:
        yield
    finally:
        dt, dcpu = time.perf_counter() - t, time.process_time() - cpu
        stop.set()
        th.join()
        results[name] = {"s": dt, "cpu_s": dcpu, "peak_add_mb": max(peak[0], _rss_mb()) - start}
        print(
            f"  {name:<16} {dt:9.2f} s   +{results[name]['peak_add_mb']:7.1f} MB"
            f"   ({dcpu:.2f} CPU s, this process)",
            flush=True,
        )
        if prof is not None:
            prof.report(name)


class _Profile:
    """cProfile of the calling thread and of every thread started meanwhile (pool workers).

    ``BENCH_SCALE_PROFILE=resume,pack`` profiles those operations and prints the
    functions with the most own time, all threads summed.
    """

    def __init__(self) -> None:
        import cProfile

        self.profiles = [cProfile.Profile()]

        def start_thread(*_) -> None:
            pr = cProfile.Profile()
            self.profiles.append(pr)
            pr.enable()

        threading.setprofile(start_thread)
        self.profiles[0].enable()

    def report(self, name: str, top: int = 15) -> None:
        import pstats

        self.profiles[0].disable()
        threading.setprofile(None)
        out = io.StringIO()
        stats = pstats.Stats(self.profiles[0], stream=out)
        for pr in self.profiles[1:]:
            stats.add(pr)
        stats.sort_stats("tottime").print_stats(top)
        print(f"  profile of {name} ({len(self.profiles) - 1} threads started):")
        for line in out.getvalue().splitlines():
            if line.strip() and not line.lstrip().startswith(("Ordered", "List reduced")):
                print("    | " + line.rstrip()[:150])


def _proc_mem_mb(pid: int | str = "self") -> dict:
    """Resident and proportional (shared pages split between processes) memory of a process."""
    out = {}
    with open(f"/proc/{pid}/smaps_rollup") as f:
        for line in f:
            key = line.split(":")[0]
            if key in ("Rss", "Pss"):
                out[key.lower() + "_mb"] = int(line.split()[1]) / 1024
    return out


def _children() -> list[int]:
    """Ids of this process's child processes (the DataLoader workers)."""
    me, out = os.getpid(), []
    for d in os.listdir("/proc"):
        if d.isdigit():
            try:
                with open(f"/proc/{d}/stat") as f:
                    if int(f.read().rsplit(")", 1)[1].split()[1]) == me:
                        out.append(int(d))
            except OSError:
                continue
    return out


def _as_list(batch: list) -> list:
    return batch


def loader_child(root: str, kind: str, batch: int, workers: int = 0) -> dict:
    """Run in a fresh process: init, first batch and resident memory of one loader.

    ``workers`` > 0: the first batch comes through a ``StreamingDataLoader`` with that
    many workers, and each worker's memory is read from /proc after it.
    """
    import logging

    from streaming import Stream, StreamingDataLoader, StreamingDataset

    from prx_data.export import layout
    from prx_data.stream.dataset import BucketedDataset, DatasetSpec

    class EncodedBucketed(BucketedDataset):
        decode_images = False  # tiny fabricated pixels: time the loader, not the JPEG decoder

    logging.disable(logging.WARNING)
    rss0 = _rss_mb()  # after the imports (torch alone is most of it)
    t = time.perf_counter()
    if kind == "bucketed":
        ds = EncodedBucketed(
            DatasetSpec(root),
            tier=TIER,
            batch_size=batch,
            num_canonical_nodes=1,
            shuffle=True,
            small_buckets="drop",
            **({"num_workers": workers} if workers else {}),
        )
    else:
        streams = [Stream(local=layout.rel_join(root, b)) for b in layout.list_buckets(root)]
        ds = StreamingDataset(
            streams=streams,
            batch_size=batch,
            num_canonical_nodes=1,
            shuffle=True,
            batching_method="per_stream",
        )
    init = time.perf_counter() - t
    t = time.perf_counter()
    out: dict = {}
    if workers:
        dl = StreamingDataLoader(ds, batch_size=batch, num_workers=workers, collate_fn=_as_list)
        it = iter(dl)
        next(it)
        first = time.perf_counter() - t
        mems = [_proc_mem_mb(pid) for pid in _children()]
        out["worker_rss_mb"] = max(m["rss_mb"] for m in mems)
        out["worker_pss_mb"] = max(m["pss_mb"] for m in mems)
        del it
    else:
        prof = f"first_batch_{kind}" in os.environ.get("BENCH_SCALE_PROFILE", "").split(",")
        prof = _Profile() if prof else None
        it = iter(ds)
        for _ in range(batch):
            next(it)
        first = time.perf_counter() - t
        if prof is not None:
            sys.stdout = sys.stderr  # the parent reads the figures from stdout
            prof.report(f"first batch, {kind}")
            sys.stdout = sys.__stdout__
    return {
        "init_s": init,
        "first_batch_s": first,
        "rss_mb": _rss_mb(),
        "rss_before_mb": rss0,
        "pss_mb": _proc_mem_mb()["pss_mb"],
        **out,
    }


def _hwm_mb() -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024
    return float("nan")


def _phase_meter(rss0: float) -> tuple[dict[str, float], list]:
    """Checkpoints inside an opt-out: after each step, the peak memory added so far (VmHWM
    less ``rss0``). VmHWM only grows, so the step after which a figure jumps is the one
    that raised the peak. Returns the figures and the patches to undo."""
    from prx_data.export import idindex
    from prx_data.skips import export_state, materialise, ops, sidecar

    marks: dict[str, float] = {}
    undo: list = []

    def mark(name: str) -> None:
        marks[name] = round(_hwm_mb() - rss0, 1)

    def wrap(mod, attr: str, name: str) -> None:
        fn = getattr(mod, attr)

        def wrapped(*a, **k):
            out = fn(*a, **k)
            mark(name if name not in marks else f"{name}.{sum(k.startswith(name) for k in marks)}")
            return out

        setattr(mod, attr, wrapped)
        undo.append((mod, attr, fn))

    lookup = idindex.IdIndex.lookup

    def metered_lookup(self, ids):
        for i, t in enumerate(lookup(self, ids)):
            mark(f"query {i + 1}")
            yield t
        mark("lookup done")

    idindex.IdIndex.lookup = metered_lookup
    undo.append((idindex.IdIndex, "lookup", lookup))
    # Each step is wrapped in the room that calls it (prx_data.skips: ops -> materialise).
    wrap(ops, "resolve", "registry")
    wrap(export_state, "read_store_list", "store read")
    wrap(idindex, "open_index", "index open")
    wrap(materialise, "bind", "bind")
    wrap(materialise, "write_store_list", "store write")
    wrap(materialise, "_write_sidecars", "sidecars")
    wrap(sidecar, "skip_stats", "stats")
    return marks, undo


def optout_child(root: str, ids_file: str) -> dict:
    """Run in a fresh process: an opt-out of the ids in ``ids_file``, time and peak memory,
    and the peak memory added after each of its steps (``phases``)."""
    from prx_data.skips.optout import add_optout

    with open(ids_file) as f:
        ids = f.read().split()
    add_optout(root, "optout-warm", ids[:1])  # the imports and Lance's start-up, not counted
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # resets VmHWM to the current resident size
    rss0 = _rss_mb()
    marks, undo = _phase_meter(rss0)
    t, cpu = time.perf_counter(), time.process_time()
    rep = add_optout(root, "optout-fresh", ids)
    dt, dcpu = time.perf_counter() - t, time.process_time() - cpu
    for mod, attr, fn in undo:
        setattr(mod, attr, fn)
    assert rep.ids_not_in_export == 0
    return {
        "s": dt,
        "cpu_s": dcpu,
        "rss_before_mb": rss0,
        "hwm_mb": _hwm_mb(),
        "ids": len(ids),
        "phases": marks,
    }


def run_loader(root: str, kind: str, batch: int, workers: int = 0) -> dict:
    cmd = [sys.executable, os.path.abspath(__file__), "--_loader", kind, root]
    cmd += ["--batch", str(batch), "--_workers", str(workers)]
    out = subprocess.run(cmd, capture_output=True, text=True, check=False)
    if out.returncode:
        raise SystemExit(f"loader {kind} failed:\n{out.stderr[-3000:]}")
    if "profile of" in out.stderr:
        print(out.stderr[out.stderr.index("  profile of") :], end="", flush=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def _fresh_child(args: list[str]) -> dict:
    out = subprocess.run(
        [sys.executable, os.path.abspath(__file__), *args],
        capture_output=True,
        text=True,
        check=False,
    )
    if out.returncode:
        raise SystemExit(f"{args[0]} child failed:\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def run_optout_fresh(root: str, n: int, work: str, res: dict) -> None:
    """``optout_fresh``: 10^4 ids (not the ones ``optout`` took) opted out in a fresh process."""
    step = max(1, n // 10_000)
    ids_file = os.path.join(work, "optout-ids.txt")
    with open(ids_file, "w") as f:
        f.write("\n".join(_sid(i) for i in range(1, n, step)[:10_000]))
    r = _fresh_child(["--_optout", root, ids_file])
    res["optout_fresh"] = {"s": r["s"], "peak_add_mb": r["hwm_mb"] - r["rss_before_mb"], **r}
    steps = ", ".join(f"{k} {v:+.0f}" for k, v in r.get("phases", {}).items())
    print(
        f"  {'optout_fresh':<16} {r['s']:9.2f} s   +{res['optout_fresh']['peak_add_mb']:7.1f} MB"
        f"   ({r.get('cpu_s', float('nan')):.2f} CPU s; peak RSS {r['hwm_mb']:.0f} MB,"
        f" {r['rss_before_mb']:.0f} after imports;"
        f" peak so far, MB: {steps})",
        flush=True,
    )


def idindex_child(root: str) -> dict:
    """Run in a fresh process: rebuild the export's id index; seconds and peak memory added."""
    import lance

    import prx_data.core.streaming_compat  # noqa: F401  (the index checks import streaming)
    from prx_data.export import idindex
    from prx_data.table.lance_ops import open_table

    open_table(idindex.index_uri(root)).count_rows()  # the imports and Lance's start-up
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    rss0 = _rss_mb()
    marks: dict[str, float] = {}
    # The BTREE step: idindex._build_btree, or (older trees of the code) Lance's own call.
    owner, attr = (
        (idindex, "_build_btree")
        if hasattr(idindex, "_build_btree")
        else (lance.LanceDataset, "create_scalar_index")
    )
    write, index = lance.write_dataset, getattr(owner, attr)

    def metered_write(*a, **k):
        out = write(*a, **k)
        marks["table written"] = round(_hwm_mb() - rss0, 1)
        return out

    def metered_index(*a, **k):
        out = index(*a, **k)
        marks["btree built"] = round(_hwm_mb() - rss0, 1)
        return out

    lance.write_dataset = metered_write
    setattr(owner, attr, metered_index)
    t, cpu = time.perf_counter(), time.process_time()
    info = idindex.write_id_index(root)
    return {
        "s": time.perf_counter() - t,
        "cpu_s": time.process_time() - cpu,
        "rss_before_mb": rss0,
        "hwm_mb": _hwm_mb(),
        "rows": info.rows,
        "phases": marks,
    }


def run_idindex_fresh(root: str, res: dict) -> None:
    r = _fresh_child(["--_idindex", root])
    res["id_index_fresh"] = {"peak_add_mb": r["hwm_mb"] - r["rss_before_mb"], **r}
    print(
        f"  {'id_index_fresh':<16} {r['s']:9.2f} s   +{res['id_index_fresh']['peak_add_mb']:7.1f} MB"
        f"   ({r['cpu_s']:.2f} CPU s; peak RSS {r['hwm_mb']:.0f} MB; peak so far, MB: "
        + ", ".join(f"{k} {v:+.0f}" for k, v in r.get("phases", {}).items())
        + ")",
        flush=True,
    )


def finalize_timed(cfg, finished: dict, n: int, res: dict, packs=None) -> None:  # noqa: ANN001
    """``finalize``, with the id index it builds inside timed apart as ``id_index``."""
    from prx_data.export import idindex
    from prx_data.export.merge import finalize

    build = idindex.write_id_index

    def timed_build(*a, **k):
        with measured(res, "id_index"):
            return build(*a, **k)

    idindex.write_id_index = timed_build
    try:
        with measured(res, "finalize"):
            report = finalize(cfg, {p: finished[p] for p in sorted(finished)}, 0.0, packs=packs)
    finally:
        idindex.write_id_index = build
    assert report.samples_written == n, report.samples_written


def skips_add_step(root: str, n: int, res: dict) -> None:
    """``skips add`` of 1 % of the ids, drawn at random."""
    from tests.exportkit import skip_samples  # the sidecar writer alone (a fabricated tree)

    rng = np.random.default_rng(0)
    one_pct = [_sid(int(i)) for i in rng.choice(n, max(1, n // 100), replace=False)]
    with measured(res, "skips_add"):
        added = skip_samples(root, "bench", ids=one_pct)
    assert added.samples_listed == len(one_pct) and not added.ids_not_found


def optout_step(root: str, n: int, work: str, res: dict) -> None:
    """An opt-out of 10^4 evenly spread ids here, then another in a fresh process: its peak
    resident memory over the imports (VmHWM), which this process's figure understates once
    earlier steps grew the heap."""
    from prx_data.skips.optout import add_optout

    step = max(1, n // 10_000)
    optout_ids = [_sid(i) for i in range(0, n, step)][:10_000]
    with measured(res, "optout"):
        rep = add_optout(root, "optout-bench", optout_ids)
    assert rep.ids_not_in_export == 0
    res["optout"]["ids"] = len(optout_ids)
    run_optout_fresh(root, n, work, res)


def idindex_size(n: int, work: str, shard_size: int = 1 << 26, px: int = 8) -> dict:
    """``--only idindex``: what the id index and an opt-out need, at a fraction of the cost.

    The tree has the packed shape (shards of about ``shard_size``, one per part, no pack
    stage run) and no shard files: id index build (in ``finalize``, and again in a fresh
    process), ``skips add`` of 1 %, ``optout`` and ``optout_fresh``, as in a full run.
    """
    from prx_data.core.buckets import DEFAULT_SPEC
    from prx_data.export.merge import done_parts
    from prx_data.export.spec import ExportConfig

    root = os.path.join(work, f"export-{n}")
    res: dict = {}
    print(f"n = {n:,} (--only idindex)", flush=True)
    nb = len(DEFAULT_SPEC.shapes(TIER))
    per_bucket = -(-n // nb)
    sample = BucketTemplate("512/1.000", 8, 8, work, px).sample_size
    shards_per_bucket = max(1, -(-per_bucket * sample // shard_size))
    per_part = -(-per_bucket // shards_per_bucket)
    with measured(res, "fabricate"):
        res["shape"] = fabricate(root, n, per_part, work, px, shard_files=False)
    print(f"  ({res['shape']['parts']:,} shards of {per_part:,} samples)", flush=True)
    cfg = ExportConfig(table="(bench_scale)", out=root, caption_columns=("caption",), tiers=(TIER,))
    finalize_timed(cfg, done_parts(root), n, res)
    run_idindex_fresh(root, res)
    skips_add_step(root, n, res)
    optout_step(root, n, work, res)
    shutil.rmtree(root)
    return res


def one_size(
    n: int,
    per_part: int,
    work: str,
    rewrite: bool,
    batch: int,
    shard_size: int = 1 << 26,
    px: int = 8,
    workers: int = 2,
) -> dict:
    """Every operation at one size (run in its own process); returns {op: figures}."""
    import prx_data.pipelines.write_mds as pipeline

    from prx_data.cli.verify import check_sidecar
    from prx_data.export import layout, safety
    from prx_data.export.merge import done_parts
    from prx_data.export.pack import plan_packs
    from prx_data.export.spec import ExportConfig
    from prx_data.export.verify import verify_export
    from prx_data.skips.rewrite import rewrite_export
    from prx_data.stream.holdout import Holdout

    root = os.path.join(work, f"export-{n}")
    res: dict = {}
    print(f"n = {n:,}", flush=True)
    with measured(res, "fabricate"):
        res["shape"] = fabricate(root, n, per_part, work, px)
    print(f"  ({res['shape']['units']:,} units, {res['shape']['parts']:,} parts)", flush=True)
    with measured(res, "resume"):  # what `write_mds --resume` does before scheduling units
        assert not safety.foreign_entries(root)
        finished = done_parts(root)
        safety.remove_stale_parts(root, set(finished), (TIER,))
    cfg = ExportConfig(
        table="(bench_scale)",
        out=root,
        caption_columns=("caption",),
        tiers=(TIER,),
        shard_size=shard_size,
    )
    ordered = {p: finished[p] for p in sorted(finished)}
    packed = None
    if shard_size:
        pipeline.DRIVER_PACK_BYTES = 1 << 62  # the pack's own work, not a Ray start on 2 cores
        with measured(res, "pack"):
            plan = plan_packs(root, ordered, shard_size)
            packed = pipeline.run_packs(cfg, plan)
        res["pack"]["packs"] = len(plan)
        print(f"  ({len(plan):,} packs)", flush=True)
    finalize_timed(cfg, ordered, n, res, packs=packed)
    skips_add_step(root, n, res)
    with measured(res, "holdout"):
        h = Holdout(0.01, salt="bench")
        held = 0
        for b in layout.list_buckets(root):
            held += sum(len(v) for v in h.skips(root, b, layout.read_index(root, b)).values())
    for kind in ("bucketed", "plain"):
        r = run_loader(root, kind, batch)
        res[f"loader_{kind}"] = {"s": r["init_s"] + r["first_batch_s"], **r}
        print(
            f"  loader_{kind:<9} init {r['init_s']:.2f} s, first batch {r['first_batch_s']:.2f} s, "
            f"RSS {r['rss_mb']:.0f} MB (+{r['rss_mb'] - r['rss_before_mb']:.0f} over imports)",
            flush=True,
        )
        if workers:
            w = run_loader(root, kind, batch, workers)
            res[f"loader_{kind}"].update(
                worker_rss_mb=w["worker_rss_mb"],
                worker_pss_mb=w["worker_pss_mb"],
                workers_first_batch_s=w["first_batch_s"],
            )
            print(
                f"  {'':<16} {workers} workers: first batch {w['first_batch_s']:.2f} s, "
                f"per worker RSS {w['worker_rss_mb']:.0f} MB (PSS {w['worker_pss_mb']:.0f} MB)",
                flush=True,
            )
    if rewrite:
        with measured(res, "rewrite"):
            rewrite_export(root, os.path.join(work, f"rewritten-{n}"), force=True)
        shutil.rmtree(os.path.join(work, f"rewritten-{n}"))
    optout_step(root, n, work, res)
    with measured(res, "verify"):
        v = verify_export(root, check_sidecar=check_sidecar)
    if not v.ok:
        raise SystemExit(f"verify found problems: {[str(p) for p in v.problems[:5]]}")
    res["verify"]["sidecars"] = v.sidecars
    if n == int(os.environ.get("BENCH_SCALE_CLI_CHECK", "0")):  # the CLI itself, once
        cli = subprocess.run([sys.executable, "-m", "prx_data.verify", root], check=False)
        assert cli.returncode == 0
    shutil.rmtree(root)
    return res


def exponent(n1: int, t1: float, n2: int, t2: float) -> float:
    """Growth exponent: 1 is linear, 0 constant (timings below 1 ms are noise: reported as nan)."""
    if min(t1, t2) < 1e-3:
        return float("nan")
    return math.log(t2 / t1) / math.log(n2 / n1)


def table(sizes: list[int], runs: dict[int, dict]) -> str:
    head = f"{'operation':<18}" + "".join(f"{f'n={n:.0e}':>11}" for n in sizes)
    head += "".join(
        f"{f'exp {a:.0e}->{b:.0e}':>17}" for a, b in zip(sizes, sizes[1:], strict=False)
    )
    lines = ["seconds (growth exponent between sizes; <= 1.1 is the target)", head]
    for op in OPS:
        t = [runs[n].get(op, {}).get("s") for n in sizes]
        row = f"{op:<18}" + "".join(f"{x:>11.3f}" if x is not None else f"{'-':>11}" for x in t)
        for i in range(len(sizes) - 1):
            if t[i] is None or t[i + 1] is None:
                row += f"{'-':>17}"
            else:
                row += f"{exponent(sizes[i], t[i], sizes[i + 1], t[i + 1]):>17.2f}"
        lines.append(row)
    lines += [
        "",
        "peak resident memory added (MB); loaders: what init + one batch added to the process "
        "(after imports)",
    ]
    for op in OPS:
        vals = []
        for n in sizes:
            r = runs[n].get(op)
            if r is None:
                vals.append(f"{'-':>11}")
            else:
                mb = r["rss_mb"] - r["rss_before_mb"] if "rss_mb" in r else r["peak_add_mb"]
                vals.append(f"{mb:>11.1f}")
        lines.append(f"{op:<18}" + "".join(vals))
    return "\n".join(lines)


def markdown(sizes: list[int], runs: dict[int, dict]) -> str:
    """The figures as markdown: seconds, memory and growth exponents, and the loader targets."""
    pairs = list(zip(sizes, sizes[1:], strict=False))
    head = ["operation"] + [f"s @ {n:.0e}" for n in sizes] + [f"MB @ {n:.0e}" for n in sizes]
    head += [f"exp {a:.0e}→{b:.0e}" for a, b in pairs]
    cpu = any("cpu_s" in r for n in sizes for r in runs[n].values() if isinstance(r, dict))
    if cpu:
        head += [f"CPU exp {a:.0e}→{b:.0e}" for a, b in pairs]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for op in OPS:
        rs = [runs[n].get(op) for n in sizes]
        row = [op] + [f"{r['s']:.3f}" if r else "–" for r in rs]
        row += [
            (
                "–"
                if r is None
                else f"{r['rss_mb'] - r['rss_before_mb'] if 'rss_mb' in r else r['peak_add_mb']:.1f}"
            )
            for r in rs
        ]
        for i, _ in enumerate(pairs):
            a, b = rs[i], rs[i + 1]
            e = exponent(sizes[i], a["s"], sizes[i + 1], b["s"]) if a and b else float("nan")
            row.append("–" if math.isnan(e) else f"{e:.2f}" + ("" if e <= 1.1 else " ✗"))
        for i, _ in enumerate(pairs if cpu else ()):
            a, b = rs[i], rs[i + 1]
            ok = a and b and "cpu_s" in a and "cpu_s" in b
            e = exponent(sizes[i], a["cpu_s"], sizes[i + 1], b["cpu_s"]) if ok else float("nan")
            row.append("–" if math.isnan(e) else f"{e:.2f}" + ("" if e <= 1.1 else " ✗"))
        lines.append("| " + " | ".join(row) + " |")
    lines += [
        "",
        "| size | shape | loader | init s | first batch s | process RSS MB | "
        "per-worker RSS / PSS MB | load average |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for n in sizes:
        r = runs[n]
        sh = r["shape"]
        shape = f"{sh['units']:,} units, {sh['parts']:,} parts, {r['pack'].get('packs', '–') if 'pack' in r else '–'} packs, {sh['sample_bytes']} B/sample"
        for kind in ("bucketed", "plain"):
            x = r.get(f"loader_{kind}")
            if not x:
                continue
            wk = (
                f"{x['worker_rss_mb']:.0f} / {x['worker_pss_mb']:.0f}"
                if "worker_rss_mb" in x
                else "–"
            )
            la = " ".join(f"{v:.1f}" for v in r.get("loadavg", ()))
            lines.append(
                f"| {n:.0e} | {shape} | {kind} | {x['init_s']:.2f} | {x['first_batch_s']:.2f} | "
                f"{x['rss_mb']:.0f} | {wk} | {la} |"
            )
    return "\n".join(lines)


def e2e_export(n: int, work: str, shard_size: int, num_cpus: int) -> str:
    """``python -m prx_data.write_mds`` of an ``n``-row Lance table: shard sizes per bucket.

    The table holds one small flat JPEG per bucket shape of tier 512 (so every bucket
    fills evenly and no image is upscaled), cycled over distinct ids, written in batches.
    Returns a markdown table: per bucket, shards, samples and the median shard against
    ``shard_size`` (the last shard of a bucket is its remainder, so it is left out of
    the median where the bucket has more than one).
    """
    import lance
    import pyarrow as pa
    from PIL import Image

    from prx_data.core.buckets import DEFAULT_SPEC
    from prx_data.core.imaging import probe
    from prx_data.core.schema import TABLE_SCHEMA
    from prx_data.export import layout

    images = []
    for k, (w, h) in enumerate(DEFAULT_SPEC.shapes(TIER)):
        buf = io.BytesIO()
        im = Image.linear_gradient("L").resize((w, h)).convert("RGB")
        Image.blend(im, Image.new("RGB", (w, h), (40 + 15 * k, 90, 160)), 0.5).save(
            buf, "JPEG", quality=85
        )
        images.append((buf.getvalue(), probe(buf.getvalue())))
    table_uri = os.path.join(work, "e2e-table.lance")
    out = os.path.join(work, "e2e-export")

    def batches(step: int = 10_000):
        for a in range(0, n, step):
            idx = np.arange(a, min(n, a + step)) % len(images)
            m = len(idx)
            yield pa.record_batch(
                {
                    "id": pa.array([f"e2e/{i:09d}" for i in range(a, a + m)]),
                    "image": pa.array([images[i][0] for i in idx], pa.binary()),
                    "width": pa.array([images[i][1].width for i in idx], pa.int32()),
                    "height": pa.array([images[i][1].height for i in idx], pa.int32()),
                    "format": pa.array([images[i][1].format for i in idx]),
                    "source": pa.array(["bench"] * m),
                    "caption": pa.array([f"flat photo {i % 97}" for i in range(a, a + m)]),
                    "probe_error": pa.nulls(m, pa.string()),
                },
                schema=TABLE_SCHEMA,
            )

    t = time.perf_counter()
    reader = pa.RecordBatchReader.from_batches(TABLE_SCHEMA, batches())
    lance.write_dataset(reader, table_uri, mode="create")
    t_table = time.perf_counter() - t
    ray_tmp = tempfile.mkdtemp(prefix="r")  # short: Ray's socket paths must fit in 107 bytes
    env = {**os.environ, "TMPDIR": ray_tmp}
    env.pop("RAY_ADDRESS", None)
    cmd = [sys.executable, "-m", "prx_data.write_mds", "--table", table_uri, "--out", out]
    cmd += ["--tiers", str(TIER), "--shard-size", str(shard_size), "--num-cpus", str(num_cpus)]
    t = time.perf_counter()
    try:
        r = subprocess.run(cmd, env=env, capture_output=True, text=True, check=False)
    finally:
        shutil.rmtree(ray_tmp, ignore_errors=True)
    t_export = time.perf_counter() - t
    if r.returncode:
        raise SystemExit(f"write_mds failed:\n{r.stderr[-3000:]}")
    rows = []
    all_sizes = []
    for b in layout.list_buckets(out):
        shards = layout.read_index(out, b)
        sizes = [x.bytes for x in shards]
        all_sizes += sizes
        body = sizes[:-1] if len(sizes) > 1 else sizes
        med = float(np.median(body))
        samples = sum(x.samples for x in shards)
        full = sum(sizes) >= 2 * shard_size
        ok = "yes" if shard_size / 2 <= med <= 2 * shard_size else ("no" if full else "(small)")
        rows.append(
            f"| {b} | {samples:,} | {len(sizes)} | {sum(sizes) / 2**20:.1f} | "
            f"{med / 2**20:.2f} | {med / shard_size:.2f} | {ok} |"
        )
    la = " ".join(f"{v:.1f}" for v in os.getloadavg())
    head = [
        f"write_mds of {n:,} rows, tier {TIER}, default unit size (1,000 rows), "
        f"--shard-size {shard_size / 2**20:g} MiB, --num-cpus {num_cpus}: table {t_table:.0f} s, "
        f"export {t_export:.0f} s (load average {la}); {len(all_sizes)} shards in all.",
        "",
        "| bucket | samples | shards | MiB | median shard MiB (last left out) | "
        "median / --shard-size | within 2× |",
        "|---|---|---|---|---|---|---|",
    ]
    shutil.rmtree(table_uri, ignore_errors=True)
    shutil.rmtree(out, ignore_errors=True)
    return "\n".join(head + rows)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--sizes", nargs="+", type=float, default=[1e4, 1e5])
    p.add_argument("--per-part", type=int, default=40, help="samples per part (unit x bucket)")
    p.add_argument("--batch", type=int, default=16)
    p.add_argument(
        "--shard-size", type=int, default=1 << 26, help="pack target bytes (0: leave unpacked)"
    )
    p.add_argument("--no-rewrite-above", type=float, default=None, metavar="N")
    p.add_argument(
        "--image-px", type=int, default=8, help="side of the cached JPEG (0: the bucket shape)"
    )
    p.add_argument("--workers", type=int, default=2, help="loader workers to measure (0: none)")
    p.add_argument("--markdown", default=None, help="also write the markdown tables here")
    p.add_argument(
        "--e2e",
        type=float,
        default=None,
        metavar="N",
        help="instead: write_mds of an N-row Lance table, median shard per bucket vs --shard-size",
    )
    p.add_argument("--num-cpus", type=int, default=2, help="Ray CPUs for --e2e")
    p.add_argument("--from-json", nargs="+", default=None, help="instead: tables from --json files")
    p.add_argument("--work", default=None, help="scratch directory (default: a temp dir)")
    p.add_argument("--json", default=None, help="also write the figures here")
    p.add_argument("--_size", type=int, help=argparse.SUPPRESS)
    p.add_argument("--_loader", nargs=2, metavar=("KIND", "ROOT"), help=argparse.SUPPRESS)
    p.add_argument("--_workers", type=int, default=0, help=argparse.SUPPRESS)
    p.add_argument("--_optout", nargs=2, metavar=("ROOT", "IDS"), help=argparse.SUPPRESS)
    p.add_argument("--_idindex", metavar="ROOT", help=argparse.SUPPRESS)
    p.add_argument(
        "--only",
        choices=("idindex",),
        default=None,
        help="idindex: only the id index build and the opt-outs, on a tree of the packed shape "
        "without shard files (10^7 in a few minutes)",
    )
    args = p.parse_args()
    if args.e2e:
        work = args.work or tempfile.mkdtemp(prefix="bench-scale-e2e-")
        try:
            md = e2e_export(int(args.e2e), work, args.shard_size, args.num_cpus)
        finally:
            if args.work is None:
                shutil.rmtree(work, ignore_errors=True)
        print(md)
        if args.markdown:
            with open(args.markdown, "w") as f:
                f.write(md + "\n")
        return
    if args._optout:
        print(json.dumps(optout_child(*args._optout)))
        return
    if args._idindex:
        print(json.dumps(idindex_child(args._idindex)))
        return
    if args._loader:
        print(json.dumps(loader_child(args._loader[1], args._loader[0], args.batch, args._workers)))
        return
    os.environ["TQDM_DISABLE"] = "1"
    if args._size and args.only == "idindex":
        res = idindex_size(args._size, args.work, args.shard_size or 1 << 26, args.image_px)
        res["loadavg"] = os.getloadavg()
        print("RESULT " + json.dumps(res))
        return
    if args._size:
        rewrite = args.no_rewrite_above is None or args._size <= args.no_rewrite_above
        res = one_size(
            args._size,
            args.per_part,
            args.work,
            rewrite,
            args.batch,
            args.shard_size,
            args.image_px,
            args.workers,
        )
        res["loadavg"] = os.getloadavg()
        print("RESULT " + json.dumps(res))
        return
    if args.from_json:  # tables over figures of earlier runs (e.g. one run per size)
        runs = {}
        for path in args.from_json:
            with open(path) as f:
                runs.update({int(k): v for k, v in json.load(f).items()})
        sizes = sorted(runs)
        print(table(sizes, runs))
        md = markdown(sizes, runs)
        print()
        print(md)
        if args.markdown:
            with open(args.markdown, "w") as f:
                f.write(md + "\n")
        return
    sizes = sorted(int(s) for s in args.sizes)
    work = args.work or tempfile.mkdtemp(prefix="bench-scale-")
    os.environ.setdefault("BENCH_SCALE_CLI_CHECK", str(sizes[0]))
    runs = {}
    try:
        for n in sizes:
            cmd = [sys.executable, os.path.abspath(__file__), "--_size", str(n), "--work", work]
            cmd += ["--per-part", str(args.per_part), "--batch", str(args.batch)]
            cmd += ["--shard-size", str(args.shard_size), "--image-px", str(args.image_px)]
            cmd += ["--workers", str(args.workers)]
            if args.only:
                cmd += ["--only", args.only]
            if args.no_rewrite_above is not None:
                cmd += ["--no-rewrite-above", str(int(args.no_rewrite_above))]
            with subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True) as proc:
                result = None
                for line in proc.stdout:
                    if line.startswith("RESULT "):
                        result = json.loads(line[7:])
                    else:
                        print(line, end="", flush=True)
            if proc.returncode or result is None:
                raise SystemExit(f"size {n} failed (exit {proc.returncode})")
            runs[n] = result
            if args.json:  # after each size, so a long last size keeps the earlier ones
                with open(args.json, "w") as f:
                    json.dump({str(k): r for k, r in runs.items()}, f, indent=2)
    finally:
        if args.work is None:
            shutil.rmtree(work, ignore_errors=True)
    print()
    print(table(sizes, runs))
    md = markdown(sizes, runs)
    print()
    print(md)
    if args.markdown:
        with open(args.markdown, "w") as f:
            f.write(md + "\n")


if __name__ == "__main__":
    main()
