"""``SkipStream`` is a drop-in ``streaming.Stream`` on plain MDSWriter output.

Each test runs the same ``StreamingDataset`` twice over datasets written by a
plain ``MDSWriter`` (names ``shard.NNNNN.mds`` at the stream root, or
``<sub>/shard.NNNNN.mds`` after streaming's ``merge_index``), once with
``Stream`` and once with ``SkipStream``, and asserts the identical sample
order: iteration, shuffling, mid-epoch resumption, mixing with proportions and
a remote copied into a local cache (cold, then warm). Names that leave the
stream's directory are still refused.
"""

from __future__ import annotations

import gc
import json
import os
import shutil

import pytest
from streaming import MDSWriter, Stream, StreamingDataLoader, StreamingDataset
from streaming.base.util import clean_stale_shared_memory, merge_index

from prx_data.core.streaming_compat import World
from prx_data.export import safety
from prx_data.stream.reader import SkipStream

COLUMNS = {"id": "str", "x": "int", "blob": "bytes"}


def write_plain(out: str, n: int, *, tag: str, compression: str | None = None) -> str:
    """``n`` samples in shards of about 8 samples, written by a plain MDSWriter."""
    with MDSWriter(out=out, columns=COLUMNS, size_limit=8 * 96, compression=compression) as w:
        for i in range(n):
            w.write({"id": f"{tag}{i}", "x": i, "blob": bytes([i % 256]) * 64})
    return out


@pytest.fixture(scope="module")
def plain(tmp_path_factory):
    base = tmp_path_factory.mktemp("plain")
    return {
        "a": write_plain(str(base / "a"), 96, tag="a"),
        "b": write_plain(str(base / "b"), 40, tag="b"),
        "z": write_plain(str(base / "z"), 48, tag="z", compression="zstd"),
    }


def run(cls, streams: list[dict], *, stop_after: int | None = None, state=None, **kwargs):
    """Sample ids in order through a StreamingDataLoader (batch 4, no workers).

    ``stop_after`` batches: returns (ids so far, loader state) for a resume.
    """
    clean_stale_shared_memory()
    ds = loader = None
    try:
        ds = StreamingDataset(streams=[cls(**s) for s in streams], batch_size=4, **kwargs)
        if state is not None:
            ds.load_state_dict(state)
        loader = StreamingDataLoader(ds, batch_size=4, num_workers=0)
        ids: list[str] = []
        for n, batch in enumerate(loader, 1):
            ids += batch["id"]
            if n == stop_after:
                return ids, loader.state_dict()
        return ids
    finally:
        del loader, ds
        gc.collect()
        clean_stale_shared_memory()


def same(streams: list[dict], **kwargs):
    """The order under ``Stream`` and under ``SkipStream``: asserted equal, returned."""
    plain_order = run(Stream, streams, **kwargs)
    assert run(SkipStream, streams, **kwargs) == plain_order
    return plain_order


def test_plain_index_names_are_accepted(plain):
    with open(os.path.join(plain["a"], "index.json")) as f:
        names = [s["raw_data"]["basename"] for s in json.load(f)["shards"]]
    assert names[0] == "shard.00000.mds" and len(names) > 5
    shards = SkipStream(local=plain["a"]).get_shards(World.detect(), False)
    assert [s.raw_data.basename for s in shards] == names


def test_iteration(plain):
    order = same([{"local": plain["a"]}], shuffle=False)
    assert order == [f"a{i}" for i in range(96)]


@pytest.mark.parametrize("algo", ["py1e", "py1s"])
def test_shuffling(plain, algo):
    order = same(
        [{"local": plain["a"]}], shuffle=True, shuffle_seed=7, shuffle_algo=algo,
        num_canonical_nodes=1,
    )  # fmt: skip
    assert sorted(order) == sorted(f"a{i}" for i in range(96))
    assert order != [f"a{i}" for i in range(96)]


def test_mid_epoch_resumption(plain):
    kw = {"shuffle": True, "shuffle_seed": 3, "num_canonical_nodes": 1}
    streams = [{"local": plain["a"]}]
    runs = {}
    for cls in (Stream, SkipStream):
        head, state = run(cls, streams, stop_after=5, **kw)
        tail = run(cls, streams, state=state, **kw)
        runs[cls] = (head, state, tail)
    (h1, s1, t1), (h2, s2, t2) = runs[Stream], runs[SkipStream]
    assert (h1, s1, t1) == (h2, s2, t2)
    assert len(h1) == 20 and s1["sample_in_epoch"] == 20
    assert h1 + t1 == run(Stream, streams, **kw)  # the resume continues the same epoch


def test_mixing_with_proportions(plain):
    streams = [
        {"local": plain["a"], "proportion": 0.25},
        {"local": plain["b"], "proportion": 0.75},
    ]
    order = same(streams, shuffle=True, shuffle_seed=11, epoch_size=80, num_canonical_nodes=1)
    assert len(order) == 80
    assert sum(i.startswith("b") for i in order) == 60  # 0.75 of 80: b (40 samples) repeats


