"""The pack stage: a bucket's unit parts become shards of about ``--shard-size``.

Checked against the same export left unpacked (``shard_size=0``): the same
samples, byte for byte, with the same ids; the skip lists bound to the packed
shards; ``verify --deep`` clean; a crash at each step of a pack, then
``--resume``, byte-identical to an undisturbed run; the Ray path and the
driver path writing the same bytes.
"""

from __future__ import annotations

import io
import json
import os
from collections import Counter

import prx_data.pipelines.write_mds as pipeline
import pyarrow.parquet as pq
import pytest
from prx_data.pipelines.write_mds import run_export

from prx_data.cli import verify as verify_cli
from prx_data.core.runtime import RunOptions
from prx_data.export import layout, naming
from prx_data.export import pack as packmod
from prx_data.export.layout import content_digest, is_complete
from prx_data.export.spec import ExportConfig
from prx_data.skips import sidecar as SL
from prx_data.skips.export_state import read_store_list
from tests.tablekit import make_table

pytestmark = pytest.mark.ray
B = "512/1.000"
N_ROWS = 12


def _jpeg(i: int) -> bytes:
    from PIL import Image

    buf = io.BytesIO()
    Image.new("RGB", (600, 600), (20 * i % 255, 200 - 10 * i, 7)).save(buf, "JPEG")
    return buf.getvalue()


@pytest.fixture()
def table(tmp_path):
    """Twelve photos of one bucket over two fragments (a fresh list registry per test)."""
    uri = str(tmp_path / "t.lance")
    make_table(uri, [(f"s/{i:02d}", _jpeg(i), f"cap {i}") for i in range(N_ROWS)], 7)
    return uri


def _cfg(table: str, out: str, **kw) -> ExportConfig:
    return ExportConfig(table=table, out=out, tiers=(512,), rows_per_task=2, min_units=1, **kw)


def _export(table: str, out: str, **kw):
    flags = {k: kw.pop(k) for k in ("overwrite", "resume") if k in kw}
    return run_export(_cfg(table, out, **kw), RunOptions(progress=False), **flags)


def _samples(root: str, bucket: str = B) -> dict[str, bytes]:
    """{id: the sample's encoded MDS bytes}, found through the manifests and the merged index."""
    entries = {e["raw_data"]["basename"]: e for e in layout.read_index_entries(root, bucket)}
    got = {}
    for rel in layout.list_suffix(layout.rel_join(root, bucket), layout.MANIFEST_NAME):
        t = pq.read_table(layout.rel_join(root, f"{bucket}/{rel}")).to_pylist()
        by_shard: dict[str, list] = {}
        for row in t:
            by_shard.setdefault(row["shard"], []).append(row)
        for shard, rows in by_shard.items():
            # merged-index names carry their part: read them from the bucket directory
            data = packmod._shard_samples(layout.rel_join(root, bucket), entries[shard])
            for row in rows:
                got[row["id"]] = bytes(data[row["index"]])
    return got


def _parts(root: str, bucket: str = B) -> list[str]:
    return sorted(os.listdir(layout.rel_join(root, bucket)))


def test_packed_export_holds_the_unpacked_samples_in_few_shards(table, tmp_path, ray_local, capsys):
    plain, packed = str(tmp_path / "plain"), str(tmp_path / "packed")
    r0 = _export(table, plain, shard_size=0)
    r1 = _export(table, packed)
    assert r0.buckets == r1.buckets == {B: N_ROWS} and r0.units == r1.units
    assert len(_parts(plain)) - 1 == r0.units >= 6  # one part per unit (+ index.json)
    # The default 64 MiB: the whole bucket is one pack of one shard.
    index = layout.read_index(packed, B)
    # Parts and packs are named by the ids they hold, never by fragment ids or row numbers.
    whole = naming.content_pack_name(naming.ids_digest(f"s/{i:02d}" for i in range(N_ROWS)))
    assert [s.basename.split("/")[0] for s in index] == [whole]
    assert _parts(packed) == ["index.json", whole]
    assert all(naming.CONTENT_PART_RE.fullmatch(p) for p in _parts(plain) if p != "index.json")
    assert _samples(packed) == _samples(plain)  # the same ids, the same encoded bytes
    assert sorted(_samples(plain)) == [f"s/{i:02d}" for i in range(N_ROWS)]
    assert verify_cli.main([packed, "--deep", "--no-progress"]) == 0
    assert json.loads(open(os.path.join(packed, "_progress", "config")).read())["shard_size"] == (
        1 << 26
    )


def test_shard_size_and_size_limit_cut_packs_and_shards(table, tmp_path, ray_local):
    plain, packed = str(tmp_path / "plain"), str(tmp_path / "packed")
    _export(table, plain, shard_size=0)
    part_bytes = [s.bytes for s in layout.read_index(plain, B)]
    target = 2 * max(part_bytes) + 1  # at least two parts a pack
    _export(table, packed, shard_size=target, size_limit=max(part_bytes) + 64)
    packs = [p for p in _parts(packed) if p != "index.json"]
    assert 2 <= len(packs) < len(part_bytes) and all(naming.PART_RE.fullmatch(p) for p in packs)
    shards = layout.read_index(packed, B)
    per_pack = Counter(s.basename.split("/")[0] for s in shards)
    assert any(n > 1 for n in per_pack.values())  # size_limit splits a pack into shards
    assert all(s.bytes <= max(part_bytes) + 64 for s in shards)
    assert _samples(packed) == _samples(plain)
    assert verify_cli.main([packed, "--deep", "--no-progress"]) == 0


