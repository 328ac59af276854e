"""Every URI a job takes, on a store other than local disk, ``s3://`` and ``gs://``, is refused
in one line that names the supported ones, before anything is written.

The storage layer refuses (tests/test_store_fencing.py); these pin that each
entry point reaches that refusal, not a Lance error or an unrelated hint:
exports and their outputs (``--out``, a rewrite's destination), export roots
(``skips``, ``verify``, ``optout``, ``adopt``, the loader) and tables and
ledgers (``--table``, ``ingest``, ``stats``, ``skips ledger``), which Lance
itself could open on Azure or the Hub.
"""

from __future__ import annotations

import importlib

import pytest

from prx_data.core import storage
from tests.exportkit import make_export

OTHER = ("az://container/ex", "hf://datasets/o/r")


def _cases(uri: str, local_export: str, tmp) -> list[tuple[str, list[str]]]:
    ids = tmp / "ids.txt"
    ids.write_text("x/1\n")
    table = f"{uri}/t.lance"
    return [
        ("write_mds", ["--table", table, "--out", str(tmp / "never")]),
        ("write_mds", ["--table", str(tmp / "t.lance"), "--out", uri]),
        ("ingest", [str(tmp), "--table", table, "--engine", "local", "--no-progress"]),
        ("stats", ["--table", table, "--out", str(tmp / "stats")]),
        ("skips", ["list", uri]),
        ("skips", ["sync", uri]),
        ("skips", ["rewrite", uri, str(tmp / "never")]),
        ("skips", ["rewrite", local_export, uri, "--force"]),
        ("skips", ["ledger", "show", f"{uri}/_prx_ledger.lance"]),
        ("verify", [uri, "--deep"]),
        ("optout", ["--export", uri, "--name", "o", "--ids", str(ids)]),
        ("adopt", [uri]),
    ]


@pytest.mark.parametrize("uri", OTHER)
def test_every_job_refuses_another_store_in_one_line(uri, tmp_path, capsys):
    ex = make_export(str(tmp_path / "ex"), {"512/1.000": 4})
    work = tmp_path / "w"
    work.mkdir()
    for job, argv in _cases(uri, ex.root, work):
        main = importlib.import_module(f"prx_data.cli.{job}").main
        try:
            rc = main(argv)
        except SystemExit as e:
            rc = e.code
        err = capsys.readouterr().err.strip()
        what = f"{job} {' '.join(argv)}"
        assert rc not in (0, None), what
        assert len(err.splitlines()) == 1, f"{what}: {err}"
        scheme = uri.split("://")[0]
        assert f"{scheme}:// is not a supported store" in err, f"{what}: {err}"
        assert "local path" in err and "s3://" in err and "gs://" in err, what
        assert err.endswith("and copy the data there"), f"{what}: another cause named: {err}"
    assert sorted(p.name for p in work.iterdir()) == ["ids.txt"]  # nothing written


def test_the_loader_refuses_another_store(tmp_path):
    from prx_data.stream.dataset import BucketedDataset

    with pytest.raises(storage.UnsupportedStore, match=r"az:// is not a supported store.*gs://"):
        BucketedDataset("az://container/ex", batch_size=1, tier=512)
