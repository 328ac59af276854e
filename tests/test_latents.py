"""Precomputed VAE latents: the job, its resume, the loader's lookup and the trainer's refusals."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from prx_data.pipelines.latents import LatentsConfig, run_latents

from prx_data.core.buckets import DEFAULT_SPEC, bucket_name
from prx_data.core.errors import UsageError
from prx_data.core.runtime import RunOptions
from prx_data.export import latents as L
from prx_data.export.sample import make_sample_export
from prx_data.train.config import ConfigError, load_config
from tests.trainkit import save_tiny_t5, tiny_overrides

REPO = Path(__file__).resolve().parents[1]
SMOKE_CACHED = REPO / "configs" / "train" / "smoke_latent_cached_cpu.yaml"
#: Every bucket shape of the 512 tier, a few samples each (two shards in one of them).
SHAPES = DEFAULT_SPEC.shapes(512)


@pytest.fixture(scope="module")
def vae(tmp_path_factory) -> str:
    from prx_data.train.vae import save_tiny_autoencoder

    return save_tiny_autoencoder(str(tmp_path_factory.mktemp("vae") / "kl"))


@pytest.fixture(scope="module")
def tiny_t5(tmp_path_factory) -> str:
    return save_tiny_t5(tmp_path_factory.mktemp("t5"))


def _job(root: str, vae: str, **kw) -> LatentsConfig:
    return LatentsConfig(out=root, vae=vae, run=RunOptions(progress=False, engine="local"), **kw)


@pytest.fixture(scope="module")
def every_shape(tmp_path_factory, vae):
    """An export with every 512 bucket shape, its fp16 latents, and a skip list."""
    from tests.exportkit import skip_samples

    root = str(tmp_path_factory.mktemp("shapes") / "tree")
    buckets = {bucket_name(512, w, h): 2 for w, h in SHAPES}
    buckets[bucket_name(512, 512, 512)] = 5
    ex = make_sample_export(root, buckets, samples_per_part=3)
    report = run_latents(_job(root, vae))
    assert report.encoded_shards == report.shards and report.skipped_shards == 0
    skipped = sorted(ex.ids[bucket_name(512, 512, 512)])[:2]
    skip_samples(root, "dedup", ids=skipped)
    return ex, report, set(skipped)


def _dataset(root: str, **kw):
    from prx_data.stream.dataset import BucketedDataset

    return BucketedDataset(
        root,
        tier=512,
        batch_size=1,
        shuffle=False,
        small_buckets="drop",
        latents=True,
        **kw,
    )


# With -m slow (all 13 shapes of a tier, about 30 s): the default suite checks one shape's
# latents through the step (test_training_on_precomputed_latents_gives_the_in_step_loss).
@pytest.mark.slow
def test_stored_latents_match_encoding_the_loader_image_for_every_bucket_shape(every_shape, vae):
    """(a) Each served sample's latent is the codec's encoding of the image the loader decodes."""
    from prx_data.train.flow import uint8_to_unit
    from prx_data.train.vae import LatentCodec

    ex, report, skipped = every_shape
    codec = LatentCodec.from_pretrained(vae, dtype="float32")
    ds = _dataset(ex.root)
    items = [ds.get_item(i) for i in range(ds.num_samples)]
    assert {it["id"] for it in items} == ex.all_ids() - skipped  # skip lists still apply
    assert {it["bucket"] for it in items} == {bucket_name(512, w, h) for w, h in SHAPES}
    worst, worst_cos = 0.0, 1.0
    for it in items:
        want = codec.encode(uint8_to_unit(it["image"][None]))[0]
        got = it["latent"]
        assert got.dtype == torch.float32 and got.shape == want.shape
        assert got.shape == codec.latent_shape(it["image"].shape[2], it["image"].shape[1])
        cos = torch.nn.functional.cosine_similarity(got.flatten(), want.flatten(), dim=0)
        worst_cos = min(worst_cos, float(cos))
        worst = max(worst, float((got - want).abs().max()))
        assert cos > 0.999, (it["id"], float(cos))
        # fp16 keeps 11 significant bits: a relative error above ~1e-3 is not rounding.
        bound = 2e-3 * max(1.0, float(want.abs().max()))
        assert float((got - want).abs().max()) <= bound, it["id"]
    print(f"fp16 latents: max abs error {worst:.2e}, worst cosine {worst_cos:.6f}")
    assert report.dtype == "float16"


def test_each_served_sample_gets_the_latent_at_its_stored_index(tmp_path, vae):
    """Skip lists shift the served indices: the lookup goes by the index in the shard file."""
    from tests.exportkit import skip_samples

    root = str(tmp_path / "tree")
    ex = make_sample_export(root, {"512/1.000": 10, "512/0.778": 4}, samples_per_part=5)
    run_latents(_job(root, vae))
    record = L.read_record(root)
    for key, rec in record["shards"].items():
        # Tag every stored latent with its index in the shard (the loader checks no digest).
        tagged = np.broadcast_to(
            np.arange(rec["samples"], dtype=np.float16)[:, None, None, None], rec["shape"]
        )
        L.write_npy(root, key, tagged)
    gone = sorted(ex.ids["512/1.000"])[1::3]
    skip_samples(root, "dedup", ids=gone)
    ds = _dataset(root)
    seen = set()
    for i in range(ds.num_samples):
        it = ds.get_item(i)
        _bucket, _shard, index = ex.where[it["id"]]
        assert torch.all(it["latent"] == index), (it["id"], index)
        seen.add(it["id"])
    assert seen == ex.all_ids() - set(gone)


def test_rerun_skips_every_shard_and_a_corrupted_npy_is_redone(tmp_path, vae):
    """(b) A second run encodes nothing; a .npy whose digest differs from the record is redone."""
    root = str(tmp_path / "tree")
    make_sample_export(root, {"512/1.000": 6, "512/0.778": 4}, samples_per_part=3)
    first = run_latents(_job(root, vae))
    assert first.encoded_shards == first.shards == 4 and first.encoded_samples == 10
    again = run_latents(_job(root, vae))
    assert (again.encoded_shards, again.skipped_shards) == (0, 4)
    record = L.read_record(root)
    key = sorted(record["shards"])[0]
    path = L.npy_path(root, key)
    good = Path(path).read_bytes()
    bad = bytearray(good)
    bad[-3] ^= 0xFF  # same size, one payload byte flipped
    Path(path).write_bytes(bytes(bad))
    third = run_latents(_job(root, vae))
    assert (third.encoded_shards, third.skipped_shards) == (1, 3)
    assert Path(path).read_bytes() == good  # the same latents again
    os.remove(path)
    fourth = run_latents(_job(root, vae))
    assert (fourth.encoded_shards, fourth.skipped_shards) == (1, 3)
    # The record vouches for each shard's own data: a changed shard is not served old latents.
    record = L.read_record(root)
    record["shards"][key]["shard_bytes"] += 1
    L.write_record(root, record["vae"], record["dtype"], record["shards"])
    from prx_data.export.layout import read_index

    bucket = "/".join(key.split("/")[:2])
    assert L.stale_shards(L.read_record(root), bucket, read_index(root, bucket)) == [key]
    with pytest.raises(L.LatentsError, match="no up-to-date latents"):
        _dataset(root)
    fifth = run_latents(_job(root, vae))
    assert (fifth.encoded_shards, fifth.skipped_shards) == (1, 3)
    assert len(_dataset(root)) > 0


def test_export_safety_accepts_the_latents_folder_and_never_deletes_it(tmp_path, vae):
    from prx_data.export.safety import clear_export, foreign_entries

    root = str(tmp_path / "tree")
    make_sample_export(root, {"512/1.000": 3})
    run_latents(_job(root, vae))
    assert foreign_entries(root) == []
    clear_export(root, sorted(os.listdir(root)))
    assert os.path.isfile(os.path.join(root, *L.RECORD_NAME.split("/")))


def _trainer_cfg(tmp_path: Path, root: str, t5: str, vae: str, source: str, run: str, extra=()):
    return load_config(
        SMOKE_CACHED,
        [
            *tiny_overrides(t5),
            "model.patch_size=4",
            f"vae.name_or_path={vae}",
            f"vae.source={source}",
            f"variables.data_root={root}",
            f"variables.run_name={run}",
            f"trainer.save_folder={tmp_path / '{run_name}' / 'checkpoints'}",
            "trainer.autoresume=false",
            "trainer.max_duration=2ba",
            "trainer.save_interval=2ba",
            "eval.enabled=false",
            "sampling.enabled=false",
            "metrics.enabled=false",
            "logging.log_to_console=false",
            *extra,
        ],
    )


def _fit_losses(cfg) -> list[float]:
    from composer.core import Callback

    from prx_data.train.trainer import build_trainer

    class Losses(Callback):
        def __init__(self) -> None:
            self.seen: list[float] = []

        def after_loss(self, state, logger) -> None:
            self.seen.append(float(state.loss))

    losses = Losses()
    trainer = build_trainer(cfg, callbacks=[losses])
    trainer.fit()
    trainer.close()
    return losses.seen


def test_training_on_precomputed_latents_gives_the_in_step_loss(
    tmp_path, vae, tiny_t5, monkeypatch
):
    """(c) Same seed, same steps: float32 latents give the in-step loss; the encoder never runs."""
    from prx_data.train.vae import LatentCodec

    root = str(tmp_path / "tree")
    make_sample_export(root, {"512/1.000": 8, "512/0.778": 8}, samples_per_part=4)
    run_latents(_job(root, vae, dtype="float32"))
    encoded = _fit_losses(_trainer_cfg(tmp_path, root, tiny_t5, vae, "encode", "enc"))

    def refuse(*args, **kwargs):
        raise AssertionError("the encoder ran with vae.source: precomputed")

    with monkeypatch.context() as m:
        m.setattr(LatentCodec, "encode", refuse)
        cached = _fit_losses(_trainer_cfg(tmp_path, root, tiny_t5, vae, "precomputed", "pre"))
    assert len(encoded) == len(cached) == 2
    np.testing.assert_allclose(cached, encoded, rtol=1e-6, atol=1e-8)
    print(f"losses in-step {encoded}, precomputed {cached}")


def test_a_vae_mismatch_or_missing_latents_is_refused_in_one_line(tmp_path, vae, tiny_t5):
    """(d) Another VAE's latents (or none) stop the run before it starts, naming what differs."""
    from prx_data.train.trainer import build_trainer

    root = str(tmp_path / "tree")
    make_sample_export(root, {"512/1.000": 4})
    cfg = _trainer_cfg(tmp_path, root, tiny_t5, vae, "precomputed", "none")
    with pytest.raises(ConfigError, match="no precomputed latents") as err:
        build_trainer(cfg)
    assert "\n" not in str(err.value) and "python -m prx_data.latents" in str(err.value)
    run_latents(_job(root, vae))
    other = _trainer_cfg(
        tmp_path, root, tiny_t5, vae, "precomputed", "other", ["vae.scaling_factor=0.25"]
    )
    with pytest.raises(ConfigError, match=r"scaling_factor 0\.5 -> 0\.25") as err:
        build_trainer(other)
    assert "\n" not in str(err.value)
    # The job refuses to mix VAEs in one latents folder too.
    from prx_data.train.vae import save_tiny_autoencoder

    dc = save_tiny_autoencoder(str(tmp_path / "dc"), "AutoencoderDC")
    with pytest.raises(L.LatentsError, match="class 'AutoencoderKL' -> 'AutoencoderDC'") as err:
        run_latents(_job(root, dc))
    assert "--replace" in str(err.value) and "\n" not in str(err.value)
    with pytest.raises(L.LatentsError, match=r"dtype 'float16' -> 'bfloat16'"):
        run_latents(_job(root, vae, dtype="bfloat16"))
    assert run_latents(_job(root, vae, dtype="bfloat16", replace=True)).encoded_shards == 1
    with pytest.raises(ConfigError, match="vae.source"):
        load_config(SMOKE_CACHED, ["data.plan.include_higher_tiers=true"])


