"""write_mds --keep-columns: table metadata rides in every sample and reaches the batches."""

from __future__ import annotations

import gc
import logging
import math
import os
from unittest import mock

import lance
import pyarrow as pa
import pytest

from prx_data.core.sample_data import make_sample_collection
from prx_data.export.merge import finalize
from prx_data.export.naming import ExportError
from prx_data.export.prepare import plan_units, prepare_output
from prx_data.export.spec import ExportConfig
from prx_data.export.unit import export_unit
from prx_data.stream.dataset import DatasetSpec
from tests.tablekit import folder_items, make_table

logging.getLogger("streaming").setLevel(logging.ERROR)


def _table(tmp_path) -> tuple[str, dict[str, dict]]:
    sizes = ((768, 768), (1024, 768), (700, 700), (768, 1024))
    items = make_sample_collection(str(tmp_path / "src"), sizes=sizes, repeats=1)
    uri = str(tmp_path / "t.lance")
    make_table(uri, folder_items(items), max_rows_per_file=2)
    ds = lance.dataset(uri)
    ids = ds.to_table(columns=["id"])["id"].to_pylist()
    n = len(ids)
    meta = {
        "similarity": pa.array([0.25 + i / 8 if i != 1 else None for i in range(n)], pa.float32()),
        "nsfw_votes": pa.array([i if i != 2 else None for i in range(n)], pa.int64()),
        "url": pa.array([f"http://x/{i}" for i in range(n)], pa.string()),
        "tags": pa.array([["a", "b"][: i % 3] for i in range(n)], pa.list_(pa.string())),
        "clip": pa.array([[float(i), 0.5] for i in range(n)], pa.list_(pa.float32(), 2)),
        "blob": pa.array([b"x"] * n, pa.binary()),
    }
    t = ds.to_table()
    for name, values in meta.items():
        t = t.append_column(name, values)
    lance.write_dataset(t, uri, mode="overwrite", max_rows_per_file=2)
    rows = {r["id"]: r for r in lance.dataset(uri).to_table().to_pylist()}
    return uri, rows


def _export(cfg: ExportConfig):
    cfg = prepare_output(cfg).cfg
    results = {}
    for unit in plan_units(cfg):
        r = export_unit(cfg, unit)
        results[r.part] = r
    return cfg, finalize(cfg, results, 0.0)


def _all_items(make) -> list[dict]:
    """Every item of the dataset ``make()`` builds, as one single-process rank."""
    import streaming.base.dataset as sd
    from streaming.base.util import clean_stale_shared_memory

    from prx_data.stream import dataset as ps

    env = {"RANK": "0", "WORLD_SIZE": "1", "LOCAL_WORLD_SIZE": "1", "LOCAL_RANK": "0"}
    clean_stale_shared_memory()
    with (
        mock.patch.dict(os.environ, env),
        mock.patch.object(sd, "maybe_init_dist", lambda: False),
        mock.patch.object(ps, "maybe_init_dist", lambda: False),
    ):
        ds = make()
        try:
            return [ds.get_item(i) for i in range(ds.num_samples)]
        finally:
            del ds
            gc.collect()
            clean_stale_shared_memory()


def _items(out: str, **kwargs) -> list[dict]:
    from prx_data.stream import dataset as ps

    return _all_items(
        lambda: ps.BucketedDataset(
            DatasetSpec(out), tier=512, batch_size=1, shuffle=False, num_workers=1, **kwargs
        )
    )


keep = ("similarity", "nsfw_votes", "url", "tags", "clip")


