"""No swallowed errors: failed units and images are recorded with a reason, and every job
fails past ``--max-error-rate`` and says where the details are."""

from __future__ import annotations

import json
import os
from collections import Counter

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from prx_data.core.runtime import RunOptions
from tests.ingest_data import jpeg


def _parquet_dir(root: str, bad: int, good: int = 1) -> list[str]:
    """``good`` readable parquet files and ``bad`` ones whose data pages are overwritten."""
    os.makedirs(root, exist_ok=True)
    t = pa.table({"id": [f"k{i}" for i in range(4)], "image": [jpeg(32, 32)] * 4})
    bad_paths = []
    for i in range(good + bad):
        path = os.path.join(root, f"part-{i}.parquet")
        pq.write_table(t.set_column(0, "id", pa.array([f"f{i}-k{j}" for j in range(4)])), path)
        if i >= good:
            b = bytearray(open(path, "rb").read())
            b[8 : len(b) // 2] = b"\xab" * (len(b) // 2 - 8)  # footer intact: planning works
            open(path, "wb").write(bytes(b))
            bad_paths.append(path)
    return bad_paths


def test_check_error_rate():
    from prx_data.core import errors

    errors.check_error_rate("job", 2, 10, 0.2, "there")
    with pytest.raises(errors.ErrorRateExceeded, match=r"job: 3 of 10 rows failed.*details: there"):
        errors.check_error_rate("job", 3, 10, 0.2, "there", "rows")
    errors.check_error_rate("job", 0, 0, 0.0, "there")  # nothing to do is not an error


def test_ingest_records_failed_units_and_fails_past_the_rate(tmp_path, ray_local, capsys):
    from prx_data.cli.ingest import main

    bad = _parquet_dir(str(tmp_path / "src"), bad=1)
    table = str(tmp_path / "t.lance")
    assert main([str(tmp_path / "src"), "--table", table, "--json", "--no-progress"]) == 1
    captured = capsys.readouterr()
    report = json.loads(captured.out)
    assert report["rows_written"] == 4 and report["units"] == 2
    [f] = report["failures"]
    assert f["path"] == bad[0] and f["error"] == "OSError" and "thrift" in f["message"]
    assert "ingest: 1 of 2 work units failed (50.0% > --max-error-rate 0.2)" in captured.err
    assert "details: the failed units above" in captured.err
    # The same run allowed a higher rate succeeds, still listing the failure.
    table2 = str(tmp_path / "t2.lance")
    args = [str(tmp_path / "src"), "--table", table2, "--no-progress", "--max-error-rate", "0.5"]
    assert main(args) == 0
    out = capsys.readouterr().out
    assert f"failed units (1 of 2):\n    {bad[0]}: OSError:" in out


def test_write_mds_fails_past_the_rate_counting_failures_not_policy(tmp_path, ray_local, capsys):
    from prx_data.cli.write_mds import main
    from tests.tablekit import make_table

    uri = str(tmp_path / "t.lance")
    items = [("t/good", jpeg(600, 600), "ok"), ("t/broken", b"not an image", "x")]
    items += [(f"t/small{i}", jpeg(40, 40), "tiny") for i in range(3)]  # too_small: a choice
    make_table(uri, items)
    out = str(tmp_path / "out")
    assert main(["--table", uri, "--out", out, "--no-progress", "--num-cpus", "1"]) == 0
    capsys.readouterr()
    args = ["--table", uri, "--out", out, "--overwrite", "--no-progress", "--num-cpus", "1"]
    assert main(args + ["--max-error-rate", "0.1"]) == 1
    err = capsys.readouterr().err
    assert "write_mds: 1 of 5 rows failed (20.0% > --max-error-rate 0.1)" in err
    assert f"dropped counts by reason in {out}/report.json" in err


@pytest.mark.ray
def test_caption_cli_fails_past_the_rate(tmp_path, ray_local, capsys):
    from prx_data.cli.caption import main
    from tests.caption_doubles import ChatServer
    from tests.test_caption import jpeg as cjpeg
    from tests.test_caption import make_table as cmake_table

    uri = cmake_table(tmp_path / "c.lance", [cjpeg(50, 40, (200, 10, 10))] * 3)
    out = tmp_path / "report.json"
    with ChatServer() as srv:
        srv.fail_next(400, 400)  # client errors are not retried: two rows fail
        rc = main(
            [
                "--table", uri, "--backend", "openai", "--model", "test-model",
                "--base-url", srv.base_url, "--column", "cap3", "--batch-size", "1",
                "--report-json", str(out), "--no-progress",
            ]
        )  # fmt: skip
    assert rc == 1
    err = capsys.readouterr().err
    assert (
        "column job (cap3, cap3_status, cap3_error): 2 of 3 rows failed (66.7% > --max-error-rate 0.2)"
        in err
    )
    assert f"and in {out}" in err
    assert json.loads(out.read_text())["counts"]["error"] == 2


def test_dedup_cli_fails_past_the_rate(tmp_path, capsys):
    from prx_data.cli.dedup import main
    from tests.dedup_images import jpeg as djpeg
    from tests.dedup_images import make_image
    from tests.tablekit import make_table

    uri = str(tmp_path / "t.lance")
    items = [("p/good", djpeg(make_image(1, 64, 64)), None)]
    items += [(f"p/bad{i}", b"not an image", None) for i in range(2)]
    make_table(uri, items)
    args = ["--table", uri, "--engine", "local", "--report", "", "--no-progress"]
    assert main(args) == 1
    err = capsys.readouterr().err
    assert "dedup: 2 of 3 rows failed (66.7% > --max-error-rate 0.2)" in err
    assert f"phash_error column of {uri}" in err
    assert main(args + ["--max-error-rate", "1"]) == 0


def test_descriptor_failures_keep_their_reason(tmp_path):
    import lance

    from prx_data.columns.descriptors import compute_descriptors
    from prx_data.core import descriptor
    from tests.dedup_images import jpeg as djpeg
    from tests.dedup_images import make_image
    from tests.tablekit import make_table

    v, why = descriptor.describe_reason(b"not an image")
    assert v is None and why == "not_an_image"
    uri = str(tmp_path / "t.lance")
    good = djpeg(make_image(3, 64, 64))
    make_table(uri, [("p/good", good, None), ("p/bad", b"\xff\xd8\xff broken", None)])
    failed = Counter()
    assert compute_descriptors(uri, run=RunOptions(progress=False), errors=failed) == 2
    t = lance.dataset(uri).to_table(columns=["id", "pixel_descriptor", "pixel_descriptor_error"])
    rows = {r["id"]: r for r in t.to_pylist()}
    assert rows["p/good"]["pixel_descriptor"] is not None
    assert rows["p/good"]["pixel_descriptor_error"] is None
    assert rows["p/bad"]["pixel_descriptor"] is None
    assert rows["p/bad"]["pixel_descriptor_error"] in ("decode_error", "truncated", "not_an_image")
    assert sum(failed.values()) == 1
