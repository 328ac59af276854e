"""Caption and classify keep each failure's reason in the table; --only redoes flagged rows alone."""

from __future__ import annotations

import lance
import pyarrow as pa
import pytest

from prx_data.columns.backends import GenerationConfig
from prx_data.core.runtime import RunOptions
from tests.caption_doubles import ChatServer, label_caption
from tests.test_caption import jpeg, make_table, scripted


def rows(uri: str, *columns: str) -> dict[str, tuple]:
    t = lance.dataset(uri).to_table(columns=["id", *columns]).to_pylist()
    return {r["id"]: tuple(r[c] for c in columns) for r in t}


def append_row(uri: str, row_id: str, **values) -> None:
    ds = lance.dataset(uri)
    data = {f.name: pa.array([values.get(f.name)], f.type) for f in ds.schema}
    data["id"] = pa.array([row_id], ds.schema.field("id").type)
    lance.write_dataset(pa.table(data, schema=ds.schema), uri, mode="append")


@pytest.mark.ray
@pytest.mark.usefixtures("ray_local")
def test_caption_records_each_failure_reason_and_only_redoes_flagged_rows(tmp_path):
    from prx_data.pipelines.caption import CaptionConfig, run_caption

    good = jpeg(64, 48, (220, 20, 20))
    images = [
        good,  # ok
        b"",  # empty file
        b"garbage",  # not an image
        good[:200],  # cut short: decode error
        None,  # no image at all
        jpeg(64, 48, (20, 20, 220)),  # looping (scripted)
        jpeg(64, 48, (20, 220, 20)),  # empty answer (scripted)
    ]
    uri = make_table(tmp_path / "t.lance", images)
    cols = ("caption_vlm", "caption_vlm_status", "caption_vlm_error")
    with ChatServer(scripted) as srv:
        cfg = CaptionConfig(
            table=uri,
            backend="openai",
            model="test-model",
            generation=GenerationConfig(max_tokens=64),
            backend_options={"base_url": srv.base_url, "backoff": 0.01},
            run=RunOptions(progress=False),
        )
        report = run_caption(cfg)
    assert report.rows == 7
    got = rows(uri, *cols)
    assert got["t/0"] == ("A plain red image of 64 by 48 pixels.", "ok", None)
    assert got["t/1"] == (None, "unreadable", "image: empty_file")
    assert got["t/2"] == (None, "unreadable", "image: not_an_image")
    assert got["t/3"] == (None, "unreadable", "image: decode_error")
    assert got["t/4"] == (None, "unreadable", "image: no_image")
    assert got["t/5"] == (None, "looping", "flagged: looping")
    assert got["t/6"] == (None, "empty", "flagged: empty")

    # A row ingested later has never been captioned; --only looping must leave it alone.
    append_row(uri, "t/new", image=good)
    with ChatServer() as srv:  # this server describes blue images without looping
        opts = {**cfg.backend_options, "base_url": srv.base_url}
        only = CaptionConfig(**{**cfg.__dict__, "backend_options": opts, "only": ("looping",)})
        redo = run_caption(only)
        assert srv.requests == 1
    assert redo.rows == 1 and redo.counts == {"ok": 1}
    after = rows(uri, *cols)
    assert after["t/5"] == ("A plain blue image of 64 by 48 pixels.", "ok", None)
    assert after["t/new"] == (None, None, None)
    assert {k: v for k, v in after.items() if k not in ("t/5", "t/new")} == {
        k: v for k, v in got.items() if k != "t/5"
    }
    with pytest.raises(ValueError, match="redo or only"):
        CaptionConfig(**{**cfg.__dict__, "redo": ("error",), "only": ("looping",)})
    with pytest.raises(ValueError, match="unknown status"):
        CaptionConfig(**{**cfg.__dict__, "only": ("lopping",)})


