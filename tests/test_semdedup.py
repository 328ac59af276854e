"""Semantic dedup (``python -m prx_data.semdedup``): planted near-duplicates, largest kept."""

from __future__ import annotations

import json

import numpy as np
import pyarrow as pa
import pytest
from PIL import ImageEnhance

from prx_data.columns.descriptors import compute_descriptors
from prx_data.core.runtime import RunOptions
from prx_data.export import layout
from prx_data.pipelines import semdedup as SJ
from prx_data.skips import semdedup as SD
from prx_data.skips import sidecar as SL
from tests.dedup_images import jpeg, make_image
from tests.tablekit import make_table
from tests.test_dedup import export_in_process

#: The originals are the largest; each has three planted near-duplicates.
PLANTED = {
    "p/00-small": "p/00",  # re-encoded at lower quality and size
    "p/00-crop": "p/00",  # cropped by 10 %
    "p/00-colour": "p/00",  # saturation and brightness shifted
    "p/05-small": "p/05",
    "p/05-crop": "p/05",
    "p/05-colour": "p/05",
}


def planted_items() -> list[tuple[str, bytes, str | None]]:
    out = []
    for s in range(16):
        out.append((f"p/{s:02d}", jpeg(make_image(s, 320, 240)), f"photo {s}"))
    for s in (0, 5):
        o = make_image(s, 320, 240)
        shifted = ImageEnhance.Color(o).enhance(1.4).point(lambda v: min(255, int(v * 1.1)))
        out += [
            (f"p/{s:02d}-small", jpeg(o.resize((200, 150)), quality=50), None),
            (f"p/{s:02d}-crop", jpeg(o.crop((16, 12, 304, 228))), None),
            (f"p/{s:02d}-colour", jpeg(shifted.resize((300, 225))), None),
        ]
    return out


@pytest.fixture()
def planted(tmp_path):
    uri = str(tmp_path / "t.lance")
    make_table(uri, planted_items(), max_rows_per_file=5)
    compute_descriptors(
        uri,
        run=RunOptions(progress=False),
    )  # a deterministic, model-free embedding
    return uri


@pytest.mark.parametrize("engine", ["local", "ray"])
def test_planted_near_duplicates_found_and_the_largest_kept(planted, tmp_path, engine, request):
    if engine == "ray":
        request.getfixturevalue("ray_local")
    out = str(tmp_path / "export")
    export_in_process(planted, out)
    cfg = SJ.SemDedupConfig(
        planted,
        export=out,
        embedding_column="pixel_descriptor",
        cluster_size=4,
        run=RunOptions(engine=engine),
    )
    rep = SJ.run_semdedup(cfg)
    assert rep.rows == 22 and rep.clusters > 1 and rep.threshold == SD.DEFAULT_THRESHOLD
    assert rep.removed == len(PLANTED)
    assert {e["id"]: e["kept"] for e in rep.examples} == PLANTED
    assert rep.by_threshold["0.95"]["removed"] == 6
    assert rep.by_threshold["0.8"]["removed"] >= 6  # lower thresholds remove at least as much
    assert json.loads(json.dumps(rep.to_dict()))["removed"] == 6

    # The skip list names exactly the planted copies.
    man = layout.read_manifests(out)
    where = {
        (b, s, int(x)): i
        for b, s, x, i in zip(
            *(man[c].to_pylist() for c in ("bucket", "shard", "index", "id")), strict=True
        )
    }
    skipped = set()
    for bucket in layout.list_buckets(out):
        shards = layout.read_index(out, bucket)
        for base, idx in SL.load_skips(out, bucket, shards, ["semdedup"]).items():
            skipped |= {where[(bucket, base, int(x))] for x in idx.tolist()}
    assert skipped == set(PLANTED)
    assert rep.skip_list["samples_listed"] == 6
    from prx_data.skips.ops import list_ids  # recorded in the table's list registry too

    assert set(list_ids(out, "semdedup").to_pylist()) == set(PLANTED)
    # Deterministic: a second run gives the same sidecars, byte for byte.
    before = {r: open(f"{out}/{r}", "rb").read() for r in SL.storage.list_files(out, ".skip")}
    SJ.run_semdedup(cfg)
    after = {r: open(f"{out}/{r}", "rb").read() for r in SL.storage.list_files(out, ".skip")}
    assert before == after


