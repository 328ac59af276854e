"""Streaming's per-shard sampling, vectorised, with the same result.

When a stream's ``choose`` is not a whole multiple of its samples (the
planner sizes buckets so that it rarely is), ``streaming.base.sampling
.get_sampling`` walks a random order of the stream's sampling granules one by
one in Python until it has drawn ``choose`` samples. With the default
``sampling_granularity=1`` that is one iteration per sample: 8 s of the first
batch at 10^7 samples, on every worker at every epoch start.

:func:`get_sampling` draws the same permutation from the same generator and
replaces the loop by a cumulative sum, so every epoch takes exactly the same
samples as with upstream's function (tested against it). The choice of
samples, and with it every resume position, is unchanged.

:func:`vectorised_sampling` routes streaming's dataset module to it for the
duration of a call (``BucketedDataset.resample_streams``).
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator

import numpy as np
from numpy.typing import NDArray

from prx_data.core.streaming_compat import sampling_hooks

__all__ = [
    "get_sampling",
]

#: Upstream's function (the reference this one must equal) and the module that calls it.
_upstream_dataset, upstream_get_sampling = sampling_hooks()


def get_sampling(
    samples_per_shard: NDArray[np.int64],
    choose: int,
    granularity: int,
    seed: int,
    epoch: int,
    use_epoch: bool,
) -> NDArray[np.int64]:
    """How many samples to draw from each shard: upstream's result without its Python loop."""
    samples_per_shard = np.asarray(samples_per_shard)
    num_samples = int(samples_per_shard.sum())
    if choose < 0 or granularity <= 0 or seed < 0 or epoch < 0 or not num_samples:
        # Upstream's argument errors (and its empty-stream behaviour) stay upstream's.
        return upstream_get_sampling(samples_per_shard, choose, granularity, seed, epoch, use_epoch)
    if not choose % num_samples:
        return samples_per_shard * choose // num_samples

    num_shards = len(samples_per_shard)
    picks_per_shard = (samples_per_shard + granularity - 1) // granularity
    num_picks = int(picks_per_shard.sum())
    pick_shard_ids = np.repeat(np.arange(num_shards), picks_per_shard)
    samples_per_pick = np.repeat(np.full(num_shards, granularity), picks_per_shard)
    samples_per_pick[np.cumsum(picks_per_shard) - 1] = (
        samples_per_shard - (picks_per_shard - 1) * granularity
    )
    rng = np.random.default_rng(seed + epoch if use_epoch else seed)
    order = rng.permutation(num_picks)

    choose_per_shard = samples_per_shard * (choose // num_samples)
    remainder = choose % num_samples
    if granularity == 1:  # streaming's default: every pick is one sample
        drawn = np.bincount(pick_shard_ids[order[:remainder]], minlength=num_shards)
        return choose_per_shard + drawn.astype(choose_per_shard.dtype)
    # Upstream takes whole picks in ``order`` until the next one would overshoot, then the
    # part of that pick that is still needed: the first pick whose running total reaches
    # ``remainder`` is the last one taken.
    sizes = samples_per_pick[order]
    total = np.cumsum(sizes)
    last = int(np.searchsorted(total, remainder))
    taken = sizes[: last + 1].copy()
    taken[last] = remainder - (int(total[last - 1]) if last else 0)
    drawn = np.bincount(pick_shard_ids[order[: last + 1]], weights=taken, minlength=num_shards)
    return choose_per_shard + drawn.astype(choose_per_shard.dtype)


_lock = threading.Lock()
_depth = 0


@contextlib.contextmanager
def vectorised_sampling() -> Iterator[None]:
    """Within the block, streaming's datasets sample through :func:`get_sampling`.

    Only the name streaming's dataset module looks up is swapped, and only while
    a call is inside the block (nested and concurrent blocks share one swap).
    The results are identical, so any other dataset that samples meanwhile is
    unaffected.
    """
    global _depth
    with _lock:
        if _depth == 0:
            _upstream_dataset.get_sampling = get_sampling
        _depth += 1
    try:
        yield
    finally:
        with _lock:
            _depth -= 1
            if _depth == 0:
                _upstream_dataset.get_sampling = upstream_get_sampling
