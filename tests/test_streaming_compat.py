"""Contracts of the private Mosaic Streaming symbols in ``prx_data.core.streaming_compat``.

One test per symbol: when an upgrade breaks one, this file says which.
"""

from __future__ import annotations

import importlib
import json
import os

import numpy as np
import pytest
import streaming
from streaming import MDSWriter
from streaming.base.compression import compress

from prx_data.core import streaming_compat as C
from prx_data.skips.reader import SkipMDSReader


def _shard(tmp_path, n=10, compression=None):
    out = str(tmp_path / "mds")
    with MDSWriter(out=out, columns={"x": "int", "s": "str"}, compression=compression) as w:
        for i in range(n):
            w.write({"x": i, "s": f"s{i}"})
    with open(os.path.join(out, "index.json")) as f:
        entry = json.load(f)["shards"][0]
    return out, entry


def test_version_guard_names_what_to_check(monkeypatch):
    monkeypatch.setattr(streaming, "__version__", "0.99.0")
    with pytest.raises(ImportError, match="MDSReader.*SUPPORTED"):
        importlib.reload(C)
    monkeypatch.undo()
    importlib.reload(C)
    assert streaming.__version__.startswith(C.SUPPORTED)


def test_reader_from_json_builds_an_mds_reader_that_reads_samples(tmp_path):
    out, entry = _shard(tmp_path)
    reader = C.reader_from_json(out, None, entry)
    assert isinstance(reader, C.MDSReader)
    assert reader.samples == 10
    assert reader.get_item(3) == {"x": 3, "s": "s3"}
    assert isinstance(reader.raw_data, C.FileInfo)
    assert reader.raw_data.basename == entry["raw_data"]["basename"]


def test_mds_reader_constructor_round_trip(tmp_path):
    out, entry = _shard(tmp_path)
    reader = C.reader_from_json(out, None, entry)
    again = C.MDSReader(**C.mds_reader_args(reader))
    assert [again.get_item(i) for i in range(10)] == [reader.get_item(i) for i in range(10)]
    skipping = SkipMDSReader.wrap(reader, np.array([0, 4, 9]))
    assert skipping.samples == 7 and skipping.raw_samples == 10
    assert [skipping.get_item(i)["x"] for i in range(7)] == [1, 2, 3, 5, 6, 7, 8]
    assert skipping.raw_data is reader.raw_data  # same shard, not a copied __dict__


def test_decompress_inverts_compress():
    data = b"prx" * 1000
    assert C.decompress("zstd", compress("zstd", data)) == data


def test_world_detect_without_a_process_group(monkeypatch):
    for var in ("WORLD_SIZE", "RANK", "LOCAL_WORLD_SIZE", "LOCAL_RANK"):
        monkeypatch.delenv(var, raising=False)
    world = C.World.detect()
    assert (world.num_ranks, world.rank, world.num_nodes) == (1, 0, 1)


def test_maybe_init_dist_is_a_no_op_on_one_process(monkeypatch):
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    assert C.maybe_init_dist() is False
