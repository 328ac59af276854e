"""Work units sized to the cluster: small tables use every core, huge tables plan from metadata."""

from __future__ import annotations

import glob
import io
import json
import os
import time

import lance
import pyarrow as pa
import pytest
from lance.fragment import FragmentMetadata
from PIL import Image
from prx_data.pipelines.write_mds import UNITS_PER_CPU, run_export

from prx_data.core.runtime import RunOptions
from prx_data.export.naming import ExportError
from prx_data.export.prepare import plan_units, prepare_output
from prx_data.export.spec import ExportConfig, WorkUnit
from tests.tablekit import make_table


def _covers(units: list[WorkUnit], sizes: dict[int, int]) -> None:
    """Units are contiguous, non-empty row ranges that cover each fragment exactly once."""
    by_frag: dict[int, list[WorkUnit]] = {}
    for u in units:
        assert u.count > 0
        by_frag.setdefault(u.fragment_id, []).append(u)
    assert set(by_frag) == {f for f, n in sizes.items() if n}
    for f, us in by_frag.items():
        pos = 0
        for u in sorted(us, key=lambda u: u.start):
            assert u.start == pos
            pos += u.count
        assert pos == sizes[f]
    assert len({u.part for u in units}) == len(units)


def _tiny_jpeg(i: int) -> bytes:
    buf = io.BytesIO()
    Image.new("RGB", (8, 8), (i % 256, 0, 0)).save(buf, "JPEG")
    return buf.getvalue()


@pytest.fixture(scope="module")
def small_table(tmp_path_factory):
    """259 rows in fragments of 100, 100 and 59 (images too small to export: it is the plan that counts)."""
    uri = str(tmp_path_factory.mktemp("small") / "t.lance")
    make_table(uri, [(f"r/{i:04d}", _tiny_jpeg(i), "c") for i in range(259)], max_rows_per_file=100)
    return uri


def _sizes(uri: str) -> dict[int, int]:
    return {f.fragment_id: f.count_rows() for f in lance.dataset(uri).get_fragments()}


