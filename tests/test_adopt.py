"""MDS trees another writer made: stream, plan, adopt, skip-list them; refusals are one line."""

from __future__ import annotations

import hashlib
import io
import json
import os
import re
import subprocess
import sys

import pytest
from PIL import Image
from streaming import MDSWriter

from prx_data.export import layout, safety
from prx_data.export.adopt import adopt_tree, read_record
from prx_data.stream.dataset import DatasetSpec
from tests.exportkit import run_rank, upload_tree

#: On the default grid at tier 512: 512x512 (1.000) and 480x544 (0.882).
SHAPES = {"1.000": (512, 512), "0.882": (480, 544)}
PER_BUCKET = 8


def _jpeg(size: tuple[int, int], n: int) -> Image.Image:
    buf = io.BytesIO()
    Image.new("RGB", size, (n * 20 % 251, 40, 90)).save(buf, "JPEG", quality=80)
    return Image.open(io.BytesIO(buf.getvalue()))


def _write(out: str, ar: str, ids: range, caption: str = "caption") -> None:
    cols = {"image": "jpeg", "id": "str", caption: "str"}
    with MDSWriter(out=out, columns=cols, size_limit=1 << 14) as w:  # several shards
        for i in ids:
            w.write({"image": _jpeg(SHAPES[ar], i), "id": f"x/{ar}/{i}", caption: f"c {i}"})


@pytest.fixture
def tiered(tmp_path):
    """A plain ``<tier>/<ar>/`` tree: one MDSWriter run per bucket."""
    root = tmp_path / "plain"
    for ar in SHAPES:
        _write(str(root / "512" / ar), ar, range(PER_BUCKET))
    return str(root)


@pytest.fixture
def flat(tmp_path):
    """PRX's fine-t2i-to-mds.py layout: ``<ar>/w<N>/`` writers, then ``merge_index``."""
    from streaming.base.util import merge_index

    root = tmp_path / "prx"
    for ar in SHAPES:
        for w in range(2):
            start = w * PER_BUCKET // 2
            _write(str(root / ar / f"w{w}"), ar, range(start, start + 4), caption="prompt")
        idx = sorted(str(p) for p in (root / ar).glob("w*/index.json"))
        merge_index(idx, str(root / ar), keep_local=True)
    return str(root)


def _digest(root: str) -> dict[str, str]:
    out = {}
    for dirpath, _d, files in os.walk(root):
        for f in files:
            if ".mds" in f and not f.endswith(".skip") or f == "index.json":
                p = os.path.join(dirpath, f)
                out[p] = hashlib.sha256(open(p, "rb").read()).hexdigest()
    return out


def _ids(spec, batch_size: int = 2, **kw) -> tuple[list[str], set]:
    run = run_rank(spec, rank=0, world_size=1, batch_size=batch_size, tier=512, shuffle=False, **kw)
    return [i for b in run.batches for i in b], {s for s in run.shapes}


def test_plain_tree_streams_adopts_and_skips(tiered):
    ids, shapes = _ids(DatasetSpec(tiered))
    assert sorted(ids) == sorted(f"x/{ar}/{i}" for ar in SHAPES for i in range(PER_BUCKET))
    assert shapes == {((3, 544, 480),), ((3, 512, 512),)}  # one shape per batch
    before = _digest(tiered)
    res = adopt_tree(tiered)
    assert res.buckets == {"512/0.882": PER_BUCKET, "512/1.000": PER_BUCKET}
    assert res.id_column == "id" and res.shards > 2
    assert _digest(tiered) == before  # shards and indexes byte-identical
    assert json.load(open(os.path.join(tiered, "_prx", "report.json")))["samples"] == 16
    assert "512/1.000" in open(os.path.join(tiered, "_prx", "report.txt")).read()

    from prx_data.cli.skips import main as skips

    ids_file = os.path.join(tiered, "..", "drop.txt")
    gone = {"x/1.000/3", "x/1.000/4", "x/0.882/5", "x/0.882/0"}  # even buckets: no tail drop
    open(ids_file, "w").write("\n".join([*gone, "not/there"]))
    assert skips(["add", tiered, "optout", "--ids", ids_file]) == 0
    again, _ = _ids(DatasetSpec(tiered))
    assert sorted(again) == sorted(set(ids) - gone)
    assert len(again) == len(set(again))  # exactly once

    from prx_data.cli.verify import main as verify

    assert verify([tiered, "--deep"]) == 0
    assert _digest(tiered) == before
    # A bucket whose index changed after adoption: its manifest may name other samples.
    index = os.path.join(tiered, "512", "1.000", "index.json")
    obj = json.load(open(index))
    open(index, "w").write(json.dumps(obj, indent=2))
    assert skips(["add", tiered, "optout", "--ids", ids_file]) == 2
    assert verify([tiered]) == 1


