"""One corpus's life on each store: local disk, ``s3://`` (moto) and ``gs://`` (fake-gcs-server).

The same table is exported, opted out of, synced, streamed with a cache
limit, rewritten (``--compact`` in the slow variant) and checked with
``verify --deep`` on each of the three stores, and the three results must
agree: the same samples streamed, the same skip counts, the same verdict and
the same rewritten shards byte for byte.

What stays local, and why: the table and the corpus ledger are Lance
datasets, and so is an export's id index (``_ids.lance``). Lance lists a
dataset's versions through GCS's XML API, which the GCS emulators do not
implement (see tests/test_gcs_export.py, whose whole ``write_mds`` run on
``gs://`` is a strict xfail for that reason). So the table and the ledger are
local for every store, the ``gs://`` export is the local export's tree
uploaded (the export is written on the other two stores), and on ``gs://``
the id index is not written (the test replaces its build with nothing for
``gs://`` roots): every id lookup there reads the manifests, as for an export
whose index is out of date. Every other path (shards, indexes, manifests,
sidecars, the export's lease, the loader's per-node cache, the rewrite's
stage) runs on the emulator.
"""

from __future__ import annotations

import io
import logging
import shutil

import pytest
from prx_data.pipelines.write_mds import run_export

from prx_data.cli import optout as optout_cli
from prx_data.cli import skips as skips_cli
from prx_data.cli import verify as verify_cli
from prx_data.core import storage
from prx_data.core.runtime import RunOptions
from prx_data.export import idindex, layout
from prx_data.export.spec import ExportConfig
from prx_data.skips import rewrite as rewrite_mod
from prx_data.skips import sidecar as S
from prx_data.stream.dataset import DatasetSpec
from tests.exportkit import run_rank, upload_tree
from tests.tablekit import make_table

pytestmark = pytest.mark.remote
logging.getLogger("streaming").setLevel(logging.ERROR)
STORES = ("local", "s3", "gs")
#: About two 512-tier samples per shard, so the cache limit has shards to evict.
SHARD_BYTES = 60_000


def _jpeg(i: int) -> bytes:
    """A 600x600 photo-like image (smooth random structure), 512-tier."""
    import numpy as np
    from PIL import Image

    rng = np.random.default_rng(2000 + i)
    small = Image.fromarray(rng.integers(0, 256, (8, 8, 3), dtype=np.uint8))
    buf = io.BytesIO()
    small.resize((600, 600), Image.Resampling.BICUBIC).save(buf, "JPEG", quality=90)
    return buf.getvalue()


def _export(table: str, out: str) -> None:
    cfg = ExportConfig(
        table=table,
        out=out,
        tiers=(512,),
        size_limit=SHARD_BYTES,
        shard_size=0,  # one small part per unit and bucket, as many small appends leave
        rows_per_task=2,
        min_units=1,
    )
    run_export(cfg, RunOptions(progress=False, num_cpus=1, engine="local"))


def _skip_counts(root: str) -> dict[str, int]:
    """{list: samples it skips} read from the sidecars (what the loader applies)."""
    counts: dict[str, int] = {}
    for bucket in layout.list_buckets(root):
        shards = S.read_index(root, bucket)
        for name in S.list_sidecars(root, bucket, shards):
            skips = S.load_skips(root, bucket, shards, [name])
            counts[name] = counts.get(name, 0) + sum(len(v) for v in skips.values())
    return counts


def _stream(root: str, cache: str) -> list[str]:
    shard = max(s.bytes for b in layout.list_buckets(root) for s in layout.read_index(root, b))
    spec = DatasetSpec(root, local=cache) if storage.is_remote(root) else DatasetSpec(root)
    kw = {"cache_limit": 4 * shard + 4096, "predownload": 2, "shuffle": False}
    run = run_rank(spec, rank=0, world_size=1, batch_size=1, tier=512, **kw)
    return [i for b in run.batches for i in b]


