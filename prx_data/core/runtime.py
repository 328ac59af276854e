"""Starting or joining Ray for a job: local embedded Ray by default, a cluster via RAY_ADDRESS.

Ray itself retries a dead address for many minutes: with no address given it
joins the cluster named in its record of the last ``ray start`` on this host
(``<tmp>/ray/ray_current_cluster``, left behind when that head dies), and an
explicit dead address is retried the same way. So before ``ray.init`` the
address is probed with a plain TCP connect: a stale record is bypassed for a
local Ray (with a warning naming it), and an address that was given fails
after ``PRX_RAY_CONNECT_TIMEOUT_S`` seconds with one line saying what to do.
"""

from __future__ import annotations

import contextlib
import logging
import os
import socket
import sys
import time
import warnings
from collections.abc import Iterator

from prx_data.core.errors import PrxDataError

#: Seconds a job waits for the GCS port of the Ray cluster it was given to accept a
#: connection (a head that is still starting) before it gives up.
CONNECT_TIMEOUT_ENV = "PRX_RAY_CONNECT_TIMEOUT_S"
DEFAULT_CONNECT_TIMEOUT_S = 20.0
#: One connect attempt at a recorded (not given) address: a head that died refuses at once.
RECORD_PROBE_S = 2.0


class RayStartError(PrxDataError, RuntimeError):
    """Ray could not be joined or started; the message is one line that says what to do."""


def ray_record_path() -> str:
    """Ray's record of the cluster the last ``ray start`` on this host made."""
    try:
        from ray._common.utils import get_ray_address_file

        return get_ray_address_file(None)
    except (ImportError, AttributeError):  # Ray's own rule, should the helper move
        base = os.environ.get("RAY_TMPDIR") or os.environ.get("TMPDIR") or "/tmp"
        return os.path.join(base, "ray", "ray_current_cluster")


def connect_timeout_s(value: float | None = None) -> float:
    """``value``, else ``$PRX_RAY_CONNECT_TIMEOUT_S``, else the default."""
    raw = value if value is not None else os.environ.get(CONNECT_TIMEOUT_ENV)
    if raw is None or raw == "":
        return DEFAULT_CONNECT_TIMEOUT_S
    try:
        seconds = float(raw)
    except ValueError:
        seconds = -1.0
    if not seconds >= 0:
        raise RayStartError(f"{CONNECT_TIMEOUT_ENV}={raw!r} is not a number of seconds (e.g. 20)")
    return seconds


def _host_port(address: str) -> tuple[str, int] | None:
    """``(host, port)`` of ``host:port`` or ``ray://host:port``; None for ``auto`` and the like."""
    rest = address.split("://", 1)[-1].split("/", 1)[0]
    host, sep, port = rest.rpartition(":")
    if not sep or not host or not port.isascii() or not port.isdigit():
        return None
    return host.strip("[]"), int(port)


def _answers(host: str, port: int, timeout_s: float, *, retry: bool) -> bool:
    """Whether ``host:port`` accepts a TCP connection (with ``retry``, until ``timeout_s``)."""
    deadline = time.monotonic() + timeout_s
    while True:
        left = deadline - time.monotonic()
        try:
            with socket.create_connection((host, port), timeout=max(0.1, min(left, 2.0))):
                return True
        except OSError:
            if not retry or time.monotonic() + 0.25 >= deadline:
                return False
            time.sleep(0.25)


def _read_record(path: str) -> str | None:
    try:
        with open(path, encoding="utf-8") as f:
            return f.read().strip() or None
    except OSError:
        return None


def ensure_ray(
    address: str | None = None,
    num_cpus: int | None = None,
    object_store_memory: int | None = None,
    *,
    connect_timeout: float | None = None,
) -> None:
    """Join ``address`` (or ``$RAY_ADDRESS``), else start a local Ray runtime.

    Reuses an already-initialised runtime (notebooks, tests). Each worker is
    told to use one Lance thread so that Ray, not Lance, decides parallelism.
    A given address where nothing answers within ``connect_timeout`` seconds
    (default ``$PRX_RAY_CONNECT_TIMEOUT_S`` or 20) raises :class:`RayStartError`;
    with no address, a stale record of a dead ``ray start`` cluster is skipped
    with a warning and a local Ray is started.
    """
    import ray

    if ray.is_initialized():
        return
    timeout = connect_timeout_s(connect_timeout)
    source = "--ray-address" if address else "RAY_ADDRESS"
    address = address or os.environ.get("RAY_ADDRESS") or None
    worker_env = {"LANCE_CPU_THREADS": os.environ.get("LANCE_CPU_THREADS", "1")}
    kwargs: dict = {
        "log_to_driver": True,
        "logging_level": logging.WARNING,
        "include_dashboard": False,
    }
    joined = {
        **kwargs,
        "runtime_env": {"env_vars": worker_env},
    }  # a cluster's workers do not inherit our environment
    if address and address != "local":
        _check_address(address, source, timeout)
        ray.init(address=address, **joined)
    else:
        state = _record_state() if address is None else "none"
        if state == "stale":
            address = "local"  # Ray would retry the recorded one for many minutes
        if state == "live" and (num_cpus is not None or object_store_memory is not None):
            # Ray joins the recorded cluster and refuses sizes for it: join it as it is.
            warnings.warn(
                f"joining the running Ray cluster named in {ray_record_path()}; its own size "
                "applies (num_cpus / object_store_memory are ignored). Pass --ray-address "
                "local for a private local Ray.",
                UserWarning,
                stacklevel=2,
            )
            ray.init(**joined)
        elif state == "live":
            ray.init(address=address, **joined)
        else:
            with _inherited_by_workers(worker_env):
                ray.init(
                    address=address,
                    num_cpus=num_cpus,
                    object_store_memory=object_store_memory,
                    **kwargs,
                )
    import ray.data

    ctx = ray.data.DataContext.get_current()
    ctx.enable_progress_bars = False  # the jobs draw one bar of their own
    ctx.print_on_execution_start = False
    quiet_ray_data()


