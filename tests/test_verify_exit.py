"""`python -m prx_data.verify` exits with its verdict, never with a native abort after it.

pyarrow's native teardown at interpreter exit sometimes aborts ("terminate
called without an active exception", exit 134) after threaded parquet reads,
which verify does: an export verified "ok" then failed the shell. verify, a
read-only job, ends its process as soon as its verdict is printed.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.exportkit import make_export

REPO = Path(__file__).resolve().parent.parent
#: Run verify as `python -m` does, with an exit handler that aborts if teardown runs.
PROGRAM = (
    "import atexit, os, runpy, sys\n"
    "atexit.register(os.abort)\n"
    "sys.argv = ['prx_data.verify', *sys.argv[1:]]\n"
    "runpy.run_module('prx_data.verify', run_name='__main__')\n"
)


@pytest.fixture()
def export(tmp_path):
    return make_export(str(tmp_path / "ex"), {"512/1.000": 8}, samples_per_part=4).root


def _verify(*args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    return subprocess.run(
        [sys.executable, *args], env=env, capture_output=True, text=True, timeout=300
    )


def test_verify_ends_with_its_verdict_before_any_native_teardown(export):
    ok = _verify("-c", PROGRAM, export, "--deep")
    assert ok.returncode == 0, ok.stderr[-1000:]
    assert ok.stderr.rstrip().endswith(": ok")
    os.remove(os.path.join(export, "report.json"))
    bad = _verify("-c", PROGRAM, export)
    assert bad.returncode == 1, bad.stderr[-1000:]


#: The same through the console script's entry point (``prx-data verify``).
CONSOLE = (
    "import atexit, os, sys\n"
    "atexit.register(os.abort)\n"
    "sys.argv = ['prx-data', 'verify', *sys.argv[1:]]\n"
    "from prx_data.cli import main\n"
    "sys.exit(main())\n"
)


def test_prx_data_verify_ends_the_same_way(export):
    ok = _verify("-c", CONSOLE, export)
    assert ok.returncode == 0, ok.stderr[-1000:]
    assert ok.stderr.rstrip().endswith(": ok")


@pytest.mark.slow
def test_verify_deep_exits_0_every_time(export):
    for _ in range(8):
        res = _verify("-m", "prx_data.verify", export, "--deep")
        assert res.returncode == 0, res.stderr[-1000:]
