"""Every object-store call has a deadline: against an endpoint that never answers, each
small-file call fails within its configured time, naming the endpoint and the setting."""

from __future__ import annotations

import os
import threading

import pyarrow.fs as pafs
import pytest

from prx_data.core import storage
from prx_data.core.storage import StorageTimeout
from prx_data.export import layout
from prx_data.stream.dataset import DatasetSpec, fetch_catalog
from tests.s3proxy import RuleProxy

pytestmark = pytest.mark.remote


def test_s3_calls_through_boto3_keep_the_filesystem_semantics(s3_bucket, tmp_path):
    """Routed through boto3, ``s3://`` answers as a local directory tree does."""
    trees = {"local": str(tmp_path / "t"), "s3": f"s3://{s3_bucket}/t"}
    files = {"a.json": b"1", "512/1.000/index.json": b"22", "512/1.000/p/x.mds": b"333"}
    got = {}
    for kind, root in trees.items():
        for rel, data in files.items():
            storage.write_bytes_atomic(storage.join(root, *rel.split("/")), data)
        got[kind] = (
            storage.list_files(root),
            storage.list_files(root, ".json", recursive=False),
            storage.list_dirs(root),
            storage.list_dirs(storage.join(root, "512")),
            storage.file_sizes(root),
            [storage.exists(storage.join(root, p)) for p in ("a.json", "512", "512/1.0", "no")],
            layout.list_buckets(root),
        )
        storage.delete(storage.join(root, "512"))
        storage.delete(storage.join(root, "nothing-here"))
        got[kind] += (storage.list_files(root), storage.exists(storage.join(root, "512")))
    assert got["s3"] == got["local"]
    assert got["s3"][0] == sorted(files) and got["s3"][5] == [True, True, False, False]
    assert got["s3"][-2:] == (["a.json"], False)


@pytest.fixture
def silent_store(moto_server, monkeypatch):
    """S3_ENDPOINT_URL points at a loopback endpoint that takes every request and never
    answers; one attempt of 1 s each."""
    with RuleProxy(int(moto_server.rsplit(":", 1)[1]), lambda m, p: "stall") as proxy:
        monkeypatch.setenv("S3_ENDPOINT_URL", proxy.url)
        monkeypatch.setenv("S3_READ_TIMEOUT_S", "1")
        monkeypatch.setenv("S3_CONNECT_TIMEOUT_S", "1")
        monkeypatch.setenv("S3_MAX_ATTEMPTS", "1")
        yield proxy


CALLS = {
    "exists": lambda root: storage.exists(f"{root}/report.json"),
    "list_files": lambda root: storage.list_files(root),
    "list_dirs": lambda root: storage.list_dirs(root),
    "delete": lambda root: storage.delete(f"{root}/512"),
    "read": lambda root: storage.read_bytes(f"{root}/report.json"),
    "write": lambda root: storage.write_bytes_atomic(f"{root}/x.json", b"{}"),
    "list_buckets": lambda root: layout.list_buckets(root),
    "file_sizes": lambda root: storage.file_sizes(root),
}


@pytest.mark.faults
@pytest.mark.parametrize("call", sorted(CALLS))
def test_a_store_that_never_answers_fails_each_call_naming_endpoint_and_setting(call, silent_store):
    with pytest.raises(StorageTimeout) as e:
        CALLS[call]("s3://bucket/ex")
    msg = str(e.value)
    assert silent_store.url in msg and "S3_READ_TIMEOUT_S" in msg and "1 attempt(s)" in msg
    assert msg.startswith("s3://bucket/ex")
    assert silent_store.log, "the call never reached the endpoint"


@pytest.mark.faults
def test_the_catalog_fetch_fails_instead_of_hanging_and_tells_the_other_ranks(
    silent_store, tmp_path
):
    cache = str(tmp_path / "cache")
    os.makedirs(cache)
    spec = DatasetSpec("s3://bucket/ex", local=cache)
    with pytest.raises(StorageTimeout, match="S3_READ_TIMEOUT_S"):
        fetch_catalog(spec, [512], cache, is_leader=True)
    with pytest.raises(RuntimeError, match="StorageTimeout: .*got no answer"):
        fetch_catalog(spec, [512], cache, is_leader=False, timeout=5)


@pytest.mark.faults
def test_pyarrow_stores_run_under_a_deadline(silent_store, monkeypatch):
    """gs:// and other pyarrow-only stores: a real pyarrow client on the silent endpoint
    (its own timeouts set far out) is cut off by STORAGE_DEADLINE_S."""
    fs = pafs.S3FileSystem(
        endpoint_override=silent_store.url.removeprefix("http://"),
        scheme="http",
        request_timeout=60,
        connect_timeout=60,
        retry_strategy=pafs.AwsStandardS3RetryStrategy(max_attempts=1),
        access_key="testing",
        secret_key="testing",
        region="us-east-1",
    )
    monkeypatch.setattr(storage, "filesystem", lambda path: (fs, path.split("://", 1)[1]))
    monkeypatch.setenv("STORAGE_DEADLINE_S", "0.5")
    for call in (
        lambda: storage.exists("gs://bucket/ex/report.json"),
        lambda: storage.list_files("gs://bucket/ex"),
        lambda: storage.read_bytes("gs://bucket/ex/report.json"),
        lambda: storage.delete("gs://bucket/ex/512"),
    ):
        with pytest.raises(StorageTimeout, match=r"gs://bucket within 0\.5 s.*STORAGE_DEADLINE_S"):
            call()


def test_a_deadline_passes_answers_and_errors_through():
    assert storage.with_deadline("gs://b/x", "read", lambda: b"ok", 5) == b"ok"
    with pytest.raises(FileNotFoundError):
        storage.with_deadline(
            "gs://b/x", "read", lambda: (_ for _ in ()).throw(FileNotFoundError("x")), 5
        )
    gate = threading.Event()
    try:
        with pytest.raises(StorageTimeout, match="STORAGE_DEADLINE_S"):
            storage.with_deadline("gs://b/x", "read", gate.wait, 0.05)
    finally:
        gate.set()


@pytest.mark.faults
@pytest.mark.parametrize(
    "job, argv",
    [("verify", ["s3://bucket/ex", "--no-progress"]), ("skips", ["list", "s3://bucket/ex"])],
)
def test_the_verify_and_skips_clis_say_a_silent_store_in_one_line(job, argv, silent_store, capsys):
    import importlib

    main = importlib.import_module(f"prx_data.cli.{job}").main
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: s3://bucket/ex") and "S3_READ_TIMEOUT_S" in err
    assert len(err.splitlines()) == 1


@pytest.mark.faults
def test_ingest_parquet_reads_run_under_a_deadline(silent_store, monkeypatch):
    """Planning (the footer) and unit reads of a remote parquet source are cut off too."""
    from prx_data.ingest import parquet

    fs = pafs.S3FileSystem(
        endpoint_override=silent_store.url.removeprefix("http://"),
        scheme="http",
        request_timeout=60,
        connect_timeout=60,
        retry_strategy=pafs.AwsStandardS3RetryStrategy(max_attempts=1),
        access_key="testing",
        secret_key="testing",
        region="us-east-1",
    )
    monkeypatch.setattr(storage, "filesystem", lambda path: (fs, path.split("://", 1)[1]))
    monkeypatch.setenv("STORAGE_DEADLINE_S", "0.5")
    with pytest.raises(StorageTimeout, match=r"s3://bucket within 0\.5 s.*STORAGE_DEADLINE_S"):
        parquet._open("s3://bucket/src/part-0.parquet")
