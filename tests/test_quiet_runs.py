"""A job's output is its own lines: no third-party notices nobody can act on, no line twice.

Each check runs a job (or the loader a job runs) and reads what reached the
terminal, file descriptor 2 included, since Lance logs from Rust straight to it.
"""

from __future__ import annotations

import importlib.util
import os
import warnings

import pytest

from prx_data.cli import JOBS


@pytest.fixture(scope="module")
def sample(tmp_path_factory):
    from prx_data.core.sample_data import make_sample_collection

    d = tmp_path_factory.mktemp("sample")
    return str(d / "src"), make_sample_collection(str(d / "src"), repeats=1)


def test_ingest_into_a_new_table_has_no_lance_notice(sample, tmp_path, capfd):
    src, _ = sample
    assert JOBS["ingest"].main([src, "--table", str(tmp_path / "t.lance")]) == 0
    err = capfd.readouterr().err
    assert "No existing dataset" not in err and "WARN" not in err


@pytest.mark.skipif(
    importlib.util.find_spec("accelerate") is not None, reason="the notice is for its absence"
)
def test_loading_a_vae_does_not_recommend_accelerate(tmp_path, capfd):
    import torch

    from prx_data.train.vae import load_autoencoder, save_tiny_autoencoder

    path = save_tiny_autoencoder(str(tmp_path / "kl"))
    capfd.readouterr()
    load_autoencoder(path, None, torch.float32)
    assert "accelerate" not in capfd.readouterr().err


def test_a_vlm_processor_loads_without_the_fast_processor_notice(tmp_path, capfd):
    from transformers.utils import logging as tf_logging

    from prx_data.columns.backends import GenerationConfig, TransformersBackend
    from prx_data.core.tinymodels import build_tiny_vlm

    vlm = str(build_tiny_vlm(tmp_path / "vlm"))
    tf_logging.get_logger().warning_once.__func__.cache_clear()  # shown once per process
    capfd.readouterr()
    TransformersBackend(vlm, GenerationConfig(max_tokens=2), device="cpu")
    assert "fast processor" not in capfd.readouterr().err


def test_an_export_says_each_warning_once(sample, tmp_path, capfd):
    from tests.tablekit import folder_items, make_table

    _, items = sample
    table = str(tmp_path / "t.lance")
    make_table(table, [(i, b, None) for i, b, _ in folder_items(items)])  # no captions
    argv = ["--table", table, "--out", str(tmp_path / "out"), "--engine", "local"]
    assert JOBS["write_mds"].main(argv) == 0
    said = capfd.readouterr()
    text = said.out + said.err
    assert text.count("caption column 'caption' is null or empty in every exported sample") == 1
    assert "UserWarning" not in text


def test_a_column_job_with_nothing_to_do_says_why_once(tmp_path, capfd):
    import lance
    import pyarrow as pa

    table = str(tmp_path / "t.lance")
    rows = {
        "id": ["a", "b"],
        "caption": ["x", "y"],
        "caption_vlm": pa.array([None, None], pa.string()),
    }
    lance.write_dataset(pa.table(rows), table)
    argv = ["--table", table, "--backend", "transformers", "--model", "none", "--engine", "local"]
    assert JOBS["classify"].main(argv) == 0
    out = capfd.readouterr().out
    assert out.count("nothing to do") == 1 and "caption_vlm" in out


@pytest.mark.skipif(not hasattr(os, "fork"), reason="fork")
def test_a_training_process_that_forks_says_nothing_about_lance():
    import lance  # noqa: F401 - registers Lance's at-fork warning

    from prx_data.train.logs import quiet_logs

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("default")
        quiet_logs("INFO")
        pid = os.fork()  # what a DataLoader with workers does
        if pid == 0:
            os._exit(0)
        os.waitpid(pid, 0)
    assert not [w for w in caught if "fork-safe" in str(w.message)]
