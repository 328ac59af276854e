"""Opt-out skip lists: every bucket and tier, from ids, a query or source keys; idempotent."""

from __future__ import annotations

import json
import os

import pytest

from prx_data.cli import optout as OC
from prx_data.export import layout
from prx_data.skips import optout as O
from prx_data.skips import sidecar as SL
from tests.exportkit import make_export
from tests.tablekit import make_table

BUCKETS = {"512/1.000": 20, "512/0.500": 6, "1024/1.000": 12}


@pytest.fixture()
def export(tmp_path):
    # Ids are "src/<bucket>/<i>": source "src", key "<bucket>/<i>".
    return make_export(
        str(tmp_path / "out"), BUCKETS, name="src", samples_per_part=8, samples_per_shard=3
    )


def skipped_ids(exp, name: str) -> set[str]:
    out = set()
    for bucket in layout.list_buckets(exp.root):
        lists = SL.load_skips(exp.root, bucket, layout.read_index(exp.root, bucket), [name])
        for sid, (b, shard, idx) in exp.where.items():
            if b == bucket and shard in lists and idx in set(lists[shard].tolist()):
                out.add(sid)
    return out


def sidecars(root: str) -> dict[str, bytes]:
    return {
        rel: open(os.path.join(root, rel), "rb").read()
        for rel in SL.storage.list_files(root, ".skip")
    }


def test_ids_file_covers_every_tier_and_rerun_changes_nothing(export, tmp_path, capsys):
    chosen = [
        "src/512/1.000/0",
        "src/512/1.000/19",
        "src/512/0.500/4",
        "src/1024/1.000/7",
        "src/1024/1.000/8",
    ]
    f = tmp_path / "ids.txt"
    f.write_text("# opt-outs, November\n" + "\n".join(chosen) + "\n\nsrc/missing/1\n")
    args = [
        "--export",
        export.root,
        "--name",
        "optout-2026-11",
        "--ids",
        str(f),
        "--report",
        str(tmp_path / "r.json"),
    ]
    assert OC.main(args) == 0
    assert skipped_ids(export, "optout-2026-11") == set(chosen)
    rep = json.loads((tmp_path / "r.json").read_text())
    assert (
        rep["samples_in_list"] == 5 and rep["ids_not_in_export"] == 1 and rep["ids_requested"] == 6
    )
    assert rep["tiers"] == {"512": 3, "1024": 2}
    assert rep["buckets"] == {"512/0.500": 1, "512/1.000": 2, "1024/1.000": 2}
    # 5 of 38 samples (13 %) are skipped: past 10 % the report suggests a rewrite.
    assert rep["skipped_share_all_lists"] == pytest.approx(5 / 38)
    assert f"python -m prx_data.skips rewrite {export.root}" in capsys.readouterr().out
    first = sidecars(export.root)
    assert len(first) >= 4  # several shards in three buckets
    assert OC.main(args) == 0
    assert sidecars(export.root) == first  # byte-identical
    # A later request under the same name extends the list.
    f2 = tmp_path / "more.txt"
    f2.write_text("src/512/1.000/1\n")
    OC.main(["--export", export.root, "--name", "optout-2026-11", "--ids", str(f2)])
    assert skipped_ids(export, "optout-2026-11") == set(chosen) | {"src/512/1.000/1"}


def test_query_and_source_ids(export, tmp_path):
    from tests.dedup_images import jpeg, make_image

    # Each row its own image: rows sharing bytes would leave together (content keys).
    items = [
        (sid, jpeg(make_image(k, 64, 64)), "remove me" if sid.endswith("/3") else "keep")
        for k, sid in enumerate(sorted(export.all_ids()))
    ]
    table = str(tmp_path / "t.lance")
    make_table(table, items)  # tablekit puts every row under source "test"
    assert (
        OC.main(
            [
                "--export",
                export.root,
                "--name",
                "by-query",
                "--table",
                table,
                "--where",
                "caption = 'remove me'",
            ]
        )
        == 0
    )
    assert skipped_ids(export, "by-query") == {
        "src/512/1.000/3",
        "src/512/0.500/3",
        "src/1024/1.000/3",
    }

    keys = tmp_path / "keys.txt"
    keys.write_text("512/1.000/5\n1024/1.000/11\n")
    assert (
        OC.main(
            [
                "--export",
                export.root,
                "--name",
                "by-key",
                "--source-ids",
                str(keys),
                "--source",
                "src",
            ]
        )
        == 0
    )
    assert skipped_ids(export, "by-key") == {"src/512/1.000/5", "src/1024/1.000/11"}
    # Through the table: its rows have source "test", so these keys name no row there.
    assert O.ids_from_source_ids(["512/1.000/5"], table=table) == []
    assert O.ids_from_source_ids(["1.000/5"], source="src/512") == ["src/512/1.000/5"]


def test_source_ids_through_table_sources(tmp_path):
    from tests.dedup_images import jpeg, make_image

    img = jpeg(make_image(1, 64, 64))
    table = str(tmp_path / "t.lance")
    make_table(table, [("test/a/1", img, None), ("test/b", img, None)])
    assert O.ids_from_source_ids(["a/1", "b", "zzz"], table=table) == ["test/a/1", "test/b"]


def test_errors_are_clear(export, tmp_path, capsys):
    f = tmp_path / "ids.txt"
    f.write_text("src/512/1.000/0\n")
    assert OC.main(["--export", export.root, "--name", "Bad Name", "--ids", str(f)]) == 2
    assert capsys.readouterr().err.startswith("error: invalid skip-list name 'Bad Name'")
    with pytest.raises(SystemExit):
        OC.main(["--export", export.root, "--name", "x", "--where", "id = 'a'"])
    assert "--where needs --table" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        OC.main(["--export", export.root, "--name", "x", "--source-ids", str(f)])
    with pytest.raises(SystemExit):
        OC.main(["--help"])
    help_text = capsys.readouterr().out
    for opt in (
        "--export",
        "--name",
        "--ids",
        "--where",
        "--source-ids",
        "--table",
        "--source",
        "--report",
    ):
        assert opt in help_text
