"""Caption classification: answer parsing, the rule filter and the Ray pipeline.

The language model is a tiny random Qwen2 built from config
(tests/tinymodels.py) and the HTTP endpoint is a local test double
(tests/caption_doubles.py); their answers carry no meaning.
"""

from __future__ import annotations

import os
import subprocess
import sys

import lance
import pyarrow as pa
import pytest

from prx_data.columns.backends import GenerationConfig, Request
from prx_data.columns.labels import RuleFilter, parse_label, quoted_words
from prx_data.core.runtime import RunOptions
from tests.caption_doubles import ChatServer, label_caption

os.environ.setdefault("HF_HUB_OFFLINE", "1")


@pytest.mark.parametrize(
    "answer, label",
    [
        ("visual", "visual"),
        ("Text.", "text"),
        ("**NSFW**", "nsfw"),
        ("Answer: visual", "visual"),
        ('{"label": "text"}', "text"),
        ("I would read it.", "text"),
        ("Look at it", "visual"),
        ("Text. The image is a scanned page, not something visual.", "text"),
        ("<think>text or visual?</think>\nvisual", "visual"),
        ("It is visual, but also text", "unknown"),
        ("banana", "unknown"),
        ("", "unknown"),
        (None, "unknown"),
        ("contextual", "unknown"),
    ],
)
def test_parse_label(answer, label):
    assert parse_label(answer) == label


def test_rule_filter_defaults_catch_clear_cases_only():
    rules = RuleFilter.load()
    assert rules("A screenshot of a spreadsheet with monthly totals.") == "text"
    assert rules("A nude figure study in charcoal.") == "nsfw"
    assert rules('A red bicycle leaning on a brick wall beside a sign reading "OPEN".') is None
    assert rules("A photo with no text at all.") is None
    assert rules(None) is None
    long_quote = 'A poster that reads "' + " ".join(f"w{i}" for i in range(45)) + '".'
    assert quoted_words(long_quote) == 45
    assert rules(long_quote) == "text"


def test_rule_file_errors_name_the_line(tmp_path):
    p = tmp_path / "rules.txt"
    p.write_text("# comment\ntext: \\bmenu\\b\n")
    assert RuleFilter.load(p)("A restaurant MENU board") == "text"
    p.write_text("# comment\nlooks: foo\n")
    with pytest.raises(ValueError, match=":2:"):
        RuleFilter.load(p)
    p.write_text("nsfw: (unclosed\n")
    with pytest.raises(ValueError, match="regular expression"):
        RuleFilter.load(p)


CAPTIONS = [
    "A screenshot of a settings menu with toggles.",  # rules -> text
    "A page covered in small letters.",  # model -> text
    "A weird thing.",  # model -> unparseable -> unknown
    "An unclothed figure on a beach.",  # model -> nsfw
    "A cat asleep on a sofa.",  # model -> visual
    None,  # no caption: not classified
]


def make_table(path, captions=CAPTIONS) -> str:
    n = len(captions)
    tbl = pa.table(
        {
            "id": [f"c/{i}" for i in range(n)],
            "image": pa.array([b""] * n, pa.large_binary()),
            "caption_vlm": pa.array(captions, pa.string()),
        }
    )
    lance.write_dataset(tbl, str(path), max_rows_per_file=4)
    return str(path)


def labels_of(uri: str, column: str = "label") -> list:
    t = lance.dataset(uri).to_table(columns=["id", column]).to_pylist()
    return [r[column] for r in sorted(t, key=lambda r: r["id"])]


@pytest.mark.ray
def test_classify_rules_only(tmp_path, ray_local):
    from prx_data.pipelines.classify import ClassifyConfig, run_classify

    uri = make_table(tmp_path / "r.lance")
    report = run_classify(
        ClassifyConfig(
            table=uri,
            rules_only=True,
            run=RunOptions(progress=False),
        )
    )
    assert report.rows == 5 and report.counts == {"visual": 4, "text": 1}
    assert labels_of(uri) == ["text", "visual", "visual", "visual", "visual", None]


@pytest.mark.ray
def test_classify_openai_rules_then_model_resume_redo(tmp_path, ray_local):
    from prx_data.pipelines.classify import ClassifyConfig, run_classify

    uri = make_table(tmp_path / "o.lance")
    with ChatServer(label_caption) as srv:
        srv.fail_next(503)
        cfg = ClassifyConfig(
            table=uri,
            backend="openai",
            model="test-model",
            backend_options={"base_url": srv.base_url, "backoff": 0.01},
            run=RunOptions(progress=False),
        )
        report = run_classify(cfg)
        assert report.counts == {"text": 2, "unknown": 1, "nsfw": 1, "visual": 1}
        assert (
            report.reasons["rules: text"] == 1 and report.reasons["model: unparseable answer"] == 1
        )
        assert labels_of(uri) == ["text", "text", "unknown", "nsfw", "visual", None]
        assert srv.requests == 4 + 1  # the rule hit never reached the model; one retry
        assert run_classify(cfg).rows == 0
        redo = run_classify(ClassifyConfig(**{**cfg.__dict__, "redo": ("unknown",)}))
        assert redo.rows == 1 and redo.counts == {"unknown": 1}


