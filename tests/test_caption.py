"""Captioning: output checks, image budget, backends and the Ray pipeline on tiny tables.

The transformers backend runs a tiny random Qwen2-VL built from config
(tests/tinymodels.py); the openai backend talks to a local test-double
server (tests/caption_doubles.py). Neither produces meaningful captions:
the tests check the code paths and the bookkeeping.
"""

from __future__ import annotations

import io
import json
import os
import subprocess
import sys

import lance
import pyarrow as pa
import pytest
from PIL import Image

from prx_data.columns import checks
from prx_data.columns.backends import (
    BackendSpec,
    BackendUnavailable,
    GenerationConfig,
    OpenAIBackend,
    Request,
    VLLMBackend,
    data_url,
    make_spec,
)
from prx_data.columns.images import fit_image, fit_size
from prx_data.columns.prompts import load_classify_prompt, load_prompt
from prx_data.core.imaging import ImageError
from prx_data.core.runtime import RunOptions
from tests.caption_doubles import ChatServer, describe_image

os.environ.setdefault("HF_HUB_OFFLINE", "1")

FLUENT = (
    "A close-up photograph of a tabby cat curled on a knitted blue blanket, taken from slightly "
    "above. The cat occupies the centre of the frame, its head resting on its front paws and its "
    "green eyes half open. Soft window light falls from the left, leaving the right side of the "
    "blanket in gentle shadow. Behind the cat, out of focus, a wooden shelf holds two potted ferns "
    'and a white mug with the word "HOME" printed in black capitals.'
)


def jpeg(w: int, h: int, colour=(200, 30, 30)) -> bytes:
    buf = io.BytesIO()
    Image.new("RGB", (w, h), colour).save(buf, "JPEG", quality=90)
    return buf.getvalue()


def make_table(path, images: list[bytes | None], prefix: str = "t") -> str:
    uri = str(path)
    n = len(images)
    tbl = pa.table(
        {
            "id": [f"{prefix}/{i}" for i in range(n)],
            "image": pa.array(images, pa.large_binary()),
            "caption": pa.array([None] * n, pa.string()),
        }
    )
    lance.write_dataset(tbl, uri, max_rows_per_file=3)
    return uri


def read_back(uri: str, column: str = "caption_vlm") -> dict[str, tuple]:
    t = lance.dataset(uri).to_table(columns=["id", column, f"{column}_status"]).to_pylist()
    return {r["id"]: (r[column], r[f"{column}_status"]) for r in t}


# --- output checks ---------------------------------------------------------------


def test_checks_accept_a_fluent_caption_and_flag_failures():
    assert checks.check(FLUENT, "stop") == ("ok", FLUENT)
    # Hitting the limit right after a finished sentence is fine.
    assert checks.check(FLUENT, "length")[0] == "ok"
    assert checks.check(FLUENT.rsplit(".", 1)[0] + " and a", "length") == ("truncated", None)
    # Without a limit hit an unpunctuated end is not truncation.
    assert checks.check("A red bicycle leaning on a wall", "stop")[0] == "ok"
    assert checks.check("   ", "stop") == ("empty", None)
    assert checks.check(None, "stop") == ("empty", None)
    assert checks.check("<think>hmm</think>  ", "stop") == ("empty", None)
    assert checks.check("fine", "stop", error="http 500") == ("error", None)


def test_checks_detect_loops_in_words_and_characters():
    loop = "A red car parked by the road, " * 12
    assert checks.check(loop, "length") == ("looping", None)
    tail = FLUENT + " The blanket is blue and" + " very soft and" * 8
    assert checks.is_looping(tail)
    assert not checks.is_looping(FLUENT)
    assert checks.is_looping("一只猫坐在窗边。" + "蓝色的毯子" * 10)
    assert not checks.is_looping(
        "一只小猫坐在窗边的蓝色毯子上，阳光从左侧照进房间，背景里有两盆绿色的植物和一个白色杯子。"
    )
    # Looping wins over truncation: it says more about what went wrong.
    assert (
        checks.check("the the the the the the the the the the the the the", "length")[0]
        == "looping"
    )


