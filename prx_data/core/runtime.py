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
import json
import logging
import os
import socket
import sys
import time
import warnings
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

from prx_data.core.errors import PrxDataError, UsageError
from prx_data.core.flags import add_flags, flag, from_args, nested

__all__ = [
    "ENGINES",
    "Placement",
    "Resources",
    "RunOptions",
    "add_run_args",
    "check_engine",
    "ensure_ray",
    "map_units",
    "place",
    "placement_cpus",
    "run_options_from_args",
]

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


#: The address of the Ray cluster this process joined (None: a private local Ray, or none).
_joined: str | None = None


def ensure_ray(
    address: str | None = None,
    num_cpus: int | None = None,
    object_store_memory: int | None = None,
    *,
    connect_timeout: float | None = None,
) -> str | None:
    """Join ``address`` (or ``$RAY_ADDRESS``), else start a local Ray runtime.

    Reuses an already-initialised runtime (notebooks, tests). Each worker is
    told to use one Lance thread so that Ray, not Lance, decides parallelism.
    A given address where nothing answers within ``connect_timeout`` seconds
    (default ``$PRX_RAY_CONNECT_TIMEOUT_S`` or 20) raises :class:`RayStartError`;
    with no address, a stale record of a dead ``ray start`` cluster is skipped
    with a warning and a local Ray is started, and a live one is joined after
    one line on stderr naming it and how to run locally instead.

    Returns the address of the cluster joined, or None for a private local Ray.
    """
    global _joined
    import ray

    if ray.is_initialized():
        return _joined
    quiet_logs()
    timeout = connect_timeout_s(connect_timeout)
    source = "--ray-address" if address else "RAY_ADDRESS"
    address = address or os.environ.get("RAY_ADDRESS") or None
    worker_env = {"LANCE_CPU_THREADS": os.environ.get("LANCE_CPU_THREADS", "1")}
    if not _verbose:
        worker_env["PYTHONWARNINGS"] = os.environ.get("PYTHONWARNINGS") or _WORKER_WARNINGS
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
        _quiet_token_auth(joining=True)
        ray.init(address=address, **joined)
        _joined = address
    else:
        state = _record_state() if address is None else "none"
        if state == "stale":
            address = "local"  # Ray would retry the recorded one for many minutes
        if state == "live":
            recorded = _read_record(ray_record_path()) or "auto"
            sizes = num_cpus is not None or object_store_memory is not None
            print(
                f"joining the Ray cluster at {recorded} (a `ray start` cluster on this host)"
                + (", at its own size" if sizes else "")
                + "; to run on this machine alone pass --engine local or set RAY_ADDRESS=local",
                file=sys.stderr,
            )
            _quiet_token_auth(joining=True)
            ray.init(**joined)  # Ray refuses sizes for a cluster it joins: join it as it is
            _joined = recorded
        else:
            _quiet_token_auth(joining=False)
            with _inherited_by_workers(worker_env):
                ray.init(
                    address=address,
                    num_cpus=num_cpus,
                    object_store_memory=object_store_memory,
                    **kwargs,
                )
            _joined = None
    import ray.data

    ctx = ray.data.DataContext.get_current()
    ctx.enable_progress_bars = False  # the jobs draw one bar of their own
    ctx.print_on_execution_start = False
    quiet_ray_data()
    return _joined


#: Known warnings, handled by the project, kept out of job output unless ``-v``.
_KNOWN_WARNINGS = ("lance is not fork-safe",)
_WORKER_WARNINGS = ",".join(f"ignore:{m}" for m in _KNOWN_WARNINGS)
_verbose = False


def quiet_logs(*, verbose: bool | None = None) -> None:
    """Keep job output to the job's own lines; ``verbose=True`` (``-v``) shows everything.

    Lance warns at every fork that it is not fork-safe (Ray's and the
    job's subprocesses exec at once, so it does not apply); Ray warns about
    token authentication, whose mode this module sets explicitly
    (:func:`_quiet_token_auth`). Both are hidden unless verbose.
    """
    global _verbose
    if verbose is not None:
        _verbose = verbose
    if _verbose:
        warnings.filterwarnings("default", message=_KNOWN_WARNINGS[0])
        return
    for message in _KNOWN_WARNINGS:
        warnings.filterwarnings("ignore", message=message)


