"""Structured attributes: schema -> struct column, guided generation, validation, subsets.

The models here are test doubles that say so: :class:`tests.caption_doubles.ChatServer`
(a local OpenAI-compatible endpoint answering from the image's colour), a
stand-in ``vllm`` module that records what the backend passes it, and
:class:`ScriptedBackend`, a :class:`Backend` that ignores the schema (like the
transformers backend, which cannot enforce it) so validation alone must
catch its bad outputs.
"""

from __future__ import annotations

import hashlib
import importlib.machinery
import io
import json
import os
import sys
import types
from collections.abc import Sequence

import lance
import pyarrow as pa
import pytest
from PIL import Image

from prx_data.columns import structured as ST
from prx_data.columns.backends import (
    Backend,
    BackendSpec,
    Generation,
    GenerationConfig,
    Request,
    VLLMBackend,
)
from prx_data.core.runtime import RunOptions
from tests.caption_doubles import ChatServer
from tests.tablekit import make_table

SCHEMA_FILE = os.path.join(os.path.dirname(__file__), "..", "configs", "attributes.schema.json")


def attrs(style: str, **kw) -> dict:
    base = {
        "subjects": ["object"],
        "style": style,
        "lighting": "studio",
        "text_present": False,
        "watermark_present": False,
    }
    return {**base, **kw}


def jpeg(colour, w: int = 400, h: int = 400) -> bytes:
    buf = io.BytesIO()
    Image.new("RGB", (w, h), colour).save(buf, "JPEG", quality=90)
    return buf.getvalue()


RED, GREEN, BLUE, GREY = (220, 20, 20), (20, 200, 20), (20, 20, 220), (128, 128, 128)


