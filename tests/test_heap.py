"""An export's Ray workers keep their large decode buffers in the heap between images.

glibc maps every block above 32 MB afresh and unmaps it at free, so each full-scale
decode of a large photo page-faults all its pages again (``prx_data.core.heap``). The
export's workers start with glibc's settings in their environment; the fault counts
are taken in child processes started the same way.
"""

from __future__ import annotations

import json
import os
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

_CHILD = """
import json, resource
import numpy as np
def faults():
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt
a = np.ones((3000, 5000, 3), np.uint8)  # a decoded 15 MP photo, 45 MB
del a
f0 = faults()
b = np.ones((3000, 5000, 3), np.uint8)  # the next image
print(json.dumps({"faults": faults() - f0}))
"""


def _second_image_faults(env: dict[str, str]) -> int:
    clean = {k: v for k, v in os.environ.items() if not k.startswith("MALLOC_")}
    out = subprocess.run(
        [sys.executable, "-c", _CHILD],
        capture_output=True,
        text=True,
        check=True,
        env={**clean, **env},
    )
    return json.loads(out.stdout)["faults"]


@pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="glibc's malloc settings")
def test_a_worker_started_with_the_setting_reuses_the_pages_the_last_image_freed():
    kept = _second_image_faults(heap.worker_env(True))
    default = _second_image_faults(heap.worker_env(False))
    # 45 MB is about 11,000 pages: glibc's default maps and faults them all again.
    assert kept < 200, kept
    if default > 2000:  # (not with transparent huge pages on every mapping)
        assert kept * 10 < default, (kept, default)


@pytest.fixture(scope="module")
def table(tmp_path_factory) -> str:
    uri = str(tmp_path_factory.mktemp("heap") / "t.lance")
    make_table(uri, [(f"h/{k}", badinputs.good_jpeg(seed=k), f"cap {k}") for k in range(2)])
    return uri


@pytest.mark.parametrize("release", [False, True])
def test_export_units_get_the_setting_unless_released(table, tmp_path, monkeypatch, release):
    """The units' Resources carry the workers' environment (Ray starts them with it); the
    driver's own process is never changed."""
    seen = []
    real = pipeline.map_units

    def spy(fn, units, where, resources, **kw):
        if kw.get("desc") == "write_mds":
            seen.append(dict(resources.env or {}))
        return real(fn, units, where, resources, **kw)

    monkeypatch.setattr(pipeline, "map_units", spy)
    cfg = ExportConfig(table=table, out=str(tmp_path / "out"), tiers=(512,), min_units=1)
    cfg = replace(cfg, keep_heap=not release)
    pipeline.run_export(cfg, RunOptions(engine="local", num_cpus=1, progress=False))
    assert seen and all((env.get("MALLOC_MMAP_MAX_") == "0") is not release for env in seen), seen
    assert "MALLOC_MMAP_MAX_" not in os.environ


def test_the_setting_is_not_part_of_what_a_resume_or_append_compares():
    a = ExportConfig(table="t", out="o")
    b = replace(a, keep_heap=False)
    assert a.fingerprint() == b.fingerprint()
    assert a.sample_settings() == b.sample_settings()
