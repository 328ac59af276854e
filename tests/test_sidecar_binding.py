"""Sidecars are bound to their file name and their shard's bytes; stray ones are reported."""

from __future__ import annotations

import json
import os
import shutil
import warnings

import pytest
from streaming.base.hashing import get_hash

from prx_data.cli.skips import main
from prx_data.export import layout, naming
from prx_data.skips import sidecar as S
from prx_data.stream.dataset import DatasetSpec, load_sources
from tests.exportkit import FakeExport, make_export, skip_samples

B = "512/1.000"


@pytest.fixture(scope="module")
def template(tmp_path_factory):
    root = str(tmp_path_factory.mktemp("tpl") / "ex")
    return make_export(root, {B: 12}, samples_per_part=12, samples_per_shard=4, hashes=["xxh64"])


@pytest.fixture()
def export(template, tmp_path):
    root = str(tmp_path / "ex")
    shutil.copytree(template.root, root)
    ex = FakeExport(root, template.ids, template.where)
    skip_samples(root, "dedup", {(B, _shard(ex)): [1, 2]})
    return ex


def _shard(ex: FakeExport, i: int = 0) -> str:
    return ex.where[f"ds/{B}/{i}"][1]


def _path(ex: FakeExport, shard: str, name: str) -> str:
    return os.path.join(ex.root, B, f"{shard}.{name}.skip")


def _shards(ex: FakeExport):
    return layout.read_index(ex.root, B)


def test_renamed_sidecar_is_refused(export):
    """A dedup sidecar renamed to nsfw must not be applied as the nsfw list."""
    shard = _shard(export)
    os.rename(_path(export, shard, "dedup"), _path(export, shard, "nsfw"))
    with pytest.raises(S.SkipListError, match="named for list 'nsfw' but holds list 'dedup'"):
        S.load_skips(export.root, B, _shards(export), ["nsfw"])
    with pytest.raises(S.SkipListError, match="renamed"):
        load_sources(DatasetSpec(export.root, skip_lists=["nsfw"]), [512])


def test_sidecar_copied_to_another_shard_is_refused(export):
    src, dst = _shard(export, 0), _shard(export, 4)
    assert src != dst
    shutil.copy(_path(export, src, "dedup"), _path(export, dst, "dedup"))
    with pytest.raises(S.SkipListError, match="does not match its shard"):
        S.load_skips(export.root, B, _shards(export), ["dedup"])


def _rehash_shard(ex: FakeExport, shard: str, data: bytes, *, algos=("xxh64",)) -> None:
    """Replace a shard's bytes and record them in the merged index, as a re-export would."""
    with open(os.path.join(ex.root, B, shard), "wb") as f:
        f.write(data)
    index = os.path.join(ex.root, B, "index.json")
    obj = json.load(open(index))
    for e in obj["shards"]:
        if e["raw_data"]["basename"] == shard:
            e["raw_data"]["bytes"] = len(data)
            e["raw_data"]["hashes"] = {a: get_hash(a, data) for a in algos}
    with open(index, "w") as f:
        json.dump(obj, f)


def test_same_size_rewrite_invalidates_with_a_hashed_index(export):
    shard = _shard(export)
    old = open(os.path.join(export.root, B, shard), "rb").read()
    assert _shards(export)[0].hashes.keys() == {"xxh64"}
    _rehash_shard(export, shard, old[:-1] + bytes([old[-1] ^ 0xFF]))
    with pytest.raises(S.SkipListError, match="xxh64"):
        S.load_skips(export.root, B, _shards(export))


def test_appended_shard_invalidates(export):
    shard = _shard(export)
    old = open(os.path.join(export.root, B, shard), "rb").read()
    _rehash_shard(export, shard, old + b"\0" * 16)
    with pytest.raises(S.SkipListError, match="bytes"):
        S.load_skips(export.root, B, _shards(export))


