"""The corpus ledger: an opt-out follows the image, whatever happens to the table files.

Each test is one way the corpus changes shape (a table rebuilt beside the old one, a
byte-identical copy, a dedup group, a lost or copied ledger, a received export, a paused
writer) and checks what a fresh export writes and what the loader streams.
"""

from __future__ import annotations

import io
import json
import os
import shutil

import lance
import numpy as np
import pyarrow as pa
import pytest
from prx_data.pipelines.write_mds import run_export

from prx_data.cli import optout as OC
from prx_data.cli import skips as SC
from prx_data.core.errors import Conflict
from prx_data.core.runtime import RunOptions
from prx_data.export import layout
from prx_data.export.spec import ExportConfig
from prx_data.skips import ledger as LG
from prx_data.skips import place as PL
from prx_data.skips.errors import ListError
from prx_data.skips.log import Provenance, conform_entries, log_rows
from prx_data.stream.dataset import DatasetSpec
from prx_data.table.lance_ops import append_at_version
from tests.exportkit import run_rank
from tests.tablekit import make_table


def _jpeg(i: int, size: int = 600) -> bytes:
    """A photo-like image of its own (its own bytes and pHash), 512-tier."""
    from PIL import Image

    rng = np.random.default_rng(7000 + i)
    small = Image.fromarray(rng.integers(0, 256, (8, 8, 3), dtype=np.uint8))
    buf = io.BytesIO()
    small.resize((size, size), Image.Resampling.BICUBIC).save(buf, "JPEG", quality=90)
    return buf.getvalue()


IMAGES = {f"test/img{i}": _jpeg(i) for i in range(6)}


def _table(path, extra: dict[str, bytes] | None = None) -> str:
    items = [(k, v, f"caption {k}") for k, v in {**IMAGES, **(extra or {})}.items()]
    make_table(str(path), items)
    return str(path)


def _export(table: str, out, *, ledger: str | None = None, overwrite: bool = False):
    cfg = ExportConfig(table=table, out=str(out), tiers=(512,), ledger=ledger)
    return run_export(cfg, RunOptions(progress=False), overwrite=overwrite)


def written_ids(root: str) -> set[str]:
    """Every id whose bytes are in the export's shards (skipped or not)."""
    return set(layout.read_manifests(root)["id"].to_pylist())


def streamed_ids(root: str) -> set[str]:
    run = run_rank([DatasetSpec(root)], rank=0, world_size=1, batch_size=1, tier=512)
    return {i for batch in run.batches for i in batch}


def _optout(export: str, ids: list[str], tmp_path, *extra: str) -> int:
    f = tmp_path / "ids.txt"
    f.write_text("\n".join(ids) + "\n")
    args = ["--export", export, "--name", "optout-1", "--ids", str(f), *extra]
    return OC.main(args + ["--report", str(tmp_path / "r.json")])


@pytest.fixture()
def corpus(tmp_path):
    data = tmp_path / "data"
    data.mkdir()
    table = _table(data / "photos.lance")
    out = str(tmp_path / "exp1")
    _export(table, out)
    return table, out


def test_a_rebuilt_table_beside_the_old_one_keeps_the_opt_out(corpus, tmp_path):
    table, out = corpus
    assert _optout(out, ["test/img1"], tmp_path) == 0
    assert "test/img1" not in streamed_ids(out)
    # The same source ingested again into a new table in the same folder.
    rebuilt = _table(tmp_path / "data" / "photos-v2.lance")
    report = _export(rebuilt, tmp_path / "exp2")
    assert report.dropped.get("opted_out") == 1
    assert "test/img1" not in written_ids(str(tmp_path / "exp2"))
    assert streamed_ids(str(tmp_path / "exp2")) == set(IMAGES) - {"test/img1"}


def test_a_byte_identical_copy_leaves_with_the_original(tmp_path):
    data = tmp_path / "data"
    data.mkdir()
    table = _table(data / "t.lance", extra={"other/copy-of-2": IMAGES["test/img2"]})
    out = str(tmp_path / "exp")
    _export(table, out)
    assert _optout(out, ["test/img2"], tmp_path) == 0
    assert streamed_ids(out) == set(IMAGES) - {"test/img2"}
    rep = json.loads((tmp_path / "r.json").read_text())
    assert rep["by_rule"]["sha256"] == 1
    # A copy ingested later, under yet another name, is never written.
    later = _table(data / "t2.lance", extra={"late/copy": IMAGES["test/img2"]})
    report = _export(later, tmp_path / "exp2")
    assert report.dropped.get("opted_out") == 2  # the original id and the late copy
    assert not {"test/img2", "late/copy"} & written_ids(str(tmp_path / "exp2"))


