"""``skips rewrite --compact``: the small parts of an export repacked to the recommended size.

An export grown by many small appends (or written with ``--shard-size 0``)
holds one small part, and small shards, per unit and bucket. ``--compact``
packs a bucket's consecutive parts through the rewrite's own stage: encoded
samples copied, the skipped ones left out. Checked on a fabricated export of
many two-sample parts: far fewer parts, every kept sample streams
exactly once, its encoded bytes unchanged, ``verify --deep`` clean; and on a
real ``--shard-size 0`` export, which compacts to the packs the export's own
pack stage writes (same content names, same bytes).
"""

from __future__ import annotations

import os

import pyarrow.parquet as pq
import pytest

from prx_data.cli import verify as verify_cli
from prx_data.cli.skips import main as skips_main
from prx_data.export import layout
from prx_data.export import pack as packmod
from prx_data.skips import rewrite as R
from prx_data.skips import sidecar as S
from prx_data.stream.dataset import DatasetSpec
from tests.exportkit import make_export, run_rank, skip_samples

B1, B2 = "512/1.000", "512/0.500"


def encoded_samples(root: str) -> dict[str, bytes]:
    """{id: the sample's encoded MDS bytes}, through the manifests and the merged indexes."""
    got: dict[str, bytes] = {}
    for bucket in layout.list_buckets(root):
        entries = {e["raw_data"]["basename"]: e for e in layout.read_index_entries(root, bucket)}
        bdir = layout.rel_join(root, bucket)
        for rel in layout.list_suffix(bdir, layout.MANIFEST_NAME):
            rows = pq.read_table(layout.rel_join(root, f"{bucket}/{rel}")).to_pylist()
            cache: dict[str, list] = {}
            for row in rows:
                if row["shard"] not in cache:
                    raw = packmod.shard_raw(bdir, entries[row["shard"]])
                    cache[row["shard"]] = packmod.split_samples(raw)
                assert row["id"] not in got
                got[row["id"]] = bytes(cache[row["shard"]][row["index"]])
    return got


def parts(root: str, bucket: str) -> list[str]:
    bdir = layout.rel_join(root, bucket)
    return sorted(p for p in os.listdir(bdir) if os.path.isdir(os.path.join(bdir, p)))


def streamed(root: str) -> list[str]:
    """Every id one rank streams from ``root`` in one epoch (every bucket of the tier)."""
    run = run_rank(DatasetSpec(root), rank=0, world_size=1, batch_size=1, tier=512, shuffle=False)
    return [i for b in run.batches for i in b]


@pytest.fixture()
def small_parts(tmp_path):
    """20 + 12 parts of one two-sample shard each: what many small appends leave."""
    ex = make_export(str(tmp_path / "src"), {B1: 40, B2: 24}, samples_per_part=2)
    skip_samples(ex.root, "dedup", ids=[f"ds/{B1}/{i}" for i in range(0, 40, 5)])
    return ex


def test_compact_packs_small_parts_and_keeps_every_sample_once_byte_for_byte(small_parts, tmp_path):
    root = small_parts.root
    before = encoded_samples(root)
    assert len(parts(root, B1)) == 20 and len(parts(root, B2)) == 12
    out = str(tmp_path / "out")
    r = R.rewrite_export(root, out, names=["dedup"], compact="64M", progress=False)
    # No threshold applies (8 of 64 skipped); every bucket is one part of one shard now.
    assert r.verified and r.samples_out == 64 - 8 and r.parts == [32, 2]
    assert parts(out, B1) == ["f000000-000000000"] and parts(out, B2) == ["f000000-000000000"]
    shards = {b: len(layout.read_index_entries(out, b)) for b in (B1, B2)}
    assert shards == {B1: 1, B2: 1}
    after = encoded_samples(out)
    dead = {f"ds/{B1}/{i}" for i in range(0, 40, 5)}
    assert after == {k: v for k, v in before.items() if k not in dead}
    ids = streamed(out)
    assert len(ids) == len(set(ids)) == 56 and set(ids) == set(after)
    assert verify_cli.main([out, "--deep", "--no-progress"]) == 0
    assert "parts packed" in r.text()


