"""One error base: a user's mistake is one line and a non-zero exit; a bug keeps its traceback.

CLIs catch :class:`PrxDataError` only, so an exception of any other type that
escapes the library (a ``KeyError`` from a bug, say) is not printed as an
"error:" line that looks like bad input.
"""

from __future__ import annotations

import importlib
from pathlib import Path

import pytest

from prx_data.core import errors

SMOKE_CONFIG = str(Path(__file__).resolve().parents[1] / "configs/train/smoke_cpu.yaml")


def _cli(job: str):
    return importlib.import_module(f"prx_data.cli.{job}").main


def test_user_error_classes_keep_their_standard_bases():
    for cls, base in [
        (errors.UsageError, ValueError),
        (errors.NotFound, FileNotFoundError),
        (errors.AlreadyExists, FileExistsError),
        (errors.UnknownName, KeyError),
        (errors.OutOfRange, IndexError),
        (errors.Conflict, RuntimeError),
    ]:
        assert issubclass(cls, errors.PrxDataError) and issubclass(cls, base)
    assert str(errors.UnknownName("shard 'x' is not in the index")) == (
        "shard 'x' is not in the index"
    )


def _user_errors(tmp_path):
    missing = str(tmp_path / "nothing-here")
    table = str(tmp_path / "t.lance")
    ex = str(tmp_path / "ex")  # an export (made by the test)
    return {
        "skips-ids-file": ("skips", ["add", ex, "dedup", "--ids", missing], "ids file"),
        "skips-bad-name": ("skips", ["add", ex, "Dedup", "--ids", "IDS"], "Dedup"),
        "skips-bad-where": (
            "skips",
            ["add", ex, "dedup", "--table", table, "--where", "no_such_col > 1"],
            "no_such_col",
        ),
        "skips-no-export": ("skips", ["add", missing, "dedup", "--ids", "IDS"], "does not exist"),
        "optout-no-export": (
            "optout",
            ["--export", missing, "--name", "o", "--ids", "IDS"],
            "does not exist",
        ),
        "table-missing": ("table", ["stats", missing], "no Lance table at"),
        "download-missing": ("download", ["--table", missing], "ingest the URL list first"),
        "train-config-missing": ("train", [missing], "config file"),
        # A setting checked when the trainer is built, not when the config is read.
        "train-precision-on-cpu": (
            "train",
            [SMOKE_CONFIG, "trainer.device=cpu", "trainer.precision=amp_bf16"],
            "use fp32 on CPU",
        ),
    }


@pytest.mark.parametrize(
    "case",
    [
        "skips-ids-file",
        "skips-bad-name",
        "skips-bad-where",
        "skips-no-export",
        "optout-no-export",
        "table-missing",
        "download-missing",
        "train-config-missing",
        "train-precision-on-cpu",
    ],
)
def test_a_user_error_is_one_line_and_a_non_zero_exit(case, tmp_path, capsys):
    from tests.exportkit import make_export
    from tests.ingest_data import jpeg
    from tests.tablekit import make_table

    make_table(str(tmp_path / "t.lance"), [("t/a", jpeg(32, 32), "a")])
    make_export(str(tmp_path / "ex"), {"512/1.000": 2})
    (tmp_path / "IDS").write_text("t/a\n")
    job, argv, says = _user_errors(tmp_path)[case]
    argv = [str(tmp_path / "IDS") if a == "IDS" else a for a in argv]
    assert _cli(job)(argv) != 0
    err = capsys.readouterr().err.strip()
    assert "Traceback" not in err and len(err.splitlines()) == 1, err
    assert says in err


def _boom(exc: type[BaseException]):
    def raise_it(*args, **kwargs):
        raise exc("an injected bug")

    return raise_it