def test_within_cluster_matches_brute_force_and_chains_to_a_kept_row():
    rng = np.random.default_rng(1)
    base = SD.normalise(rng.standard_normal((300, 24)))
    copies = SD.normalise(base[:40] + 0.05 * rng.standard_normal((40, 24)))
    x = np.vstack([base, copies])
    area = np.r_[np.full(300, 100), np.full(40, 50)]  # originals are larger
    ids = pa.array([f"r{i:04d}" for i in range(len(x))])
    dups = SD.find_semantic_duplicates(
        lambda rows: x[rows], len(x), area, ids, cluster_size=30, batch_rows=64
    )
    removed = set(np.flatnonzero(dups.removed(0.95)).tolist())
    assert set(range(300, 340)) <= removed and len(removed) == 40
    keeper = dups.keeper(0.95)
    assert all(keeper[300 + i] == i for i in range(40))
    # Brute force (one cluster) finds the same at this threshold.
    one = SD.find_semantic_duplicates(lambda rows: x[rows], len(x), area, ids, cluster_size=10**6)
    assert set(np.flatnonzero(one.removed(0.95)).tolist()) == removed


def test_cli_reports_thresholds_and_explains_a_missing_column(planted, capsys):
    from prx_data.cli.semdedup import main

    assert (
        main(["--table", planted, "--embedding-column", "pixel_descriptor", "--engine", "local"])
        == 0
    )
    text = capsys.readouterr().out
    assert "<- chosen" in text and "cosine threshold" in text
    assert main(["--table", planted, "--engine", "local"]) == 2  # no clip_image_embedding yet
    err = capsys.readouterr().err
    assert "python -m prx_data.score clip" in err and len(err.splitlines()) == 1


def _image_files(uri: str) -> dict[int, list[str]]:
    """Per fragment, the data files that hold the image column."""
    import lance

    ds = lance.dataset(uri)
    fid = ds.lance_schema.field("image").id()
    return {
        f.fragment_id: sorted(d.path for d in f.metadata.data_files() if fid in d.field_ids())
        for f in ds.get_fragments()
    }


def test_ray_and_local_engines_agree_and_store_cluster_columns(planted, tmp_path, ray_local):
    import lance

    images = lance.dataset(planted).to_table(columns=["id", "image"]).sort_by("id")
    files = _image_files(planted)
    # A training sample smaller than the table: both engines must draw the same rows.
    common = dict(
        embedding_column="pixel_descriptor", cluster_size=4, rows_per_task=8, train_rows=12
    )
    reps, stored = {}, {}
    for engine in ("local", "ray"):
        out = str(tmp_path / f"export-{engine}")
        export_in_process(planted, out)
        rep = SJ.run_semdedup(
            SJ.SemDedupConfig(planted, export=out, run=RunOptions(engine=engine), **common)
        )
        d = rep.to_dict()
        d.pop("seconds")
        reps[engine] = (d, set(_list_ids(out)))
        stored[engine] = (
            lance.dataset(planted)
            .to_table(columns=["id", "semdedup_cluster", "semdedup_cosine"])
            .sort_by("id")
        )
    assert reps["local"][1] == reps["ray"][1] == set(PLANTED)
    for d in (reps["local"][0], reps["ray"][0]):
        d.pop("skip_list")
    assert reps["local"][0] == reps["ray"][0]
    assert stored["local"].equals(stored["ray"])
    t = stored["ray"].to_pydict()
    pairs = zip(t["semdedup_cluster"], t["semdedup_cosine"], strict=True)
    row = dict(zip(t["id"], pairs, strict=True))
    for copy, kept in PLANTED.items():
        assert row[copy][0] == row[kept][0]  # same stored cluster
        assert row[copy][1] >= SD.DEFAULT_THRESHOLD
    assert all(c is not None for c, _ in row.values())
    # Only the new columns' files were written: image files and bytes are as before.
    assert _image_files(planted) == files
    assert lance.dataset(planted).to_table(columns=["id", "image"]).sort_by("id").equals(images)


def _list_ids(out: str) -> list[str]:
    from prx_data.skips.ops import list_ids

    return list_ids(out, "semdedup").to_pylist()
