"""Starting or joining Ray for a job: local embedded Ray by default, a cluster via RAY_ADDRESS."""

from __future__ import annotations

import logging
import os


def ensure_ray(
    address: str | None = None, num_cpus: int | None = None, object_store_memory: int | None = None
) -> None:
    """Join ``address`` (or ``$RAY_ADDRESS``), else start a local Ray runtime.

    Reuses an already-initialised runtime (notebooks, tests). Each worker is
    told to use one Lance thread so that Ray, not Lance, decides parallelism.
    """
    import ray

    if ray.is_initialized():
        return
    address = address or os.environ.get("RAY_ADDRESS") or None
    runtime_env = {"env_vars": {"LANCE_CPU_THREADS": os.environ.get("LANCE_CPU_THREADS", "1")}}
    kwargs: dict = {
        "runtime_env": runtime_env,
        "log_to_driver": True,
        "logging_level": logging.WARNING,
        "include_dashboard": False,
    }
    if address:
        ray.init(address=address, **kwargs)
    else:
        ray.init(num_cpus=num_cpus, object_store_memory=object_store_memory, **kwargs)
    import ray.data

    ctx = ray.data.DataContext.get_current()
    ctx.enable_progress_bars = False  # the jobs draw one bar of their own
    ctx.print_on_execution_start = False
    quiet_ray_data()


def unit_dataset(items: list[dict], *, single_operator: bool = True):
    """A Ray Dataset of work units, one block (so one task) per unit.

    ``single_operator``: the graph built on it fuses into one operator (task
    stages only, same resources). Ray Data then reserves half the cluster for
    that operator and lends the rest out only after its next resource poll,
    about a second later: on 2 CPUs the second core idles for that second and
    the last unit ends a second behind the others. With one operator there is
    no one to reserve for, so the reservation is turned off for this dataset
    alone (the process-wide ``DataContext`` is left as it is).
    """
    import ray.data

    ds = ray.data.from_items(items, override_num_blocks=max(1, len(items)))
    if single_operator:
        ds.context.op_resource_reservation_enabled = False
    return ds


def quiet_ray_data() -> None:
    """Keep job output readable: Ray Data's per-operator logging stays at WARNING."""
    logging.getLogger("ray.data").setLevel(logging.WARNING)
    logging.getLogger("ray.data._internal.progress").setLevel(logging.ERROR)