def test_flat_tree_with_declared_tier(flat, capsys):
    spec = DatasetSpec(flat, tier=512, columns={"caption": "prompt"})
    ids, shapes = _ids(spec)
    assert len(ids) == 2 * PER_BUCKET and len(set(ids)) == len(ids)
    assert shapes == {((3, 544, 480),), ((3, 512, 512),)}

    from prx_data.cli.planner import main as planner

    assert planner([flat, "--tier", "512", "--batch-size", "2"]) == 0
    assert "512/1.000" in capsys.readouterr().out

    before = _digest(flat)
    res = adopt_tree(flat, tier=512, id_column="")  # synthetic ids
    assert res.layout == "flat" and res.id_column is None
    assert read_record(flat)["tier"] == 512
    assert _digest(flat) == before
    ids, _ = _ids(DatasetSpec(flat, columns={"caption": "prompt"}))
    synthetic = re.compile(r"512/(1\.000|0\.882)/w[01]/shard\.[0-9]{5}\.mds:[0-9]+")
    assert all(synthetic.fullmatch(i) for i in ids), ids[:3]  # <bucket>/<shard>:<index>

    from prx_data.cli.skips import main as skips

    ids_file = os.path.join(flat, "..", "drop.txt")
    gone = {
        *sorted(i for i in ids if "/1.000/" in i)[:2],
        *sorted(i for i in ids if "/0.882/" in i)[-2:],
    }
    open(ids_file, "w").write("\n".join(gone))
    assert skips(["add", flat, "dedup", "--ids", ids_file]) == 0
    again, _ = _ids(DatasetSpec(flat, columns={"caption": "prompt"}))
    assert sorted(again) == sorted(set(ids) - gone)
    assert _digest(flat) == before
    # No process-wide layout: a plain root is read as <tier>/<ar>/, and an adopted flat
    # one is refused rather than read as empty; resolved, it lists its buckets.
    with pytest.raises(layout.ForeignTreeError, match=r"layout\.tree\(root\)"):
        layout.list_buckets(flat)
    assert layout.list_buckets(layout.tree(flat)) == ["512/0.882", "512/1.000"]
    assert layout.list_buckets(layout.tree(flat, 512), [256]) == []
    with pytest.raises(layout.ForeignTreeError, match="says tier 512, not 256"):
        layout.tree(flat, 256)


def test_a_tree_is_a_frozen_path_that_keeps_its_layout():
    import pickle

    t = layout.Tree("/data/flat", 512)
    assert t == "/data/flat" and t.flat_tier == 512 and not t.remote
    assert layout.rel_join(t, "512/1.000/index.json") == "/data/flat/1.000/index.json"
    assert (
        layout.rel_join("/data/flat", "512/1.000/index.json") == "/data/flat/512/1.000/index.json"
    )
    back = pickle.loads(pickle.dumps(t))
    assert isinstance(back, layout.Tree) and back.flat_tier == 512
    assert layout.tree(t) is t  # resolved once: no second read
    with pytest.raises(AttributeError, match="frozen"):
        t.flat_tier = 256
    assert layout.Tree("s3://b/x").remote


def test_loader_names_the_columns_it_needs(flat):
    from prx_data.export.layout import ForeignTreeError

    with pytest.raises(ForeignTreeError, match=r"no column 'caption'.*columns=\{'image'"):
        _ids(DatasetSpec(flat, tier=512))
    from prx_data.train.data import EncodedBucketedDataset

    spec = DatasetSpec(flat, tier=512, columns={"caption": "prompt"})
    with pytest.raises(ForeignTreeError, match="encoded 'jpeg'.*decode on the CPU"):
        EncodedBucketedDataset(spec, tier=512, batch_size=2)


