"""Driver work around an export at scale: bounded parallel reads, same bytes, O(1) progress.

Concurrency is shown without timing: the first read waits on a ``threading.Barrier``
of two, which passes only if a second read starts meanwhile (one by one, the
barrier breaks after its guard timeout and the test fails).
"""

from __future__ import annotations

import json
import os
import posixpath
import random
import threading

import pytest
from prx_data.pipelines.write_mds import ProgressTotals

from prx_data.cli.verify import check_sidecar
from prx_data.core import storage
from prx_data.export import bounded, layout, merge, naming, safety
from prx_data.export import verify as V
from prx_data.export.merge import done_parts
from prx_data.export.spec import UnitResult
from tests.exportkit import make_export, skip_samples

B = "512/1.000"


def _pairwise(fn):
    """``fn`` whose first call returns only once a second call is running alongside it."""
    barrier = threading.Barrier(2, timeout=60)
    lock = threading.Lock()
    calls = 0

    def wrapped(*a, **kw):
        nonlocal calls
        with lock:
            calls += 1
            first_two = calls <= 2
        if first_two:
            barrier.wait()
        return fn(*a, **kw)

    return wrapped


def test_imap_bounded_keeps_input_order_and_bounds_what_is_in_flight():
    pulled = 0

    def items():
        nonlocal pulled
        for i in range(200):
            pulled += 1
            yield i

    workers = 4
    got = []
    for r in bounded.imap_bounded(_pairwise(lambda x: x * x), items(), workers):
        got.append(r)
        assert pulled - len(got) <= 2 * workers  # never the whole input submitted at once
    assert got == [i * i for i in range(200)]


def test_imap_bounded_raises_the_first_error_in_input_order():
    def fn(x):
        if x in (5, 9):
            raise ValueError(f"bad {x}")
        return x

    with pytest.raises(ValueError, match="bad 5"):
        bounded.map_bounded(fn, range(50), 8)


