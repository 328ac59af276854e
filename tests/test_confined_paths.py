"""Hostile shard names in an index or manifest are refused at every entry point.

Each case plants a name that would point outside the export (or outside the
layout the exporter writes) and checks the tool refuses, naming the file, and
that a victim file outside the export is neither changed nor joined by new files.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from prx_data.export import durable, layout, merge, naming, safety
from prx_data.skips import sidecar as S
from tests.exportkit import FakeExport, make_export, skip_samples

B = "512/1.000"
HOSTILE = ["../../../victim/shard.00000.mds", "/etc/passwd", "f000000-000000000\\..\\x.mds"]


@pytest.fixture(scope="module")
def template(tmp_path_factory):
    root = str(tmp_path_factory.mktemp("tpl") / "ex")
    return make_export(root, {B: 8}, samples_per_part=8)


def _snapshot(d: str) -> dict[str, tuple[str, float]]:
    out = {}
    for dirpath, _dirs, files in os.walk(d):
        for f in files:
            p = os.path.join(dirpath, f)
            out[p] = (hashlib.sha1(open(p, "rb").read()).hexdigest(), os.stat(p).st_mtime_ns)
    return out


class Planted:
    def __init__(self, ex: FakeExport, victim_dir: str, bad: str):
        self.ex, self.root, self.victim_dir, self.bad = ex, ex.root, victim_dir, bad
        self.before = _snapshot(victim_dir)

    def assert_victim_untouched(self) -> None:
        assert _snapshot(self.victim_dir) == self.before


@pytest.fixture(params=HOSTILE, ids=["dotdot", "absolute", "backslash"])
def planted(request, template, tmp_path):
    """An export at tmp/ex whose merged index names ``bad`` for its first shard.

    ``tmp/victim/shard.00000.mds`` is a copy of a real shard, so a reader that
    followed ``../../../victim/...`` from ``tmp/ex/512/1.000`` would succeed.
    """
    root = str(tmp_path / "ex")
    shutil.copytree(template.root, root)
    victim = tmp_path / "victim"
    victim.mkdir()
    real = template.where[f"ds/{B}/0"][1]
    shutil.copy(os.path.join(root, B, real), victim / "shard.00000.mds")
    index = os.path.join(root, B, "index.json")
    obj = json.load(open(index))
    obj["shards"][0]["raw_data"]["basename"] = request.param
    with open(index, "w") as f:
        json.dump(obj, f)
    return Planted(FakeExport(root, template.ids, template.where), str(victim), request.param)


def _refused(p: Planted, fn, *args, **kwargs):
    with pytest.raises(safety.UnsafeIndexError, match="refusing shard name") as e:
        fn(*args, **kwargs)
    assert os.path.join(B, "index.json") in str(e.value).replace(os.sep, "/")
    p.assert_victim_untouched()


def test_read_index(planted):
    _refused(planted, layout.read_index, planted.root, B)


def test_loader(planted):
    from prx_data.stream.dataset import DatasetSpec, load_sources

    _refused(planted, load_sources, DatasetSpec(planted.root), [512])


def test_loader_remote_fetch_path(planted, tmp_path):
    """The fetch path for remote roots checks the index before it reaches the cache."""
    from prx_data.stream.catalog import _fetch
    from prx_data.stream.spec import DatasetSpec

    cache = tmp_path / "cache"
    _refused(planted, _fetch, DatasetSpec(planted.root), [512], str(cache))
    assert not (cache / B / "index.json").exists()


def test_stream_reading_the_index_itself(planted):
    """Streaming's own get_shards joins names to ``local``: the stream checks them first."""
    from prx_data.core.streaming_compat import World
    from prx_data.stream.reader import SkipStream

    s = SkipStream(local=os.path.join(planted.root, B))
    with pytest.raises(safety.UnsafeIndexError, match="refusing shard name"):
        s.get_shards(World.detect(), False)
    planted.assert_victim_untouched()


def test_planner(planted):
    from prx_data.stream.planner import count_export

    _refused(planted, count_export, planted.root, [512])


def test_skips_add_list_stats_remove(planted):
    # ``skips add`` with the hostile name as the shard: it would write next to the victim.
    # The sidecar writer (private to the list materialisation; reached through the test double).
    _refused(planted, skip_samples, planted.root, "dedup", {(B, planted.bad): [0]})
    _refused(planted, skip_samples, planted.root, "dedup", ids=[f"ds/{B}/3"])
    _refused(planted, S.list_skip_lists, planted.root)
    _refused(planted, S.skip_stats, planted.root)
    _refused(planted, skip_samples, planted.root, "dedup", remove=True)


def test_skips_cli_exits_cleanly(planted, capsys):
    from prx_data.cli.skips import main

    assert main(["add", planted.root, "dedup", "--ids", _ids_file(planted)]) == 2
    assert "refusing shard name" in capsys.readouterr().err
    planted.assert_victim_untouched()


def _ids_file(p: Planted) -> str:
    path = os.path.join(os.path.dirname(p.root), "ids.txt")
    with open(path, "w") as f:
        f.write(f"ds/{B}/3\n")
    return path