def test_sidecar_without_hashes_is_refused_by_a_hashed_index(tmp_path):
    """A list made when the index had no hashes proves nothing once the index has them.

    The shard was re-exported at the same size with hashes recorded: the old
    sidecar's header (bytes, samples) still matches, only the hashes differ.
    """
    root = str(tmp_path / "ex")
    ex = make_export(root, {B: 12}, samples_per_part=12, samples_per_shard=4, hashes=[])
    shard = _shard(ex)
    skip_samples(root, "dedup", {(B, shard): [1]})
    old = open(os.path.join(root, B, shard), "rb").read()
    _rehash_shard(ex, shard, old[:-1] + bytes([old[-1] ^ 0xFF]))
    with pytest.raises(S.SkipListError, match="index records shard hashes"):
        S.load_skips(root, B, layout.read_index(root, B))


def _plant_strays(ex: FakeExport) -> dict[str, str]:
    shard = _shard(ex)
    good = open(_path(ex, shard, "dedup"), "rb").read()
    paths = {
        "wrong_case": _path(ex, shard, "Dedup"),
        "no_shard": _path(ex, naming.part_name(0, 0) + "/shard.00099.mds", "dedup"),
        "unparseable": _path(ex, shard, "junk"),
    }
    for key, p in paths.items():
        with open(p, "wb") as f:
            f.write(b"not a sidecar" if key == "unparseable" else good)
    return paths


def test_list_and_stats_report_stray_sidecars(export, capsys):
    paths = _plant_strays(export)
    listing, orphans = S.scan_sidecars(export.root, B, _shards(export))
    assert {o.path for o in orphans} == {paths["wrong_case"], paths["no_shard"]}
    assert listing["dedup"] == [_shard(export)]
    probs = S.sidecar_problems(export.root)
    assert {(p.kind, p.path) for p in probs} == {
        ("orphan", paths["wrong_case"]),
        ("orphan", paths["no_shard"]),
        ("unparseable", paths["unparseable"]),
    }

    assert main(["list", export.root]) == 1
    out = capsys.readouterr()
    for p in paths.values():
        assert p in out.out
    assert "sidecar problem" in out.err

    assert main(["stats", export.root, "--json"]) == 1
    body = json.loads(capsys.readouterr().out)
    assert {p["path"] for p in body["_problems"]} == set(paths.values())
    # The good list is still counted; the unparseable one is left out, not fatal.
    assert sum(r["skipped"] for r in body["dedup"]) == 2


def test_clean_export_lists_without_problems(export, capsys):
    assert main(["list", export.root]) == 0
    assert main(["stats", export.root]) == 0
    assert "problem" not in capsys.readouterr().err


def test_loader_warns_or_refuses_on_stray_sidecars(export):
    shard = _shard(export)
    good = open(_path(export, shard, "dedup"), "rb").read()
    stray = _path(export, naming.part_name(0, 0) + "/shard.00099.mds", "nsfw")
    with open(stray, "wb") as f:
        f.write(good)
    with pytest.warns(UserWarning, match="stray sidecar.*shard.00099.mds.nsfw.skip"):
        src = load_sources(DatasetSpec(export.root), [512])
    assert src[0].skipped == 2
    with warnings.catch_warnings():  # not requested: a warning, the requested list loads
        warnings.simplefilter("ignore")
        load_sources(DatasetSpec(export.root, skip_lists=["dedup"]), [512])
    with open(_path(export, shard, "Dedup"), "wb") as f:
        f.write(good)
    with pytest.raises(S.SkipListError, match="requested skip list cannot be applied|Dedup"):
        load_sources(DatasetSpec(export.root, skip_lists=["dedup"]), [512])


def test_list_no_check_reports_orphans_only(export, capsys):
    paths = _plant_strays(export)
    assert main(["list", export.root, "--no-check"]) == 1
    out = capsys.readouterr().out
    assert paths["wrong_case"] in out and paths["no_shard"] in out
    assert paths["unparseable"] not in out
