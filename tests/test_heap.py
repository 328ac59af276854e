"""An export worker keeps its large decode buffers in the heap between images.

glibc maps every block above 32 MB afresh and unmaps it at free, so each full-scale
decode of a large photo page-faults all its pages again (``prx_data.core.heap``).
The settings are process-wide, so the fault counts are taken in child processes.
"""

from __future__ import annotations

import json
import platform
import subprocess
import sys
from dataclasses import replace

import pytest

from prx_data.core import heap
from prx_data.core.runtime import RunOptions
from prx_data.export.spec import ExportConfig
from prx_data.pipelines import write_mds as pipeline
from tests import badinputs
from tests.tablekit import make_table

glibc = pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="glibc's mallopt")

_CHILD = """
import json, resource, sys
import numpy as np
from prx_data.core import heap
took = heap.keep_large_buffers() if sys.argv[1] == "keep" else None
def faults():
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt
a = np.ones((3000, 5000, 3), np.uint8)  # a decoded 15 MP photo, 45 MB
del a
f0 = faults()
b = np.ones((3000, 5000, 3), np.uint8)  # the next image
print(json.dumps({"took": took, "faults": faults() - f0}))
"""


def _second_image_faults(mode: str) -> dict:
    out = subprocess.run(
        [sys.executable, "-c", _CHILD, mode], capture_output=True, text=True, check=True
    )
    return json.loads(out.stdout)


@glibc
def test_the_next_image_reuses_the_pages_the_last_one_freed():
    kept = _second_image_faults("keep")
    default = _second_image_faults("default")
    assert kept["took"] is True
    # 45 MB is about 11,000 pages: glibc's default maps and faults them all again.
    assert kept["faults"] < 200, kept
    if default["faults"] > 2000:  # (not with transparent huge pages on every mapping)
        assert kept["faults"] * 10 < default["faults"], (kept, default)


def test_once_per_process_and_a_no_op_off_glibc(monkeypatch):
    monkeypatch.setattr(heap, "_applied", None)
    monkeypatch.setattr(heap.platform, "libc_ver", lambda: ("musl", "1.2"))
    assert heap.keep_large_buffers() is False
    monkeypatch.setattr(heap.platform, "libc_ver", lambda: ("glibc", "2.36"))
    assert heap.keep_large_buffers() is False  # the first answer stands


@pytest.fixture(scope="module")
def table(tmp_path_factory) -> str:
    uri = str(tmp_path_factory.mktemp("heap") / "t.lance")
    make_table(uri, [(f"h/{k}", badinputs.good_jpeg(seed=k), f"cap {k}") for k in range(2)])
    return uri


@pytest.mark.parametrize("release", [False, True])
def test_export_workers_keep_buffers_unless_released(table, tmp_path, monkeypatch, release):
    calls = []
    monkeypatch.setattr(heap, "keep_large_buffers", lambda: calls.append(1) or True)
    cfg = ExportConfig(table=table, out=str(tmp_path / "out"), tiers=(512,), min_units=1)
    cfg = replace(cfg, keep_heap=not release)
    pipeline.run_export(cfg, RunOptions(engine="local", num_cpus=1, progress=False))
    assert bool(calls) is not release


def test_the_setting_is_not_part_of_what_a_resume_or_append_compares():
    a = ExportConfig(table="t", out="o")
    b = replace(a, keep_heap=False)
    assert a.fingerprint() == b.fingerprint()
    assert a.sample_settings() == b.sample_settings()
