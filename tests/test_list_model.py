"""The skip-list model: one commit-ordered log per table, every export a materialisation of it.

One regression test per confirmed scenario of the list redesign, and a
stateful model-based test (``hypothesis``) whose model is the set of ids each
list must hold for each export; after every step the ids each export skips
(its sidecars through its manifests, the loader's view) and holds (its
``_lists/`` store) must equal the model. The exports are sample trees
(:func:`tests.exportkit.make_export`) bound to one small Lance table.
"""

from __future__ import annotations

import datetime as dt
import json
import os
import shutil
import threading

import pyarrow as pa
import pytest

from prx_data.cli import skips as skips_cli
from prx_data.cli import verify as verify_cli
from prx_data.core.lease import LeaseUnsupported
from prx_data.export import layout, naming
from prx_data.export.lock import ExportLock
from prx_data.skips import materialise as MAT  # the room whose steps some tests replace
from prx_data.skips import sidecar as SL
from prx_data.skips.bind import bind
from prx_data.skips.errors import ListError
from prx_data.skips.export_state import (
    ExportState,
    read_state,
    read_store,
    read_store_file,
    store_names,
    write_state,
    write_store_list,
)
from prx_data.skips.ledger import Ledger
from prx_data.skips.log import Provenance, log_rows, store_table
from prx_data.skips.ops import carry, sync, update_list
from prx_data.skips.place import default_ledger_uri, registry_uri
from prx_data.skips.which import resolve
from tests.exportkit import make_export, skip_samples
from tests.tablekit import make_table

B = "512/1.000"
N = 12


def _table(path: str) -> str:
    make_table(path, [("s/0", b"\xff\xd8not-an-image", "c")])
    return path


def _ids_file(tmp_path, name: str, ids) -> str:
    p = tmp_path / f"{name}.txt"
    p.write_text("".join(f"{i}\n" for i in ids))
    return str(p)


def _ex(root: str, n: int = N):
    return make_export(root, {B: n}, samples_per_part=4, samples_per_shard=2)


def skipped(ex, root: str | None = None) -> dict[str, set[str]]:
    """{list: ids the loader skips}: every list's sidecars, through the export's positions."""
    root = root or ex.root
    shards = layout.read_index(root, B)
    names = SL.list_sidecars(root, B, shards)
    by_pos = {(s, i): sid for sid, (_, s, i) in ex.where.items()}
    out = {}
    for n in names:
        got = SL.load_skips(root, B, shards, [n])
        ids = {by_pos[(s, int(i))] for s, idx in got.items() for i in idx}
        if ids:
            out[n] = ids
    return out


def stored(root: str) -> dict[str, set[str]]:
    return {n: set(t["id"].to_pylist()) for n, t in read_store(root).items()}


def _id(i: int) -> str:
    return f"ds/{B}/{i}"


@pytest.fixture()
def bound(tmp_path):
    """Two exports of one table, bound to its registry."""
    t = _table(str(tmp_path / "t.lance"))
    a, b = _ex(str(tmp_path / "a")), _ex(str(tmp_path / "b"))
    for ex in (a, b):
        sync(ex.root, t)
    return t, a, b


def _add(root, name, ids, **kw):
    return update_list(root, name, ids, Provenance("test"), **kw)


def _remove(root, name, ids=None, **kw):
    return update_list(root, name, ids, Provenance("test"), mode="remove", **kw)


# --- one test per confirmed scenario ----------------------------------------------------------


def test_an_optout_landing_while_sync_runs_is_not_undone(bound, monkeypatch):
    _, a, _ = bound
    _add(a.root, "optout", [_id(1)])
    real_bind = bind
    started = threading.Event()
    late: dict = {}

    def racing_bind(root, lists, **kw):
        if not started.is_set():  # the sync is between reading the log and writing
            started.set()
            t = threading.Thread(target=lambda: late.update(r=_add(a.root, "optout", [_id(2)])))
            t.start()
            late["t"] = t
            t.join(0.5)  # it must wait for the export's lease, not interleave
            late["waited"] = t.is_alive()
        return real_bind(root, lists, **kw)

    monkeypatch.setattr(MAT, "bind", racing_bind)
    sync(a.root)
    late["t"].join(60)
    assert late["waited"]
    assert skipped(a)["optout"] == {_id(1), _id(2)}
    monkeypatch.setattr(MAT, "bind", real_bind)
    sync(a.root)  # idempotent
    assert skipped(a)["optout"] == {_id(1), _id(2)}