def test_kept_columns_reach_items_and_batches_with_their_types(tmp_path):
    from prx_data.train.data import collate

    uri, rows = _table(tmp_path)
    cfg, report = _export(
        ExportConfig(table=uri, out=str(tmp_path / "out"), tiers=(512,), keep_columns=keep)
    )
    assert report.samples_written == len(rows)
    items = _items(cfg.out, extra_columns=keep)
    assert sorted(i["id"] for i in items) == sorted(rows)
    for item in items:
        want = rows[item["id"]]
        if want["similarity"] is None:
            assert math.isnan(item["similarity"])
        else:
            assert item["similarity"] == pytest.approx(want["similarity"])
            assert isinstance(item["similarity"], float)
        assert item["nsfw_votes"] == want["nsfw_votes"]  # an int, or None where null
        assert item["url"] == want["url"] and item["tags"] == want["tags"]
        assert item["clip"] == pytest.approx(want["clip"])
    by_bucket: dict[str, list] = {}
    for i in items:
        by_bucket.setdefault(i["bucket"], []).append(i)
    square = max(by_bucket.values(), key=len)
    assert len(square) == 2  # 768x768 and 700x700
    batch = collate(square)
    assert batch["url"] == [i["url"] for i in square]
    assert batch["tags"] == [i["tags"] for i in square]
    with pytest.raises(Exception, match="not in the export"):
        _items(cfg.out, extra_columns=("punsafe",))


def test_keep_columns_refusals_and_resume(tmp_path):
    uri, _ = _table(tmp_path)
    out = str(tmp_path / "out")
    with pytest.raises(ExportError, match="'blob' is binary"):
        prepare_output(ExportConfig(table=uri, out=out, tiers=(512,), keep_columns=("blob",)))
    with pytest.raises(ExportError, match="'nope' is not in the table"):
        prepare_output(ExportConfig(table=uri, out=out, tiers=(512,), keep_columns=("nope",)))
    with pytest.raises(ExportError, match="clashes"):
        prepare_output(ExportConfig(table=uri, out=out, tiers=(512,), keep_columns=("width",)))
    assert not os.path.exists(out) or not os.listdir(out)
    # An interrupted export resumes only with the same --keep-columns.
    cfg = prepare_output(
        ExportConfig(table=uri, out=out, tiers=(512,), keep_columns=("url", "similarity"))
    ).cfg
    export_unit(cfg, plan_units(cfg)[0])
    with pytest.raises(ExportError, match="keep_columns"):
        prepare_output(
            ExportConfig(table=uri, out=out, tiers=(512,), keep_columns=("url",)), resume=True
        )
    again = prepare_output(
        ExportConfig(table=uri, out=out, tiers=(512,), keep_columns=("url", "similarity")),
        resume=True,
    ).cfg
    assert again.keep_columns == ("url", "similarity")


def test_train_yaml_extra_columns_reach_the_batches(tmp_path):
    """`data.extra_columns` in a training config: the trainer's own loader carries them."""
    from omegaconf import OmegaConf

    from prx_data.train.config import ConfigError, load_config
    from prx_data.train.data import build_dataset, collate

    uri, rows = _table(tmp_path)
    cfg, _ = _export(
        ExportConfig(table=uri, out=str(tmp_path / "out"), tiers=(512,), keep_columns=keep)
    )
    raw = {
        "data": {
            "datasets": [{"root": cfg.out}],
            "extra_columns": ["similarity", "url"],
            "global_batch_size": 1,
            "num_workers": 0,
            "plan": {"shuffle": False},
        },
    }
    path = tmp_path / "train.yaml"
    path.write_text(OmegaConf.to_yaml(raw))
    data = load_config(str(path)).data
    assert data.extra_columns == ["similarity", "url"]
    items = _all_items(lambda: build_dataset(data, batch_size=1))
    assert sorted(i["id"] for i in items) == sorted(rows)
    assert all(i["url"] == rows[i["id"]]["url"] for i in items)
    assert "tags" not in items[0]  # only what the config names
    assert collate(items[:1])["url"] == [items[0]["url"]]
    raw["data"]["extra_columns"] = ["caption"]
    path.write_text(OmegaConf.to_yaml(raw))
    with pytest.raises(ConfigError, match="data.extra_columns"):
        load_config(str(path))