def test_bfloat16_storage_round_trips_to_nearest():
    x = np.array([1.0, -2.5, 3.14159, 1e-3, 65504.0], np.float32)
    back = L.from_stored(L.to_stored(x, "bfloat16"), "bfloat16")
    want = torch.from_numpy(x).to(torch.bfloat16).float().numpy()
    np.testing.assert_array_equal(back, want)


def test_job_help_and_a_missing_vae_are_one_line(tmp_path):
    """(e) ``--help`` works; a VAE that is not there is one error line, not a traceback."""
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    out = subprocess.run(
        [sys.executable, "-m", "prx_data.latents", "--help"],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
    )
    assert out.returncode == 0 and "--vae" in out.stdout and "--dtype" in out.stdout
    root = str(tmp_path / "tree")
    make_sample_export(root, {"512/1.000": 2})
    from prx_data.cli.latents import main

    assert main([root, "--vae", str(tmp_path / "missing"), "--no-progress"]) == 2
    assert json.loads(Path(root, "report.json").read_text())  # the export is untouched


def test_cached_smoke_config_trains_evaluates_and_samples_without_the_encoder(
    tmp_path, vae, tiny_t5, monkeypatch
):
    """smoke_latent_cached_cpu.yaml as it is (eval on the hold-out, sample grids on the decoder)."""
    from prx_data.train.sampling import SampleGrid
    from prx_data.train.trainer import build_trainer
    from prx_data.train.vae import LatentCodec

    root = str(tmp_path / "tree")
    make_sample_export(root, {"512/1.000": 12, "512/0.778": 8}, samples_per_part=8)
    run_latents(_job(root, vae))
    cfg = load_config(
        SMOKE_CACHED,
        [
            *tiny_overrides(tiny_t5),
            "model.patch_size=4",
            f"vae.name_or_path={vae}",
            f"variables.data_root={root}",
            f"trainer.save_folder={tmp_path / 'run' / 'checkpoints'}",
            f"sampling.folder={tmp_path / 'run' / 'samples'}",
            "trainer.max_duration=2ba",
            "trainer.save_interval=2ba",
            "eval.interval=2ba",
            "metrics.enabled=false",
            "logging.log_to_console=false",
        ],
    )
    assert cfg.vae.source == "precomputed" and cfg.eval.enabled and cfg.sampling.enabled

    def refuse(*args, **kwargs):
        raise AssertionError("the encoder ran with vae.source: precomputed")

    monkeypatch.setattr(LatentCodec, "encode", refuse)
    trainer = build_trainer(cfg)
    trainer.fit()
    metrics = {k: float(v.compute()) for k, v in trainer.state.eval_metrics["eval"].items()}
    assert metrics and all(np.isfinite(v) and v > 0 for v in metrics.values())
    grid = next(c for c in trainer.state.callbacks if isinstance(c, SampleGrid))
    assert len(grid.written) == 1
    trainer.close()


