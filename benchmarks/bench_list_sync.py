"""``skips sync`` at scale: a registry of R ids (two lists) over a fabricated export of N samples.

Usage: ``python benchmarks/bench_list_sync.py [--samples N] [--registry R] [--work DIR]``.

The export has the real layout (indexes, manifests, id index; no shard files, which
``sync`` never reads), built as ``bench_scale --only idindex`` builds it. Half of the
registry's ids are in the export (every other sample), half are not. Measured: the full
materialisation (``sync``: read the log, bind every id through the id index, write every
store and sidecar) in this process, wall time and peak resident memory above the start,
then a second ``sync`` (nothing changed since the recorded position), an opt-out of 10^3
ids (applied from the log's entries since the recorded position), the same with the
position distrusted (the whole list rebound: the anchor) and once more from a delta.
Results go to ``benchmarks/results/list-sync.json``; ``list_sync.md`` keeps the dated runs.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import sys
import tempfile
import time

import numpy as np
import pyarrow as pa

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))


def _hwm_mb() -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def _rss_mb() -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return 0.0


def _reset_hwm() -> None:
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        pass


def _measured(res: dict, key: str, fn):
    """Run ``fn``; record its seconds as ``<key>_s`` and its peak memory growth as
    ``<key>_peak_add_mb`` in ``res``; return what it returned."""
    _reset_hwm()
    base = _rss_mb()
    t0 = time.perf_counter()
    out = fn()
    res[f"{key}_s"] = round(time.perf_counter() - t0, 2)
    res[f"{key}_peak_add_mb"] = round(_hwm_mb() - base, 0)
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--samples", type=int, default=1_000_000)
    ap.add_argument("--registry", type=int, default=10_000_000)
    ap.add_argument("--work", default=None)
    args = ap.parse_args()
    import bench_scale as BS

    from prx_data.core.buckets import DEFAULT_SPEC
    from prx_data.export.merge import done_parts
    from prx_data.export.spec import ExportConfig
    from prx_data.skips.export_state import ExportState, read_state, write_state
    from prx_data.skips.ledger import Ledger
    from prx_data.skips.log import Provenance, log_rows
    from prx_data.skips.ops import sync, update_list
    from tests.tablekit import make_table

    work = tempfile.mkdtemp(prefix="prx-listsync-", dir=args.work)
    res: dict = {"samples": args.samples, "registry_ids": args.registry}
    res["load_avg_1m_start"] = os.getloadavg()[0]
    try:
        n = args.samples
        root = os.path.join(work, "export")
        nb = len(DEFAULT_SPEC.shapes(BS.TIER))
        per_part = -(-n // nb)  # one part (and one shard) per bucket
        t0 = time.perf_counter()
        BS.fabricate(root, n, per_part, work, 0, shard_files=False)
        cfg = ExportConfig(
            table="(bench)", out=root, caption_columns=("caption",), tiers=(BS.TIER,)
        )
        BS.finalize_timed(cfg, done_parts(root), n, {})
        res["fabricate_s"] = round(time.perf_counter() - t0, 1)
        table = os.path.join(work, "t.lance")
        make_table(table, [("s/0", b"\xff\xd8x", "c")])
        reg = Ledger.for_table(table)
        t0 = time.perf_counter()
        r = args.registry
        half = min(r // 2, n // 2)
        inside = np.arange(0, 2 * half, 2)  # every other sample of the export
        outside = np.arange(n, n + (r - half))
        ids = [BS._sid(int(i)) for i in np.concatenate([inside, outside])]
        for k, name in enumerate(("optout", "dedup")):
            part = pa.array(ids[k::2], pa.string())
            reg.append(
                lambda seq, part=part, name=name: log_rows(
                    name, part, "add", Provenance("bench"), seq=seq, base=seq, kind=0, export=""
                )
            )
        del ids
        res["registry_write_s"] = round(time.perf_counter() - t0, 1)
        write_state(root, ExportState())  # bound at the first sync
        res["lists"] = _measured(res, "sync_full", lambda: sync(root, table))
        t0 = time.perf_counter()
        sync(root)
        res["sync_again_s"] = round(time.perf_counter() - t0, 2)
        t0 = time.perf_counter()
        opt = [BS._sid(int(i)) for i in range(1, 2001, 2)]
        update_list(root, "optout", opt, Provenance("bench"))
        res["optout_1e3_s"] = round(time.perf_counter() - t0, 2)
        # The same opt-out with the recorded position distrusted (an interrupted run): the
        # whole list is rebound, the cost every opt-out had before updates applied deltas.
        st = read_state(root)
        st.dirty = True
        write_state(root, st)
        prov = Provenance("bench")
        for key, first in (("optout_1e3_full_rebind", 2001), ("optout_1e3_delta", 4001)):
            opt = [BS._sid(int(i)) for i in range(first, first + 2000, 2)]
            _measured(res, key, lambda opt=opt: update_list(root, "optout", opt, prov))
        res["ratio_delta_to_full_rebind"] = round(
            res["optout_1e3_delta_s"] / res["optout_1e3_full_rebind_s"], 3
        )
        res["load_avg_1m_end"] = os.getloadavg()[0]
    finally:
        shutil.rmtree(work, ignore_errors=True)
    print(json.dumps(res, indent=1))
    out = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results", "list-sync.json")
    with open(out, "w") as f:
        json.dump(res, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
