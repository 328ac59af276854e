"""Replication in the trainer's DataSpec: each rank counts its share of the unique samples."""

from __future__ import annotations

import pytest
import torch

from prx_data.train.config import ConfigError, load_config
from prx_data.train.data import build_dataspec, unique_share


def test_unique_share_sums_to_the_unique_samples_over_ranks():
    # world 4, replication 2, device batch 3: 2 groups x 3 = 6 unique samples per step.
    assert sum(unique_share(3, 2) for _ in range(4)) == 6
    assert unique_share(3, 1) == 3 and isinstance(unique_share(3, 1), int)
    # world 8, replication 8, device batch 1: one unique sample per step.
    assert sum(unique_share(1, 8) for _ in range(8)) == 1


class _Stub(torch.utils.data.IterableDataset):
    """Test double: an iterable dataset of nothing (the DataSpec only wraps it)."""

    def __iter__(self):
        return iter(())


@pytest.mark.parametrize(("replication", "samples", "tokens"), [(None, 4, 64), (2, 2.0, 32)])
def test_dataspec_counts_unique_samples_and_tokens(replication, samples, tokens):
    over = ["data.global_batch_size=8", "data.num_workers=0"]
    if replication:
        over.append(f"data.plan.replication={replication}")
    cfg = load_config(None, over)
    spec = build_dataspec(cfg.data, world_size=2, patch_size=16, dataset=_Stub())
    batch = {"image": torch.zeros(4, 3, 64, 64, dtype=torch.uint8)}
    assert spec.get_num_samples_in_batch(batch) == samples
    got = spec.get_num_tokens_in_batch(batch)
    assert got == tokens and isinstance(got, int)


@pytest.mark.parametrize(
    ("overrides", "key"),
    [
        (["data.global_batch_size=8", "data.plan.replication=3"], "data.plan.replication"),
        (["data.on_change=resume"], "data.on_change"),
    ],
)
def test_bad_replication_and_on_change_name_the_key(overrides, key):
    with pytest.raises(ConfigError, match=key):
        load_config(None, overrides)