def test_a_compressed_export_gets_the_same_latents_and_the_loader_serves_them(tmp_path, vae):
    """zstd shards are decompressed aside (the export is not written to) and give equal latents."""
    buckets = {"512/1.000": 5, "512/0.778": 3}
    plain = make_sample_export(str(tmp_path / "plain"), buckets, samples_per_part=4)
    packed = make_sample_export(
        str(tmp_path / "zstd"), buckets, samples_per_part=4, compression="zstd"
    )
    run_latents(_job(plain.root, vae))
    before = sorted(p.name for p in Path(packed.root).rglob("*") if "_latents" not in p.parts)
    run_latents(_job(packed.root, vae))
    after = sorted(p.name for p in Path(packed.root).rglob("*") if "_latents" not in p.parts)
    assert before == after
    a, b = L.read_record(plain.root), L.read_record(packed.root)
    assert sorted(a["shards"]) == sorted(b["shards"])
    for key in a["shards"]:
        assert (
            Path(L.npy_path(plain.root, key)).read_bytes()
            == Path(L.npy_path(packed.root, key)).read_bytes()
        )
    ds = _dataset(packed.root)
    assert all(ds.get_item(i)["latent"].shape[0] == 4 for i in range(ds.num_samples))


def test_verify_checks_the_latents_against_their_record(tmp_path, vae):
    from prx_data.export.verify import verify_export

    root = str(tmp_path / "tree")
    make_sample_export(root, {"512/1.000": 6}, samples_per_part=3)
    run_latents(_job(root, vae))
    assert verify_export(root, deep=True).ok
    keys = sorted(L.read_record(root)["shards"])
    first, second = (Path(L.npy_path(root, k)) for k in keys)
    data = bytearray(first.read_bytes())
    data[-1] ^= 0x01
    first.write_bytes(bytes(data))
    assert verify_export(root).ok  # same size: only the digest tells
    deep = verify_export(root, deep=True)
    assert [p.message for p in deep.problems] == ["xxh64 differs from the latents record"]
    second.unlink()
    Path(root, "_latents", "stray.npy").write_bytes(b"x")
    found = sorted(str(p) for p in verify_export(root).problems)
    assert len(found) == 2 and "missing" in " ".join(found) and "stray.npy" in " ".join(found)