@pytest.fixture(scope="module")
def tiny_lm(tmp_path_factory):
    from prx_data.core.tinymodels import build_tiny_causal_lm

    return str(build_tiny_causal_lm(tmp_path_factory.mktemp("lm") / "tiny-qwen2"))


def test_transformers_text_backend(tiny_lm):
    from prx_data.columns.backends import TransformersBackend

    b = TransformersBackend(tiny_lm, GenerationConfig(max_tokens=4), text_only=True, device="cpu")
    out = b(
        [
            Request("Is this visual? a cat"),
            Request("Is this text? a page of a book with many words"),
        ]
    )
    assert len(out) == 2 and all(
        g.error is None and g.finish_reason in ("stop", "length") for g in out
    )
    bad = b([Request("x", image=b"\xff\xd8\xff")])
    assert "text-only" in bad[0].error


@pytest.mark.slow  # a fresh actor imports torch and loads the model: 10-20 s here
@pytest.mark.ray
def test_classify_transformers_tiny_lm(tmp_path, ray_local, tiny_lm):
    from prx_data.pipelines.classify import ClassifyConfig, run_classify

    uri = make_table(tmp_path / "t.lance")
    cfg = ClassifyConfig(
        table=uri,
        backend="transformers",
        model=tiny_lm,
        column="kind",
        use_rules=False,
        backend_options={"device": "cpu"},
        batch_size=4,
        run=RunOptions(progress=False),
    )
    report = run_classify(cfg)
    assert report.rows == 5 and sum(report.counts.values()) == 5
    got = labels_of(uri, "kind")
    assert got[-1] is None
    assert set(got[:-1]) <= {"visual", "text", "nsfw", "unknown"}


def test_classify_cli(tmp_path, capsys):
    r = subprocess.run(
        [sys.executable, "-m", "prx_data.classify", "--help"],
        capture_output=True,
        text=True,
        check=True,
    )
    for opt in ("--table", "--backend", "--model", "--column", "--source-column", "--rules-only"):
        assert opt in r.stdout
    from prx_data.cli.classify import main

    assert main(["--table", "x"]) == 2  # neither a model nor --rules-only: one line
    assert "--rules-only" in capsys.readouterr().err


@pytest.mark.ray
def test_classify_cli_rules_only(tmp_path, ray_local):
    from prx_data.cli.classify import main

    uri = make_table(tmp_path / "cli.lance")
    assert main(["--table", uri, "--rules-only", "--column", "lbl", "--no-progress"]) == 0
    assert labels_of(uri, "lbl")[0] == "text"


def test_a_run_with_nothing_to_classify_says_why(tmp_path):
    """The README's default column (caption_vlm) empty: the report names it, the count, and
    the column to pass instead, rather than only "nothing to do"."""
    from prx_data.pipelines.classify import ClassifyConfig, run_classify

    uri = str(tmp_path / "t.lance")
    n = 5
    lance.write_dataset(
        pa.table(
            {
                "id": [f"c/{i}" for i in range(n)],
                "caption": [f"a photo of a cat {i}" for i in range(n)],
                "caption_vlm": pa.nulls(n, pa.string()),
                "caption_vlm_status": pa.array(["error"] * n, pa.string()),
            }
        ),
        uri,
    )
    cfg = ClassifyConfig(table=uri, rules_only=True, run=RunOptions(progress=False, engine="local"))
    report = run_classify(cfg)
    assert report.rows == 0
    text = report.summary()
    assert "'caption_vlm' has a usable value in 0 of 5 rows" in text
    assert "pass --source-column caption (5 rows have one)" in text
    # Once labelled, a rerun says so instead.
    run_classify(
        ClassifyConfig(
            table=uri,
            rules_only=True,
            run=RunOptions(progress=False, engine="local"),
            source_column="caption",
        )
    )
    again = run_classify(
        ClassifyConfig(
            table=uri,
            rules_only=True,
            run=RunOptions(progress=False, engine="local"),
            source_column="caption",
        )
    )
    assert (
        "5 of 5 rows have a 'caption' value and every one already has a 'label'" in again.summary()
    )