def test_repeat_and_choose(plain):
    streams = [{"local": plain["a"], "choose": 30}, {"local": plain["b"], "repeat": 1.5}]
    same(streams, shuffle=True, shuffle_seed=5, num_canonical_nodes=1)


def test_remote_into_a_shared_local_cache(plain, tmp_path):
    """A (compressed) remote copied into a local cache: cold run, then a warm one on the same cache."""
    orders, listings = {}, {}
    for cls in (Stream, SkipStream):
        cache = str(tmp_path / cls.__name__)
        streams = [
            {"remote": plain["z"], "local": cache},
            {"remote": plain["b"], "local": cache + "-b"},
        ]
        kw = {"shuffle": True, "shuffle_seed": 9, "num_canonical_nodes": 1}
        cold = run(cls, streams, **kw)
        listings[cls] = sorted(os.listdir(cache))
        warm = run(cls, streams, **kw)
        assert warm == cold
        orders[cls] = cold
    assert orders[Stream] == orders[SkipStream]
    assert listings[Stream] == listings[SkipStream]
    assert "shard.00000.mds" in listings[SkipStream]  # decompressed from shard.00000.mds.zstd


def test_split(tmp_path):
    root = tmp_path / "ds"
    write_plain(str(root / "train"), 24, tag="t")
    assert same([{"local": str(root), "split": "train"}], shuffle=False) == [
        f"t{i}" for i in range(24)
    ]


def test_subdirectories_from_merge_index(tmp_path):
    """The format allows subpaths (streaming's merge_index writes ``<sub>/shard.NNNNN.mds``)."""
    root = tmp_path / "merged"
    write_plain(str(root / "part0"), 20, tag="p")
    write_plain(str(root / "part1"), 12, tag="q")
    merge_index(str(root), keep_local=True)
    with open(root / "index.json") as f:
        names = {s["raw_data"]["basename"].split("/")[0] for s in json.load(f)["shards"]}
    assert names == {"part0", "part1"}
    order = same([{"local": str(root)}], shuffle=False)
    assert sorted(order) == sorted([f"p{i}" for i in range(20)] + [f"q{i}" for i in range(12)])


def test_skips_still_apply_on_plain_data(plain):
    """The skip-aware part keeps working on plain names (the reason SkipStream exists)."""
    import numpy as np

    skips = {"shard.00000.mds": np.array([0, 2], np.uint32)}
    order = run(SkipStream, [{"local": plain["a"], "skips": skips}], shuffle=False)
    assert order == [f"a{i}" for i in range(96) if i not in (0, 2)]


# --- still refused -------------------------------------------------------------------------------


def _with_name(src: str, dst: str, name: str) -> str:
    shutil.copytree(src, dst)
    index = os.path.join(dst, "index.json")
    with open(index) as f:
        obj = json.load(f)
    obj["shards"][0]["raw_data"]["basename"] = name
    with open(index, "w") as f:
        json.dump(obj, f)
    return dst


@pytest.mark.parametrize(
    "name",
    ["../a/shard.00000.mds", "sub/../../x.mds", "/etc/passwd", "C:/x.mds", "a\\..\\x.mds",
     "shard.00000.mds\0.txt", ""],
)  # fmt: skip
def test_escaping_names_are_refused(plain, tmp_path, name):
    d = _with_name(plain["a"], str(tmp_path / "ds"), name)
    with pytest.raises(safety.UnsafeIndexError, match="refusing shard name"):
        SkipStream(local=d).get_shards(World.detect(), False)


def test_symlink_escapes_are_refused(plain, tmp_path):
    outside = tmp_path / "outside"
    outside.mkdir()
    shutil.copy(os.path.join(plain["a"], "shard.00000.mds"), outside / "shard.00000.mds")
    d = _with_name(plain["a"], str(tmp_path / "ds"), "sub/shard.00000.mds")
    os.symlink(outside, os.path.join(d, "sub"))  # a directory link out of the stream
    with pytest.raises(safety.UnsafeIndexError, match="symlink leads out"):
        SkipStream(local=d).get_shards(World.detect(), False)
    os.remove(os.path.join(d, "sub"))
    os.remove(os.path.join(d, "shard.00001.mds"))
    os.symlink(outside / "shard.00000.mds", os.path.join(d, "shard.00001.mds"))  # a file link
    with pytest.raises(safety.UnsafeIndexError, match="symlink leads out"):
        SkipStream(local=d).get_shards(World.detect(), False)


def test_symlinks_inside_the_directory_are_fine(plain, tmp_path):
    d = str(tmp_path / "ds")
    shutil.copytree(plain["a"], d)
    os.rename(os.path.join(d, "shard.00000.mds"), os.path.join(d, "real.mds"))
    os.symlink("real.mds", os.path.join(d, "shard.00000.mds"))
    link = str(tmp_path / "link")
    os.symlink(d, link)  # the stream's directory itself may be a link
    assert run(SkipStream, [{"local": link}], shuffle=False) == [f"a{i}" for i in range(96)]