def test_mixed_exports_each_serve_their_own_latents(tmp_path, vae):
    """Two exports mixed: each sample's latent comes from its own export's _latents/."""
    from prx_data.stream.dataset import BucketedDataset
    from prx_data.stream.spec import DatasetSpec

    roots = []
    for tag in (1, 2):
        root = str(tmp_path / f"tree{tag}")
        make_sample_export(root, {"512/1.000": 4}, name=f"ds{tag}", samples_per_part=4)
        run_latents(_job(root, vae))
        for key, rec in L.read_record(root)["shards"].items():
            L.write_npy(root, key, np.full(rec["shape"], tag, np.float16))
        roots.append(root)
    specs = [DatasetSpec(r, proportion=1.0) for r in roots]
    ds = BucketedDataset(
        specs, tier=512, batch_size=1, shuffle=False, small_buckets="drop", latents=True
    )
    items = [ds.get_item(i) for i in range(ds.num_samples)]
    assert {it["id"].split("/")[0] for it in items} == {"ds1", "ds2"}
    for it in items:
        assert torch.all(it["latent"] == int(it["id"][2])), it["id"]
    bare = str(tmp_path / "bare")
    make_sample_export(bare, {"512/1.000": 4}, name="ds3")
    with pytest.raises(L.LatentsError, match="no precomputed latents"):
        BucketedDataset(
            [*specs, DatasetSpec(bare, proportion=1.0)],
            tier=512,
            batch_size=1,
            small_buckets="drop",
            latents=True,
        )