# --- images and prompts --------------------------------------------------------


def test_fit_image_keeps_aspect_within_budget():
    assert fit_size(100, 50, 10_000) == (100, 50)
    w, h = fit_size(4000, 3000, 1_000_000)
    assert w * h <= 1_000_000 and abs(w / h - 4 / 3) < 0.01
    data, w, h = fit_image(jpeg(1200, 600), max_pixels=20_000)
    assert w * h <= 20_000 and abs(w / h - 2) < 0.05
    with Image.open(io.BytesIO(data)) as im:
        assert im.format == "JPEG" and im.size == (w, h)
    with pytest.raises(ImageError) as e:
        fit_image(b"not an image")
    assert e.value.reason == "not_an_image"


def test_prompts_are_editable_files(tmp_path):
    default = load_prompt(None)
    assert "verbatim" in default and "100 to 200 words" in default
    p = tmp_path / "mine.txt"
    p.write_text("  Describe the image briefly.\n")
    assert load_prompt(p) == "Describe the image briefly."
    p.write_text("\n")
    with pytest.raises(ValueError, match="empty"):
        load_prompt(p)
    with pytest.raises(FileNotFoundError):
        load_prompt(tmp_path / "missing.txt")
    p.write_text("Label this.")
    with pytest.raises(ValueError, match="caption"):
        load_classify_prompt(p)


# --- backend construction ----------------------------------------------------------


def test_spec_validation_and_resources():
    with pytest.raises(ValueError, match="unknown backend"):
        make_spec("nope", "m")
    with pytest.raises(ValueError, match="unknown option"):
        make_spec("openai", "m", options={"concurency": 4})
    spec = make_spec("openai", "m", options={"concurrency": 4}, replicas=2)
    assert (spec.replicas, spec.batch_size, spec.num_gpus) == (2, 16, 0.0)
    with pytest.raises(ValueError, match="max_tokens"):
        GenerationConfig(max_tokens=0)
    with pytest.raises(ValueError, match="replicas"):
        BackendSpec(OpenAIBackend, "m", replicas=0)


def test_vllm_backend_validates_and_explains_when_missing():
    assert (
        VLLMBackend.gpus_per_replica({"tensor_parallel_size": 2, "pipeline_parallel_size": 2}) == 4
    )
    assert VLLMBackend.engine_args({})["limit_mm_per_prompt"] == {"image": 1}
    assert "limit_mm_per_prompt" not in VLLMBackend.engine_args({}, text_only=True)
    assert (
        VLLMBackend.engine_args({"tensor_parallel_size": 2})["distributed_executor_backend"] == "mp"
    )
    with pytest.raises(ValueError, match="tensor_parallel_size"):
        VLLMBackend.engine_args({"tensor_parallel_size": 0})
    with pytest.raises(ValueError, match="must be a dict"):
        VLLMBackend.engine_args(["tensor_parallel_size", 2])
    try:
        import vllm  # noqa: F401
    except ImportError:
        with pytest.raises(BackendUnavailable, match="pip install vllm"):
            make_spec("vllm", "Qwen/Qwen3-VL-8B-Instruct")
        with pytest.raises(BackendUnavailable):
            VLLMBackend("Qwen/Qwen3-VL-8B-Instruct")
    else:  # pragma: no cover - only on GPU nodes with vllm
        spec = make_spec("vllm", "m", options={"engine_kwargs": {"tensor_parallel_size": 2}})
        assert spec.num_gpus == 2


def test_failure_guard_stops_only_a_backend_failing_everywhere():
    from prx_data.columns.backends import FailureGuard, Generation

    guard = FailureGuard(max_failed_batches=2)
    bad, good = Generation(None, None, "http 503"), Generation("A cat.", "stop")
    guard.update([bad, bad])
    guard.update([bad, good])  # one success resets the count
    guard.update([bad])
    with pytest.raises(RuntimeError, match="every row"):
        guard.update([bad, bad])