def test_compact_cuts_at_the_size_and_keeps_lists_by_id(small_parts, tmp_path, capsys):
    root = small_parts.root
    skip_samples(root, "optout", ids=[f"ds/{B2}/{i}" for i in (0, 7, 23)])
    part_bytes = layout.read_index_entries(root, B2)[0]["raw_data"]["bytes"]  # one part
    out = str(tmp_path / "out")
    # About four parts' bytes per pack (captions differ in length): B2 (nothing applied) in 3
    # or 4 packs; B1 keeps 16 parts' worth (8 of its 20 parts lost half), so 4 or 5.
    assert (
        skips_main(["rewrite", root, out, "--name", "dedup", "--compact", str(4 * part_bytes)]) == 0
    )
    assert "packed 32 parts into" in capsys.readouterr().out
    assert 4 <= len(parts(out, B1)) <= 5 and 3 <= len(parts(out, B2)) <= 4
    for e in layout.read_index_entries(out, B2):  # no pack beyond the size asked for
        assert e["raw_data"]["bytes"] <= 4 * part_bytes
    # The list not applied is carried by row id onto the packed shards.
    assert S.list_skip_lists(out).keys() == {"optout"}
    ids = streamed(out)
    want = {f"ds/{B1}/{i}" for i in range(40) if i % 5} | {
        f"ds/{B2}/{i}" for i in range(24) if i not in (0, 7, 23)
    }
    assert len(ids) == len(set(ids)) and set(ids) == want


def test_without_compact_each_part_stays_a_part(small_parts, tmp_path):
    r = R.rewrite_export(small_parts.root, str(tmp_path / "out"), force=True, progress=False)
    assert r.parts == [32, 32] and "parts packed" not in r.text()
    assert len(parts(r.out, B2)) == 12


def test_compacting_a_shard_size_0_export_writes_the_export_pack_stages_packs(tmp_path):
    """The repack of small parts is the export's pack stage, run later: same names, same bytes."""
    import io

    from PIL import Image
    from prx_data.pipelines.write_mds import run_export

    from prx_data.core.runtime import RunOptions
    from prx_data.export.spec import ExportConfig
    from tests.tablekit import make_table

    def jpeg(i: int) -> bytes:
        buf = io.BytesIO()
        Image.new("RGB", (600, 600), (20 * i % 255, 200 - 10 * i, 7)).save(buf, "JPEG")
        return buf.getvalue()

    table = str(tmp_path / "t.lance")
    make_table(table, [(f"s/{i:02d}", jpeg(i), f"cap {i}") for i in range(12)], 7)

    def export(out: str, shard_size: int) -> str:
        cfg = ExportConfig(
            table=table, out=out, tiers=(512,), rows_per_task=2, min_units=1, shard_size=shard_size
        )
        run_export(cfg, RunOptions(progress=False, num_cpus=1, engine="local"))
        return out

    plain = export(str(tmp_path / "plain"), 0)
    part_bytes = [
        sum(
            e["raw_data"]["bytes"]
            for e in layout.read_index_entries(plain, B1)
            if p in e["raw_data"]["basename"]
        )
        for p in parts(plain, B1)
    ]
    target = 3 * max(part_bytes)  # a few packs of about three unit parts
    packed = export(str(tmp_path / "packed"), target)
    n_units = len(parts(plain, B1))  # 7: two fragments of 7 and 5 rows, 2 rows a unit
    assert n_units == 7 and 1 < len(parts(packed, B1)) < n_units
    out = str(tmp_path / "compacted")
    r = R.rewrite_export(plain, out, compact=target, progress=False)
    assert r.samples_out == r.samples_in == 12 and r.parts == [n_units, len(parts(packed, B1))]
    assert parts(out, B1) == parts(packed, B1)  # named by content, as the export names packs
    assert layout.content_digest(out) == layout.content_digest(packed)
    assert encoded_samples(out) == encoded_samples(plain)