def test_tiers_encodes_only_those_and_keeps_the_others(tmp_path, vae):
    root = str(tmp_path / "tree")
    make_sample_export(root, {"512/1.000": 3, "1024/1.000": 2})
    first = run_latents(_job(root, vae, tiers=(512,)))
    assert (first.shards, first.encoded_shards) == (1, 1)
    assert len(_dataset(root)) > 0  # a 512 run needs only the 512 tier
    from prx_data.export.verify import verify_export

    assert verify_export(root, deep=True).ok  # a tier not asked for is not a problem
    rest = run_latents(_job(root, vae))
    assert (rest.shards, rest.encoded_shards, rest.skipped_shards) == (2, 1, 1)
    again = run_latents(_job(root, vae, tiers=(1024,)))
    assert (again.encoded_shards, again.skipped_shards) == (0, 1)
    assert len(L.read_record(root)["shards"]) == 2
    # A tier the export lacks (768 is no tier at all) is refused, naming the ones it has.
    with pytest.raises(UsageError, match="--tiers 768: .* has no such tier; its tiers: 512,1024"):
        run_latents(_job(root, vae, tiers=(768,)))


def test_a_second_run_is_refused_while_one_holds_the_latents_lease(tmp_path, vae):
    """The job's own lease: a concurrent run is refused; the export's lease stays free."""
    from prx_data.pipelines.latents import LatentsLocked

    from prx_data.core.lease import Lease
    from prx_data.export.lock import ExportLock

    root = str(tmp_path / "tree")
    make_sample_export(root, {"512/1.000": 2})
    os.makedirs(os.path.join(root, L.LATENTS_DIR))
    with Lease(os.path.join(root, *L.LOCK_NAME.split("/")), what="latents run"):
        with pytest.raises(LatentsLocked) as err:
            run_latents(_job(root, vae))
        assert "\n" not in str(err.value)
    held = Lease(os.path.join(root, *L.LOCK_NAME.split("/")), what="latents run")
    with held, ExportLock(root, what="skip-list update"):  # not blocked by a latents run
        pass
    assert run_latents(_job(root, vae)).encoded_shards == 1
    from prx_data.export.verify import verify_export

    assert verify_export(root, deep=True).ok  # the lock file is the job's own


