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


@pytest.mark.parametrize(
    ("ncn", "nodes", "rpn", "workers", "batch"),
    [(1, 1, 1, 1, 4), (4, 2, 2, 2, 4), (8, 4, 2, 3, 2), (2, 1, 4, 2, 3), (6, 3, 1, 2, 5)],
)
@pytest.mark.parametrize("algo", ["relaxed", "orig"])
def test_get_partitions_has_no_padding_at_the_planner_unit(algo, ncn, nodes, rpn, workers, batch):
    """The planner's per_stream unit is where streaming's own partition needs no padding."""
    from prx_data.stream.planner import BucketCount, DatasetCount, plan_buckets

    p = plan_buckets(
        [DatasetCount("a", [BucketCount("512/1.000", 10**6)])],
        device_batch_size=batch,
        world_size=nodes * rpn,
        num_nodes=nodes,
        num_workers=workers,
        num_canonical_nodes=ncn,
        shuffle=False,
    )
    gbs = batch * nodes * rpn
    for n in (p.unit, 3 * p.unit):
        part = C.get_partitions(algo, n, ncn, nodes, rpn, workers, batch)
        flat = part.reshape(-1)
        assert (flat >= 0).all(), "padding holes"
        assert sorted(flat.tolist()) == list(range(n)), "repeated or missing samples"
        # per_stream reads it as global batches in traversal order: all of them complete.
        assert part.transpose(3, 2, 0, 1, 4).reshape(-1, gbs).shape[0] == n // gbs
    # One global batch short of a unit, streaming pads (or the unit was not needed).
    if p.unit > gbs:
        short = C.get_partitions(algo, p.unit - gbs, ncn, nodes, rpn, workers, batch).reshape(-1)
        assert (short < 0).any() or len(short) != len(set(short.tolist()))


def test_is_safe_mds_encoding_reads_the_encodings_name():
    """Streaming's own check compares the whole string with 'pkl'; ours reads the name."""
    from streaming.base.format.mds.encodings import is_mds_encoding_safe

    assert is_mds_encoding_safe("pkl:x")  # streaming's check alone would let this through
    for enc in ("str", "bytes", "int32", "json", "jpeg", "ndarray:int8:3"):
        assert C.is_safe_mds_encoding(enc), enc
    for enc in ("pkl", "pkl:x", "PKL", " pkl", "ndarray:nonsense", "no-such", 7, None):
        assert not C.is_safe_mds_encoding(enc), enc


def test_get_hash_matches_the_hashes_mdswriter_records(tmp_path):
    """``verify --deep`` recomputes the index's shard hashes with this function."""
    out = str(tmp_path / "mds")
    with MDSWriter(out=out, columns={"x": "int"}, hashes=["sha1", "xxh64"]) as w:
        for i in range(5):
            w.write({"x": i})
    with open(os.path.join(out, "index.json")) as f:
        raw = json.load(f)["shards"][0]["raw_data"]
    with open(os.path.join(out, raw["basename"]), "rb") as f:
        data = f.read()
    assert {algo: C.get_hash(algo, data) for algo in raw["hashes"]} == raw["hashes"]


def test_no_streaming_internals_outside_the_compat_module():
    """Only the compat module may import ``streaming.<private>``."""
    import ast
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    allowed = {"prx_data/core/streaming_compat.py"}
    found = []
    for path in sorted([*root.glob("prx_data/**/*.py"), *root.glob("pipelines/**/*.py")]):
        rel = path.relative_to(root).as_posix()
        if rel in allowed:
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            names = (
                [a.name for a in node.names]
                if isinstance(node, ast.Import)
                else [node.module or ""]
                if isinstance(node, ast.ImportFrom)
                else []
            )
            found += [f"{rel}:{node.lineno}: {n}" for n in names if n.startswith("streaming.")]
    assert not found, found


def test_resample_streams_looks_get_sampling_up_as_a_module_global():
    """prx_data.stream.sampling reroutes that global: it only works while upstream calls it so."""
    from streaming import StreamingDataset

    module, get_sampling = C.sampling_hooks()
    assert module.get_sampling is get_sampling
    assert StreamingDataset.resample_streams.__globals__ is vars(module)
    assert "get_sampling" in StreamingDataset.resample_streams.__code__.co_names


def test_streamings_gcs_clients_are_anonymous_at_an_emulator_only(monkeypatch):
    """streaming_compat's hook: with STORAGE_EMULATOR_HOST, streaming's GCS downloader gets
    an anonymous client at the emulator; without it, streaming's own code runs (and fails
    without credentials, as it always did)."""
    from streaming.base.storage.download import GCSDownloader

    monkeypatch.delenv("GCS_KEY", raising=False)
    monkeypatch.delenv("STORAGE_EMULATOR_HOST", raising=False)
    monkeypatch.setenv("GOOGLE_APPLICATION_CREDENTIALS", "/nonexistent/credentials.json")
    d = GCSDownloader()
    with pytest.raises(ValueError):
        d._create_gcs_client()
    monkeypatch.setenv("STORAGE_EMULATOR_HOST", "http://127.0.0.1:9")
    d._create_gcs_client()
    assert type(d._gcs_client._credentials).__name__ == "AnonymousCredentials"
    assert "127.0.0.1:9" in d._gcs_client._connection.API_BASE_URL


@pytest.mark.parametrize("quiet", [False, True])
def test_shared_memory_another_process_removed_is_no_leak_line_at_exit(tmp_path, quiet):
    """streaming's atexit clean-up stops at the first block already gone and leaves the rest
    registered: the resource tracker then prints 'leaked shared_memory' at exit."""
    import subprocess
    import sys
    import uuid

    tag = uuid.uuid4().hex[:8]
    script = tmp_path / "shm.py"
    script.write_text(
        "import _posixshmem\n"
        + ("from prx_data.core.streaming_compat import quiet_shared_memory\n" if quiet else "")
        + ("quiet_shared_memory()\n" if quiet else "")
        + "from streaming.base.shared.memory import SharedMemory\n"
        + f"a = SharedMemory(name='{tag}_a', create=True, size=64)\n"
        + f"b = SharedMemory(name='{tag}_b', create=True, size=64)\n"
        + f"_posixshmem.shm_unlink('/{tag}_a')  # another process's clean-up\n"
    )
    r = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    leaked = "leaked shared_memory" in r.stderr or "No such file" in r.stderr
    assert leaked != quiet, r.stderr
    assert not os.path.exists(f"/dev/shm/{tag}_b")
