"""The vectorised per-shard sampling draws exactly what streaming's own loop draws."""

from __future__ import annotations

import logging

import numpy as np
import pytest
import streaming.base.dataset as upstream_dataset

from prx_data.stream import sampling
from prx_data.stream.dataset import DatasetSpec
from tests.exportkit import make_export, run_rank

logging.getLogger("streaming").setLevel(logging.ERROR)


def _cases():
    rng = np.random.default_rng(7)
    for case in range(300):
        shards = int(rng.integers(1, 40))
        sizes = rng.integers(0 if case % 5 == 0 else 1, 60, size=shards).astype(np.int64)
        if sizes.sum() == 0:
            sizes[0] = 1
        total = int(sizes.sum())
        choose = int(rng.choice([rng.integers(0, 3 * total + 1), total, 2 * total, 1, total - 1]))
        granularity = int(rng.choice([1, 1, 2, 3, 7, 64]))
        yield sizes, choose, granularity, int(rng.integers(0, 10_000)), int(rng.integers(0, 5))


@pytest.mark.parametrize("use_epoch", [True, False])
def test_equals_upstream_get_sampling(use_epoch):
    for sizes, choose, granularity, seed, epoch in _cases():
        want = sampling.upstream_get_sampling(
            sizes.copy(), choose, granularity, seed, epoch, use_epoch
        )
        got = sampling.get_sampling(sizes.copy(), choose, granularity, seed, epoch, use_epoch)
        assert got.dtype == want.dtype
        np.testing.assert_array_equal(got, want, err_msg=str((sizes, choose, granularity)))
        assert int(got.sum()) == choose


def test_bad_arguments_keep_upstreams_errors():
    with pytest.raises(ValueError, match="choose"):
        sampling.get_sampling(np.array([3, 4]), -1, 1, 0, 0, True)
    with pytest.raises(ValueError, match="granularity"):
        sampling.get_sampling(np.array([3, 4]), 5, 0, 0, 0, True)


def test_swap_is_scoped_and_nests():
    assert upstream_dataset.get_sampling is sampling.upstream_get_sampling
    with sampling.vectorised_sampling():
        with sampling.vectorised_sampling():
            assert upstream_dataset.get_sampling is sampling.get_sampling
        assert upstream_dataset.get_sampling is sampling.get_sampling
    assert upstream_dataset.get_sampling is sampling.upstream_get_sampling
    with pytest.raises(RuntimeError), sampling.vectorised_sampling():
        raise RuntimeError
    assert upstream_dataset.get_sampling is sampling.upstream_get_sampling


def test_bucketed_epochs_match_upstream_sampling(tmp_path, monkeypatch):
    """A partly up- and down-sampled mix takes the same samples in the same order both ways."""
    a = make_export(str(tmp_path / "a"), {"512/1.000": 53, "512/0.500": 29}, name="a")
    b = make_export(str(tmp_path / "b"), {"512/1.000": 31}, name="b")
    specs = [DatasetSpec(a.root, proportion=0.6), DatasetSpec(b.root, proportion=0.4)]

    def epoch():
        return run_rank(
            specs,
            rank=0,
            world_size=1,
            batch_size=4,
            tier=512,
            epoch_size=96,
            small_buckets="drop",
        ).batches

    fast = epoch()
    monkeypatch.setattr(sampling, "get_sampling", sampling.upstream_get_sampling)
    slow = epoch()
    assert fast == slow
    ids = [i for batch in fast for i in batch]
    # b is upsampled (0.4 * 96 > 31): some ids twice; a is downsampled: some left out.
    assert len(ids) > len(set(ids))
    assert len({i for i in ids if i.startswith("a/")}) < 82