def _quiet_token_auth(*, joining: bool) -> None:
    """Set Ray's token-auth mode to what Ray would choose, so it does not warn about choosing.

    A private local Ray uses token auth by default; a joined cluster needs it
    when this host has a token. An explicit ``RAY_AUTH_MODE`` is left alone,
    and so is everything with ``-v``.

    Ray reads the mode into its config when it is imported, and ``ray.init``
    creates a missing token only by that config: so the config is read again
    here, else a host without ``~/.ray/auth_token`` starts a head that needs a
    token nobody made (its GCS exits and ``ray.init`` times out).
    """
    if _verbose or os.environ.get("RAY_AUTH_MODE"):
        return
    if joining:
        token = os.environ.get("RAY_AUTH_TOKEN") or os.path.exists(
            os.path.expanduser("~/.ray/auth_token")
        )
        if not token:
            return
    os.environ["RAY_AUTH_MODE"] = "token"
    try:
        from ray._raylet import Config

        Config.initialize("")
    except (ImportError, AttributeError):  # Ray's config moved: it reads the mode on its own
        pass


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


# --- run options: one set of run flags for every job ----------------------------------------

#: How a job runs its work units: ``auto`` (driver threads for small work, Ray for the
#: rest or whenever a cluster is named), ``local`` (driver threads, never Ray), ``ray``.
ENGINES = ("auto", "local", "ray")


def check_engine(engine: str) -> str:
    """``engine`` if it is one of :data:`ENGINES`; else a one-line :class:`UsageError`."""
    if engine not in ENGINES:
        raise UsageError(
            f"engine must be one of {', '.join(ENGINES)}, got {engine!r} (--engine auto runs "
            "small work in this process and the rest on Ray)"
        )
    return engine