def test_reoptout_export_only_after_remove_survives_sync_rewrite_and_overwrite(bound, tmp_path):
    t, a, b = bound
    _add(a.root, "optout", [_id(3)])
    _remove(a.root, "optout", [_id(3)])
    _add(a.root, "optout", [_id(3)], export_only=True)
    sync(a.root)
    assert skipped(a)["optout"] == {_id(3)}
    # Another export does not see an export-only change...
    sync(b.root)
    assert "optout" not in skipped(b)
    # ...until --overwrite / rewrite carries it into the registry (the newest state of the id).
    assert carry(a.root, Ledger.for_table(t)) == 1
    assert Ledger.for_table(t).state()["optout"]["id"].to_pylist() == [_id(3)]
    sync(b.root)
    assert skipped(b)["optout"] == {_id(3)}


def test_a_writer_with_a_skewed_clock_cannot_reorder(bound, monkeypatch):
    _, a, _ = bound
    _add(a.root, "optout", [_id(4)])
    _remove(a.root, "optout", [_id(4)])
    behind = dt.datetime.now(dt.UTC) - dt.timedelta(hours=1)
    _add(a.root, "optout", [_id(4)])  # what matters is commit order...
    update_list(a.root, "optout", [_id(5)], Provenance("skewed", at=behind))
    _remove(a.root, "optout", [_id(5)])
    update_list(a.root, "optout", [_id(5)], Provenance("skewed", at=behind))  # ...not `at`
    assert skipped(a)["optout"] == {_id(4), _id(5)}


def test_removing_one_id_of_a_sidecar_only_list_removes_only_that_id(tmp_path):
    ex = _ex(str(tmp_path / "e"))
    # Sidecars and no store (an export from before the store).
    pos = {}
    for i in (1, 2, 6):
        _, s, k = ex.where[_id(i)]
        pos.setdefault((B, s), []).append(k)
    skip_samples(ex.root, "legacy", pos)
    assert store_names(ex.root) == []
    _remove(ex.root, "legacy", [_id(2)])
    assert skipped(ex)["legacy"] == {_id(1), _id(6)}
    assert stored(ex.root)["legacy"] == {_id(1), _id(6)}


def test_a_whole_list_removed_from_the_registry_leaves_other_exports_sidecars_too(
    bound, tmp_path, capsys
):
    _, a, b = bound
    _add(a.root, "trial", [_id(i) for i in range(8)])
    sync(b.root)
    assert skipped(b)["trial"] == {_id(i) for i in range(8)}
    assert skips_cli.main(["remove", a.root, "trial"]) == 0
    assert skips_cli.main(["sync", b.root]) == 0
    assert "trial" not in skipped(b) and "trial" not in stored(b.root)
    capsys.readouterr()
    assert skips_cli.main(["list", b.root]) == 0
    assert "trial" not in capsys.readouterr().out
    assert verify_cli.main([b.root, "--no-progress"]) == 0


def test_a_symlinked_table_path_finds_the_same_registry_and_a_moved_one_is_found_by_table(
    bound, tmp_path
):
    t, a, _ = bound
    link = str(tmp_path / "link.lance")
    os.symlink(t, link)
    c = _ex(str(tmp_path / "c"))
    sync(c.root, link)
    _add(a.root, "optout", [_id(7)])
    sync(c.root)
    assert skipped(c)["optout"] == {_id(7)}
    # The table moves with its ledger: the export's recorded paths fail (naming the missing
    # ledger, never reading it as empty), --table finds both.
    os.unlink(link)
    moved = str(tmp_path / "moved")
    os.makedirs(moved)
    ledger = default_ledger_uri(t)
    shutil.move(t, os.path.join(moved, "t.lance"))
    shutil.move(ledger, default_ledger_uri(os.path.join(moved, "t.lance")))
    with pytest.raises(ListError, match=f"{ledger}, which is missing"):
        _add(a.root, "optout", [_id(8)])
    _add(a.root, "optout", [_id(8)], table=os.path.join(moved, "t.lance"))
    assert skipped(a)["optout"] == {_id(7), _id(8)}


