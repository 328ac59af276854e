"""``img_latent``: the precomputed VAE latents as one attached column among the others.

The latents job (``python -m prx_data.latents``, or ``python -m prx_data.attach OUT --vae``)
is the producer of the ``img_latent`` attached column; its files stay in ``_latents/``.
The loader serves it as ``extra_columns`` from local and ``s3://`` exports (the value
``vae.source: precomputed`` trains on), and the listings of an export's attached columns
(verify, the attach report) name it.
"""

from __future__ import annotations

import os

import numpy as np
import pytest

from prx_data.core.errors import UnknownName, UsageError
from prx_data.core.runtime import RunOptions
from prx_data.export import attached as A
from prx_data.export import latents as L
from prx_data.stream.spec import DatasetSpec
from tests.exportkit import make_export, rank_items, skip_samples, upload_tree

B1, B2 = "512/1.000", "512/0.500"


@pytest.fixture(scope="module")
def vae(tmp_path_factory) -> str:
    from prx_data.train.vae import save_tiny_autoencoder

    return save_tiny_autoencoder(str(tmp_path_factory.mktemp("vae") / "kl"))


@pytest.fixture(scope="module")
def export(tmp_path_factory, vae):
    """Two buckets, several shards each, float32 latents and a skip list (served indices
    differ from stored ones)."""
    from prx_data.pipelines.latents import LatentsConfig, run_latents

    root = str(tmp_path_factory.mktemp("latcol") / "ex")
    ex = make_export(root, {B1: 8, B2: 6}, samples_per_part=4, samples_per_shard=3)
    run_latents(
        LatentsConfig(
            out=root, vae=vae, dtype="float32", run=RunOptions(progress=False, engine="local")
        )
    )
    skip_samples(root, "dedup", ids=[f"ds/{B1}/1", f"ds/{B2}/4"])
    return ex


def test_img_latent_is_an_extra_column_holding_the_trained_latent(export):
    both = rank_items(DatasetSpec(export.root), extra_columns=("img_latent",), latents=True)
    alone = {
        i["id"]: i for i in rank_items(DatasetSpec(export.root), extra_columns=("img_latent",))
    }
    assert sorted(alone) == sorted(export.all_ids() - {f"ds/{B1}/1", f"ds/{B2}/4"})
    for it in both:
        got = it["img_latent"]
        assert isinstance(got, np.ndarray) and got.dtype == np.float32 and got.ndim == 3
        np.testing.assert_array_equal(got, it["latent"].numpy())
        np.testing.assert_array_equal(alone[it["id"]]["img_latent"], got)
        assert "latent" not in alone[it["id"]]


def test_img_latent_streams_from_s3_with_its_shard(tmp_path, export, s3_bucket, moto_server):
    local = {
        i["id"]: i["img_latent"] for i in rank_items(export.root, extra_columns=("img_latent",))
    }
    root = f"s3://{s3_bucket}/ex"
    upload_tree(export.root, root)
    cache = str(tmp_path / "cache")
    items = rank_items(DatasetSpec(root, local=cache), extra_columns=("img_latent",))
    assert sorted(i["id"] for i in items) == sorted(local)
    for it in items:
        np.testing.assert_array_equal(it["img_latent"], local[it["id"]])
    npys = [f for _, _, fs in os.walk(cache) for f in fs if f.endswith(".npy")]
    assert len(npys) == len(L.read_record(export.root)["shards"])


def test_img_latent_without_latents_or_with_stale_ones_is_one_line(tmp_path, export):
    bare = str(tmp_path / "bare")
    make_export(bare, {B1: 2})
    with pytest.raises(UnknownName, match="no precomputed latents") as err:
        rank_items(DatasetSpec(bare), extra_columns=("img_latent",))
    assert "python -m prx_data.latents" in str(err.value) and "\n" not in str(err.value)

    import shutil

    stale = str(tmp_path / "stale")
    shutil.copytree(export.root, stale)
    record = L.read_record(stale)
    record["shards"].pop(sorted(record["shards"])[0])
    L.write_record(stale, record["vae"], record["dtype"], record["shards"])
    with pytest.raises(L.LatentsError, match="no up-to-date latents") as err:
        rank_items(DatasetSpec(stale), extra_columns=("img_latent",))
    assert "\n" not in str(err.value)


def test_listings_of_attached_columns_name_img_latent(tmp_path, export, capsys):
    import lance
    import pyarrow as pa
    from prx_data.pipelines.attach import AttachConfig, run_attach

    from prx_data.cli.verify import main as verify_main
    from prx_data.export.verify import verify_export

    assert A.all_columns(export.root) == ["img_latent"]
    bare = str(tmp_path / "bare")
    make_export(bare, {B1: 2})
    assert A.all_columns(bare) == []

    import shutil

    root = str(tmp_path / "ex")
    shutil.copytree(export.root, root)
    ids = sorted(export.all_ids())
    table = str(tmp_path / "t.lance")
    lance.write_dataset(pa.table({"id": ids, "cap2": [f"c {i}" for i in ids]}), table)
    report = run_attach(AttachConfig(out=root, table=table, columns=("cap2",)))
    assert report.attached == ["cap2", "img_latent"]
    assert "attached columns: cap2, img_latent" in report.text()

    res = verify_export(root)
    assert res.ok and res.columns == ["cap2", "img_latent"]
    assert verify_main([root]) == 0
    assert "attached columns cap2, img_latent" in capsys.readouterr().err

    # The name belongs to the latents job: a table column of that name is refused.
    with pytest.raises(UsageError, match="prx_data.latents"):
        AttachConfig(out=root, table=table, columns=("img_latent",))


def test_attach_with_vae_runs_the_latents_job(tmp_path, vae, capsys):
    from prx_data.cli.attach import build_parser
    from prx_data.cli.attach import main as attach_main

    assert "img_latent" in build_parser().format_help()
    root = str(tmp_path / "ex")
    make_export(root, {B1: 2})
    argv = [root, "--vae", vae, "--dtype", "float32", "--engine", "local", "--no-progress"]
    assert attach_main(argv) == 0
    record = L.read_record(root)
    assert record["dtype"] == "float32" and len(record["shards"]) == 1
    assert A.all_columns(root) == ["img_latent"]
    # Every option of attach's own (not the latents job's) is named in the one line.
    for own in (["--table", "t.lance"], ["--text-dtype", "float16"], ["--max-length", "8"]):
        with pytest.raises(SystemExit) as ex:
            attach_main([root, "--vae", vae, *own])
        assert ex.value.code == 2
        err = capsys.readouterr().err
        assert "--vae makes the img_latent column" in err and f"not {own[0]}:" in err, err
