"""Untrusted exports never run code: a crafted ``pkl`` column is refused by every reader.

The crafted export is a real one (``make_export``) whose one part is rewritten
with ``MDSWriter`` so that its ``caption`` column is ``pkl`` and every value
unpickles to ``os.mkdir(<marker>)``. A reader that decoded a single caption
would create the marker directory; each test asserts it refuses, naming the
column and the encoding, and that the marker does not exist.
"""

from __future__ import annotations

import json
import os
import shutil

import pyarrow as pa
import pytest

from prx_data.core.schema import MDS_COLUMNS
from prx_data.export import layout, naming, safety
from tests.exportkit import make_export

B = "512/1.000"
PART = naming.part_name(0, 0)


class _Payload:
    """Unpickles to ``os.mkdir(path)``: a side effect a test can see."""

    def __init__(self, path: str) -> None:
        self.path = path

    def __reduce__(self):
        return (os.mkdir, (self.path,))


@pytest.fixture(scope="module")
def template(tmp_path_factory):
    return make_export(str(tmp_path_factory.mktemp("tpl") / "ex"), {B: 8}, samples_per_part=8)


def _merge_like_the_exporter(bdir: str) -> None:
    """The merged index from the parts' indexes, written by hand (merge.merge_bucket refuses)."""
    shards = []
    for part in sorted(p for p in os.listdir(bdir) if os.path.isdir(os.path.join(bdir, p))):
        with open(os.path.join(bdir, part, "index.json")) as f:
            for entry in json.load(f)["shards"]:
                for key in ("raw_data", "zip_data"):
                    if entry.get(key):
                        entry[key]["basename"] = f"{part}/{entry[key]['basename']}"
                shards.append(entry)
    with open(os.path.join(bdir, "index.json"), "w") as f:
        json.dump({"version": 2, "shards": shards}, f, sort_keys=True)


def plant(template, tmp_path, column: str = "caption", encoding: str = "pkl"):
    """A copy of the export whose part's ``column`` is ``encoding``; returns (root, marker)."""
    from streaming import MDSWriter

    from prx_data.core.streaming_compat import reader_from_json

    root = str(tmp_path / "ex")
    shutil.copytree(template.root, root)
    marker = str(tmp_path / "payload-ran")
    pdir = os.path.join(root, B, PART)
    with open(os.path.join(pdir, "index.json")) as f:
        entry = json.load(f)["shards"][0]
    reader = reader_from_json(pdir, None, entry)  # our own safe columns: decoding is fine
    samples = [reader.get_item(i) for i in range(reader.samples)]
    columns = dict(zip(entry["column_names"], entry["column_encodings"], strict=True))
    columns[column] = encoding
    new = pdir + ".new"
    with MDSWriter(out=new, columns=columns, hashes=["sha1", "xxh64"]) as w:
        for s in samples:
            w.write({**s, column: _Payload(marker) if encoding == "pkl" else s.get(column, b"x")})
    for f in os.listdir(new):
        shutil.move(os.path.join(new, f), os.path.join(pdir, f))
    os.rmdir(new)
    _merge_like_the_exporter(os.path.join(root, B))
    return root, marker


@pytest.fixture()
def crafted(template, tmp_path):
    root, marker = plant(template, tmp_path)
    yield root, marker
    assert not os.path.exists(marker), "the pickle payload ran"


def _refused(fn, *args, **kwargs):
    with pytest.raises(safety.UnsafeIndexError, match=r"column 'caption' with encoding 'pkl'"):
        fn(*args, **kwargs)


def test_payload_really_runs_when_decoded(template, tmp_path):
    """The crafted shard is live: streaming's own reader runs the payload (so the tests bite)."""
    from prx_data.core.streaming_compat import reader_from_json

    root, marker = plant(template, tmp_path)
    pdir = os.path.join(root, B, PART)
    with open(os.path.join(pdir, "index.json")) as f:
        entry = json.load(f)["shards"][0]
    reader_from_json(pdir, None, entry).get_item(0)
    assert os.path.isdir(marker)


def test_rewrite_refuses_before_writing(crafted, tmp_path):
    from prx_data.skips.rewrite import rewrite_export

    root, _marker = crafted
    out = tmp_path / "out"
    _refused(rewrite_export, root, str(out), force=True)
    assert not out.exists() or not list(out.rglob("*.mds"))


def test_rewrite_cli_exits_with_one_line(crafted, tmp_path, capsys):
    from prx_data.cli.skips import main

    root, _marker = crafted
    assert main(["rewrite", root, str(tmp_path / "out"), "--force"]) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and "'caption'" in err and "'pkl'" in err


def test_verify_reports_the_column(crafted):
    from prx_data.export.verify import verify_export

    root, _marker = crafted
    res = verify_export(root, deep=True)
    found = [str(p) for p in res.problems if "caption" in p.message]
    assert len(found) == 1 and "'pkl'" in found[0] and f"{B}/index.json" in found[0]


def test_loader_refuses(crafted):
    from prx_data.stream.dataset import DatasetSpec, load_sources

    root, _marker = crafted
    _refused(load_sources, DatasetSpec(root), [512])


def test_skipstream_refuses_even_with_allow_unsafe_types(crafted):
    """Streaming's own check is off with allow_unsafe_types=True; the stream's is not."""
    from prx_data.core.streaming_compat import World
    from prx_data.stream.reader import SkipStream

    root, _marker = crafted
    _refused(SkipStream(local=os.path.join(root, B)).get_shards, World.detect(), True)