def test_a_crafted_export_cannot_inject_lists_into_our_registry(bound, tmp_path):
    t, a, b = bound
    evil = _ex(str(tmp_path / "evil"))
    lists = os.path.join(evil.root, naming.LISTS_DIR)
    os.makedirs(lists, exist_ok=True)
    # It names our table (path and a guessed identity) and holds a list of every id.
    st = ExportState(table_id="0" * 32, table=t, position=1)
    write_state(evil.root, st)
    write_store_list(
        evil.root, "all", store_table(pa.array(sorted(evil.all_ids())), Provenance("x"))
    )
    with pytest.raises(ListError):
        resolve(evil.root)  # never our registry
    new = str(tmp_path / "new")
    assert skips_cli.main(["rewrite", evil.root, new, "--force", "--name", "none"]) in (0, 2)
    assert "all" not in Ledger.for_table(t).state()
    sync(b.root)
    assert "all" not in skipped(b)
    # An export that names no table at all is export-only.
    plain = _ex(str(tmp_path / "plain"))
    assert resolve(plain.root) is None


def test_a_trial_list_warns_and_is_reported_with_its_source(bound, tmp_path, capsys):
    _, a, b = bound
    f = _ids_file(tmp_path, "trial", [_id(i) for i in range(6)])
    assert skips_cli.main(["add", a.root, "semdedup", "--ids", f]) == 0
    err = capsys.readouterr().err
    assert "leaves out 50.0%" in err and f"skips remove {a.root} semdedup" in err
    done = sync(b.root)
    assert done["semdedup"]["source"] == "registry" and done["semdedup"]["share"] == 0.5
    capsys.readouterr()
    assert skips_cli.main(["list", b.root]) == 0
    assert "semdedup: 512/1.000" in capsys.readouterr().out


def test_lease_refuses_stores_without_conditional_writes_and_a_symlinked_lists_dir(tmp_path):
    with pytest.raises(LeaseUnsupported, match="az:// has no conditional writes.*s3://.*gs://"):
        ExportLock("az://bucket/export").acquire()
    ex = _ex(str(tmp_path / "e"))
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    os.symlink(str(elsewhere), os.path.join(ex.root, naming.LISTS_DIR))
    with pytest.raises(ListError, match="_lists is a symbolic link"):
        _add(ex.root, "optout", [_id(1)])
    assert list(elsewhere.iterdir()) == []


def test_a_list_update_waits_for_the_exports_lease_and_never_deletes_it(bound):
    _, a, _ = bound
    holder = ExportLock(a.root)
    holder.acquire()
    done = threading.Event()
    th = threading.Thread(target=lambda: (_add(a.root, "optout", [_id(9)]), done.set()))
    th.start()
    th.join(0.5)
    assert not done.is_set() and os.path.exists(holder.path)
    holder.release()
    th.join(60)
    assert skipped(a)["optout"] == {_id(9)}


def test_registry_written_before_commit_order_is_converted(tmp_path):
    import lance

    t = _table(str(tmp_path / "t.lance"))
    old = pa.table(
        {
            "list": ["x", "x", "x"],
            "id": ["a", "b", "a"],
            "op": ["add", "add", "remove"],
            "at": pa.array(
                [dt.datetime(2026, 1, d, tzinfo=dt.UTC) for d in (1, 1, 2)],
                pa.timestamp("us", tz="UTC"),
            ),
            "command": ["c"] * 3,
            "reason": [""] * 3,
            "export": [""] * 3,
            "txn": [""] * 3,
        }
    )
    lance.write_dataset(old, registry_uri(t))
    reg = Ledger.for_table(t)
    assert reg.state()["x"]["id"].to_pylist() == ["b"]
    reg.append(
        lambda seq: log_rows(
            "x", pa.array(["c"]), "add", Provenance("t"), seq=seq, base=seq, kind=0, export=""
        )
    )
    assert reg.state()["x"]["id"].to_pylist() == ["b", "c"]
    assert json.dumps(sorted(reg.state())) == '["x"]'


# --- one write path: sidecars only from the log -------------------------------------------------


