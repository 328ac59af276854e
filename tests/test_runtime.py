"""The one runner: run options from one set of flags, where work runs, and map_units' policy."""

from __future__ import annotations

import argparse
import socket
import subprocess
import sys
import threading

import pytest

from prx_data.cli.reporting import ReportOptions, add_report_args, report_options_from_args
from prx_data.core import runtime
from prx_data.core.errors import PrxDataError, UsageError
from prx_data.core.runtime import Placement, Resources, RunOptions, map_units, place


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser()
    runtime.add_run_args(p)
    add_report_args(p)
    return p


def test_run_flags_build_run_options_with_the_documented_defaults():
    args = _parser().parse_args([])
    opts = runtime.run_options_from_args(args)
    assert opts == RunOptions()
    assert opts.engine == "auto" and opts.progress
    assert report_options_from_args(args) == ReportOptions(max_error_rate=0.2)
    args = _parser().parse_args(
        ["--engine", "local", "--ray-address", "h:1", "--num-cpus", "3", "--no-progress"]
        + ["--max-error-rate", "0.5", "--report-json", "r.json"]
    )
    opts = runtime.run_options_from_args(args)
    assert (opts.engine, opts.ray_address, opts.num_cpus) == ("local", "h:1", 3)
    assert not opts.progress
    rep = report_options_from_args(args)
    assert (rep.max_error_rate, rep.report_json) == (0.5, "r.json")
    assert opts.job_fields() == {
        "engine": "local",
        "ray_address": "h:1",
        "num_cpus": 3,
        "progress": False,
    }


def test_help_documents_ray_address_local_and_refuses_bad_values(capsys):
    with pytest.raises(SystemExit):
        _parser().parse_args(["--help"])
    assert "RAY_ADDRESS=local" in capsys.readouterr().out
    for bad in (["--engine", "spark"], ["--num-cpus", "0"], ["--max-error-rate", "2"]):
        with pytest.raises(SystemExit):
            _parser().parse_args(bad)


def test_engine_is_checked_in_one_place_with_one_line():
    with pytest.raises(UsageError) as err:
        RunOptions(engine="spark")
    assert "\n" not in str(err.value) and "auto" in str(err.value)
    with pytest.raises(UsageError):
        runtime.check_engine("threads")


def test_auto_keeps_small_work_off_ray_and_a_named_cluster_on_it(monkeypatch):
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    # As in a fresh job process: no Ray runtime in this one (another test may have started one).
    monkeypatch.delitem(sys.modules, "ray", raising=False)
    small = place("auto", size=12, small=64, num_cpus=2)
    assert not small.on_ray and small.threads == 2 and small.reason == "small"
    assert place("auto", size=65, small=64).on_ray
    assert place("local", size=10**9, small=64).threads >= 1
    assert place("ray", size=1, small=64).on_ray
    assert place("auto", size=1, small=64, ray_address="127.0.0.1:6379").reason == "cluster"
    monkeypatch.setenv("RAY_ADDRESS", "127.0.0.1:6379")
    assert place("auto", size=1, small=64).reason == "cluster"
    monkeypatch.setenv("RAY_ADDRESS", "local")  # a private local Ray, when Ray is used
    assert not place("auto", size=1, small=64).on_ray


def test_auto_keeps_small_work_on_threads_while_a_ray_runs_in_this_process(monkeypatch):
    """A notebook's (or a test session's) Ray does not make a 12-row job pay for Ray."""
    import types

    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    monkeypatch.setitem(sys.modules, "ray", types.SimpleNamespace(is_initialized=lambda: True))
    assert place("auto", size=12, small=64, num_cpus=2).reason == "small"
    assert place("auto", size=65, small=64).on_ray