def test_tiny_bucket_of_one_sample_is_one_pack(tmp_path, ray_local):
    uri = str(tmp_path / "one.lance")
    make_table(uri, [("only", _jpeg(3), "c")])
    out = str(tmp_path / "o")
    report = _export(uri, out)
    assert report.samples_written == 1
    assert _parts(out) == ["index.json", naming.content_pack_name(naming.ids_digest(["only"]))]
    assert list(_samples(out)) == ["only"]
    assert verify_cli.main([out, "--deep", "--no-progress"]) == 0


def test_overwrite_carries_the_optout_list_onto_packed_shards(table, tmp_path, ray_local, capsys):
    out = str(tmp_path / "out")
    _export(table, out, shard_size=0)  # an old, unpacked tree
    ids = tmp_path / "o.txt"
    ids.write_text("s/01\ns/08\n")
    # A plain list (an opt-out's rows are never written again, so it would bind nothing).
    from prx_data.cli import skips as skips_cli

    assert skips_cli.main(["add", out, "optout", "--ids", str(ids)]) == 0
    report = _export(table, out, overwrite=True)  # re-exported packed: the list is carried
    assert {k: report.lists["optout"][k] for k in ("ids", "samples", "shards", "source")} == {
        "ids": 2,
        "samples": 2,
        "shards": 1,
        "source": "registry",
    }
    shards = layout.read_index(out, B)
    assert all(s.basename.startswith("p") for s in shards)
    skipped = SL.load_skips(out, B, shards, ["optout"])
    where = {}
    for rel in layout.list_suffix(layout.rel_join(out, B), layout.MANIFEST_NAME):
        for row in pq.read_table(layout.rel_join(out, f"{B}/{rel}")).to_pylist():
            where[row["id"]] = (row["shard"], row["index"])
    hit = sorted(i for i, (s, k) in where.items() if s in skipped and k in skipped[s])
    assert hit == ["s/01", "s/08"]
    assert sorted(read_store_list(out, "optout")["id"].to_pylist()) == ["s/01", "s/08"]
    capsys.readouterr()
    assert verify_cli.main([out, "--deep", "--no-progress"]) == 0, capsys.readouterr().out


class _Crash(Exception):
    pass


@pytest.mark.faults
@pytest.mark.parametrize("where", ["publish", "marker", "delete"])
def test_crash_inside_the_pack_stage_resumes_to_identical_bytes(
    where, table, tmp_path, ray_local, monkeypatch
):
    """A pack dies while staged, after its rename, or after its marker; --resume finishes it."""
    ref, out = str(tmp_path / "ref"), str(tmp_path / "out")
    part_bytes = max(s.bytes for s in layout.read_index(_export_plain(table, tmp_path), B))
    kw = {"shard_size": 2 * part_bytes + 1}
    _export(table, ref, **kw)
    calls = Counter()

    def crash_second(real):
        def wrapped(*a, **k):
            calls[where] += 1
            if calls[where] == 2:
                raise _Crash(where)
            return real(*a, **k)

        return wrapped

    if where == "publish":
        monkeypatch.setattr(packmod, "publish_parts", crash_second(packmod.publish_parts))
    elif where == "marker":
        real = packmod.storage.write_bytes_atomic
        monkeypatch.setattr(
            packmod.storage,
            "write_bytes_atomic",
            lambda p, d: (crash_second(real) if "/packed/" in p else real)(p, d),
        )
        calls[where] = 0
    else:
        monkeypatch.setattr(packmod, "remove_tree", crash_second(packmod.remove_tree))
    monkeypatch.setattr(pipeline, "DRIVER_PACK_THREADS", 1)  # the crash lands on the second pack
    with pytest.raises(_Crash):
        _export(table, out, **kw)
    monkeypatch.undo()
    assert not is_complete(out)
    _export(table, out, resume=True, **kw)
    assert content_digest(out) == content_digest(ref)
    assert _parts(out) == _parts(ref)
    assert verify_cli.main([out, "--deep", "--no-progress"]) == 0


def _export_plain(table: str, tmp_path) -> str:
    plain = str(tmp_path / "plain")
    if not os.path.isdir(plain):
        _export(table, plain, shard_size=0)
    return plain


def test_ray_tasks_and_driver_threads_write_the_same_packs(table, tmp_path, ray_local, monkeypatch):
    """Where a pack runs changes nothing: the plan is the units' counts, the bytes the parts'."""
    part_bytes = max(s.bytes for s in layout.read_index(_export_plain(table, tmp_path), B))
    kw = {"shard_size": 2 * part_bytes + 1}
    driver, ray_out = str(tmp_path / "driver"), str(tmp_path / "ray")
    _export(table, driver, **kw)
    monkeypatch.setattr(pipeline, "DRIVER_PACK_BYTES", 0)
    _export(table, ray_out, **kw)
    assert content_digest(ray_out) == content_digest(driver)
    assert len([p for p in _parts(ray_out) if p.startswith("p")]) >= 2