def _positive_int(value: str) -> int:
    import argparse

    try:
        n = int(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a whole number: {value!r}") from None
    if n < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {n}")
    return n


@dataclass(frozen=True)
class RunOptions:
    """How a job runs, the same for every job; each field carries its command-line flag.

    Every job config holds one (``run: RunOptions = run_field()``), so these
    settings, their flags and their checks are declared here only; a notebook
    passes ``run=RunOptions(engine="local")``. How a CLI reports (the error rate
    that fails it, the JSON report, ``-v``) is not the job's:
    :class:`prx_data.cli.reporting.ReportOptions`.
    """

    engine: str = flag(
        "auto",
        "--engine",
        help="where the work runs: auto = in this process when the job is small and no Ray "
        "cluster is named, else Ray; local = in this process (threads), never Ray; ray = a "
        "Ray runtime (default: %(default)s)",
        choices=ENGINES,
    )
    ray_address: str | None = flag(
        None,
        "--ray-address",
        help="Ray cluster to join (default: $RAY_ADDRESS; unset, or RAY_ADDRESS=local, runs "
        "on a private local Ray when Ray is used). A named cluster always runs the job on Ray",
        metavar="HOST:PORT",
    )
    num_cpus: int | None = flag(
        None,
        "--num-cpus",
        help="CPUs for the work in this process or on a private local Ray (default: all); "
        "a joined cluster keeps its own size",
        type=_positive_int,
    )
    progress: bool = flag(True, "--no-progress", help="hide the progress bar", negate=True)

    def __post_init__(self) -> None:
        check_engine(self.engine)
        if self.num_cpus is not None and self.num_cpus < 1:
            raise UsageError(f"num_cpus must be at least 1, got {self.num_cpus}")

    def place(self, *, size: int, small: int) -> Placement:
        """Where a job of ``size`` runs under these options (:func:`place`)."""
        return place(
            self.engine,
            size=size,
            small=small,
            ray_address=self.ray_address,
            num_cpus=self.num_cpus,
        )

    def job_fields(self) -> dict:
        """These options as keywords, for a function that still takes them one by one."""
        return {
            "engine": self.engine,
            "ray_address": self.ray_address,
            "num_cpus": self.num_cpus,
            "progress": self.progress,
        }


def run_field() -> Any:
    """``run: RunOptions = run_field()``: a job config's run options, with their flags."""
    return nested(RunOptions, "run options")


def add_run_args(p, *, title: str = "run options") -> None:
    """Add the run flags of :class:`RunOptions` to ``p`` (a parser), in one group."""
    add_flags(p.add_argument_group(title), RunOptions)


def run_options_from_args(args, **overrides) -> RunOptions:
    """The :class:`RunOptions` that ``args`` (parsed after :func:`add_run_args`) spell."""
    return from_args(RunOptions, args, **overrides)


# --- where a job runs -----------------------------------------------------------------------


@dataclass(frozen=True)
class Placement:
    """Where :func:`map_units` runs: ``threads`` driver threads, or Ray (``threads`` None)."""

    threads: int | None
    ray_address: str | None = None
    num_cpus: int | None = None
    #: Why (for logs and tests): "small", "local", "ray", "cluster".
    reason: str = ""

    @property
    def on_ray(self) -> bool:
        return self.threads is None


def named_cluster(address: str | None = None) -> str | None:
    """The cluster a job was told to join (``address``, else ``$RAY_ADDRESS``), or None
    (nothing named, or ``local``: a private local Ray)."""
    address = address or os.environ.get("RAY_ADDRESS") or None
    return None if address in (None, "local") else address


def place(
    engine: str,
    *,
    size: int,
    small: int,
    ray_address: str | None = None,
    num_cpus: int | None = None,
) -> Placement:
    """Decide where a job of ``size`` (rows or bytes, the job's own measure) runs.

    ``auto`` keeps work of at most ``small`` on driver threads, one per CPU the
    private local Ray would have had, and starts nothing, even when a Ray
    already runs in this process (a notebook's, a test session's): small work
    pays Ray's scheduling and serialisation for nothing. Any named cluster
    (``ray_address``, ``$RAY_ADDRESS``) takes the Ray path whatever the size.
    ``local`` always runs on threads, ``ray`` always on Ray.
    """
    check_engine(engine)
    if engine == "local":
        return Placement(_driver_cpus(num_cpus), reason="local")
    if engine == "ray":
        return Placement(None, ray_address, num_cpus, reason="ray")
    if named_cluster(ray_address):
        return Placement(None, ray_address, num_cpus, reason="cluster")
    if size <= small:
        return Placement(_driver_cpus(num_cpus), reason="small")
    return Placement(None, ray_address, num_cpus, reason="ray")


def _driver_cpus(num_cpus: int | None) -> int:
    """``num_cpus``, else the CPUs this process may use (affinity, then a cgroup quota), as
    Ray would count them for a local runtime, without importing Ray."""
    if num_cpus is not None:
        return max(1, num_cpus)
    try:
        n = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        n = os.cpu_count() or 1
    try:
        with open("/sys/fs/cgroup/cpu.max", encoding="ascii") as f:
            quota, period = f.read().split()[:2]
        if quota != "max":
            n = min(n, max(1, -(-int(quota) // int(period))))
    except (OSError, ValueError):
        pass
    return max(1, n)


def placement_cpus(placement: Placement) -> int:
    """CPUs the work gets: the driver threads, or the Ray cluster's CPUs (Ray started here)."""
    if not placement.on_ray:
        return placement.threads or 1
    ensure_ray(placement.ray_address, placement.num_cpus)
    import ray

    return max(1, int(ray.cluster_resources().get("CPU", 1)))


# --- one runner ---------------------------------------------------------------------------


@dataclass(frozen=True)
class Resources:
    """What each call of a :func:`map_units` function needs.

    ``num_cpus`` / ``num_gpus`` per Ray task or actor; ``actors``: a pool of that
    many instances of a class (Ray), or at most that many driver threads, each
    with its own instance; ``env``: variables the Ray workers need (a joined
    cluster's workers do not inherit the driver's).
    """

    num_cpus: float = 1.0
    num_gpus: float = 0.0
    actors: int | None = None
    constructor_args: tuple = ()
    env: dict | None = None


class UnitError(PrxDataError, RuntimeError):
    """A work unit failed with a :class:`PrxDataError`: the one line says which and why."""


class ClusterLost(PrxDataError, RuntimeError):
    """The Ray cluster a job ran on stopped answering before the job ended."""


def map_units(
    fn: Callable | type,
    units: Sequence,
    placement: Placement,
    resources: Resources = Resources(),
    *,
    desc: str = "units",
    progress: bool = False,
    total: int | None = None,
    initial: int = 0,
    weight: Callable[[Any], int] | None = None,
    postfix: Callable[[], dict] | None = None,
    unit_name: str = "unit",
    tables: bool = False,
    single_operator: bool = True,
) -> Iterator[Any]:
    """Run ``fn`` over ``units`` where ``placement`` says; results as they finish.

    ``fn`` is a function ``unit -> result`` or a class whose instances are
    called with a unit (one per driver thread or Ray actor: models live
    there; a ``close()`` is called at the end on the driver). A call may
    return an iterator of results (a unit yielding several batches); they are
    flattened. On Ray, units and results travel as JSON (``tables``: results
    are ``pyarrow.Table`` s and travel as blocks).

    One progress bar (``weight(result)`` steps per result, ``total`` of them)
    and one error policy: the first unit that raises ends the job. A
    :class:`PrxDataError` comes back as one line naming the unit
    (:class:`UnitError`); anything else is a bug and keeps its traceback. A
    Ray cluster that stops answering mid-job ends it with
    :class:`ClusterLost`, one line that says how to run locally.
    """
    from tqdm.auto import tqdm

    bar = tqdm(
        total=len(units) if total is None else total,
        initial=initial,
        desc=desc,
        unit=unit_name,
        disable=not progress,
        file=sys.stderr,
        smoothing=0.1,
    )
    if not units:
        bar.close()
        return
    if placement.on_ray:
        results = _on_ray(fn, units, placement, resources, tables, single_operator)
    else:
        results = _on_threads(fn, units, placement.threads or 1, resources)
    try:
        for r in results:
            bar.update(weight(r) if weight else 1)
            if postfix is not None:
                bar.set_postfix(postfix(), refresh=False)
            yield r
    finally:
        bar.close()
        close = getattr(results, "close", None)
        if close is not None:
            close()


def _flatten(out) -> Iterator[Any]:
    if isinstance(out, Iterator):
        yield from out
    else:
        yield out


def _on_threads(fn, units: Sequence, threads: int, resources: Resources) -> Iterator[Any]:
    """``fn`` over ``units`` on at most ``threads`` driver threads, in unit order.

    At most ``2 * threads`` calls are in flight or waiting, so a million units
    cost a bounded number of futures; a class gets one instance per thread.
    """
    import threading
    from collections import deque
    from concurrent.futures import ThreadPoolExecutor

    is_class = isinstance(fn, type)
    if resources.actors:
        threads = min(threads, resources.actors)
    threads = max(1, min(threads, len(units)))
    local = threading.local()
    made: list = []
    lock = threading.Lock()

    def call(i: int) -> list:
        target = fn
        if is_class:
            target = getattr(local, "inst", None)
            if target is None:
                target = local.inst = fn(*resources.constructor_args)
                with lock:
                    made.append(target)
        try:
            return list(_flatten(target(units[i])))
        except PrxDataError as e:
            raise UnitError(_unit_line(units[i], e)) from e

    try:
        if threads == 1:
            for i in range(len(units)):
                yield from call(i)
            return
        pending: deque = deque()
        with ThreadPoolExecutor(threads, thread_name_prefix="prx-unit") as ex:
            try:
                for i in range(len(units)):
                    pending.append(ex.submit(call, i))
                    if len(pending) >= 2 * threads:
                        yield from pending.popleft().result()
                while pending:
                    yield from pending.popleft().result()
            finally:
                for f in pending:  # an error or an abandoned generator: start nothing new
                    f.cancel()
    finally:
        for inst in made:
            close = getattr(inst, "close", None)
            if callable(close):
                close()


def _unit_line(unit, e: BaseException) -> str:
    text = json.dumps(unit, default=str) if not isinstance(unit, str) else unit
    if len(text) > 200:
        text = text[:197] + "..."
    first = str(e).splitlines()[0] if str(e) else type(e).__name__
    return f"work unit {text} failed: {first}"


class _RayCall:
    """Ray Data UDF around a job's function or class: JSON units in, results out."""

    def __init__(self, fn, constructor_args: tuple, tables: bool):
        self.fn = fn(*constructor_args) if isinstance(fn, type) else fn
        self.tables = tables

    def __call__(self, batch):
        import pyarrow as pa

        for text in batch["unit"].to_pylist():
            unit = json.loads(text)
            try:
                outs = list(_flatten(self.fn(unit)))
            except PrxDataError as e:
                raise UnitError(_unit_line(unit, e)) from e
            if self.tables:
                yield from (t for t in outs if t.num_rows)
            elif outs:
                yield pa.table({"result": [json.dumps(o) for o in outs]})


def _on_ray(fn, units, placement: Placement, resources: Resources, tables, single_operator):
    import ray

    address = ensure_ray(placement.ray_address, placement.num_cpus)  # None: a private Ray
    ds = unit_dataset([{"unit": json.dumps(u)} for u in units], single_operator=single_operator)
    kw: dict = {"batch_size": 1, "batch_format": "pyarrow", "num_cpus": resources.num_cpus}
    if resources.num_gpus:
        kw["num_gpus"] = resources.num_gpus
    if resources.env:
        kw["runtime_env"] = {"env_vars": dict(resources.env)}
    if isinstance(fn, type):
        kw["compute"] = ray.data.ActorPoolStrategy(size=resources.actors or 1)
        # Ray Data restarts a pool's actors forever by default: an actor whose start
        # fails every time (a model that does not fit, a class its workers cannot
        # import) then retries without end, and Ray logs an error line for every pool
        # ("has constructor arguments in the object store and max_restarts > 0":
        # Ray Data passes its own config that way, ray-project/ray#57733). A dead
        # actor ends the job instead; the jobs resume from what they committed.
        # Ray Data's own way to turn that off (Ray warns it goes in Ray 2.64).
        kw["max_restarts"] = 0
        kw["fn_constructor_args"] = (fn, tuple(resources.constructor_args), tables)
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message="`ray_remote_args` is deprecated")
            ds = ds.map_batches(_RayCall, **kw)
    else:
        ds = ds.map_batches(_RayCall(fn, (), tables).__call__, **kw)
    try:
        for block in ds.iter_batches(batch_format="pyarrow", batch_size=None):
            if tables:
                yield block
            else:
                yield from (json.loads(t) for t in block["result"].to_pylist())
    except Exception as e:
        unit_err = _task_cause(e)
        if unit_err is not None:
            raise unit_err from e
        if address and not _cluster_answers(address):
            raise ClusterLost(
                f"the Ray cluster at {address} stopped answering before the job ended; what "
                "is committed stays. Restart it, or rerun with --engine local (or "
                "RAY_ADDRESS=local) to run on this machine"
            ) from e
        raise


def _task_cause(e: BaseException) -> BaseException | None:
    """The :class:`PrxDataError` a Ray task raised, if that is what ended the job."""
    seen = 0
    while e is not None and seen < 8:
        if isinstance(e, PrxDataError):
            return e if isinstance(e, UnitError) else UnitError(str(e).splitlines()[0])
        cause = getattr(e, "cause", None) or e.__cause__
        e, seen = cause, seen + 1
    return None


def _cluster_answers(address: str) -> bool:
    hp = _host_port(address)
    return hp is None or _answers(*hp, RECORD_PROBE_S, retry=False)