def test_the_sidecar_module_has_no_writer():
    """Sidecars are written only by the materialisation: the format module only reads them."""
    public = {n for n in dir(SL) if not n.startswith("_")}
    assert not {n for n in public if n.startswith(("add_", "write_", "remove_"))}


def test_sidecars_no_log_knows_are_taken_into_the_log_exactly(bound):
    _, a, _ = bound
    _add(a.root, "optout", [_id(1)])
    # A list only in sidecars (a tree from before the log) goes into the log exactly.
    assert skip_samples(a.root, "manual", ids=[_id(4), _id(5)]).samples_listed == 2
    _add(a.root, "optout", [_id(3)])
    sync(a.root)
    assert skipped(a) == {"optout": {_id(1), _id(3)}, "manual": {_id(4), _id(5)}}
    _remove(a.root, "manual", [_id(4)])
    assert skipped(a)["manual"] == {_id(5)}


# --- delta materialisation ---------------------------------------------------------------------


def _forms(root: str) -> tuple:
    """Everything materialised: stores (with kinds), sidecar bytes, the state's lists and counts."""
    stores = {n: read_store_file(root, n).to_pydict() for n in store_names(root)}
    cars = {}
    for dirpath, _, files in os.walk(root):
        for f in files:
            if f.endswith(".skip"):
                cars[os.path.relpath(os.path.join(dirpath, f), root)] = open(
                    os.path.join(dirpath, f), "rb"
                ).read()
    st = read_state(root)
    return stores, cars, st.lists, st.counts, st.position


def test_an_update_binds_only_the_changed_ids_and_equals_a_full_rebind(bound, monkeypatch):
    _, a, b = bound
    _add(a.root, "optout", [_id(i) for i in range(8)] + ["gone/1"])
    _add(a.root, "optout", [_id(10)], export_only=True)
    _add(b.root, "dedup", [_id(9)])  # the registry moves on without a
    real, seen = bind, []

    def counting(root, lists, **kw):
        seen.append(sum(len(v) for v in lists.values()))
        return real(root, lists, **kw)

    monkeypatch.setattr(MAT, "bind", counting)
    r = _remove(a.root, "optout", [_id(3)])
    assert seen == [2]  # _id(3), and dedup's _id(9) from b: not the list's 9 ids
    assert (r.ids_in_list, r.samples_listed) == (9, 8)
    delta = _forms(a.root)
    monkeypatch.setattr(MAT, "bind", real)
    sync(a.root)  # the full rebind
    assert _forms(a.root) == delta
    assert skipped(a) == {"optout": {_id(i) for i in (0, 1, 2, 4, 5, 6, 7, 10)}, "dedup": {_id(9)}}


@pytest.mark.parametrize("why", ["dirty", "log"])
def test_an_update_rebinds_whole_when_the_position_is_not_a_known_prefix(bound, monkeypatch, why):
    _, a, _ = bound
    _add(a.root, "optout", [_id(1), _id(2)])
    st = read_state(a.root)
    if why == "dirty":  # a materialisation was interrupted
        st.dirty = True
    else:  # the registry was rewritten (converted, recreated) since
        st.log_id = "0" * 32
    write_state(a.root, st)
    real, seen = bind, []
    monkeypatch.setattr(
        MAT, "bind", lambda root, lists, **kw: seen.append(dict(lists)) or real(root, lists, **kw)
    )
    _add(a.root, "optout", [_id(3)])
    assert [sorted(x) for x in seen] == [["optout"]]
    assert len(seen[0]["optout"]) == 3
    assert skipped(a)["optout"] == {_id(1), _id(2), _id(3)}
    assert not read_state(a.root).dirty


def test_an_interrupted_update_leaves_the_state_dirty_and_the_next_one_repairs(bound, monkeypatch):
    _, a, _ = bound
    _add(a.root, "optout", [_id(1)])

    def boom(*a, **kw):
        raise OSError("disk full")

    monkeypatch.setattr(MAT, "write_store_list", boom)
    with pytest.raises(OSError):
        _add(a.root, "optout", [_id(2)])
    assert read_state(a.root).dirty
    monkeypatch.undo()
    _add(a.root, "optout", [_id(3)])
    assert skipped(a)["optout"] == {_id(1), _id(2), _id(3)}
    assert not read_state(a.root).dirty