def test_small_table_gets_min_units(small_table):
    sizes = _sizes(small_table)
    old = plan_units(ExportConfig(table=small_table, out="-", rows_per_task=1000))
    assert len(old) == 3  # one per fragment: two cores would idle
    units = plan_units(ExportConfig(table=small_table, out="-", rows_per_task=1000, min_units=8))
    _covers(units, sizes)
    assert len(units) >= 8
    assert max(u.count for u in units) <= -(-259 // 8)
    # rows_per_task still caps a unit, and the plan is a pure function of table + settings
    capped = plan_units(ExportConfig(table=small_table, out="-", rows_per_task=10, min_units=8))
    _covers(capped, sizes)
    assert max(u.count for u in capped) <= 10 and len(capped) == 10 + 10 + 6
    again = plan_units(ExportConfig(table=small_table, out="-", rows_per_task=10, min_units=8))
    assert capped == again


def test_units_within_a_fragment_are_even(small_table):
    units = plan_units(ExportConfig(table=small_table, out="-", rows_per_task=40))
    for f, n in _sizes(small_table).items():
        counts = [u.count for u in units if u.fragment_id == f]
        assert sum(counts) == n and max(counts) - min(counts) <= 1 and max(counts) <= 40


def test_huge_table_plans_from_metadata_alone(tmp_path):
    """10^8 rows in 100 fragments, with every data file deleted: planning reads the manifest only."""
    uri = str(tmp_path / "huge.lance")
    tbl = pa.table(
        {"id": [f"r{i}" for i in range(10)], "image": pa.array([b"x"] * 10, pa.large_binary())}
    )
    ds = lance.write_dataset(tbl, uri)
    proto = ds.get_fragments()[0].metadata.to_json()
    frags = []
    for i in range(100):
        # Every fragment claims 10^6 rows of the same 10-row file: any read of data would fail.
        frags.append(
            FragmentMetadata.from_json(json.dumps({**proto, "id": i, "physical_rows": 10**6}))
        )
    ds = lance.LanceDataset.commit(
        uri, lance.LanceOperation.Overwrite(ds.schema, frags), read_version=ds.version
    )
    assert ds.count_rows() == 10**8
    for name in os.listdir(os.path.join(uri, "data")):
        os.remove(os.path.join(uri, "data", name))
    t0 = time.perf_counter()
    units = plan_units(ExportConfig(table=uri, out="-", rows_per_task=1000, min_units=64))
    seconds = time.perf_counter() - t0
    assert len(units) == 10**5 and sum(u.count for u in units) == 10**8
    _covers(units, {f.fragment_id: 10**6 for f in ds.get_fragments()})
    assert seconds < 30, seconds  # ~1.5 s on a busy 2-core machine


@pytest.mark.ray
def test_export_uses_every_cpu_and_resume_keeps_the_plan(small_table, tmp_path, ray_local):
    """At the default --rows-per-task a 259-row table still makes UNITS_PER_CPU units per CPU;
    the count is recorded, so a resume on another cluster size plans the same units."""
    cpus = int(ray_local.cluster_resources()["CPU"])
    out = str(tmp_path / "out")
    report = run_export(ExportConfig(table=small_table, out=out), RunOptions(progress=False))
    assert report.rows_read == 259
    assert report.units >= UNITS_PER_CPU * cpus
    with open(os.path.join(out, "_progress", "config")) as f:
        assert json.load(f)["min_units"] == UNITS_PER_CPU * cpus
    # resuming without --min-units takes the recorded count, not this cluster's
    resumed = prepare_output(ExportConfig(table=small_table, out=out), resume=True).cfg
    assert resumed.min_units == UNITS_PER_CPU * cpus
    # an explicit, different count is a different export: refused
    with pytest.raises(ExportError, match="min_units"):
        prepare_output(ExportConfig(table=small_table, out=out, min_units=3), resume=True)


def test_bad_codec_settings_fail_before_any_work(small_table, tmp_path):
    out = tmp_path / "o"
    cfg = ExportConfig(table=small_table, out=str(out), codec="vips", resample="box")
    with pytest.raises(ExportError, match="Lanczos3 only"):
        run_export(cfg, RunOptions(progress=False))
    assert not out.exists()
    cfg = ExportConfig(table=small_table, out=str(out), draft_margin=0.5)
    with pytest.raises(ExportError, match="below 1.0"):
        run_export(cfg, RunOptions(progress=False))
    assert not out.exists()


@pytest.mark.ray
def test_unit_dataset_is_one_task_per_unit_without_reservation(ray_local):
    """A one-operator graph over work units does not reserve half the cluster (which
    starts the second core a resource poll late); other datasets keep Ray's default."""
    from ray.data import DataContext

    from prx_data.core.runtime import unit_dataset

    ds = unit_dataset([{"i": i} for i in range(3)])
    assert ds.context.op_resource_reservation_enabled is False
    assert DataContext.get_current().op_resource_reservation_enabled is True
    multi = unit_dataset([{"i": 0}], single_operator=False)
    assert multi.context.op_resource_reservation_enabled is True
    assert ds.materialize().num_blocks() == 3
    assert sorted(r["i"] for r in ds.iter_rows()) == [0, 1, 2]


def test_draft_margin_reaches_the_export_and_its_resume_check(tmp_path):
    """--draft-margin changes the exported pixels, and a resume with another margin is a
    different export (refused), like any other setting that changes the bytes."""
    from prx_data.core.sample_data import photo_like
    from prx_data.export.merge import finalize
    from prx_data.export.unit import export_unit

    buf = io.BytesIO()
    photo_like(1600, 1200, 7)[0].save(buf, "JPEG", quality=95)  # 2x draft at 1.0, none at 1.5
    table = str(tmp_path / "t.lance")
    make_table(table, [("big", buf.getvalue(), "a big photo")])
    images = {}
    for margin in (1.0, 1.5):
        cfg = ExportConfig(
            table=table, out=str(tmp_path / f"m{margin}"), tiers=(512,), draft_margin=margin
        )
        cfg = prepare_output(cfg).cfg
        results = {u.part: export_unit(cfg, u) for u in plan_units(cfg)}
        assert finalize(cfg, results, 0.0).samples_written == 1
        (shard,) = glob.glob(os.path.join(cfg.out, "512", "*", "*", "shard.*.mds"))
        images[margin] = open(shard, "rb").read()
    assert images[1.0] != images[1.5]
    started = str(tmp_path / "started")
    prepare_output(ExportConfig(table=table, out=started, tiers=(512,), draft_margin=1.0))
    with pytest.raises(ExportError, match="draft_margin"):
        prepare_output(ExportConfig(table=table, out=started, tiers=(512,)), resume=True)