def test_dedup_optout_planner_refuse(crafted):
    from prx_data.skips.dedup import replace_skip_list
    from prx_data.skips.optout import add_optout
    from prx_data.stream.planner import count_export

    root, _marker = crafted
    rows = pa.table({"bucket": [B], "shard": [f"{PART}/shard.00000.mds"], "index": [0]})
    _refused(replace_skip_list, root, "dedup", rows)
    _refused(add_optout, root, "optout", [f"ds/{B}/3"])
    _refused(count_export, root, [512])
    assert not any(f.endswith(".skip") for _d, _s, fs in os.walk(root) for f in fs)


def test_bucketed_dataset_refuses_allow_unsafe_types(template):
    from prx_data.stream.dataset import BucketedDataset

    with pytest.raises(ValueError, match="allow_unsafe_types"):
        BucketedDataset(template.root, tier=512, batch_size=2, allow_unsafe_types=True)


@pytest.mark.parametrize("encoding", ["pkl:x", "PKL", "no-such-encoding", "ndarray:nonsense"])
def test_other_unsafe_or_unknown_encodings_are_refused(template, tmp_path, encoding):
    """Streaming compares the whole string with 'pkl'; the check reads the encoding's name."""
    root = str(tmp_path / "ex")
    shutil.copytree(template.root, root)
    index = os.path.join(root, B, "index.json")
    obj = json.load(open(index))
    obj["shards"][0]["column_encodings"][obj["shards"][0]["column_names"].index("caption")] = (
        encoding
    )
    with open(index, "w") as f:
        json.dump(obj, f)
    with pytest.raises(
        safety.UnsafeIndexError, match=f"column 'caption' with encoding '{encoding}"
    ):
        layout.read_index(root, B)


@pytest.mark.parametrize(
    "change, message",
    [
        ({"caption": "json"}, "column 'caption' with encoding 'json'"),
        ({"image": "jpeg"}, "column 'image' has encoding 'jpeg'"),
        ({"extra": "int32"}, "column 'extra' with encoding 'int32'"),
    ],
)
def test_rewrite_and_verify_want_the_exporters_columns(template, tmp_path, change, message):
    """Safe but foreign columns: the loader streams them, rewrite and verify refuse them."""
    from prx_data.export.verify import verify_export
    from prx_data.skips.rewrite import rewrite_export

    root = str(tmp_path / "ex")
    shutil.copytree(template.root, root)
    index = os.path.join(root, B, "index.json")
    obj = json.load(open(index))
    entry = obj["shards"][0]
    for name, enc in change.items():
        if name in entry["column_names"]:
            entry["column_encodings"][entry["column_names"].index(name)] = enc
        else:
            entry["column_names"].append(name)
            entry["column_encodings"].append(enc)
            entry["column_sizes"].append(4)
    with open(index, "w") as f:
        json.dump(obj, f)
    assert layout.read_index(root, B)  # safe encodings: the plain readers accept them
    with pytest.raises(safety.UnsafeIndexError, match=message):
        rewrite_export(root, str(tmp_path / "out"), force=True)
    assert any(message in p.message for p in verify_export(root).problems)


def test_exporters_columns_are_accepted(template):
    entry = layout.read_index_entries(template.root, B, export_columns=True)[0]
    assert dict(zip(entry["column_names"], entry["column_encodings"], strict=True)) == {
        **MDS_COLUMNS,
        "caption": "str",
    }


# --- strict names: fullmatch, ASCII digits --------------------------------------------------------


@pytest.mark.parametrize("bucket", ["512/1.000\n", "٥١٢/1.000", "512/١.٠٠٠", "５１２/1.000"])
def test_bucket_names_need_ascii_digits_and_no_newline(bucket):
    with pytest.raises(safety.UnsafeIndexError, match="bad bucket name"):
        safety.check_bucket(bucket)


@pytest.mark.parametrize(
    "name",
    [
        "f000000-000000000/shard.00000.mds\n",
        "f٠٠٠٠٠٠-000000000/shard.00000.mds",
        "f000000-000000000/shard.٠٠٠٠٠.mds",
    ],
)
def test_shard_names_need_ascii_digits_and_no_newline(name):
    with pytest.raises(safety.UnsafeIndexError, match="refusing shard name"):
        safety.check_shard_basename("x/index.json", name)


@pytest.mark.parametrize("name", ["shard.00000.mds\n", "shard.٠٠٠٠٠.mds", "shard.00000.mds.zstd\n"])
def test_part_shard_names_need_ascii_digits_and_no_newline(name):
    with pytest.raises(safety.UnsafeIndexError, match="refusing shard name"):
        safety.check_shard_basename("x/index.json", name, in_part=True)


@pytest.mark.parametrize("name", ["dedup\n", "optout-2026-11\n"])
def test_skip_list_names_need_fullmatch(name):
    from prx_data.skips import sidecar as S

    with pytest.raises(ValueError, match="invalid skip-list name"):
        S.validate_name(name)


def test_tree_checks_refuse_non_ascii_tiers(template, tmp_path):
    """A tier directory named with Arabic-Indic digits is foreign, not part of the export."""
    root = str(tmp_path / "ex")
    shutil.copytree(template.root, root)
    os.makedirs(os.path.join(root, "٥١٢", "1.000"))
    shutil.copy(os.path.join(root, B, "index.json"), os.path.join(root, "٥١٢", "1.000"))
    assert "٥١٢" in safety.foreign_entries(root)
    assert layout.list_buckets(root) == [B]


def test_indices_file_needs_ascii_digits(tmp_path):
    from prx_data.skips.rewrite import read_indices_file

    f = tmp_path / "picks.tsv"
    f.write_text(f"{B} {PART}/shard.00000.mds ٣\n")
    with pytest.raises(ValueError, match="expected '<bucket> <shard> <index>'"):
        read_indices_file(str(f))