def _one_line(main, argv: list[str], capsys) -> str:
    """The CLI's refusal: exit status 2 and one ``error:`` line (a traceback fails the test)."""
    capsys.readouterr()
    assert main(argv) == 2
    got = capsys.readouterr()
    lines = [x for x in (got.out + got.err).splitlines() if x.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: "), lines
    return lines[0]


def test_refusals_are_one_line(tiered, flat, tmp_path, capsys):
    from prx_data.cli.adopt import main as adopt
    from prx_data.cli.planner import main as planner
    from prx_data.cli.skips import main as skips
    from prx_data.cli.verify import main as verify

    # A path-escaping name in an index: planner, adopt, skips refuse it in one line.
    bad = os.path.join(tiered, "512", "1.000", "index.json")
    obj = json.load(open(bad))
    obj["shards"][0]["raw_data"]["basename"] = "../../../victim/shard.00000.mds"
    open(bad, "w").write(json.dumps(obj))
    plan = [tiered, "--tier", "512", "--batch-size", "2"]
    assert "refusing shard name" in _one_line(planner, plan, capsys)
    assert "refusing shard name" in _one_line(adopt, [tiered], capsys)
    assert "refusing shard name" in _one_line(skips, ["stats", tiered], capsys)
    # The shim, as a user runs it: one line, no traceback.
    env = dict(os.environ, PYTHONPATH=os.getcwd())
    p = subprocess.run(
        [sys.executable, "-m", "prx_data.planner", *plan], capture_output=True, text=True, env=env
    )
    said = (p.stdout + p.stderr).strip()
    assert p.returncode == 2 and "Traceback" not in said
    assert said.count("\n") == 0 and "refusing shard name" in said
    # A flat tree without a tier; skips add / verify before adoption; a pickle column.
    assert "--tier" in _one_line(adopt, [flat], capsys)
    ids = tmp_path / "ids.txt"
    ids.write_text("x\n")
    assert "prx_data.adopt" in _one_line(skips, ["add", flat, "a", "--ids", str(ids)], capsys)
    from prx_data.cli.optout import main as optout

    argv = ["--export", flat, "--name", "optout", "--ids", str(ids)]
    assert "prx_data.adopt" in _one_line(optout, argv, capsys)
    assert not os.path.exists(os.path.join(flat, "_lists"))  # nothing written
    assert "prx_data.adopt" in _one_line(verify, [flat], capsys)
    pkl = os.path.join(flat, "1.000", "index.json")
    obj = json.load(open(pkl))
    obj["shards"][0]["column_encodings"][0] = "pkl"
    open(pkl, "w").write(json.dumps(obj))
    assert "unpickling" in _one_line(adopt, [flat, "--tier", "512"], capsys)
    # A tree of ours (here: a report.json, as skips rewrite leaves) is never adopted.
    ours = tmp_path / "ours"
    _write(str(ours / "512" / "1.000"), "1.000", range(2))
    (ours / "report.json").write_text(json.dumps({"buckets": {"512/1.000": 2}}))
    assert "needs no adoption" in _one_line(adopt, [str(ours)], capsys)


def test_link_out_of_a_bucket_is_refused(tiered, tmp_path):
    bdir = os.path.join(tiered, "512", "1.000")
    victim = tmp_path / "victim"
    victim.mkdir()
    os.replace(os.path.join(bdir, "shard.00000.mds"), victim / "shard.00000.mds")
    os.symlink(victim / "shard.00000.mds", os.path.join(bdir, "shard.00000.mds"))
    with pytest.raises(safety.UnsafeIndexError, match="symlink leads out"):
        layout.read_index(tiered, "512/1.000")
    with pytest.raises(safety.UnsafeIndexError, match="symlink leads out"):
        adopt_tree(tiered)


def test_remote_tree_adopts_and_streams(tiered, s3_bucket, tmp_path):
    root = f"s3://{s3_bucket}/plain"
    upload_tree(tiered, root)
    res = adopt_tree(root)
    assert res.buckets == {"512/0.882": PER_BUCKET, "512/1.000": PER_BUCKET}
    from prx_data.skips.log import Provenance
    from prx_data.skips.ops import update_list

    gone = {"x/1.000/1", "x/1.000/2"}
    assert update_list(root, "optout", sorted(gone), Provenance("test", "")).samples_listed == 2
    ids, _ = _ids(DatasetSpec(root, local=str(tmp_path / "cache")))
    want = {f"x/{ar}/{i}" for ar in SHAPES for i in range(PER_BUCKET)} - gone
    assert sorted(ids) == sorted(want)


def test_holdout_on_an_adopted_tree(tiered):
    from prx_data.stream.holdout import Holdout

    adopt_tree(tiered)
    sides = [
        _ids(DatasetSpec(tiered, holdout=Holdout(0.4, keep=k)), batch_size=1)[0]
        for k in ("train", "eval")
    ]
    train, held = (set(x) for x in sides)
    assert train and held and not train & held
    assert train | held == {f"x/{ar}/{i}" for ar in SHAPES for i in range(PER_BUCKET)}
