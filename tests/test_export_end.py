"""The export's end in one visible order, and the table opened once by the driver.

``ExportSink.on_write_complete`` runs pack -> merge -> id index -> skip lists ->
report, and ``report.json`` is the last file it writes: a run stopped between
two steps leaves a tree that does not look complete, and ``--resume`` finishes it.
"""

from __future__ import annotations

import os
import threading

import lance
import pytest

from prx_data.core import storage
from prx_data.core.runtime import RunOptions
from prx_data.export.layout import REPORT_NAME, is_complete
from prx_data.export.spec import ExportConfig
from prx_data.pipelines import write_mds as pipeline
from prx_data.skips import materialise as materialise_mod
from tests import badinputs
from tests.tablekit import make_table

HERE = RunOptions(engine="local", num_cpus=2, progress=False)


@pytest.fixture(scope="module")
def table(tmp_path_factory) -> str:
    uri = str(tmp_path_factory.mktemp("end") / "t.lance")
    make_table(uri, [(f"e/{k}", badinputs.good_jpeg(seed=k), f"cap {k}") for k in range(6)])
    return uri


def _cfg(table: str, out: str) -> ExportConfig:
    return ExportConfig(table=table, out=out, tiers=(512,), rows_per_task=2, min_units=1)


def test_the_driver_opens_the_table_once(table, tmp_path, monkeypatch):
    pipeline.run_export(_cfg(table, str(tmp_path / "first")), HERE)  # the ledger exists now
    opens = []
    real = lance.dataset

    def counting(uri, *a, **k):
        if threading.current_thread() is threading.main_thread() and str(uri) == table:
            opens.append(k.get("version"))
        return real(uri, *a, **k)

    monkeypatch.setattr(lance, "dataset", counting)
    report = pipeline.run_export(_cfg(table, str(tmp_path / "out")), HERE)
    assert report.samples_written == 6
    assert len(opens) == 1, opens  # placement, preparation, plan and release share it


def test_the_end_runs_in_order_with_the_report_last(table, tmp_path, monkeypatch):
    events: list[str] = []

    def spy(name, fn):
        def wrapped(*a, **k):
            events.append(name)
            return fn(*a, **k)

        return wrapped

    monkeypatch.setattr(pipeline, "merge", spy("merge", pipeline.merge))
    monkeypatch.setattr(pipeline, "write_id_index", spy("id index", pipeline.write_id_index))
    monkeypatch.setattr(materialise_mod, "materialise", spy("lists", materialise_mod.materialise))
    monkeypatch.setattr(pipeline, "write_report", spy("report", pipeline.write_report))
    written: list[str] = []
    write = storage.write_bytes_atomic

    def recording(path, data):
        written.append(os.path.basename(path))
        write(path, data)

    monkeypatch.setattr(storage, "write_bytes_atomic", recording)
    out = str(tmp_path / "out")
    pipeline.run_export(_cfg(table, out), HERE)
    assert events == ["merge", "id index", "lists", "report"]
    assert written[-1] == REPORT_NAME and written.count(REPORT_NAME) == 1


def test_a_run_stopped_between_the_steps_looks_unfinished_and_resumes(table, tmp_path, monkeypatch):
    out = str(tmp_path / "out")

    def killed(*a, **k):
        raise KeyboardInterrupt  # the run stops after the id index, before the lists

    with monkeypatch.context() as m:
        m.setattr(materialise_mod, "materialise", killed)
        with pytest.raises(KeyboardInterrupt):
            pipeline.run_export(_cfg(table, out), HERE)
    assert os.path.exists(os.path.join(out, "_ids.lance")) and not is_complete(out)
    report = pipeline.run_export(_cfg(table, out), HERE, resume=True)
    assert is_complete(out) and report.samples_written == 6
