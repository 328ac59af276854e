"""python -m prx_data.skips: add / list / stats / remove / rewrite."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from prx_data.cli.skips import main
from prx_data.skips import sidecar as S
from prx_data.skips.rewrite import RewriteRefused, rewrite_export
from tests.exportkit import make_export, skip_samples

B1, B2 = "512/1.000", "512/0.500"


@pytest.fixture()
def export(tmp_path):
    return make_export(
        str(tmp_path / "ex"), {B1: 20, B2: 10}, samples_per_part=8, samples_per_shard=4
    )


def test_add_list_stats_remove(export, tmp_path, capsys):
    root = export.root
    ids = tmp_path / "ids.txt"
    ids.write_text(f"ds/{B1}/0\nds/{B1}/9\n\nnot/there\n")
    assert main(["add", root, "optout", "--ids", str(ids)]) == 0
    assert "2 samples" in capsys.readouterr().out
    bucket, shard, idx = export.where[f"ds/{B2}/5"]
    picks = tmp_path / "picks.tsv"
    picks.write_text(f"# manual\n{bucket} {shard} {idx}\n")
    assert main(["add", root, "manual", "--indices", str(picks)]) == 0
    capsys.readouterr()
    assert main(["list", root]) == 0
    out = capsys.readouterr().out
    assert "optout: 512/1.000" in out and "manual: 512/0.500" in out
    assert main(["stats", root, "--json"]) == 0
    stats = json.loads(capsys.readouterr().out)
    union = {r["bucket"]: r for r in stats["*"]}
    assert union[B1]["skipped"] == 2 and union[B2]["skipped"] == 1
    assert union[B1]["percent"] == pytest.approx(10.0)
    assert main(["remove", root, "manual"]) == 0
    assert set(S.list_skip_lists(root)) == {"optout"}
    # Bad input: a clear message and a non-zero exit, nothing written.
    picks.write_text(f"{bucket} {shard} 999\n")
    assert main(["add", root, "bad", "--indices", str(picks)]) == 2
    assert "outside" in capsys.readouterr().err
    assert "bad" not in S.list_skip_lists(root)


def test_add_from_table_query(export, tmp_path):
    import lance
    import pyarrow as pa

    uri = str(tmp_path / "t.lance")
    ids = sorted(export.all_ids())
    lance.write_dataset(pa.table({"id": ids, "nsfw": [i % 3 == 0 for i in range(len(ids))]}), uri)
    assert main(["add", export.root, "nsfw", "--table", uri, "--where", "nsfw = true"]) == 0
    total = sum(r.skipped for r in S.skip_stats(export.root)["nsfw"])
    assert total == len([i for i in range(len(ids)) if i % 3 == 0])


def test_rewrite_threshold_and_verified_output(export, tmp_path):
    root = export.root
    skip_samples(root, "dedup", ids=[f"ds/{B1}/{i}" for i in (0, 1, 7)])  # 3 of 30 = 10%
    skip_samples(root, "x", ids=[f"ds/{B2}/{i}" for i in (4,)])
    with pytest.raises(RewriteRefused, match="Pass --force"):
        rewrite_export(root, str(tmp_path / "o1"), names=["x"])
    out = str(tmp_path / "clean")
    r = rewrite_export(root, out)
    assert (r.samples_in, r.samples_out, r.skipped, r.verified) == (30, 26, 4, True)
    assert S.list_skip_lists(out) == {}
    # The new export has consistent manifests and streams exactly the kept ids.
    kept = export.all_ids() - {f"ds/{B1}/{i}" for i in (0, 1, 7)} - {f"ds/{B2}/4"}
    assert set(S.read_manifests(out)["id"].to_pylist()) == kept
    from tests.exportkit import run_rank

    run = run_rank(out, rank=0, world_size=1, batch_size=1, tier=512, shuffle=False)
    assert {i for b in run.batches for i in b} == kept
    # The verification is real: against the unfiltered source the new export differs.
    from prx_data.skips import repack

    class Unfiltered:  # test double: a "skip-aware" view that skips nothing
        @staticmethod
        def wrap(reader, skipped):
            return reader

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(repack, "SkipMDSReader", Unfiltered)
        with pytest.raises(AssertionError, match="differs from the filtered source"):
            rewrite_export(root, str(tmp_path / "o2"))
    # And the CLI refuses to write over it.
    assert main(["rewrite", root, out, "--force"]) == 2


def test_cli_module_help_runs():
    res = subprocess.run(
        [sys.executable, "-m", "prx_data.skips", "rewrite", "--help"],
        capture_output=True,
        text=True,
        cwd=os.path.dirname(os.path.dirname(__file__)),
    )
    assert res.returncode == 0 and "--threshold" in res.stdout


def test_a_directory_named_like_a_sidecar_is_one_line_and_a_verify_problem(
    export, tmp_path, capsys
):
    from prx_data.export.verify import verify_export

    root = export.root
    bucket, shard, idx = export.where[f"ds/{B1}/3"]
    blocker = os.path.join(root, *bucket.split("/"), *f"{shard}.manual.skip".split("/"))
    os.makedirs(blocker)
    res = verify_export(root)
    assert not res.ok
    assert any(p.path.endswith(".manual.skip") and "a directory" in p.message for p in res.problems)
    picks = tmp_path / "picks.tsv"
    picks.write_text(f"{bucket} {shard} {idx}\n")
    assert main(["add", root, "manual", "--indices", str(picks)]) == 2
    err = capsys.readouterr().err.strip()
    assert "a directory where the sidecar file belongs" in err and len(err.splitlines()) == 1
    assert os.path.isdir(blocker) and "manual" not in S.list_skip_lists(root)
