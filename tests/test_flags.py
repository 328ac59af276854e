"""One spelling per setting: config fields carry their flags (prx_data.core.flags)."""

from __future__ import annotations

import argparse
import io
import shlex
from dataclasses import dataclass

import pytest
from PIL import Image

from prx_data.cli import write_mds as cli
from prx_data.core.flags import (
    REQUIRED,
    add_flags,
    comma_ints,
    comma_list,
    flag,
    from_args,
    mebibytes,
    option_name,
)
from prx_data.core.imaging import EncodeSpec, prepare_with
from prx_data.core.runtime import RunOptions, run_field
from prx_data.export.spec import ExportConfig, resume_flags


@dataclass(frozen=True)
class _Toy:
    name: str = flag(REQUIRED, "name", help="a positional argument")
    path: str = flag(REQUIRED, "--path", help="a required option")
    sizes: tuple[int, ...] = flag((1,), "--sizes", type=comma_ints, help="ints")
    keep: bool = flag(True, "--no-keep", negate=True, help="a negated switch")
    internal: int = 0


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(exit_on_error=False)
    add_flags(p, _Toy)
    return p


@dataclass(frozen=True)
class _Job:
    table: str = flag(REQUIRED, "--table", help="a job's own option")
    run: RunOptions = run_field()


@dataclass(frozen=True)
class _OtherJob:
    limit: int = flag(0, "--limit", type=int, help="another job's option")
    run: RunOptions = run_field()


def test_a_nested_run_options_field_adds_the_run_flags_once_and_builds_them_back():
    p = argparse.ArgumentParser(exit_on_error=False)
    add_flags(p, _Job)
    add_flags(p, _OtherJob)  # a second config nesting RunOptions shares the same flags
    groups = {g.title: [a.dest for a in g._group_actions] for g in p._action_groups}
    assert groups["run options"] == ["engine", "ray_address", "num_cpus", "progress"]
    args = p.parse_args(["--table", "t", "--engine", "local", "--num-cpus", "2", "--no-progress"])
    assert from_args(_Job, args) == _Job("t", RunOptions("local", None, 2, False))
    assert from_args(_OtherJob, args) == _OtherJob(0, RunOptions("local", None, 2, False))
    assert from_args(_Job, p.parse_args(["--table", "t"])) == _Job("t")
    assert option_name(_Job, "ray_address") == "--ray-address"


def test_every_job_config_spells_its_run_settings_once_in_run_options():
    import dataclasses

    from prx_data.columns.backends import ModelJobConfig
    from prx_data.columns.runner import ColumnJob
    from prx_data.pipelines import dedup, download, ingest, latents, quality, score, semdedup

    configs = [
        ColumnJob,
        ModelJobConfig,
        dedup.DedupConfig,
        dedup.PhashJobConfig,
        download.DownloadConfig,
        ingest.IngestConfig,
        latents.LatentsConfig,
        quality.QualityConfig,
        score.ScoreConfig,
        semdedup.SemDedupConfig,
    ]
    run_names = {f.name for f in dataclasses.fields(RunOptions)}
    for cls in configs:
        fields = {f.name: f for f in dataclasses.fields(cls)}
        assert not run_names & set(fields), cls.__name__
        assert fields["run"].default_factory is RunOptions, cls.__name__


def test_flags_build_the_options_and_the_config_back():
    args = _parser().parse_args(["n", "--path", "p", "--sizes", "2, 3", "--no-keep"])
    assert from_args(_Toy, args, internal=5) == _Toy("n", "p", (2, 3), False, 5)
    assert from_args(_Toy, _parser().parse_args(["n", "--path", "p"])) == _Toy("n", "p")


@dataclass(frozen=True)
class _More:
    items: list[str] = flag(REQUIRED, "items", nargs="+", help="one or more")
    allow: tuple[str, ...] = flag(("x",), "--allow", append=True, help="repeatable")
    tokens: tuple[str, ...] = flag(("a", "b"), "--no-tokens", const=(), help="a constant")
    size: int = flag(2 * 2**20, "--size-mb", type=mebibytes, help="MiB in, bytes out")


def test_positional_lists_repeatable_options_constants_and_units():
    p = argparse.ArgumentParser(exit_on_error=False)
    add_flags(p, _More)
    given = p.parse_args(["a", "b", "--allow", "1", "--allow", "2", "--no-tokens"])
    assert from_args(_More, given) == _More(["a", "b"], ("1", "2"), (), 2 * 2**20)
    assert from_args(_More, p.parse_args(["a", "--size-mb", "1.5"])) == _More(["a"], size=3 * 2**19)


def test_a_required_field_is_a_required_option(capsys):
    with pytest.raises(SystemExit):
        _parser().parse_args(["n"])
    assert "--path" in capsys.readouterr().err


def test_comma_lists_drop_blanks():
    assert comma_list(" a, ,b,") == ("a", "b") and comma_list("") == ()
    assert comma_ints("512,1024") == (512, 1024)