def _fake_parts(bdir: str, n: int) -> dict[str, int]:
    """Part indexes only (what merge_bucket reads): 1-3 shards of varying samples each."""
    rng = random.Random(7)
    expected = {}
    for k in range(n):
        part = naming.part_name(k // 10, (k % 10) * 1000)
        shards = []
        for j in range(rng.randint(1, 3)):
            samples = rng.randint(1, 50)
            shards.append(
                {
                    "column_names": ["id"],
                    "column_encodings": ["str"],
                    "format": "mds",
                    "raw_data": {
                        "basename": f"shard.{j:05d}.mds",
                        "bytes": 100 * samples,
                        "hashes": {"xxh64": f"{k:08x}{j:08x}"},
                    },
                    "samples": samples,
                    "zip_data": None,
                }
            )
        storage.write_bytes_atomic(
            os.path.join(bdir, part, "index.json"),
            json.dumps({"version": 2, "shards": shards}).encode(),
        )
        expected[part] = sum(s["samples"] for s in shards)
    return expected


def _reference_merge(bdir: str, parts: list[str]) -> bytes:
    """The merged index as one-by-one reads in sorted part order produce it."""
    shards = []
    for part in sorted(parts):
        with open(os.path.join(bdir, part, "index.json")) as f:
            for s in json.load(f)["shards"]:
                s["raw_data"]["basename"] = posixpath.join(part, s["raw_data"]["basename"])
                shards.append(s)
    return json.dumps({"version": 2, "shards": shards}, sort_keys=True).encode()


def test_merge_bucket_reads_parts_in_parallel_and_writes_the_same_bytes(tmp_path, monkeypatch):
    bdir = str(tmp_path / "512" / "1.000")
    expected = _fake_parts(bdir, 240)
    want = _reference_merge(bdir, list(expected))
    monkeypatch.setattr(merge, "load_index", _pairwise(safety.load_index))
    parts = list(expected)
    random.Random(1).shuffle(parts)  # the caller's order does not matter
    n = merge.merge_bucket(bdir, parts, expected=expected)
    assert n == sum(expected.values())
    with open(os.path.join(bdir, "index.json"), "rb") as f:
        assert f.read() == want


def test_merge_bucket_names_the_first_bad_part_in_order(tmp_path):
    bdir = str(tmp_path / "512" / "1.000")
    expected = _fake_parts(bdir, 60)
    parts = sorted(expected)
    wrong = dict(expected, **{parts[7]: -1, parts[40]: -1})
    with pytest.raises(naming.ExportError, match=parts[7]):
        merge.merge_bucket(bdir, parts, expected=wrong)
    assert not os.path.exists(os.path.join(bdir, "index.json"))


def test_resume_reads_unit_markers_in_parallel(tmp_path, monkeypatch):
    out = str(tmp_path)
    want = {}
    for k in range(64):
        r = UnitResult(part=naming.part_name(0, k * 10), rows=10, written=k, buckets={B: k})
        storage.write_bytes_atomic(naming.marker_path(out, r.part), r.to_json().encode())
        want[r.part] = r
    monkeypatch.setattr(storage, "read_bytes", _pairwise(storage.read_bytes))
    got = done_parts(out)
    assert list(got) == sorted(want)
    assert got == want


def test_progress_totals_are_running_sums():
    done = [UnitResult(part=f"p{i}", written=i) for i in range(10)]
    totals = ProgressTotals.of(done)
    assert (totals.units, totals.postfix()) == (10, {"samples": 45})
    totals.add(UnitResult(part="p10", written=5))
    assert (totals.units, totals.postfix()) == (11, {"samples": 50})
    # a unit reported again (e.g. retried) replaces its earlier count instead of adding to it
    totals.add(UnitResult(part="p10", written=7), replaces=UnitResult(part="p10", written=5))
    assert (totals.units, totals.postfix()) == (11, {"samples": 52})


def test_progress_postfix_does_not_revisit_finished_units():
    """Each finished unit is read once, however many finish after it (O(1) per unit)."""
    reads = 0

    class Counted(UnitResult):
        @property
        def written(self):
            nonlocal reads
            reads += 1
            return 1

        @written.setter
        def written(self, value):
            pass

    totals = ProgressTotals()
    for i in range(500):
        totals.add(Counted(part=f"p{i}"))
        totals.postfix()
    assert reads == 500 and totals.samples == 500


def test_verify_reads_manifests_and_sidecars_in_parallel_with_the_same_findings(
    tmp_path, monkeypatch
):
    root = str(tmp_path / "export")
    make_export(root, {B: 24}, samples_per_part=4, samples_per_shard=2)
    shards = layout.read_index(root, B)
    skip_samples(root, "dedup", {(B, s.basename): [0] for s in shards})
    # one sidecar for a shard that is not in the index, one with a bad name
    orphan = os.path.join(root, B, "f000000-000000000", "shard.00009.mds.dedup.skip")
    bad = os.path.join(root, B, shards[0].basename + ".Bad.skip")
    for path in (orphan, bad):
        with open(path, "wb") as f:
            f.write(b"x")
    before = V.verify_export(root, check_sidecar=check_sidecar)
    import pyarrow.parquet as pq

    monkeypatch.setattr(pq, "read_table", _pairwise(pq.read_table))
    after = V.verify_export(root, check_sidecar=_pairwise(check_sidecar))
    assert [str(p) for p in after.problems] == [str(p) for p in before.problems]
    assert after.sidecars == before.sidecars == len(shards) + 1
    assert sorted(p.path for p in after.problems) == sorted([orphan, bad])


def test_bench_scale_fabricates_an_export_that_verifies_and_streams(tmp_path):
    """The scale benchmark's fabricated tree is a real export: finalize, verify, stream."""
    import importlib.util

    from streaming import Stream, StreamingDataset

    from prx_data.export.merge import finalize
    from prx_data.export.spec import ExportConfig

    spec = importlib.util.spec_from_file_location(
        "bench_scale", os.path.join(os.path.dirname(__file__), "..", "benchmarks", "bench_scale.py")
    )
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    root = str(tmp_path / "export")
    shape = bench.fabricate(root, 1000, 40, str(tmp_path))  # checks itself against MDSWriter
    assert shape["buckets"] == 13 and shape["units"] == 2
    results = done_parts(root)
    cfg = ExportConfig(table="t", out=root, caption_columns=("caption",), tiers=(bench.TIER,))
    assert finalize(cfg, results, 0.0).samples_written == 1000
    assert V.verify_export(root, deep=True, check_sidecar=check_sidecar).ok
    bucket = layout.list_buckets(root)[0]
    ds = StreamingDataset(streams=[Stream(local=layout.rel_join(root, bucket))], batch_size=4)
    ids = [s["id"] for s in ds]
    assert ids == [bench._sid(i) for i in [*range(40), *range(520, 560)]]  # unit 0, then unit 1