@pytest.mark.parametrize(
    "job, argv, target, exc",
    [
        ("skips", ["list", "ROOT"], "prx_data.skips.sidecar.list_skip_lists", KeyError),
        (
            "skips",
            ["add", "ROOT", "dedup", "--indices", "IDX"],
            "prx_data.cli.skips.ids_at",
            IndexError,
        ),
        ("table", ["stats", "ROOT"], "prx_data.cli.table.table_stats", FileNotFoundError),
        (
            "score",
            ["clip", "--table", "T", "--model", "m"],
            "prx_data.pipelines.score.run_score",
            ValueError,
        ),
        ("semdedup", ["--table", "T"], "prx_data.pipelines.semdedup.run_semdedup", OSError),
        ("download", ["--table", "T"], "prx_data.cli.download.run_download", RuntimeError),
        (
            "optout",
            ["--export", "ROOT", "--name", "o", "--ids", "IDX"],
            "prx_data.cli.optout.add_optout",
            KeyError,
        ),
    ],
)
def test_an_injected_bug_keeps_its_traceback(job, argv, target, exc, tmp_path, monkeypatch):
    from tests.exportkit import make_export

    (tmp_path / "IDX").write_text("512/1.000 p0/shard.00000.mds 0\n")
    make_export(str(tmp_path / "ex"), {"512/1.000": 2})
    module, name = target.rsplit(".", 1)
    monkeypatch.setattr(importlib.import_module(module), name, _boom(exc))
    monkeypatch.setattr("prx_data.table.lance_ops.table_exists", lambda *a, **k: True)
    subs = {
        "ROOT": str(tmp_path / "ex"),
        "IDX": str(tmp_path / "IDX"),
        "T": str(tmp_path / "t.lance"),
    }
    with pytest.raises(exc, match="an injected bug"):
        _cli(job)([subs.get(a, a) for a in argv])


def _library_user_errors():
    """Calls a user can get wrong through a config, a flag or a request, and what each raises."""
    from prx_data.pipelines.quality import QualityConfig

    from prx_data.explore.app import int_param
    from prx_data.train.captions import CaptionPolicy
    from prx_data.train.config import DataConfig
    from prx_data.train.data import dataset_specs
    from prx_data.train.text_encoder import resolve_dtype

    return [
        (lambda: CaptionPolicy(("caption",), (1.0,), dropout=2.0), errors.UsageError),
        (
            lambda: CaptionPolicy.single("caption_vlm").choose({"caption": ["a"]}),
            errors.UnknownName,
        ),
        (lambda: resolve_dtype("int3"), errors.UsageError),
        (lambda: dataset_specs(DataConfig(datasets=[])), errors.UsageError),
        (lambda: int_param({"k": "x"}, "k", 1, 1, 10), errors.UsageError),
        (lambda: QualityConfig(table="t.lance", chunk_rows=0), errors.UsageError),
    ]


def test_user_caused_library_errors_are_prx_data_errors_with_their_old_bases():
    # The old builtin stays a base, so callers' ``except ValueError``/``KeyError`` still work.
    for call, cls in _library_user_errors():
        with pytest.raises(cls) as info:
            call()
        assert isinstance(info.value, errors.PrxDataError)
        assert len(str(info.value).splitlines()) == 1, str(info.value)


def test_the_other_ranks_relay_a_leaders_user_error_as_one_and_a_bug_as_a_bug(tmp_path):
    """A user's error on local rank 0 is a one-line error on every rank, not tracebacks."""
    from prx_data.stream.leader import lead, wait_for_leader

    def fails(exc):
        def work():
            raise exc

        return work

    marker = str(tmp_path / "marker")
    with pytest.raises(errors.UsageError):
        lead(marker, fails(errors.UsageError("eval.holdout_fraction must be below 1")))
    with pytest.raises(errors.PrxDataError, match="UsageError: eval.holdout_fraction"):
        wait_for_leader(marker, 1.0, "the hold-out")
    with pytest.raises(KeyError):
        lead(marker, fails(KeyError("an injected bug")))
    with pytest.raises(RuntimeError, match="an injected bug") as info:
        wait_for_leader(marker, 1.0, "the hold-out")
    assert not isinstance(info.value, errors.PrxDataError)
