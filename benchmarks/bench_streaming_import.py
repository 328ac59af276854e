"""What a fresh export worker pays to get ``MDSWriter``: the deferred package ``__init__`` vs a plain import.

Each sample is a new interpreter (as a new Ray worker is), timed from start to
exit, alternating the two ways so that machine load hits both alike:

* ``deferred``: ``prx_data.core.streaming_compat.mds_writer()`` (``streaming``'s
  package ``__init__`` deferred; the writer's modules only);
* ``plain``: ``import streaming; streaming.MDSWriter`` (every dataset streaming
  ships, transformers included).

    python benchmarks/bench_streaming_import.py --rounds 3
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PROBES = {
    "deferred": "from prx_data.core.streaming_compat import mds_writer; mds_writer()",
    "plain": "import streaming; streaming.MDSWriter",
}


def one(code: str) -> float:
    env = {**os.environ, "PYTHONPATH": ROOT}
    t0 = time.perf_counter()
    subprocess.run([sys.executable, "-c", code], env=env, check=True)
    return time.perf_counter() - t0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=3, help="samples per way (default 3)")
    args = p.parse_args(argv)
    got: dict[str, list[float]] = {k: [] for k in PROBES}
    for _ in range(args.rounds):
        for name, code in PROBES.items():
            got[name].append(one(code))
    med = {k: statistics.median(v) for k, v in got.items()}
    for k, v in got.items():
        print(f"{k:<9} median {med[k]:6.2f} s  ({', '.join(f'{x:.2f}' for x in v)})")
    print(f"plain / deferred: {med['plain'] / med['deferred']:.2f}x")
    print(f"load average: {' '.join(f'{x:.1f}' for x in os.getloadavg())}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