def test_data_url_sniffs_the_format():
    assert data_url(jpeg(4, 4)).startswith("data:image/jpeg;base64,")
    with pytest.raises(ValueError):
        data_url(b"nope")


# --- openai backend against the local test double --------------------------------


def test_openai_backend_retries_429_5xx_and_timeouts():
    with ChatServer() as srv:
        b = OpenAIBackend(
            "test-model",
            GenerationConfig(max_tokens=64),
            base_url=srv.base_url,
            concurrency=2,
            timeout=0.5,
            backoff=0.01,
        )
        srv.stall_s = 1.5
        srv.fail_next(429, 503, "stall")
        reqs = [Request("Describe.", jpeg(40 + i, 30, (0, 0, 220))) for i in range(4)]
        out = b(reqs)
        b.close()
    assert [g.error for g in out] == [None] * 4
    assert [g.text for g in out] == [
        f"A plain blue image of {40 + i} by 30 pixels." for i in range(4)
    ]
    assert b.retries == 3
    assert srv.failed == 2
    assert srv.max_in_flight <= 2


def test_openai_backend_gives_up_per_request():
    with ChatServer() as srv:
        b = OpenAIBackend(
            "test-model", base_url=srv.base_url, concurrency=1, max_retries=2, backoff=0.01
        )
        srv.fail_next(503, 503, 503)
        out = b([Request("Describe.", jpeg(8, 8)), Request("Describe.", jpeg(9, 9))])
        assert out[0].error.startswith("http 503") and out[1].error is None
        assert b.retries == 2
        b.retries = 0
        srv.fail_next(400)  # a client error is not retried
        out = b([Request("Describe.", jpeg(8, 8))])
        assert out[0].error.startswith("http 400") and b.retries == 0
        wrong = OpenAIBackend("other-model", base_url=srv.base_url, max_retries=0)
        assert "not served" in wrong([Request("x", jpeg(8, 8))])[0].error
        b.close()
        wrong.close()


# --- transformers backend on a tiny Qwen2-VL ------------------------------------------


@pytest.fixture(scope="module")
def tiny_vlm(tmp_path_factory):
    from prx_data.core.tinymodels import build_tiny_vlm

    return str(build_tiny_vlm(tmp_path_factory.mktemp("vlm") / "tiny-qwen2-vl"))


def test_transformers_backend_generates_from_images(tiny_vlm):
    from prx_data.columns.backends import TransformersBackend

    b = TransformersBackend(tiny_vlm, GenerationConfig(max_tokens=5), device="cpu")
    reqs = [
        Request("Describe this image.", fit_image(jpeg(300, 200, c))[0])
        for c in [(250, 0, 0), (0, 0, 250)]
    ]
    out = b(reqs)
    assert len(out) == 2
    for g in out:
        assert g.error is None and g.finish_reason in ("stop", "length")
        assert isinstance(g.text, str)
        if g.finish_reason == "length":
            assert g.text.strip()
    assert [g.text for g in b(reqs)] == [g.text for g in out]  # greedy is deterministic
    # A request the backend cannot take costs its own row, not the batch.
    mixed = b([reqs[0], Request("no image"), reqs[1]])
    assert "needs an image" in mixed[1].error
    assert [mixed[0].text, mixed[2].text] == [g.text for g in out]


# --- the Ray pipeline --------------------------------------------------------------


def scripted(image, prompt):
    """Per-colour behaviour of the test double: ok, empty, looping, truncated."""
    text, finish = describe_image(image, prompt)
    if "green" in text:
        return "", "stop"
    if "blue" in text:
        return "a blue square " * 30, "stop"
    if image.width == 33:
        return "A long description " + " ".join(f"word{i}" for i in range(40)) + ".", "stop"
    return text, finish


