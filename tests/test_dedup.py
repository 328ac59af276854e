"""Dedup: clustering (exact and within a Hamming radius), keeper choice, the job end to end."""

from __future__ import annotations

import json

import lance
import numpy as np
import pyarrow as pa
import pytest
from PIL import Image
from scipy.sparse.csgraph import connected_components

from prx_data.cli import dedup as DC
from prx_data.core import clusters as C
from prx_data.core.phash import hamming
from prx_data.core.runtime import RunOptions
from prx_data.export import layout
from prx_data.pipelines import dedup as PD
from prx_data.skips import sidecar as SL
from prx_data.skips.log import Provenance
from prx_data.skips.ops import update_list
from tests.dedup_images import jpeg, make_image
from tests.tablekit import make_table

TIERS = (64, 128)  # tier 128 needs >= 96x96 px, tier 64 >= 48x48


def same_partition(a: np.ndarray, b: np.ndarray) -> bool:
    return bool(np.array_equal(a[:, None] == a[None, :], b[:, None] == b[None, :]))


def planted(seed: int, n: int = 300, near: int = 80) -> np.ndarray:
    """Random hashes, copies with 1-5 flipped bits, and exact copies."""
    rng = np.random.default_rng(seed)
    base = rng.integers(0, 2**64, n, dtype=np.uint64, endpoint=False)
    out = [base, base[: n // 10]]
    for _ in range(near):
        h = base[int(rng.integers(n))]
        for b in rng.choice(64, int(rng.integers(1, 6)), replace=False):
            h = h ^ np.uint64(1 << int(b))
        out.append(np.array([h], np.uint64))
    return np.concatenate(out)


@pytest.mark.parametrize("radius", [0, 1, 2, 3, 5])
def test_clusters_equal_brute_force_single_linkage(radius):
    h = planted(radius)
    _, ref = connected_components(
        (hamming(h[:, None], h[None, :]) <= radius).astype(np.int8), directed=False
    )
    labels = C.cluster_hashes(h, radius)
    assert same_partition(labels, ref)
    assert labels.min() == 0 and labels.max() == len(np.unique(labels)) - 1


def test_near_pairs_finds_every_pair_within_radius():
    rng = np.random.default_rng(5)
    # Few distinct block values, so groups are large and pairs plentiful.
    h = np.unique(
        planted(9, n=200, near=200) & np.uint64(0xF0F0_FFFF_0F0F_FFFF)
        | rng.integers(0, 4, 1, dtype=np.uint64)
    )
    for radius in (1, 2, 4):
        i, j = C.near_pairs(h, radius)
        got = {(min(a, b), max(a, b)) for a, b in zip(i.tolist(), j.tolist(), strict=True)}
        d = hamming(h[:, None], h[None, :])
        want = {(a, b) for a, b in zip(*np.nonzero(np.triu(d <= radius, 1)), strict=True)}
        assert got == {(int(a), int(b)) for a, b in want}
    assert C._blocks(0) == [(0, 64)]
    assert sum(w for _, w in C._blocks(4)) == 64
    with pytest.raises(ValueError, match="radius"):
        C.cluster_hashes(h, C.MAX_RADIUS + 1)


def test_keeper_is_largest_then_smallest_id():
    hashes = np.array([7, 7, 7, 9, 9, 9, 11, 5, 5], np.uint64)
    ids = ["c", "a", "b", "z", "y", "x", "solo", "bad", "ok"]
    area = np.array([100, 400, 400, 10, 10, 10, 5, 10**6, 1])
    valid = np.array([True] * 7 + [False, True])  # "bad" has no hash
    cl = C.find_duplicates(hashes, ids, area, valid=valid)
    keeper_id = [ids[k] if k >= 0 else None for k in cl.keeper]
    assert keeper_id == ["a", "a", "a", "x", "x", "x", "solo", None, "ok"]
    assert cl.is_dup.tolist() == [True, False, True, True, True, False, False, False, False]
    assert cl.n_clusters == 2 and cl.n_removed == 4
    assert cl.labels[7] == -1
    # Ranked rows: each cluster's best first.
    assert [ids[r] for r in cl.ranked] == ["a", "b", "c", "x", "y", "z"]


def test_export_keeps_best_exported_copy_when_keeper_is_absent():
    hashes = np.array([1, 1, 1, 2, 2], np.uint64)
    cl = C.find_duplicates(hashes, ["k", "m", "n", "p", "q"], np.array([9, 5, 1, 3, 3]))
    exported = np.array([False, True, True, True, True])  # the keeper "k" was not exported
    assert sorted(C.export_skips(cl, exported).tolist()) == [2, 4]


# --- end to end -------------------------------------------------------------------------------


def dup_items() -> tuple[list[tuple[str, bytes, str | None]], dict[str, str]]:
    """Unique pictures plus copies; returns the items and the expected {copy id: keeper id}."""
    items = []
    for i in range(8):
        items.append((f"pic/{i:02d}", jpeg(make_image(300 + i, 200 + 8 * i, 160)), f"caption {i}"))
    big = make_image(400, 400, 300)
    items += [
        ("pic/big", jpeg(big), None),  # tier 128; its half-size copy lands in tier 64
        ("pic/big-half", jpeg(big.resize((100, 75), Image.Resampling.LANCZOS)), None),
        ("pic/02-copy", items[2][1], None),  # exact bytes
        ("pic/00-copy", items[0][1], None),  # same size as pic/00: the smaller id keeps
        ("pic/bad", b"not an image", None),
    ]
    expected = {"pic/big-half": "pic/big", "pic/02-copy": "pic/02", "pic/00-copy": "pic/00"}
    return items, expected


def export_in_process(table: str, out: str):
    """The real exporter's library steps, run in this process (no Ray)."""
    from prx_data.export.merge import finalize
    from prx_data.export.prepare import plan_units, prepare_output
    from prx_data.export.spec import ExportConfig
    from prx_data.export.unit import export_unit

    cfg = prepare_output(ExportConfig(table=table, out=out, tiers=TIERS, rows_per_task=5)).cfg
    results = {}
    for unit in plan_units(cfg):
        r = export_unit(cfg, unit)
        results[r.part] = r
    return finalize(cfg, results, 0.0)


def dup_of(uri: str) -> dict[str, str | None]:
    t = lance.dataset(uri).to_table(columns=["id", "dup_of"])
    return dict(zip(t["id"].to_pylist(), t["dup_of"].to_pylist(), strict=True))


@pytest.fixture()
def dup_table(tmp_path):
    items, expected = dup_items()
    uri = str(tmp_path / "t.lance")
    make_table(uri, items, max_rows_per_file=4)
    return uri, expected


def test_job_writes_dup_of_and_is_resumable(dup_table, tmp_path):
    uri, expected = dup_table
    report_path = tmp_path / "r.json"
    cfg = PD.DedupConfig(
        table=uri,
        run=RunOptions(engine="local", progress=False),
        tiers=TIERS,
        report=str(report_path),
    )
    r = PD.run_dedup(cfg)
    got = {k: v for k, v in dup_of(uri).items() if v is not None}
    assert got == expected
    assert r.removed == 3 and r.clusters == 3 and r.rows == 13 and r.hashed == 12
    assert r.unhashed == {"not_an_image": 1}
    assert r.clusters_spanning_tiers == 1  # pic/big (128) and pic/big-half (64)
    assert (
        r.tiers["64"].removed == 1 and r.tiers["128"].removed == 2
    )  # big-half is the only 64-tier row
    assert sum(b.removed for b in r.buckets.values()) == 3
    assert r.phash_job["rows_pending"] == 13 and r.phash_job["errors"] == {"not_an_image": 1}
    on_disk = json.loads(report_path.read_text())
    assert on_disk["removed"] == 3 and on_disk["tiers"]["128"]["removed"] == 2

    # Rerun: nothing left to hash (the bad row's reason is stored), same answer.
    r2 = PD.run_dedup(cfg)
    assert r2.phash_job["rows_pending"] == 0 and r2.removed == 3
    # New rows: only they are hashed, and a new copy joins an existing cluster.
    ds = lance.dataset(uri)
    row = ds.to_table(filter="id = 'pic/05'")
    extra = row.set_column(0, "id", pa.array(["pic/05-copy"]))
    for col in ("phash", "dup_of"):  # a freshly ingested row has neither
        i = extra.schema.get_field_index(col)
        extra = extra.set_column(i, extra.schema.field(i), pa.nulls(1, extra.schema.field(i).type))
    lance.write_dataset(extra, uri, mode="append")
    r3 = PD.run_dedup(cfg)
    assert r3.phash_job["rows_pending"] == 1
    assert dup_of(uri)["pic/05-copy"] == "pic/05" and r3.removed == 4


def test_radius_catches_reencoded_copy(tmp_path):
    im = make_image(82, 640, 480)  # its q20 copy hashes 2 bits away from the q95 original
    items = [
        ("a/orig", jpeg(im, 95), None),
        ("a/q20", jpeg(im, 20), None),
        ("a/other", jpeg(make_image(78, 640, 480)), None),
    ]
    uri = str(tmp_path / "r.lance")
    make_table(uri, items)
    r0 = PD.run_dedup(
        PD.DedupConfig(
            table=uri,
            run=RunOptions(engine="local", progress=False),
            radius=0,
        )
    )
    d = lance.dataset(uri).to_table(columns=["id", "phash"])
    h = dict(zip(d["id"].to_pylist(), d["phash"].to_pylist(), strict=True))
    assert int(hamming(h["a/orig"], h["a/q20"])) == 2
    assert r0.removed == 0 and dup_of(uri)["a/q20"] is None
    r2 = PD.run_dedup(
        PD.DedupConfig(
            table=uri,
            run=RunOptions(engine="local", progress=False),
            radius=2,
        )
    )
    assert r2.removed == 1 and r2.phash_job["rows_pending"] == 0
    assert dup_of(uri)["a/q20"] == "a/orig" and dup_of(uri)["a/other"] is None


def test_export_gets_dedup_skip_list(dup_table, tmp_path):
    uri, expected = dup_table
    out = str(tmp_path / "export")
    export_in_process(uri, out)
    man = layout.read_manifests(out)
    where = {
        i: (b, s, x)
        for b, s, x, i in zip(
            *(man[c].to_pylist() for c in ("bucket", "shard", "index", "id")), strict=True
        )
    }
    assert set(expected) <= set(where)
    # An id of the same list on a shard without duplicates must go, in every form.
    stale_id = "pic/07"
    b, s, x = where[stale_id]
    update_list(out, "dedup", [stale_id], Provenance("test"), table=uri)
    assert x in SL.load_skips(out, b, layout.read_index(out, b), ["dedup"])[s]
    cfg = PD.DedupConfig(
        table=uri,
        export=out,
        run=RunOptions(engine="local", progress=False),
        report=None,
    )
    r = PD.run_dedup(cfg)
    assert r.grouped_by == "export"
    skipped = set()
    for bucket in layout.list_buckets(out):
        shards = layout.read_index(out, bucket)
        for base, idx in SL.load_skips(out, bucket, shards, ["dedup"]).items():
            skipped |= {
                i
                for i, (bb, ss, xx) in where.items()
                if bb == bucket and ss == base and xx in set(idx.tolist())
            }
    assert skipped == set(expected)
    assert r.skip_list["samples_listed"] == 3
    # 3 of the 12 exported samples are skipped: past 10 % the report suggests a rewrite.
    assert r.skip_list["skipped_share_all_lists"] == pytest.approx(3 / man.num_rows)
    assert "python -m prx_data.skips rewrite" in r.table_text()
    assert r.tiers["64"].removed == 1 and r.tiers["128"].removed == 2
    assert sum(g.samples for g in r.buckets.values()) == man.num_rows
    assert r.clusters_spanning_tiers == 1
    # Running again gives the same sidecars, byte for byte.
    before = {rel: open(f"{out}/{rel}", "rb").read() for rel in SL.storage.list_files(out, ".skip")}
    PD.run_dedup(cfg)
    after = {rel: open(f"{out}/{rel}", "rb").read() for rel in SL.storage.list_files(out, ".skip")}
    assert before == after and len(before) >= 1


def test_cli_help_and_local_run(dup_table, tmp_path, capsys):
    with pytest.raises(SystemExit):
        DC.main(["--help"])
    help_text = capsys.readouterr().out
    for opt in (
        "--table",
        "--export",
        "--radius",
        "--name",
        "--report",
        "--engine",
        "--exact",
        "--tiers",
    ):
        assert opt in help_text
    uri, expected = dup_table
    rep = tmp_path / "cli.json"
    assert (
        DC.main(
            [
                "--table",
                uri,
                "--engine",
                "local",
                "--tiers",
                "64,128",
                "--report",
                str(rep),
                "--no-progress",
            ]
        )
        == 0
    )
    printed = capsys.readouterr().out
    assert "removed" in printed and "64/" in printed
    assert json.loads(rep.read_text())["removed"] == len(expected)


@pytest.mark.ray
def test_ray_engine_matches_local(dup_table, tmp_path, ray_local):
    from prx_data.pipelines.dedup import PhashJobConfig, compute_phash

    uri, _ = dup_table
    local_uri = str(tmp_path / "local.lance")
    items, _ = dup_items()
    make_table(local_uri, items)
    rep = compute_phash(
        PhashJobConfig(
            table=uri,
            run=RunOptions(engine="ray", progress=False),
            batch_size=4,
        )
    )
    compute_phash(
        PhashJobConfig(
            table=local_uri,
            run=RunOptions(engine="local", progress=False),
        )
    )
    assert rep.rows_hashed == 12 and rep.errors == {"not_an_image": 1}

    def col(u):
        t = lance.dataset(u).to_table(columns=["id", "phash", "phash_error"]).sort_by("id")
        return t.to_pylist()

    assert col(uri) == col(local_uri)


def test_the_report_goes_beside_the_table_not_into_the_working_folder(tmp_path, monkeypatch):
    from prx_data.cli import dedup as DC
    from tests.ingest_data import jpeg
    from tests.tablekit import make_table

    table = str(tmp_path / "data" / "photos.lance")
    make_table(table, [(f"t/{i}", jpeg(64 + i, 64), None) for i in range(3)])
    cwd = tmp_path / "cwd"
    cwd.mkdir()
    monkeypatch.chdir(cwd)
    assert DC.main(["--table", table, "--engine", "local", "--no-progress"]) == 0
    assert (tmp_path / "data" / "photos.dedup-report.json").is_file()
    assert not list(cwd.iterdir())
