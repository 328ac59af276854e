"""The real exporter's output streams: Lance table -> export units -> skip list by query -> loader.

Runs the exporter's per-unit function in this process (no Ray), so it
checks the data contract between ``prx_data.export.unit`` and ``prx_data.stream.dataset``.
"""

from __future__ import annotations

import logging

import lance
import pyarrow as pa

from prx_data.core.sample_data import make_sample_collection
from prx_data.export.merge import finalize
from prx_data.export.prepare import plan_units, prepare_output
from prx_data.export.spec import ExportConfig
from prx_data.export.unit import export_unit
from prx_data.skips.log import Provenance
from prx_data.skips.ops import update_list
from prx_data.stream.dataset import DatasetSpec
from prx_data.table.lance_ops import query_ids
from tests.exportkit import run_rank
from tests.tablekit import folder_items, make_table

logging.getLogger("streaming").setLevel(logging.ERROR)


def test_exporter_output_streams_with_a_query_skip_list(tmp_path):
    sizes = ((768, 768), (800, 800), (1024, 768), (700, 700), (768, 1024), (900, 900))
    items = make_sample_collection(str(tmp_path / "src"), sizes=sizes, repeats=2)
    table = str(tmp_path / "t.lance")
    make_table(table, folder_items(items), max_rows_per_file=4)
    cfg = prepare_output(
        ExportConfig(table=table, out=str(tmp_path / "out"), tiers=(512,), rows_per_task=4)
    ).cfg
    results = {}
    for unit in plan_units(cfg):
        r = export_unit(cfg, unit)
        results[r.part] = r
    report = finalize(cfg, results, 0.0)
    assert report.samples_written == len(items)

    # Skip every row whose id sorts first in its pair, chosen by a Lance filter.
    ids = sorted(lance.dataset(table).to_table(columns=["id"])["id"].to_pylist())
    chosen = ids[::2]
    flags = lance.dataset(table).to_table(columns=["id"])
    flagged = pa.table(
        {"id": flags["id"], "flag": [i in set(chosen) for i in flags["id"].to_pylist()]}
    )
    flag_uri = str(tmp_path / "flags.lance")
    lance.write_dataset(flagged, flag_uri)
    # ``skips add --table --where`` (the export's own table's registry).
    added = update_list(
        cfg.out, "flagged", query_ids(flag_uri, "flag = true"), Provenance("test"), table=table
    )
    assert added.samples_listed == len(chosen) and added.ids_not_in_export == 0

    run = run_rank(
        DatasetSpec(cfg.out), rank=0, world_size=1, batch_size=1, tier=512, shuffle=False
    )
    seen = [i for b in run.batches for i in b]
    assert sorted(seen) == sorted(set(ids) - set(chosen))
    assert all(len(s) == 1 for s in run.shapes)