def test_write_mds_flags_set_every_export_field():
    argv = (
        "--table t --out o --tiers 512,1024 --caption-columns c1,c2 --keep-columns k "
        "--format png --quality 80 --subsampling 0 --codec pillow --resample hamming "
        "--no-draft --draft-margin 1.25 --compression zstd --hashes '' --size-limit 7 "
        "--shard-size 0 --rows-per-task 9 --min-units 3 --filter x>1 --max-caption-chars 5"
    )
    cfg = from_args(ExportConfig, cli.build_parser().parse_args(shlex.split(argv)))
    assert cfg == ExportConfig(
        table="t",
        out="o",
        tiers=(512, 1024),
        caption_columns=("c1", "c2"),
        keep_columns=("k",),
        image_format="png",
        quality=80,
        subsampling=0,
        codec="pillow",
        resample="hamming",
        use_draft=False,
        draft_margin=1.25,
        compression="zstd",
        hashes=(),
        size_limit=7,
        shard_size=0,
        rows_per_task=9,
        min_units=3,
        filter="x>1",
        max_caption_chars=5,
    )
    assert cfg.encode == EncodeSpec("pillow", "png", 80, 0, False, 1.25, "hamming")


def test_resume_flags_name_each_option_and_quote_its_value():
    got = resume_flags({"codec": "pillow", "filter": "label = 'a'", "tiers": (512,)})
    assert shlex.split(got) == ["--codec", "pillow", "--filter", "label = 'a'"]


def test_an_encode_spec_and_its_keywords_encode_alike():
    buf = io.BytesIO()
    Image.new("RGB", (300, 200), (200, 40, 90)).save(buf, "JPEG")
    data = buf.getvalue()
    spec = EncodeSpec(codec="pillow", quality=70, resample="bicubic")
    a = prepare_with(spec, data, 96, 64)
    b = prepare_with("pillow", data, 96, 64, quality=70, resample="bicubic")
    assert a.data == b.data and a.crop_box == b.crop_box
    assert a.data != prepare_with("pillow", data, 96, 64).data


def test_semdedup_flags_set_their_fields_and_bad_numbers_are_an_option_error(capsys):
    from prx_data.pipelines.semdedup import SemDedupConfig

    from prx_data.cli import semdedup as sd_cli

    argv = (
        "--table t --export e --embedding-column v --threshold 0.9 --report-thresholds 0.8,0.9 "
        "--cluster-size 7 --train-rows 70 --iters 3 --seed 4 --name sd --spill-dir /s "
        "--no-columns --engine local"
    )
    args = sd_cli.build_parser().parse_args(shlex.split(argv))
    cfg = from_args(SemDedupConfig, args)
    assert cfg == SemDedupConfig(
        table="t",
        export="e",
        embedding_column="v",
        threshold=0.9,
        report_thresholds=(0.8, 0.9),
        cluster_size=7,
        train_rows=70,
        iters=3,
        seed=4,
        skip_name="sd",
        spill_dir="/s",
        store_columns=False,
        run=RunOptions(engine="local"),
    )
    with pytest.raises(SystemExit):
        sd_cli.build_parser().parse_args(["--table", "t", "--report-thresholds", "0.9,x"])
    assert "expected comma-separated numbers, got '0.9,x'" in capsys.readouterr().err


def test_download_flags_set_the_download_and_fetch_configs():
    from prx_data.pipelines.download import DownloadConfig

    from prx_data.cli import download
    from prx_data.download import fetch as F

    argv = (
        "--table t --max-mb 1 --allow-private 127.0.0.1 --allow-private 10.0.0.0/8 "
        "--ignore-x-robots-tag --insecure --only failed --only 'http_5*' --commit-mb 2 "
        "--timeout 5 --no-hash-check --task-cpus 1"
    )
    args = download.build_parser().parse_args(shlex.split(argv))
    fetch = from_args(F.FetchConfig, args)
    assert fetch == F.FetchConfig(
        max_bytes=2**20,
        allow=("127.0.0.1", "10.0.0.0/8"),
        opt_out=(),
        verify_tls=False,
        total_timeout=5.0,
    )
    assert from_args(DownloadConfig, args, fetch=fetch) == DownloadConfig(
        table="t",
        only=("failed", "http_5*"),
        commit_bytes=2 * 2**20,
        check_hashes=False,
        task_cpus=1.0,
        fetch=fetch,
    )
    plain = download.build_parser().parse_args(["--table", "t"])
    assert from_args(F.FetchConfig, plain) == F.FetchConfig()


def test_ingest_flags_set_the_ingest_config():
    from prx_data.pipelines.ingest import IngestConfig

    from prx_data.cli import ingest

    argv = "a b=c --table t --format parquet --fragment-mb 3 --caption-column TEXT --keys k"
    cfg = from_args(IngestConfig, ingest.build_parser().parse_args(shlex.split(argv)))
    assert cfg == IngestConfig(
        sources=["a", "b=c"],
        table_uri="t",
        fmt="parquet",
        fragment_bytes=3 * 2**20,
        caption_column="TEXT",
        keys="k",
    )
    assert cfg.reader_options["caption_column"] == "TEXT"


def test_explore_flags_come_from_the_explore_config_fields():
    from prx_data.cli import explore as explore_cli
    from prx_data.explore.app import DEFAULT_PORT, ExploreConfig

    assert option_name(ExploreConfig, "allowed_hosts") == "--allow-host"
    argv = "--table t --host 0.0.0.0 --page-size 9 --descriptors no --build-indexes"
    args = explore_cli.build_parser().parse_args(
        shlex.split(argv + " --allow-host a --allow-host b")
    )
    cfg = from_args(ExploreConfig, args, port=DEFAULT_PORT)
    assert cfg == ExploreConfig(
        table="t",
        host="0.0.0.0",
        page_size=9,
        descriptors="no",
        build_indexes=True,
        allowed_hosts=("a", "b"),
    )
    assert args.port is None  # not given: main picks DEFAULT_PORT, or any free one with --check
