"""Pixel score jobs (``python -m prx_data.score``) on tiny random models: no downloads."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
import textwrap

import lance
import numpy as np
import pytest

from prx_data.columns import scores as SC
from prx_data.columns.runner import checkpoint_root
from prx_data.core.runtime import RunOptions
from prx_data.core.tinymodels import (
    build_tiny_aesthetic_head,
    build_tiny_clip,
    build_tiny_image_classifier,
)
from prx_data.pipelines import score as SJ
from tests.dedup_images import jpeg, make_image, png
from tests.tablekit import make_table

ROWS = 12
PER_FRAGMENT = 3


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    d = tmp_path_factory.mktemp("models")
    return {
        "clip": str(build_tiny_clip(d / "clip")),
        "watermark": str(build_tiny_image_classifier(d / "wm", ("no watermark", "Watermark!"))),
        "nsfw": str(build_tiny_image_classifier(d / "nsfw", ("normal", "nsfw"), seed=1)),
        "aesthetic": str(build_tiny_aesthetic_head(d / "head.safetensors")),
    }


def items() -> list[tuple[str, bytes, str | None]]:
    out = []
    for i in range(ROWS):
        im = make_image(i, 40 + 7 * i, 48)
        data = png(im) if i % 2 else jpeg(im)
        if i == 4:
            data = b"not an image"
        out.append((f"t/{i:02d}", data, None if i == 7 else f"a photo of a red cat {i}"))
    return out


def table(tmp_path, name: str = "t.lance") -> str:
    uri = str(tmp_path / name)
    make_table(uri, items(), max_rows_per_file=PER_FRAGMENT)
    return uri


def data_files(uri: str) -> dict[str, str]:
    root = os.path.join(uri, "data")
    return {
        n: hashlib.sha256(open(os.path.join(root, n), "rb").read()).hexdigest()
        for n in os.listdir(root)
    }


def cfg(uri: str, scorer: str, models: dict, **kw) -> SJ.ScoreConfig:
    return SJ.ScoreConfig(
        table=uri,
        scorer=scorer,
        model=models[scorer],
        run=RunOptions(engine="local", progress=False),
        **kw,
    )


def columns(uri: str, *names: str) -> dict[str, list]:
    t = lance.dataset(uri).to_table(columns=["id", *names]).sort_by("id")
    return {n: t[n].to_pylist() for n in names}


def test_every_scorer_adds_columns_without_rewriting_image_data(tmp_path, models):
    uri = table(tmp_path)
    before = data_files(uri)
    reports = {s: SJ.run_score(cfg(uri, s, models)) for s in SC.SCORERS}
    after = data_files(uri)
    assert {k: after[k] for k in before} == before  # image files byte for byte

    clip = reports["clip"]
    assert clip.rows == ROWS and clip.failures == {"not_an_image": 1}
    ds = lance.dataset(uri)
    assert str(ds.schema.field("clip_image_embedding").type) == "fixed_size_list<item: float>[16]"
    got = columns(uri, "clip_image_embedding", "clip_text_embedding", "clip_score", "clip_error")
    img, txt = got["clip_image_embedding"], got["clip_text_embedding"]
    assert img[4] is None and got["clip_error"][4] == "not_an_image"
    assert txt[7] is None and got["clip_score"][7] is None and img[7] is not None  # no caption
    for i in (0, 1, 5):
        a, b = np.asarray(img[i]), np.asarray(txt[i])
        assert np.linalg.norm(a) == pytest.approx(1, abs=1e-5)
        assert got["clip_score"][i] == pytest.approx(float(a @ b), abs=1e-5)

    # The aesthetic head reads the stored embedding: a chain of linear layers.
    head = SC.LinearHead.from_state_dict(SC.load_state_dict(models["aesthetic"]))
    aes = columns(uri, "aesthetic_score", "aesthetic_error")
    assert reports["aesthetic"].rows == ROWS - 1  # rows without an embedding are not pending
    assert aes["aesthetic_score"][0] == pytest.approx(float(head(np.asarray([img[0]]))[0]), 1e-5)
    assert aes["aesthetic_score"][4] is None

    # Classifiers: the top class and one probability column per class, summing to 1.
    wm = columns(uri, "watermark_label", "watermark_p_no_watermark", "watermark_p_watermark")
    assert reports["watermark"].failures == {"not_an_image": 1}
    for i in range(ROWS):
        if i == 4:
            assert wm["watermark_label"][i] is None and wm["watermark_p_watermark"][i] is None
            continue
        p = (wm["watermark_p_no_watermark"][i], wm["watermark_p_watermark"][i])
        assert sum(p) == pytest.approx(1, abs=1e-5)
        assert wm["watermark_label"][i] == ("no watermark", "Watermark!")[int(np.argmax(p))]
    assert "nsfw_p_nsfw" in ds.schema.names and "nsfw_label" in ds.schema.names

    # Usable as SQL filters (skips add --where, write_mds --filter) and as the vector column.
    assert ds.count_rows("clip_score IS NOT NULL AND watermark_p_watermark >= 0") == ROWS - 2
    from prx_data.table.search import similar, vector_column

    assert vector_column(ds) == "clip_image_embedding"
    hits = similar(ds, "t/00", k=3)
    assert len(hits) == 3 and "t/00" not in hits["id"].to_pylist()

    # Done rows are not redone; a second run has nothing pending.
    assert SJ.run_score(cfg(uri, "clip", models)).rows == 1  # only the failed row is retried


NAMES = ["clip_image_embedding", "clip_score", "watermark_p_watermark", "watermark_label"]


def same_scores(a: str, b: str) -> None:
    ca, cb = columns(a, *NAMES), columns(b, *NAMES)
    assert ca["watermark_label"] == cb["watermark_label"]
    for n in NAMES[:3]:
        for x, y in zip(ca[n], cb[n], strict=True):
            assert (x is None) == (y is None)
            if x is not None:
                np.testing.assert_allclose(x, y, rtol=1e-5, atol=1e-6)


def test_scores_are_deterministic_whatever_the_batching(tmp_path, models):
    a, b = table(tmp_path, "a.lance"), table(tmp_path, "b.lance")
    for scorer in ("clip", "watermark"):
        SJ.run_score(cfg(a, scorer, models))
        SJ.run_score(cfg(b, scorer, models, batch_size=5, commit_every=1))
    same_scores(a, b)


@pytest.mark.slow
def test_ray_actors_give_the_same_scores_as_local(tmp_path, models, ray_local):
    a, b = table(tmp_path, "a.lance"), table(tmp_path, "b.lance")
    for scorer in ("clip", "watermark"):
        SJ.run_score(cfg(a, scorer, models))
        SJ.run_score(
            SJ.ScoreConfig(
                b,
                scorer,
                models[scorer],
                run=RunOptions(engine="ray", progress=False),
            )
        )
    same_scores(a, b)


KILL = textwrap.dedent(
    """
    import os, sys
    sys.path.insert(0, {root!r})
    from prx_data.pipelines import score as SJ

    def kill(fragment, done):
        if done == 2:
            os._exit(9)  # like SIGKILL: nothing committed, two fragments checkpointed

    from prx_data.core.runtime import RunOptions

    cfg = SJ.ScoreConfig({uri!r}, "clip", {model!r}, run=RunOptions("local", progress=False),
                         commit_every=100)
    SJ.run_score(cfg, on_fragment=kill)
    """
)


@pytest.mark.faults
def test_killed_score_job_resumes_and_matches_an_uninterrupted_run(tmp_path, models):
    uri, ref = table(tmp_path), table(tmp_path, "ref.lance")
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    script = KILL.format(root=root, uri=uri, model=models["clip"])
    r = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert r.returncode == 9, r.stderr[-2000:]
    assert lance.dataset(uri).count_rows("clip_image_embedding IS NOT NULL") == 0
    assert len(os.listdir(checkpoint_root(uri, "score-clip"))) == 2

    rep = SJ.run_score(cfg(uri, "clip", models))
    assert rep.recovered_rows == 2 * PER_FRAGMENT
    assert rep.rows == ROWS - 2 * PER_FRAGMENT + 1  # + the undecodable row: retried each run
    SJ.run_score(cfg(ref, "clip", models))
    got, want = columns(uri, "clip_score"), columns(ref, "clip_score")
    np.testing.assert_allclose(
        np.array(got["clip_score"], float), np.array(want["clip_score"], float), rtol=1e-5
    )
    assert not os.listdir(checkpoint_root(uri, "score-clip"))


def test_cli_runs_reports_and_rejects_bad_heads_in_one_line(tmp_path, models, capsys):
    from prx_data.cli.score import main

    uri = table(tmp_path)
    out = tmp_path / "r.json"
    argv = ["--table", uri, "--engine", "local", "--no-progress", "--max-error-rate", "0.5"]
    assert main(["clip", "--model", models["clip"], "--report-json", str(out), *argv]) == 0
    rep = json.loads(out.read_text())
    assert rep["rows"] == ROWS and rep["failures"] == {"not_an_image": 1}
    assert rep["failed"] == 0 and rep["unreadable"] == 1  # a drop, not a model failure
    assert "clip: 12 rows" in capsys.readouterr().out

    # A head for another embedding size, a pickled object, a missing file: exit 2, one line.
    wide = build_tiny_aesthetic_head(tmp_path / "wide.safetensors", dim=32)
    assert main(["aesthetic", "--model", str(wide), *argv]) == 2
    assert "16 dimensions" in capsys.readouterr().err
    import torch

    torch.save({"head": SJ.ScoreReport("t", "x", [])}, tmp_path / "pickled.pt")
    assert main(["aesthetic", "--model", str(tmp_path / "pickled.pt"), *argv]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error:") and "weights-only" in err and len(err.splitlines()) == 1
    assert main(["aesthetic", "--model", str(tmp_path / "absent.pt"), *argv]) == 2
    # aesthetic before clip: says what to run.
    fresh = table(tmp_path, "fresh.lance")
    assert (
        main(["aesthetic", "--model", models["aesthetic"], "--table", fresh, "--no-progress"]) == 2
    )
    assert "run the clip scorer first" in capsys.readouterr().err
    shutil.rmtree(fresh)


def test_stats_plots_every_score_distribution(tmp_path, capsys):
    import pyarrow as pa

    from prx_data.cli import stats as stats_cli

    uri = table(tmp_path)
    ds = lance.dataset(uri)
    ids = ds.to_table(columns=["id"])["id"]
    n = len(ids)
    vals = pa.table(
        {
            "id": ids,
            "clip_score": pa.array(np.linspace(-0.2, 0.4, n), pa.float32()),
            "nsfw_p_nsfw": pa.array([None] + [0.91] * (n - 1), pa.float32()),
        }
    )
    from prx_data.table.lance_ops import update_column

    update_column(uri, "clip_score", vals.select(["id", "clip_score"]))
    update_column(uri, "nsfw_p_nsfw", vals.select(["id", "nsfw_p_nsfw"]))
    out = str(tmp_path / "out")
    assert stats_cli.main(["--table", uri, "--out", out]) == 0
    assert open(os.path.join(out, "scores.png"), "rb").read(8) == b"\x89PNG\r\n\x1a\n"
    saved = json.load(open(os.path.join(out, "stats.json")))["scores"]
    assert set(saved) == {"clip_score", "nsfw_p_nsfw"}
    assert saved["nsfw_p_nsfw"]["scored"] == n - 1 and sum(saved["nsfw_p_nsfw"]["counts"]) == n - 1
    assert saved["nsfw_p_nsfw"]["counts"][36] == n - 1  # 0.91 in the 40-bin [0, 1] histogram
    assert saved["clip_score"]["edges"][0] == pytest.approx(-0.2, abs=1e-6)
    assert "score clip_score: 12 rows" in capsys.readouterr().out


def test_explorer_filters_and_shows_scores(tmp_path):
    import pyarrow as pa

    from prx_data.table.lance_ops import update_column
    from tests.explore_kit import make_explore_table, running_server
    from tests.test_explore import api, get

    uri = str(tmp_path / "t.lance")
    make_explore_table(uri)
    ids = lance.dataset(uri).to_table(columns=["id"])["id"].to_pylist()
    score = [0.9 if i.startswith("t/red") else 0.1 for i in ids]
    update_column(
        uri, "clip_score", pa.table({"id": ids, "clip_score": pa.array(score, pa.float32())})
    )
    with running_server(uri) as (url, _srv):
        assert api(url, "/api/meta")["scores"] == ["clip_score"]
        res = api(url, "/api/search", **{"min.clip_score": "0.5"})
        assert sorted(r["id"] for r in res["results"]) == [f"t/red{i}" for i in range(4)]
        assert all(r["scores"]["clip_score"] > 0.5 for r in res["results"])
        low = api(url, "/api/search", **{"max.clip_score": "0.5"})
        assert len(low["results"]) == len(ids) - 4 - score.count(None)
        for bad in ("high", "nan", "inf"):
            status, _, body = get(f"{url}/api/search?min.clip_score={bad}")
            assert status == 400 and b"must be a number" in body


def test_wrong_model_class_is_one_line_and_leaves_the_table_alone(tmp_path, models, capsys):
    from transformers import CLIPVisionConfig, CLIPVisionModelWithProjection

    from prx_data.cli.score import main

    uri = table(tmp_path)
    v0 = lance.dataset(uri).version
    vision = tmp_path / "vision-only"
    CLIPVisionModelWithProjection(
        CLIPVisionConfig(
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=1,
            num_attention_heads=2,
            image_size=32,
            patch_size=8,
        )
    ).save_pretrained(vision)
    argv = ["--table", uri, "--engine", "local", "--no-progress"]
    assert main(["clip", "--model", str(vision), *argv]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1
    assert "CLIPVisionModelWithProjection" in err and "needs a CLIPModel" in err
    # A CLIP model is no image classifier either.
    assert main(["watermark", "--model", models["clip"], *argv]) == 2
    err = capsys.readouterr().err.strip()
    assert "CLIPModel" in err and "image classifier" in err and len(err.splitlines()) == 1
    assert lance.dataset(uri).version == v0
    assert not [n for n in lance.dataset(uri).schema.names if n.startswith(("clip_", "watermark_"))]