@pytest.mark.timeout(60)
def test_small_auto_job_does_not_import_ray():
    code = (
        "import sys\n"
        "from prx_data.core.runtime import map_units, place\n"
        "p = place('auto', size=3, small=64)\n"
        "print(sorted(map_units(lambda u: u * 2, [1, 2, 3], p)), 'ray' in sys.modules)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.split() == ["[2,", "4,", "6]", "False"]


def test_threads_run_every_unit_in_order_and_flatten_iterators():
    units = list(range(20))
    out = list(map_units(lambda u: iter([u, -u]), units, Placement(threads=4)))
    assert out == [x for u in units for x in (u, -u)]


class _Model:
    made: list = []
    closed: list = []

    def __init__(self, scale: int):
        self.scale = scale
        self.thread = threading.get_ident()
        _Model.made.append(self)

    def __call__(self, unit: int) -> tuple[int, int]:
        assert threading.get_ident() == self.thread  # one instance per thread
        return unit * self.scale, id(self)

    def close(self) -> None:
        _Model.closed.append(self)


def test_a_class_gets_one_instance_per_thread_and_is_closed():
    _Model.made.clear()
    _Model.closed.clear()
    res = Resources(actors=2, constructor_args=(10,))
    out = list(map_units(_Model, list(range(8)), Placement(threads=4), res))
    assert [v for v, _ in out] == [u * 10 for u in range(8)]
    assert 1 <= len(_Model.made) <= 2 and len({i for _, i in out}) == len(_Model.made)
    assert sorted(map(id, _Model.closed)) == sorted(map(id, _Model.made))


def test_a_user_error_in_a_unit_is_one_line_naming_it_and_a_bug_keeps_its_type():
    def fn(u):
        if u == {"file": "b.tar"}:
            raise UsageError("b.tar is not a tar file\nmore detail")
        return u

    units = [{"file": "a.tar"}, {"file": "b.tar"}]
    with pytest.raises(runtime.UnitError) as err:
        list(map_units(fn, units, Placement(threads=2)))
    assert isinstance(err.value, PrxDataError)
    assert "b.tar" in str(err.value) and "\n" not in str(err.value)

    def bug(u):
        raise KeyError(u)

    with pytest.raises(KeyError):
        list(map_units(bug, [1], Placement(threads=1)))


def _square(u: dict) -> dict:
    return {"n": u["n"] ** 2}


class _Doubler:
    def __init__(self, k: int):
        self.k = k

    def __call__(self, u: dict):
        yield {"n": u["n"] * self.k}
        yield {"n": -u["n"]}


def _refuse(u: dict) -> dict:
    raise UsageError(f"unit {u['n']} refused")


@pytest.mark.timeout(120)
def test_ray_gives_the_results_of_the_driver_threads(ray_local):
    units = [{"n": i} for i in range(6)]
    on_ray = Placement(threads=None)
    assert sorted(r["n"] for r in map_units(_square, units, on_ray)) == [i * i for i in range(6)]
    out = map_units(
        _Doubler, units, on_ray, Resources(num_cpus=0.5, actors=2, constructor_args=(3,))
    )
    local = map_units(_Doubler, units, Placement(threads=2), Resources(constructor_args=(3,)))
    assert sorted(r["n"] for r in out) == sorted(r["n"] for r in local)
    with pytest.raises(runtime.UnitError, match="refused"):
        list(map_units(_refuse, units[:1], on_ray))


class _Unstartable:
    def __init__(self):
        raise RuntimeError("no room for the model")

    def __call__(self, u: dict) -> dict:  # pragma: no cover
        return u


@pytest.mark.timeout(120)
def test_an_actor_pool_logs_no_restart_warning_and_a_failed_start_ends_the_job(ray_local, capfd):
    units = [{"n": i} for i in range(3)]
    on_ray = Placement(threads=None)
    out = map_units(_Doubler, units, on_ray, Resources(constructor_args=(2,)))
    assert sorted(r["n"] for r in out) == [-2, -1, 0, 0, 2, 4]
    with pytest.raises(Exception, match="no room for the model"):
        list(map_units(_Unstartable, units, on_ray))  # not retried without end
    assert "constructor arguments" not in capfd.readouterr().err


class _DeadClusterDataset:
    """Test double for a Ray Dataset whose cluster dies while the job reads its results."""

    def map_batches(self, *a, **k):
        return self

    def iter_batches(self, **k):
        raise ConnectionError("GCS unreachable")
        yield  # pragma: no cover


def test_a_cluster_that_dies_mid_job_ends_it_with_one_line(monkeypatch):
    with socket.socket() as s:  # a port nothing listens on once closed
        s.bind(("127.0.0.1", 0))
        dead = f"127.0.0.1:{s.getsockname()[1]}"
    monkeypatch.setattr(runtime, "ensure_ray", lambda *a, **k: dead)
    monkeypatch.setattr(runtime, "unit_dataset", lambda *a, **k: _DeadClusterDataset())
    with pytest.raises(runtime.ClusterLost) as err:
        list(map_units(_square, [{"n": 1}], Placement(threads=None)))
    line = str(err.value)
    assert dead in line and "--engine local" in line and "\n" not in line
    # a private local Ray (no cluster joined) keeps the error as it is
    monkeypatch.setattr(runtime, "ensure_ray", lambda *a, **k: None)
    with pytest.raises(ConnectionError):
        list(map_units(_square, [{"n": 1}], Placement(threads=None)))
