"""Opt-out reports every requested key that matched nothing, in the report and in a file."""

from __future__ import annotations

import json

from prx_data.cli import optout as OC
from tests.exportkit import make_export
from tests.tablekit import make_table

B = "512/1.000"


def test_source_ids_missing_from_the_table_are_counted_and_listed(tmp_path, capsys):
    """3 keys requested: 2 have rows (one exported), 1 has no row: 2 matched nothing."""
    from tests.dedup_images import jpeg, make_image

    export = make_export(str(tmp_path / "out"), {B: 4}, name="test", samples_per_part=4)
    img = jpeg(make_image(0, 64, 64))
    table = str(tmp_path / "t.lance")
    # tablekit puts every row under source "test"; "test/512/1.000/9" is in the table only.
    make_table(table, [(f"test/{B}/1", img, None), (f"test/{B}/9", img, None)])
    keys = tmp_path / "keys.txt"
    keys.write_text(f"{B}/1\n{B}/9\nnot-a-key\n")
    report = tmp_path / "r.json"
    args = ["--export", export.root, "--name", "optout", "--source-ids", str(keys)]
    assert OC.main(args + ["--table", table, "--report", str(report)]) == 0
    out = capsys.readouterr().out
    assert "3 ids requested, 2 not in this export" in out
    rep = json.loads(report.read_text())
    assert rep["ids_requested"] == 3 and rep["ids_not_in_export"] == 2
    assert rep["samples_in_list"] == 1
    assert rep["not_matched"] == [f"{B}/9", "not-a-key"]
    listed = tmp_path / "r.unmatched.txt"
    assert rep["not_matched_file"] == str(listed)
    assert listed.read_text().splitlines() == [f"{B}/9", "not-a-key"]
    assert str(listed) in out


def test_row_ids_not_in_the_export_go_to_the_named_file(tmp_path, capsys):
    export = make_export(str(tmp_path / "out"), {B: 4}, name="src", samples_per_part=4)
    ids = tmp_path / "ids.txt"
    ids.write_text(f"src/{B}/0\nsrc/gone/1\nsrc/gone/2\n")
    unmatched = tmp_path / "left.txt"
    args = ["--export", export.root, "--name", "optout", "--ids", str(ids)]
    assert OC.main(args + ["--unmatched", str(unmatched)]) == 0
    assert "matched nothing: src/gone/1, src/gone/2" in capsys.readouterr().out
    assert unmatched.read_text().splitlines() == ["src/gone/1", "src/gone/2"]