def test_a_dedup_group_leaves_with_its_opted_out_member(tmp_path):
    data = tmp_path / "data"
    data.mkdir()
    table = _table(data / "t.lance")
    ds = lance.dataset(table)
    dup = {"test/img4": "test/img3", "test/img5": "test/img3"}  # img3 keeps, 4 and 5 are copies
    ids = ds.to_table(columns=["id"])["id"].to_pylist()
    ds.add_columns(pa.table({"dup_of": pa.array([dup.get(i) for i in ids], pa.string())}))
    out = str(tmp_path / "exp")
    _export(table, out)
    # Opting out a duplicate takes its keeper and the group's other member too.
    assert _optout(out, ["test/img4"], tmp_path) == 0
    assert streamed_ids(out) == set(IMAGES) - {"test/img3", "test/img4", "test/img5"}


def test_a_lost_ledger_is_an_error_naming_it_never_an_empty_list(corpus, tmp_path, capsys):
    table, out = corpus
    assert _optout(out, ["test/img1"], tmp_path) == 0
    ledger = PL.default_ledger_uri(table)
    shutil.rmtree(ledger)
    capsys.readouterr()
    assert SC.main(["sync", out]) != 0
    err = capsys.readouterr().err
    assert ledger in err and len(err.strip().splitlines()) == 1
    assert "test/img1" not in streamed_ids(out)  # nothing was undone


def test_a_copied_ledger_is_refused_until_one_is_chosen(corpus, tmp_path, capsys):
    table, out = corpus
    assert _optout(out, ["test/img1"], tmp_path) == 0
    shutil.copytree(tmp_path / "data", tmp_path / "copy")
    copy_table = str(tmp_path / "copy" / "photos.lance")
    with pytest.raises(ListError, match="two ledgers claim"):
        LG.Ledger.for_table(copy_table).head()
    # The original still works, and the copy works once it has its own identity.
    assert LG.Ledger.for_table(table).head() > 0
    LG.Ledger(str(tmp_path / "copy" / PL.LEDGER_NAME)).fork()
    assert LG.Ledger.for_table(copy_table).optout_keys()  # the opt-outs came along
    # An export bound to the original refuses the forked copy.
    capsys.readouterr()
    assert SC.main(["sync", out, "--ledger", str(tmp_path / "copy" / PL.LEDGER_NAME)]) != 0
    assert "ledger" in capsys.readouterr().err


def test_overwrite_from_a_copied_table_keeps_the_opt_outs(corpus, tmp_path):
    table, out = corpus
    assert _optout(out, ["test/img1"], tmp_path) == 0
    other = tmp_path / "moved"
    other.mkdir()
    moved = str(other / "photos.lance")
    shutil.copytree(table, moved)  # the table alone, as "pass --table" advice leads to
    with pytest.raises(Exception, match="ledger"):
        _export(moved, out, overwrite=True)
    assert "test/img1" not in streamed_ids(out)
    _export(moved, out, overwrite=True, ledger=PL.default_ledger_uri(table))
    assert "test/img1" not in written_ids(out)
    assert streamed_ids(out) == set(IMAGES) - {"test/img1"}


def test_an_old_registry_is_adopted_once_and_loses_nothing(tmp_path):
    data = tmp_path / "data"
    data.mkdir()
    table = _table(data / "t.lance")
    reg = PL.registry_uri(table)
    rows = conform_entries(
        log_rows(
            "optout-old",
            pa.array(["test/img0", "test/img5"]),
            "add",
            Provenance("optout"),
            seq=1,
            base=1,
            kind=0,
            export="",
        )
    )
    keep = ["seq", "base", "kind", "list", "id", "op", "at", "command", "reason", "export", "host"]
    lance.write_dataset(
        rows.select(keep).replace_schema_metadata({"prx.table_id": "x", "prx.log_id": "old1"}), reg
    )
    led = LG.Ledger.for_table(table)
    assert set(led.state()["optout-old"]["id"].to_pylist()) == {"test/img0", "test/img5"}
    head = led.head()
    assert LG.Ledger.for_table(table).head() == head  # adopted once
    report = _export(table, tmp_path / "exp")
    assert report.dropped.get("opted_out") == 2