def answer(image, prompt: str) -> tuple[str, str]:
    """The test endpoint: valid JSON for red and green, an off-schema style for blue,
    prose for grey; red 401 px wide comes in a Markdown fence."""
    assert "JSON schema" in prompt and '"watermark_present"' in prompt
    r, g, b = image.getpixel((image.width // 2, image.height // 2))
    if abs(r - g) < 30 and abs(g - b) < 30:
        return "Sure! The image shows a grey square.", "stop"
    if r > 150:
        body = json.dumps(attrs("photo", subjects=["object", "text"], text_present=True))
        return (f"```json\n{body}\n```" if image.width == 401 else body), "stop"
    if g > 150:
        return json.dumps(attrs("illustration", lighting="daylight")), "stop"
    return json.dumps(attrs("oil painting")), "stop"


def data_files(uri: str) -> dict[str, str]:
    root = os.path.join(uri, "data")
    return {
        n: hashlib.sha256(open(os.path.join(root, n), "rb").read()).hexdigest()
        for n in os.listdir(root)
    }


def read(uri: str, column: str = "attributes") -> dict[str, tuple]:
    t = lance.dataset(uri).to_table(columns=["id", column, f"{column}_status", f"{column}_error"])
    return {
        r["id"]: (r[column], r[f"{column}_status"], r[f"{column}_error"]) for r in t.to_pylist()
    }


# --- the schema --------------------------------------------------------------------------


def test_schema_types_the_struct_and_unsupported_schemas_are_refused(tmp_path):
    schema = ST.load_schema(SCHEMA_FILE)
    assert ST.arrow_type(schema) == pa.struct(
        [
            pa.field("subjects", pa.list_(pa.string())),
            pa.field("style", pa.string()),
            pa.field("lighting", pa.string()),
            pa.field("text_present", pa.bool_()),
            pa.field("watermark_present", pa.bool_()),
        ]
    )
    nested = {
        "type": "object",
        "properties": {
            "n": {"type": ["integer", "null"]},
            "box": {"type": "object", "properties": {"x": {"type": "number"}}},
        },
    }
    assert ST.arrow_type(nested) == pa.struct(
        [pa.field("n", pa.int64()), pa.field("box", pa.struct([pa.field("x", pa.float64())]))]
    )
    bad = {
        "oneOf": {"type": "object", "properties": {"a": {"oneOf": [{"type": "string"}]}}},
        "not an object": {"type": "string"},
        "no properties": {"type": "object"},
        "untyped array": {"type": "object", "properties": {"a": {"type": "array"}}},
        "bad required": {"type": "object", "properties": {"a": {}}, "required": ["b"]},
    }
    for why, schema in bad.items():
        p = tmp_path / f"{len(why)}.json"
        p.write_text(json.dumps(schema))
        with pytest.raises(ST.SchemaError):
            ST.load_schema(p)
    (tmp_path / "broken.json").write_text("{not json")
    with pytest.raises(ST.SchemaError, match="not valid JSON"):
        ST.load_schema(tmp_path / "broken.json")


def test_validator_accepts_fenced_json_and_explains_failures():
    v = ST.Validator(ST.load_schema(SCHEMA_FILE))
    ok = attrs("photo")
    assert v.parse("<think>hm</think>```json\n" + json.dumps(ok) + "\n```") == (ok, None)
    assert v.parse(json.dumps(attrs("oil")))[1].startswith("schema: style: 'oil' is not one of")
    missing = {k: val for k, val in ok.items() if k != "lighting"}
    assert "'lighting' is a required property" in v.parse(json.dumps(missing))[1]
    assert v.parse('{"style": "photo"')[1].startswith("not JSON")
    assert v.parse(json.dumps({**ok, "extra": 1}))[1].startswith("schema: (root)")
    # A value the validator accepts but Arrow cannot hold is flagged, not stored.
    wide = ST.Validator({"type": "object", "properties": {"n": {"type": "integer"}}})
    arr, why = wide.to_arrow([{"n": 1}, {"n": 2**70}, None])
    assert arr.to_pylist() == [{"n": 1}, None, None]
    assert why[0] is None and why[1].startswith("schema: value does not fit")


# --- guided generation -------------------------------------------------------------------


def test_vllm_backend_asks_for_guided_decoding(monkeypatch):
    """A stand-in ``vllm`` package (test double) records the sampling parameters."""
    seen: dict = {}

    class GuidedDecodingParams:
        def __init__(self, json=None, **kw):
            self.json = json

    class SamplingParams:
        def __init__(self, **kw):
            seen["sampling"] = kw

    class LLM:
        def __init__(self, model, **kw):
            seen["model"] = model

    vllm = types.ModuleType("vllm")
    vllm.__spec__ = importlib.machinery.ModuleSpec("vllm", None)
    vllm.LLM, vllm.SamplingParams = LLM, SamplingParams
    sp = types.ModuleType("vllm.sampling_params")
    sp.GuidedDecodingParams = GuidedDecodingParams
    monkeypatch.setitem(sys.modules, "vllm", vllm)
    monkeypatch.setitem(sys.modules, "vllm.sampling_params", sp)
    schema = ST.load_schema(SCHEMA_FILE)
    VLLMBackend("m", GenerationConfig(json_schema=ST.canonical(schema)))
    assert seen["sampling"]["guided_decoding"].json == schema
    VLLMBackend("m", GenerationConfig())
    assert "guided_decoding" not in seen["sampling"]


class ScriptedBackend(Backend):
    """Test double: answers from a script by image size, ignoring any schema."""

    name = "scripted"

    def __init__(self, model: str, generation: GenerationConfig | None = None, **kw):
        super().__init__(model, generation)

    def prepare(self, requests: Sequence[Request]):
        return [Image.open(io.BytesIO(r.image)).width for r in requests]

    def generate(self, prepared):
        script = {
            400: (json.dumps(attrs("photo")), "stop"),
            300: (json.dumps(attrs("photo"))[:40], "length"),  # cut off by the token limit
            200: ("", "stop"),
        }
        return [script.get(w, ("no JSON here", "stop")) for w in prepared]

    def decode(self, raw) -> list[Generation]:
        return [Generation(t, f) for t, f in raw]


def test_validation_alone_flags_a_backend_that_ignores_the_schema():
    """The actor as the job runs it, on a stand-in backend that cannot enforce the schema."""
    from prx_data.pipelines.caption import AttributesActor, prepare_images

    sizes = (400, 300, 200, 250)
    batch = pa.table(
        {
            "id": [f"s/{w}" for w in sizes],
            "image": pa.array([jpeg(RED, w, 300) for w in sizes], pa.large_binary()),
        }
    )
    spec = BackendSpec(ScriptedBackend, "scripted", batch_size=4)
    actor = AttributesActor(spec, "prompt", "attributes", ST.canonical(ST.load_schema(SCHEMA_FILE)))
    out = actor(prepare_images(batch, 1_000_000)).to_pydict()
    assert out["attributes"] == [attrs("photo"), None, None, None]
    assert out["attributes_status"] == ["ok", "truncated", "empty", "invalid"]
    assert out["attributes_error"][0] is None
    assert out["attributes_error"][1].startswith("truncated: not JSON")
    assert out["attributes_error"][3].startswith("invalid: not JSON")
    assert out["__reason"][1:] == ["truncated: not JSON", "flagged: empty", "invalid: not JSON"]


# --- the job --------------------------------------------------------------------------------


@pytest.mark.ray
def test_attributes_job_stores_valid_flags_invalid_and_filters_a_subset(tmp_path, ray_local):
    from prx_data.pipelines.write_mds import run_export

    from prx_data.cli.caption import main as caption_main
    from prx_data.export.layout import read_manifests
    from prx_data.export.spec import ExportConfig

    uri = str(tmp_path / "t.lance")
    items = [
        ("a/red0", jpeg(RED), None),
        ("a/red1", jpeg(RED, 401), None),  # fenced JSON
        ("a/green", jpeg(GREEN), None),
        ("a/blue", jpeg(BLUE), None),  # style not in the enum
        ("a/grey", jpeg(GREY), None),  # prose, not JSON
        ("a/bad", b"not an image", None),
    ]
    make_table(uri, items, max_rows_per_file=4)
    images = lance.dataset(uri).to_table(columns=["id", "image"]).to_pylist()
    before = data_files(uri)
    report_file = tmp_path / "report.json"
    with ChatServer(answer) as srv:
        rc = caption_main(
            [
                "--table", uri, "--backend", "openai", "--model", "test-model",
                "--base-url", srv.base_url, "--concurrency", "2", "--schema", SCHEMA_FILE,
                "--report-json", str(report_file), "--no-progress",
            ]
        )  # fmt: skip
        fmt = srv.last_body["response_format"]
        assert fmt["type"] == "json_schema"
        assert fmt["json_schema"]["schema"] == ST.load_schema(SCHEMA_FILE)
    assert rc == 0
    report = json.loads(report_file.read_text())  # the default column with --schema: attributes
    assert report["counts"] == {"ok": 3, "invalid": 2, "unreadable": 1}
    assert report["reasons"]["invalid: schema"] == 1
    assert report["reasons"]["invalid: not JSON"] == 1
    got = read(uri)
    red = attrs("photo", subjects=["object", "text"], text_present=True)
    assert got["a/red0"] == (red, "ok", None) and got["a/red1"] == (red, "ok", None)
    assert got["a/green"] == (attrs("illustration", lighting="daylight"), "ok", None)
    value, status, error = got["a/blue"]
    assert value is None and status == "invalid"
    assert error.startswith("invalid: schema: style: 'oil painting' is not one of")
    assert got["a/grey"][:2] == (None, "invalid") and "not JSON" in got["a/grey"][2]
    assert got["a/bad"][:2] == (None, "unreadable")
    ds = lance.dataset(uri)
    assert ds.schema.field("attributes").type == ST.arrow_type(ST.load_schema(SCHEMA_FILE))
    # Images untouched: the same bytes, and every data file that was there is unchanged.
    assert ds.to_table(columns=["id", "image"]).to_pylist() == images
    after = data_files(uri)
    assert {k: after[k] for k in before} == before
    # Struct fields filter like columns.
    assert ds.count_rows("attributes.style = 'photo'") == 2
    assert ds.count_rows("array_has(attributes.subjects, 'text')") == 2

    # A fine-tuning subset: export only the photos.
    out = str(tmp_path / "photos")
    run_export(
        ExportConfig(table=uri, out=out, tiers=(512,), filter="attributes.style = 'photo'"),
        RunOptions(progress=False),
    )
    assert sorted(read_manifests(out)["id"].to_pylist()) == ["a/red0", "a/red1"]

    # The CLI: a bad schema is one line and exit 2, before any work.
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"type": "object", "properties": {"a": {"anyOf": []}}}))
    args = ["--table", uri, "--backend", "openai", "--model", "m", "--schema", str(bad)]
    assert caption_main(args) == 2
