"""Precomputed latents trust nothing they read.

Latents are bound to the VAE's weights (not only its class and factors); the
loader serves a ``.npy`` only when it is a regular file inside the export's
``_latents`` with the record's dtype and the shard's shape, and each latent
only when it is finite; a latents record is data, so none of its keys can name
a file outside ``_latents`` for the job to delete.
"""

from __future__ import annotations

import contextlib
import os
import signal
from pathlib import Path

import numpy as np
import pytest
from prx_data.pipelines.latents import LatentsConfig, run_latents

from prx_data.core.confined import UnsafeFileError
from prx_data.core.runtime import RunOptions
from prx_data.export import latents as L
from prx_data.export.sample import make_sample_export

B = "512/1.000"


@pytest.fixture(scope="module")
def vaes(tmp_path_factory) -> tuple[str, str]:
    """Two tiny VAEs of one class and one config, with other weights."""
    from prx_data.train.vae import save_tiny_autoencoder

    base = tmp_path_factory.mktemp("vaes")
    return (
        save_tiny_autoencoder(str(base / "a"), seed=0),
        save_tiny_autoencoder(str(base / "b"), seed=1),
    )


def _job(root: str, vae: str, **kw) -> LatentsConfig:
    return LatentsConfig(out=root, vae=vae, run=RunOptions(progress=False, engine="local"), **kw)


@pytest.fixture()
def encoded(tmp_path, vaes) -> str:
    root = str(tmp_path / "tree")
    make_sample_export(root, {B: 4}, samples_per_part=4)
    run_latents(_job(root, vaes[0]))
    return root


def _first_item(root: str):
    from prx_data.stream import dataset

    dataset._latent_file.cache_clear()
    ds = dataset.BucketedDataset(
        root, tier=512, batch_size=1, shuffle=False, small_buckets="drop", latents=True
    )
    return ds.get_item(0)


def _only_key(root: str) -> str:
    (key,) = L.read_record(root)["shards"]
    return key


@contextlib.contextmanager
def _deadline(seconds: int):
    """Turn a hang (an open of a FIFO) into a test failure."""

    def fail(*_a):
        raise TimeoutError(f"still blocked after {seconds} s")

    old = signal.signal(signal.SIGALRM, fail)
    signal.alarm(seconds)
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, old)


def test_latents_of_another_vae_of_the_same_class_are_not_taken_for_its_own(encoded, vaes):
    record = L.read_record(encoded)
    assert len(record["vae"]["weights"]) == 64
    with pytest.raises(L.LatentsError, match="another VAE.*weights"):
        run_latents(_job(encoded, vaes[1]))
    assert L.read_record(encoded) == record  # not re-recorded as the other VAE's
    from prx_data.train.vae import LatentCodec

    other = LatentCodec.from_pretrained(vaes[1], dtype="float32", device="cpu")
    assert [d.split()[0] for d in L.vae_differences(record["vae"], other.identity())] == ["weights"]
    # The trainer's codec loads in bfloat16: the digest is of the files, so it still agrees.
    same = LatentCodec.from_pretrained(vaes[0], dtype="bfloat16", device="cpu")
    assert L.vae_differences(record["vae"], same.identity()) == []
    again = run_latents(_job(encoded, vaes[1], replace=True))
    assert again.encoded_shards == again.shards


def test_the_loader_serves_finite_latents_of_the_recorded_dtype_and_shape(encoded):
    assert np.isfinite(_first_item(encoded)["latent"].numpy()).all()
    key = _only_key(encoded)
    rec = L.read_record(encoded)["shards"][key]
    good = Path(L.npy_path(encoded, key)).read_bytes()
    bad = np.array(L.load_npy(encoded, key, "float16"))
    bad[0, 0, 0, 0] = np.nan
    L.write_npy(encoded, key, bad)
    with pytest.raises(L.LatentsError, match="NaN or infinity"):
        _first_item(encoded)
    L.write_npy(encoded, key, np.zeros(rec["shape"], np.float32))  # float32, record: float16
    with pytest.raises(L.LatentsError, match="record says float16"):
        _first_item(encoded)
    shape = list(rec["shape"])
    shape[0] -= 1  # a latent short: the last sample would have none
    L.write_npy(encoded, key, np.zeros(shape, np.float16))
    with pytest.raises(L.LatentsError, match="shape"):
        _first_item(encoded)
    Path(L.npy_path(encoded, key)).write_bytes(good)
    assert np.isfinite(_first_item(encoded)["latent"].numpy()).all()


def test_the_loader_refuses_npy_files_outside_the_export_and_fifos(encoded, tmp_path):
    key = _only_key(encoded)
    path = Path(L.npy_path(encoded, key))
    outside = tmp_path / "outside.npy"
    outside.write_bytes(path.read_bytes())
    path.unlink()
    path.symlink_to(outside)
    with pytest.raises(L.LatentsError, match="not inside|symbolic link"):
        _first_item(encoded)
    path.unlink()
    os.mkfifo(path)
    with _deadline(20), pytest.raises(L.LatentsError, match="not a regular file"):
        _first_item(encoded)


def test_a_crafted_record_cannot_delete_files_outside_the_export(encoded, tmp_path, vaes):
    victim = tmp_path / "victim" / "shard.00000.npy"
    victim.parent.mkdir()
    victim.write_bytes(b"keep me")
    record = L.read_record(encoded)
    rec = next(iter(record["shards"].values()))
    crafted = dict(record["shards"])
    crafted["512/1.000/../../../../victim/shard.00000.mds"] = rec
    L.write_record(encoded, record["vae"], record["dtype"], crafted)
    with pytest.raises(L.LatentsError, match="not a shard key"):
        run_latents(_job(encoded, vaes[0]))
    assert victim.read_bytes() == b"keep me"
    # A part folder of _latents linked out of the export: the job deletes nothing through it.
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (elsewhere / "shard.00000.npy").write_bytes(b"keep me too")
    os.symlink(
        elsewhere, Path(encoded) / "_latents" / "512" / "1.000" / "p999999-f000000-000000000"
    )
    crafted = dict(record["shards"])
    crafted["512/1.000/p999999-f000000-000000000/shard.00000.mds"] = rec
    L.write_record(encoded, record["vae"], record["dtype"], crafted)
    with pytest.raises(UnsafeFileError, match="symbolic link"):
        run_latents(_job(encoded, vaes[0]))
    assert (elsewhere / "shard.00000.npy").read_bytes() == b"keep me too"