def _life(root: str, tmp, capsys, optout_ids: list[str], compact: bool, stream_rewrite: bool):
    """Opt out, sync, stream with a cache limit, rewrite, verify --deep: what each step gave."""
    got: dict = {}
    tmp.mkdir(parents=True, exist_ok=True)
    ids_file = tmp / "optout.txt"
    ids_file.write_text("".join(f"{i}\n" for i in optout_ids))
    # The opt-out is recorded in the table's ledger (local) and applied to this export; the
    # sync is what every other export of the table runs to follow the ledger.
    assert optout_cli.main(["--export", root, "--name", "optout", "--ids", str(ids_file)]) == 0
    assert skips_cli.main(["sync", root]) == 0
    got["skips"] = _skip_counts(root)
    got["streamed"] = sorted(_stream(root, str(tmp / "cache" / "v1")))
    new = root + "-v2"
    args = ["rewrite", root, new, "--force"] + (["--compact", "1M"] if compact else [])
    assert skips_cli.main(args) == 0
    got["verify"] = verify_cli.main([new, "--deep", "--no-progress"])
    got["rewritten"] = sorted(layout.read_manifests(new)["id"].to_pylist())
    if stream_rewrite:  # the slow variant streams the rewritten export too
        assert sorted(_stream(new, str(tmp / "cache" / "v2"))) == got["rewritten"]
    got["digest"] = layout.content_digest(new)
    got["parts"] = sorted(
        {
            s.basename.split("/")[0]
            for b in layout.list_buckets(new)
            for s in layout.read_index(new, b)
        }
    )
    capsys.readouterr()
    return got


def _run_matrix(n_rows: int, compact: bool, tmp_path, capsys, monkeypatch, s3_bucket, gs_bucket):
    table = str(tmp_path / "photos.lance")
    make_table(table, [(f"m/{i:02d}", _jpeg(i), f"cap {i}") for i in range(n_rows)], 6)
    local = str(tmp_path / "exports" / "photos")
    roots = {"local": local, "s3": f"s3://{s3_bucket}/photos", "gs": f"gs://{gs_bucket}/photos"}
    _export(table, roots["local"])
    _export(table, roots["s3"])
    # gs://: the local export's tree without its id index (a Lance table, see the docstring).
    staged = str(tmp_path / "gs-upload")
    shutil.copytree(local, staged, ignore=shutil.ignore_patterns(idindex.naming.IDS_INDEX_NAME))
    upload_tree(staged, roots["gs"])
    real = idindex.write_id_index

    def no_lance_on_gs(root, *a, **kw):  # test double: Lance cannot list on the emulator
        return None if root.startswith("gs://") else real(root, *a, **kw)

    monkeypatch.setattr(idindex, "write_id_index", no_lance_on_gs)
    optout_ids = [f"m/{i:02d}" for i in range(0, n_rows, 3)]
    results = {}
    for store in STORES:
        results[store] = _life(roots[store], tmp_path / store, capsys, optout_ids, compact, compact)
    assert rewrite_mod.DEFAULT_THRESHOLD  # the rewrites ran forced, below or above it
    want = {f"m/{i:02d}" for i in range(n_rows)} - set(optout_ids)
    base = results["local"]
    assert base["skips"] == {"optout": len(optout_ids)}
    assert len(base["streamed"]) == len(set(base["streamed"])) and set(base["streamed"]) == want
    assert base["rewritten"] == base["streamed"] and base["verify"] == 0
    for store in ("s3", "gs"):
        r = results[store]
        for key in ("skips", "streamed", "verify", "rewritten", "digest", "parts"):
            assert r[key] == base[key], f"{store}: {key} differs from local disk"
    return base


def test_three_stores_live_the_same_small_corpus(
    moto_server, s3_bucket, gs_bucket, tmp_path, capsys, monkeypatch
):
    _run_matrix(8, False, tmp_path, capsys, monkeypatch, s3_bucket, gs_bucket)


@pytest.mark.slow
def test_three_stores_live_the_same_corpus_and_compact_it(
    moto_server, s3_bucket, gs_bucket, tmp_path, capsys, monkeypatch
):
    base = _run_matrix(24, True, tmp_path, capsys, monkeypatch, s3_bucket, gs_bucket)
    assert len(base["parts"]) == 1  # the small parts of --shard-size 0, compacted into one
