"""Shared fixtures. Ray is started once per test session (2 CPUs, small object store)."""

from __future__ import annotations

import os

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("RAY_ENABLE_UV_RUN_RUNTIME_ENV", "0")
os.environ.setdefault("RAY_AUTH_MODE", "disabled")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


@pytest.fixture(scope="session")
def ray_local():
    """A local Ray runtime shared by the whole session."""
    import ray

    from pipelines.runtime import ensure_ray

    ensure_ray(num_cpus=2, object_store_memory=256 * 1024 * 1024)
    yield ray
    ray.shutdown()


@pytest.fixture(autouse=True)
def _clean_streaming_shm():
    """Streaming keeps shared memory per dataset; a failed test must not poison the next."""
    yield
    try:
        from streaming.base.util import clean_stale_shared_memory

        clean_stale_shared_memory()
    except Exception:
        pass