def test_a_paused_ledger_writer_cannot_commit_after_another_did(tmp_path):
    data = tmp_path / "data"
    data.mkdir()
    table = _table(data / "t.lance")
    led = LG.Ledger.for_table(table)
    led.append(
        lambda seq: log_rows(
            "a", pa.array(["x/1"]), "add", Provenance("t"), seq=seq, base=seq, kind=0, export=""
        )
    )
    v = led.head()
    # Another writer commits while this one is paused between its read and its commit.
    intruder = conform_entries(
        log_rows(
            "a", pa.array(["x/2"]), "add", Provenance("t"), seq=v + 1, base=v + 1, kind=0, export=""
        )
    )
    append_at_version(led.uri, intruder, v)
    stale = conform_entries(
        log_rows(
            "a", pa.array(["x/3"]), "add", Provenance("t"), seq=v + 1, base=v + 1, kind=0, export=""
        )
    )
    with pytest.raises(Conflict):
        append_at_version(led.uri, stale, v)
    got = led.entries(["a"])["id"].to_pylist()
    assert sorted(got) == ["x/1", "x/2"]


def test_opt_out_on_a_path_with_no_export_creates_nothing(corpus, tmp_path, capsys):
    _, out = corpus
    typo = out + "-typo"
    capsys.readouterr()
    assert _optout(typo, ["test/img1"], tmp_path) != 0
    assert not os.path.exists(typo)
    assert len(capsys.readouterr().err.strip().splitlines()) == 1


def test_an_opt_out_that_matches_nothing_fails_unless_allowed(corpus, tmp_path, capsys):
    _, out = corpus
    assert _optout(out, ["test/nope"], tmp_path) != 0
    assert _optout(out, ["test/nope"], tmp_path, "--allow-unmatched") == 0


def test_opted_out_bytes_still_in_the_shards_are_counted_and_purged(corpus, tmp_path, capsys):
    from prx_data.cli import verify as VC

    _, out = corpus
    assert _optout(out, ["test/img1"], tmp_path) == 0
    capsys.readouterr()
    assert SC.main(["stats", out]) == 0
    assert "still in the shards (hidden by sidecars): 1 (optout-1: 1)" in capsys.readouterr().out
    assert VC.main([out]) == 0
    assert "1 opted-out samples still in the shards" in capsys.readouterr().err
    new = str(tmp_path / "purged")
    assert SC.main(["rewrite", out, new, "--purge-optouts"]) == 0  # 1 of 6: under 10 %
    assert "bytes fewer" in capsys.readouterr().out
    assert written_ids(new) == set(IMAGES) - {"test/img1"}
    assert SC.main(["stats", new]) == 0
    assert "still in the shards (hidden by sidecars): 0" in capsys.readouterr().out


def test_dedup_after_an_opt_out_takes_the_opted_out_rows_group_with_it(tmp_path):
    """A re-encoded copy (other bytes, same picture) made before dedup ever ran: dedup groups
    it with the opted-out original, and the copy leaves too instead of streaming in its place."""
    from PIL import Image

    from prx_data.cli import dedup as DC

    data = tmp_path / "data"
    data.mkdir()
    buf = io.BytesIO()
    Image.open(io.BytesIO(IMAGES["test/img2"])).save(buf, "JPEG", quality=70)
    table = _table(data / "t.lance", extra={"other/reencoded": buf.getvalue()})
    out = str(tmp_path / "exp")
    _export(table, out)
    assert _optout(out, ["test/img2"], tmp_path) == 0
    assert "other/reencoded" in streamed_ids(out)  # no group known yet: only the id went
    assert DC.main(["--table", table, "--export", out, "--engine", "local"]) == 0
    assert not {"test/img2", "other/reencoded"} & streamed_ids(out)
    report = _export(table, tmp_path / "exp2")
    assert report.dropped.get("opted_out") == 2