@pytest.mark.ray
@pytest.mark.usefixtures("ray_local")
def test_caption_cli_only_and_redo_help(tmp_path, capsys):
    from prx_data.cli.caption import build_parser, main

    help_text = " ".join(build_parser().format_help().split())
    assert "on top of the rows never computed" in help_text
    assert "--only" in help_text
    both = ["--table", "t", "--backend", "openai", "--model", "m", "--redo", "error"]
    assert main([*both, "--only", "looping"]) == 2
    assert "redo or only" in capsys.readouterr().err
    uri = make_table(tmp_path / "c.lance", [jpeg(50, 40)] * 3)
    with ChatServer() as srv:
        base = ["--table", uri, "--backend", "openai", "--model", "test-model"]
        base += ["--base-url", srv.base_url, "--no-progress"]
        assert main([*base, "--only", "error"]) == 0  # nothing is in error: nothing to do
        assert srv.requests == 0
        assert main([*base, "--limit", "2", "--commit-every", "1"]) == 0
        assert srv.requests == 2
    statuses = [v[0] for v in rows(uri, "caption_vlm_status").values()]
    assert statuses.count("ok") == 2 and statuses.count(None) == 1


def caption_table(uri: str, captions: list[str], per_fragment: int = 2) -> str:
    lance.write_dataset(
        pa.table(
            {
                "id": [f"c/{i}" for i in range(len(captions))],
                "image": pa.array([b""] * len(captions), pa.large_binary()),
                "caption_vlm": captions,
            }
        ),
        uri,
        max_rows_per_file=per_fragment,
    )
    return uri


@pytest.mark.ray
@pytest.mark.usefixtures("ray_local")
def test_classify_records_failure_reasons_and_only_redoes_unknown(tmp_path):
    from prx_data.pipelines.classify import ClassifyConfig, run_classify

    uri = caption_table(
        str(tmp_path / "c.lance"),
        [
            "A screenshot of a settings menu with toggles.",  # rules -> text
            "A weird thing.",  # model -> unparseable -> unknown
            "A cat asleep on a sofa.",  # model -> visual
        ],
    )
    with ChatServer(label_caption) as srv:
        cfg = ClassifyConfig(
            table=uri,
            backend="openai",
            model="test-model",
            backend_options={"base_url": srv.base_url, "max_retries": 0, "concurrency": 1},
            run=RunOptions(progress=False),
        )
        assert run_classify(cfg).rows == 3
    got = rows(uri, "label", "label_error")
    assert got == {
        "c/0": ("text", None),
        "c/1": ("unknown", "model: unparseable answer"),
        "c/2": ("visual", None),
    }

    append_row(uri, "c/new", caption_vlm="A horse in a field.")
    with ChatServer(lambda im, prompt: ("visual", "stop")) as srv:
        opts = {**cfg.backend_options, "base_url": srv.base_url}
        only = ClassifyConfig(**{**cfg.__dict__, "backend_options": opts, "only": ("unknown",)})
        redo = run_classify(only)
        assert redo.rows == 1 and redo.counts == {"visual": 1} and srv.requests == 1
        after = rows(uri, "label", "label_error")
        assert after["c/1"] == ("visual", None)
        assert after["c/new"] == (None, None)  # never labelled: left for a normal run
        normal = run_classify(ClassifyConfig(**{**only.__dict__, "only": ()}))
    assert normal.rows == 1 and rows(uri, "label")["c/new"] == ("visual",)


@pytest.mark.ray
@pytest.mark.usefixtures("ray_local")
def test_classify_backend_failure_keeps_its_reason_and_is_retried(tmp_path):
    from prx_data.pipelines.classify import ClassifyConfig, run_classify

    uri = caption_table(str(tmp_path / "f.lance"), ["A cat asleep on a sofa."])
    with ChatServer(label_caption) as srv:
        cfg = ClassifyConfig(
            table=uri,
            backend="openai",
            model="test-model",
            backend_options={"base_url": srv.base_url, "max_retries": 0},
            run=RunOptions(progress=False),
        )
        srv.fail_next(503)
        report = run_classify(cfg)
        assert report.counts == {"error": 1}
        label, error = rows(uri, "label", "label_error")["c/0"]
        assert label is None and error.startswith("backend: http 503")
        assert run_classify(cfg).counts == {"visual": 1}  # a null label is retried
    assert rows(uri, "label", "label_error")["c/0"] == ("visual", None)