@pytest.mark.ray
def test_caption_pipeline_openai_statuses_resume_and_redo(tmp_path, ray_local):
    from prx_data.pipelines.caption import CaptionConfig, run_caption

    images = [
        jpeg(1200, 900, (220, 20, 20)),  # ok, downsized to the budget
        jpeg(64, 48, (220, 20, 20)),  # ok
        jpeg(64, 48, (20, 220, 20)),  # empty
        jpeg(64, 48, (20, 20, 220)),  # looping
        jpeg(33, 20, (220, 20, 20)),  # truncated by max_tokens
        b"garbage",  # error: not an image
        None,  # error: no image
    ]
    uri = make_table(tmp_path / "t.lance", images)
    with ChatServer(scripted) as srv:
        srv.fail_next(429, 503)
        cfg = CaptionConfig(
            table=uri,
            backend="openai",
            model="test-model",
            max_pixels=100_000,
            generation=GenerationConfig(max_tokens=20),
            backend_options={"base_url": srv.base_url, "backoff": 0.01, "concurrency": 2},
            run=RunOptions(progress=False),
        )
        report = run_caption(cfg)
        assert report.rows == 7
        assert report.counts == {
            "ok": 2,
            "empty": 1,
            "looping": 1,
            "truncated": 1,
            "unreadable": 2,
        }
        assert report.failed == 0  # unreadable images are drops, not backend failures
        assert report.reasons["image: not_an_image"] == 1 and report.reasons["image: no_image"] == 1
        got = read_back(uri)
        w, h = fit_size(1200, 900, 100_000)
        assert got["t/0"] == (f"A plain red image of {w} by {h} pixels.", "ok")
        assert got["t/1"] == ("A plain red image of 64 by 48 pixels.", "ok")
        assert [got[f"t/{i}"] for i in range(2, 7)] == [
            (None, "empty"),
            (None, "looping"),
            (None, "truncated"),
            (None, "unreadable"),
            (None, "unreadable"),
        ]
        assert max(a * b for a, b in srv.image_sizes) <= 100_000
        sent = srv.requests
        assert run_caption(cfg).rows == 0  # resumable: nothing left
        assert srv.requests == sent
        redo = run_caption(
            CaptionConfig(
                **{
                    **cfg.__dict__,
                    "redo": ("truncated", "looping"),
                    "generation": GenerationConfig(max_tokens=64),
                }
            )
        )
        assert redo.rows == 2 and redo.counts == {"ok": 1, "looping": 1}
        assert read_back(uri)["t/4"][1] == "ok"
        assert read_back(uri)["t/0"] == got["t/0"]


@pytest.mark.slow  # a fresh actor imports torch and loads the model: 10-25 s here
@pytest.mark.ray
def test_caption_pipeline_transformers_tiny_vlm(tmp_path, ray_local, tiny_vlm):
    from prx_data.pipelines.caption import CaptionConfig, run_caption

    uri = make_table(
        tmp_path / "v.lance", [jpeg(160, 120, (i * 60, 90, 30)) for i in range(4)] + [b"x"]
    )
    cfg = CaptionConfig(
        table=uri,
        backend="transformers",
        model=tiny_vlm,
        column="caption_tiny",
        generation=GenerationConfig(max_tokens=6),
        backend_options={"device": "cpu"},
        batch_size=2,
        limit=4,
        run=RunOptions(progress=False),
    )
    report = run_caption(cfg)
    assert report.rows == 4 and sum(report.counts.values()) == 4
    got = read_back(uri, "caption_tiny")
    assert got["t/4"] == (None, None)  # beyond the limit: still pending
    for caption, status in (got[f"t/{i}"] for i in range(4)):
        assert status in checks.STATUSES and status != "error"
        assert (caption is not None) == (status == "ok")