def test_rewrite(planted, tmp_path):
    from prx_data.skips.rewrite import rewrite_export

    out = tmp_path / "out"
    _refused(planted, rewrite_export, planted.root, str(out), force=True)
    assert not out.exists() or not list(out.rglob("index.json"))


def test_dedup_skip_list(planted):
    from prx_data.skips.dedup import replace_skip_list

    rows = pa.table({"bucket": [B], "shard": [planted.bad], "index": [0]})
    _refused(planted, replace_skip_list, planted.root, "dedup", rows)


def test_optout(planted):
    from prx_data.skips.optout import add_optout

    _refused(planted, add_optout, planted.root, "optout", [f"ds/{B}/3"])


# --- manifests and part indexes ------------------------------------------------------------------


@pytest.mark.parametrize("bad", HOSTILE + ["f000001-000000000/shard.00000.mds"])
def test_manifest_shard_names_are_checked(template, tmp_path, bad):
    """ids.parquet is data too: read_manifests (dedup, opt-out) refuses a foreign shard name."""
    from prx_data.skips.optout import add_optout

    root = str(tmp_path / "ex")
    shutil.copytree(template.root, root)
    part = naming.part_name(0, 0)
    path = os.path.join(root, B, part, "ids.parquet")
    t = pq.read_table(path)
    shards = t["shard"].to_pylist()
    shards[0] = bad
    t = t.set_column(0, "shard", pa.array(shards, pa.string()))
    pq.write_table(t, path)
    shutil.rmtree(os.path.join(root, naming.IDS_INDEX_NAME))  # an export without an id index
    with pytest.raises(safety.UnsafeIndexError, match=r"ids\.parquet"):
        layout.read_manifests(root)
    with pytest.raises(safety.UnsafeIndexError):
        add_optout(root, "optout", [f"ds/{B}/0"])
    assert not list((tmp_path / "ex").rglob("*.skip"))


@pytest.mark.parametrize("bad", HOSTILE + ["../shard.00000.mds", "shard.00000.mds.skip"])
def test_part_index_names_are_checked(template, tmp_path, bad):
    """write_manifest and merge_bucket read the parts' own indexes through the same check."""
    root = str(tmp_path / "ex")
    shutil.copytree(template.root, root)
    part = naming.part_name(0, 0)
    bdir = os.path.join(root, B)
    index = os.path.join(bdir, part, "index.json")
    obj = json.load(open(index))
    obj["shards"][0]["raw_data"]["basename"] = bad
    with open(index, "w") as f:
        json.dump(obj, f)
    merged = open(os.path.join(bdir, "index.json"), "rb").read()
    with pytest.raises(safety.UnsafeIndexError, match="refusing shard name"):
        merge.merge_bucket(bdir, [part])
    with pytest.raises(safety.UnsafeIndexError, match="refusing shard name"):
        durable.write_manifest(bdir, part, [f"ds/{B}/{i}" for i in range(8)])
    assert open(os.path.join(bdir, "index.json"), "rb").read() == merged


@pytest.mark.parametrize(
    "name",
    [
        "f000000-000000000/shard.00000.mds",
        "f000000-000000000/shard.00012.mds.zstd",
        "f1234567-1234567890/shard.123456.mds",
    ],
)
def test_exporter_names_are_accepted(name):
    assert safety.check_shard_basename("x/index.json", name) == name


@pytest.mark.parametrize(
    "name",
    [
        "",
        "shard.00000.mds",
        "f000000-000000000//shard.00000.mds",
        "f000000-000000000/./shard.00000.mds",
        "f000000-000000000/../f000000-000000000/shard.00000.mds",
        "C:/f000000-000000000/shard.00000.mds",
        "f000000-000000000/shard.00000.mds/../../x",
        "f000000-000000000/index.json",
        None,
        7,
    ],
)
def test_other_names_are_refused(name):
    with pytest.raises(safety.UnsafeIndexError, match="x/index.json"):
        safety.check_shard_basename("x/index.json", name)


@pytest.mark.parametrize("bucket", ["../512/1.000", "512/../../x", "/etc", "512", "512/1.000/x"])
def test_bucket_names_are_checked(template, bucket):
    """Bucket names come from users too (``skips add --indices``): they never reach a path."""
    with pytest.raises(safety.UnsafeIndexError, match="bad bucket name"):
        layout.read_index(template.root, bucket)
    with pytest.raises(safety.UnsafeIndexError, match="bad bucket name"):
        skip_samples(template.root, "dedup", {(bucket, "f000000-000000000/shard.00000.mds"): [0]})


def test_unparseable_index_is_named(template, tmp_path):
    root = str(tmp_path / "ex")
    shutil.copytree(template.root, root)
    with open(os.path.join(root, B, "index.json"), "w") as f:
        f.write('{"version": 2, "shards": 3}')
    with pytest.raises(safety.UnsafeIndexError, match="index.json: not a streaming index"):
        layout.read_index(root, B)