def test_a_received_export_cannot_write_its_lists_into_our_ledger(corpus, tmp_path):
    """A tree that records our ledger's identity and carries a crafted export-only log: a
    rewrite without --table/--ledger keeps those entries the new tree's own."""
    table, out = corpus
    received = str(tmp_path / "received")
    shutil.copytree(out, received)
    f = tmp_path / "all.txt"
    f.write_text("\n".join(IMAGES) + "\n")
    assert SC.main(["add", received, "evil", "--ids", str(f), "--export-only"]) == 0
    led = LG.Ledger.for_table(table)
    before = led.head()
    assert SC.main(["rewrite", received, str(tmp_path / "new"), "--force"]) == 0
    assert led.head() == before and "evil" not in led.state()
    # With the user's --table, the same entries are carried, as the user asked.
    assert SC.main(["rewrite", received, str(tmp_path / "new2"), "--force", "--table", table]) == 0
    assert set(led.state()["evil"]["id"].to_pylist()) == set(IMAGES)


def test_an_export_only_change_made_out_of_reach_of_the_ledger_survives_the_next_sync(
    corpus, tmp_path
):
    table, out = corpus
    ledger = PL.default_ledger_uri(table)
    f = tmp_path / "one.txt"
    f.write_text("test/img3\n")
    assert SC.main(["add", out, "nsfw", "--ids", str(f)]) == 0
    other = str(tmp_path / "other")
    _export(table, other)
    # A remove through another export: the ledger's last word, which `out` has not seen.
    assert SC.main(["remove", other, "nsfw", "--ids", str(f)]) == 0
    shutil.move(ledger, ledger + ".away")  # the export cannot see its ledger now
    assert SC.main(["add", out, "nsfw", "--ids", str(f), "--export-only"]) == 0
    shutil.move(ledger + ".away", ledger)
    assert SC.main(["sync", out]) == 0
    assert "test/img3" not in streamed_ids(out)  # the later, export-only add stands


def test_an_export_bound_to_a_ledger_that_held_nothing_yet_keeps_following_it(corpus, tmp_path):
    table, out = corpus
    other = tmp_path / "moved"
    other.mkdir()
    moved = str(other / "photos.lance")
    shutil.copytree(table, moved)
    ledger = PL.default_ledger_uri(table)
    assert not os.path.exists(ledger)  # no opt-out yet: the ledger is made by the first
    moved_out = str(tmp_path / "exp-moved")
    _export(moved, moved_out, ledger=ledger)
    assert _optout(out, ["test/img1"], tmp_path) == 0
    assert SC.main(["sync", moved_out]) == 0
    # It follows the ledger it was exported with, not a new one beside the moved table.
    assert streamed_ids(moved_out) == set(IMAGES) - {"test/img1"}


def test_a_table_from_before_sha256_is_backfilled_and_its_copies_leave(tmp_path, capsys):
    """A table ingested before ``sha256`` was recorded: ``optout`` says its byte-identical
    copies were not looked for, and finds them once ``python -m prx_data.table sha256``
    has filled the column (only the new column is written; no image is rewritten)."""
    from prx_data.cli import table as TC

    data = tmp_path / "data"
    data.mkdir()
    table = _table(data / "old.lance", extra={"other/copy-of-2": IMAGES["test/img2"]})
    lance.dataset(table).drop_columns(["sha256"])
    out = str(tmp_path / "exp")
    _export(table, out)
    assert _optout(out, ["test/img2"], tmp_path) == 0
    assert f"{table} has no sha256 column" in capsys.readouterr().out
    assert "other/copy-of-2" in streamed_ids(out)
    image_files = {f.path for f in lance.dataset(table).get_fragments()[0].data_files()}
    assert TC.main(["sha256", table]) == 0
    assert "7 of 7 pending rows hashed" in capsys.readouterr().out
    ds = lance.dataset(table)
    got = dict(zip(*ds.to_table(columns=["id", "sha256"]).to_pydict().values(), strict=True))
    assert got["other/copy-of-2"] == got["test/img2"] is not None
    assert image_files <= {f.path for f in ds.get_fragments()[0].data_files()}  # images kept
    f = tmp_path / "again.txt"
    f.write_text("test/img2\n")
    assert OC.main(["--export", out, "--name", "optout-2", "--ids", str(f)]) == 0
    assert "has no sha256 column" not in capsys.readouterr().out
    assert streamed_ids(out) == set(IMAGES) - {"test/img2"}
    assert TC.main(["sha256", table]) == 0  # a second run has nothing to do
    assert "nothing to do" in capsys.readouterr().out
