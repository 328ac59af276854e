"""Ranks that read different sample spaces at start-up fail together, with one message.

Two real processes on gloo (started the way a launcher starts ranks). Rank 1 sees
a skip list that rank 0 does not, as when ``skips add`` lands while a job
starts: both ranks must raise the same error naming the list, instead of
streaming different epochs or hanging at the first collective.
"""

from __future__ import annotations

import argparse
import os
import socket
import subprocess
import sys

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
B1 = "512/1.000"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.slow  # two interpreters importing torch: ~10 s idle, far more on a busy box
def test_ranks_with_different_skip_lists_raise_the_same_error(tmp_path):
    from tests.exportkit import make_export, skip_samples

    root = str(tmp_path / "ex")
    make_export(root, {B1: 32}, samples_per_shard=8)
    skip_samples(root, "dedup", ids=[f"ds/{B1}/1"])
    skip_samples(root, "optout", ids=[f"ds/{B1}/2", f"ds/{B1}/3"])
    port = _free_port()
    procs = []
    for rank, lists in ((0, "dedup"), (1, "dedup,optout")):
        env = dict(
            os.environ,
            RANK=str(rank),
            WORLD_SIZE="2",
            LOCAL_RANK=str(rank),
            LOCAL_WORLD_SIZE="2",
            MASTER_ADDR="127.0.0.1",
            MASTER_PORT=str(port),
        )
        out = str(tmp_path / f"err.{rank}")
        cmd = [sys.executable, "-m", "tests.test_stream_ranks", root, lists, out]
        procs.append(subprocess.Popen(cmd, cwd=REPO, env=env, start_new_session=True))
    try:
        codes = [p.wait(timeout=240) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                os.killpg(p.pid, 9)
                p.wait()
    assert codes == [3, 3]
    errors = [open(tmp_path / f"err.{r}").read() for r in range(2)]
    assert errors[0] == errors[1]
    assert errors[0].startswith("RankMismatch: the 2 ranks do not agree on the data")
    want = f"rank 1 vs rank 0: {root}: skip list 'optout' applied on rank 1, not on rank 0"
    assert want in errors[0]


def test_rank_mismatch_message_names_each_group_of_ranks_and_what_differs():
    from prx_data.stream.dataset import describe_rank_mismatch

    def fp(lists: dict, samples: int = 32) -> dict:
        ds = {"root": "s3://c/ex", "samples": samples, "skip_lists": lists}
        return {"tier": 512, "epoch_size": 24, "datasets": [ds]}

    dedup = {"dedup": {"samples": 1, "digest": "a"}}
    extra = {**dedup, "optout": {"samples": 2, "digest": "b"}}
    text = describe_rank_mismatch([fp(dedup), fp(extra), fp(dedup), fp(extra), fp({}, 40)])
    assert text.startswith("the 5 ranks do not agree on the data")
    assert (
        "ranks 1, 3 vs rank 0: s3://c/ex: skip list 'optout' applied on ranks 1, 3, not on "
        "rank 0 (2 samples)" in text
    )
    assert "rank 4 vs rank 0: s3://c/ex: skip list 'dedup' applied on rank 0, not on rank 4" in text
    assert "rank 4 vs rank 0: s3://c/ex: 32 -> 40 samples in its shards" in text
    assert "rank 2" not in text


def _worker() -> None:
    import logging

    from prx_data.stream.dataset import BucketedDataset, DatasetSpec, RankMismatch

    logging.getLogger("streaming").setLevel(logging.ERROR)
    ap = argparse.ArgumentParser()
    ap.add_argument("root")
    ap.add_argument("lists")
    ap.add_argument("out")
    args = ap.parse_args()
    spec = DatasetSpec(args.root, skip_lists=args.lists.split(","))
    try:
        BucketedDataset(spec, tier=512, batch_size=2, num_canonical_nodes=1, small_buckets="drop")
    except RankMismatch as e:
        with open(args.out, "w") as f:
            f.write(f"{type(e).__name__}: {e}")
        sys.exit(3)


if __name__ == "__main__":
    _worker()