@contextlib.contextmanager
def _inherited_by_workers(env: dict[str, str]) -> Iterator[None]:
    """``env`` in this process's environment while ``ray.init`` starts a local runtime.

    Its raylet, and so every worker, inherits the environment it starts with.
    Given as a job ``runtime_env`` instead, the variables keep Ray from handing
    the job the workers it prestarts: each job then waits for fresh ones (a
    4-row map took 3-5 s longer on 2 loaded cores). The driver's own
    environment is restored afterwards.
    """
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def _check_address(address: str, source: str, timeout: float) -> None:
    """Raise :class:`RayStartError` unless the GCS at ``address`` accepts connections."""
    target = _read_record(ray_record_path()) if address == "auto" else address
    hp = _host_port(target) if target else None
    if hp is None or _answers(*hp, timeout, retry=True):
        return  # nothing to probe ("auto" with no record: Ray looks for one itself)
    unset = "unset RAY_ADDRESS" if source == "RAY_ADDRESS" else f"drop {source}"
    raise RayStartError(
        f"no Ray cluster answers at {target} (from {source}) after {timeout:g} s: start its "
        f"head there (`ray start --head --port {hp[1]}`), or {unset} to run on a local Ray; "
        f"`ray stop` clears what a stopped cluster left ({CONNECT_TIMEOUT_ENV} sets the wait)"
    )


def _record_state(*, warn: bool = True) -> str:
    """``"none"`` (no usable record), ``"live"``, or ``"stale"`` (after a warning, with
    ``warn``): whether Ray's cluster record names an address where a cluster answers."""
    path = ray_record_path()
    recorded = _read_record(path)
    hp = _host_port(recorded) if recorded else None
    if hp is None:
        return "none"
    if _answers(*hp, RECORD_PROBE_S, retry=False):
        return "live"
    if not warn:
        return "stale"
    warnings.warn(
        f"{path} names a Ray cluster at {recorded}, where nothing answers (its head has "
        f"stopped): starting a local Ray instead. Clear the stale record with `ray stop` or "
        f"by deleting {path}; set RAY_ADDRESS to join a cluster.",
        UserWarning,
        stacklevel=3,
    )
    return "stale"


def local_ray_cpus(address: str | None = None, num_cpus: int | None = None) -> int | None:
    """The CPUs of the private local Ray runtime :func:`ensure_ray` would start, or None
    when it would use a Ray that exists already: Ray initialised in this process, a
    cluster given by ``address`` or ``$RAY_ADDRESS``, or the live ``ray start`` cluster
    named in Ray's record on this host (also None with ``$RAY_OVERRIDE_RESOURCES``,
    which sizes a local runtime in Ray's own way).

    Starts nothing, so a job can tell before paying Ray's start-up whether its work
    could stay in this process; the count is Ray's own (``num_cpus``, else Ray's CPU
    detection), so anything planned from it matches what that runtime would report.
    """
    ray = sys.modules.get("ray")  # not imported: certainly not initialised
    if ray is not None and ray.is_initialized():
        return None
    address = address or os.environ.get("RAY_ADDRESS") or None
    if address not in (None, "local") or os.environ.get("RAY_OVERRIDE_RESOURCES"):
        return None
    if address is None and _record_state(warn=False) == "live":
        return None
    if num_cpus is not None:
        return max(1, num_cpus)
    try:
        from ray._private.utils import get_num_cpus

        return max(1, int(get_num_cpus()))
    except (ImportError, AttributeError):  # Ray's helper moved: its documented default
        return max(1, os.cpu_count() or 1)


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