@pytest.mark.ray
def test_caption_cli_runs_and_reports(tmp_path, ray_local):
    from prx_data.cli.caption import main

    uri = make_table(tmp_path / "c.lance", [jpeg(50, 40, (200, 10, 10))] * 3)
    out = tmp_path / "report.json"
    with ChatServer() as srv:
        rc = main(
            [
                "--table", uri, "--backend", "openai", "--model", "test-model",
                "--base-url", srv.base_url, "--column", "cap2", "--limit", "2",
                "--report-json", str(out), "--no-progress",
                "--chat-template-kwargs", '{"enable_thinking": false}',
            ]
        )  # fmt: skip
        assert srv.last_body["chat_template_kwargs"] == {"enable_thinking": False}
        assert srv.last_body["max_tokens"] == 512
    assert rc == 0
    report = json.loads(out.read_text())
    assert report["rows"] == 2 and report["counts"] == {"ok": 2}
    assert sum(v[1] == "ok" for v in read_back(uri, "cap2").values()) == 2


def test_caption_cli_help_and_bad_input(tmp_path):
    r = subprocess.run(
        [sys.executable, "-m", "prx_data.caption", "--help"],
        capture_output=True,
        text=True,
        check=True,
    )
    for opt in (
        "--table",
        "--backend",
        "--model",
        "--column",
        "--prompt-file",
        "--max-pixels",
        "--limit",
    ):
        assert opt in r.stdout
    from prx_data.cli.caption import main

    assert (
        main(
            [
                "--table",
                str(tmp_path / "none"),
                "--backend",
                "openai",
                "--model",
                "m",
                "--redo",
                "bogus",
            ]
        )
        == 2
    )


@pytest.mark.slow  # Ray tears the failed pipeline down slowly: ~30 s here
@pytest.mark.ray
def test_caption_pipeline_stops_when_the_backend_is_down(tmp_path, ray_local):
    from prx_data.pipelines.caption import CaptionConfig, run_caption

    uri = make_table(tmp_path / "down.lance", [jpeg(20, 20)] * 7)
    with ChatServer() as srv:
        dead = srv.base_url  # the port is closed once the server stops
    cfg = CaptionConfig(
        table=uri,
        backend="openai",
        model="test-model",
        backend_options={"base_url": dead, "max_retries": 0, "concurrency": 1},
        batch_size=1,
        run=RunOptions(progress=False),
    )
    with pytest.raises(Exception, match="failed on every row"):
        run_caption(cfg)
    # Nothing was stored as a caption; the rows stay selectable for the next run.
    assert all(cap is None for cap, _ in read_back(uri).values())


@pytest.mark.timeout(600)
def test_transformers_backend_follows_the_schema_on_cpu(tiny_vlm):
    import json

    from prx_data.columns.backends import TransformersBackend
    from prx_data.columns.structured import Validator, canonical, load_schema

    schema = load_schema("attributes")  # the example shipped with the package
    gen = GenerationConfig(max_tokens=300, json_schema=canonical(schema))
    b = TransformersBackend(tiny_vlm, gen, device="cpu")
    reqs = [
        Request("Describe.", fit_image(jpeg(120, 90, c))[0]) for c in [(250, 0, 0), (0, 0, 250)]
    ]
    out = b(reqs)
    check = Validator(schema)
    for g in out:  # random weights, yet every output is a schema-valid object
        assert g.error is None and g.finish_reason == "stop"
        value, why = check.parse(g.text)
        assert why is None and value == json.loads(g.text)
    # Unconstrained, the same model does not write JSON at all.
    free = TransformersBackend(tiny_vlm, GenerationConfig(max_tokens=30), device="cpu")
    assert all(check.parse(g.text)[1] is not None for g in free(reqs))


def test_packaged_schema_is_the_documented_example():
    from prx_data.columns.structured import load_schema, schema_path

    assert schema_path("attributes").is_file()
    assert load_schema("attributes") == load_schema("configs/attributes.schema.json")