def test_write_mds_latents_exports_then_stores_the_latents(tmp_path, vae):
    """``write_mds --latents VAE``: one command from a table to an export whose every
    shard has its latents (a second latents run finds nothing to do)."""
    import io

    from prx_data.cli.write_mds import main
    from prx_data.core.sample_data import photo_like
    from tests.tablekit import make_table

    def jpeg(seed: int) -> bytes:
        buf = io.BytesIO()
        photo_like(512, 384, seed)[0].save(buf, "JPEG", quality=90)
        return buf.getvalue()

    table = str(tmp_path / "t.lance")
    make_table(table, [(f"s/{i}", jpeg(i), f"caption {i}") for i in range(6)])
    out = str(tmp_path / "out")
    argv = ["--table", table, "--out", out, "--latents", vae, "--no-progress", "--engine", "local"]
    assert main(argv) == 0
    assert L.require_record(out)["vae"]["name_or_path"] == vae
    again = run_latents(_job(out, vae))
    assert again.shards > 0 and again.skipped_shards == again.shards
    assert again.encoded_shards == 0


def test_latents_of_shards_an_overwrite_replaced_are_removed_by_the_next_run(tmp_path, vae):
    """The job's own files for parts the export no longer has go (they are in its record);
    the export's other files and a file it never wrote stay."""
    from prx_data.export.verify import verify_export

    root = str(tmp_path / "tree")
    make_sample_export(root, {"512/1.000": 3})
    run_latents(_job(root, vae))
    old = [Path(L.npy_path(root, k)) for k in L.read_record(root)["shards"]]
    record = L.read_record(root)
    ghost = "512/1.000/p999999-f000000-000000000/shard.00000.mds"  # a part since replaced
    record["shards"][ghost] = next(iter(record["shards"].values()))
    Path(L.npy_path(root, ghost)).parent.mkdir(parents=True)
    Path(L.npy_path(root, ghost)).write_bytes(old[0].read_bytes())
    L.write_record(root, record["vae"], record["dtype"], record["shards"])
    assert not verify_export(root).ok
    again = run_latents(_job(root, vae))
    assert again.skipped_shards == again.shards == len(old)
    assert not Path(L.npy_path(root, ghost)).exists() and all(p.exists() for p in old)
    assert ghost not in L.read_record(root)["shards"] and verify_export(root, deep=True).ok
