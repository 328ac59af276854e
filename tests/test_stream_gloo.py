"""Real multi-process runs on gloo: 2 ranks stop mid-epoch, resume on 1 rank, then on 4.

Each rank is a separate process on this machine (one node, LOCAL_WORLD_SIZE = world size),
started the way a launcher would, with torch.distributed initialised by streaming.
Slow (process start-up dominates), so it is behind the ``slow`` marker.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
GLOBAL_BATCH = 8


def _launch(
    root: str, world: int, out: str, stop_after: int | None, state: str | None, port: int
) -> list[dict]:
    procs = []
    for rank in range(world):
        env = dict(
            os.environ,
            RANK=str(rank),
            WORLD_SIZE=str(world),
            LOCAL_RANK=str(rank),
            LOCAL_WORLD_SIZE=str(world),
            MASTER_ADDR="127.0.0.1",
            MASTER_PORT=str(port),
        )
        cmd = [
            sys.executable,
            "-m",
            "tests.test_stream_gloo",
            "--root",
            root,
            "--out",
            f"{out}.{rank}.json",
            "--batch",
            str(GLOBAL_BATCH // world),
        ]
        if stop_after is not None:
            cmd += ["--stop-after", str(stop_after)]
        if state:
            cmd += ["--state", state]
        procs.append(subprocess.Popen(cmd, cwd=REPO, env=env))
    for p in procs:
        assert p.wait(timeout=600) == 0
    return [json.load(open(f"{out}.{r}.json")) for r in range(world)]


@pytest.mark.slow
def test_gloo_elastic_resume_exactly_once(tmp_path):
    from tests.exportkit import make_export, skip_samples

    root = str(tmp_path / "ex")
    ex = make_export(
        root, {"512/1.000": 64, "512/0.500": 40}, samples_per_part=16, samples_per_shard=6
    )
    skipped = set(random.Random(1).sample(sorted(ex.all_ids()), 8))
    skip_samples(root, "dedup", ids=skipped)
    port = 29500 + os.getpid() % 1000
    full = _launch(root, 2, str(tmp_path / "full"), None, None, port)
    a = _launch(root, 2, str(tmp_path / "a"), 2, None, port + 1)
    state_a = str(tmp_path / "state_a.json")
    json.dump(a[0]["state"], open(state_a, "w"))
    b = _launch(root, 1, str(tmp_path / "b"), 1, state_a, port + 2)
    state_b = str(tmp_path / "state_b.json")
    json.dump(b[0]["state"], open(state_b, "w"))
    c = _launch(root, 4, str(tmp_path / "c"), None, state_b, port + 3)
    seen = [i for run in a + b + c for batch in run["batches"] for i in batch]
    expected = {i for run in full for batch in run["batches"] for i in batch}
    assert len(seen) == len(set(seen)) and set(seen) == expected
    assert not expected & skipped
    assert len({len(r["batches"]) for r in c}) == 1
    assert all(len(s) == 1 for run in full + c for s in run["shapes"])


def _worker() -> None:
    import logging

    from streaming import StreamingDataLoader

    from prx_data.stream.dataset import BucketedDataset

    logging.getLogger("streaming").setLevel(logging.ERROR)
    ap = argparse.ArgumentParser()
    ap.add_argument("--root")
    ap.add_argument("--out")
    ap.add_argument("--batch", type=int)
    ap.add_argument("--stop-after", type=int, default=None)
    ap.add_argument("--state", default=None)
    args = ap.parse_args()
    ds = BucketedDataset(
        args.root, tier=512, batch_size=args.batch, num_canonical_nodes=4, small_buckets="drop"
    )
    if args.state:
        ds.load_state_dict(json.load(open(args.state)))
    loader = StreamingDataLoader(ds, batch_size=args.batch, num_workers=0)
    batches, shapes = [], []
    for batch in loader:
        batches.append(list(batch["id"]))
        shapes.append(sorted({tuple(x.shape) for x in batch["image"]}))
        if args.stop_after is not None and len(batches) == args.stop_after:
            break
    state = loader.state_dict() if args.stop_after is not None else None
    with open(args.out, "w") as f:
        json.dump({"batches": batches, "shapes": shapes, "state": state}, f)


if __name__ == "__main__":
    _worker()
