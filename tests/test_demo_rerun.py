"""Rerunning the demo never destroys what the README's other jobs added to its table."""

from __future__ import annotations

import os

import lance
import pyarrow as pa

from prx_data.cli import demo
from prx_data.core import schema as S


def _table(path: str, extra: dict) -> None:
    n = 2
    cols = {f.name: pa.nulls(n, f.type) for f in S.TABLE_SCHEMA}
    cols[S.ID] = pa.array(["demo/a", "demo/b"])
    t = pa.table(cols, schema=S.TABLE_SCHEMA)
    for name, values in extra.items():
        t = t.append_column(name, pa.array(values, pa.string()))
    lance.write_dataset(t, path)


def test_the_demo_refuses_to_replace_a_table_with_columns_it_did_not_write(tmp_path, capsys):
    work = tmp_path / "demo_out"
    table = str(work / "table.lance")
    _table(table, {"source_file": ["a.jpg", "b.jpg"], "caption_vlm": ["a cat", "a dog"]})
    assert demo.main(["--workdir", str(work)]) == 2
    err = capsys.readouterr().err.strip()
    assert "caption_vlm" in err and "--force" in err and len(err.splitlines()) == 1
    # Nothing of the workdir was touched: no sample made, the table as it was.
    assert sorted(os.listdir(work)) == ["table.lance"]
    assert lance.dataset(table).to_table()["caption_vlm"].to_pylist() == ["a cat", "a dog"]


def test_a_table_the_demo_wrote_may_be_replaced(tmp_path):
    table = str(tmp_path / "table.lance")
    _table(table, {"source_file": ["a.jpg", "b.jpg"], "metadata": [None, None]})
    demo.check_table_is_the_demos(table)  # no refusal: only the demo's columns
    demo.check_table_is_the_demos(str(tmp_path / "none.lance"))
