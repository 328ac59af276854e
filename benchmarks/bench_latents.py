"""Precomputed latents end to end on CPU: the job's throughput, the trainer's step, the bytes.

Three parts, on the tiny random-weight models (the demo's AutoencoderKL, 8x, 4 channels):

  job        ``run_latents`` over a sample export of 512 x 512 JPEGs: samples/s of the
             whole run (VAE load included) and of the encoding alone (a second run
             with ``replace`` after the first has warmed the caches).
  step       ``build_trainer`` + ``fit`` with ``smoke_latent_cached_cpu.yaml`` on that
             export, ``vae.source: encode`` against ``precomputed``, same seed: the
             median seconds from Composer's batch_start to batch_end (the model step),
             and the median loader wait (before_dataloader to after_dataloader).
  s3         (``--parts s3``, not in the default) ``precomputed`` training as in
             ``step``, two epochs, on the export on local disk and on the same export
             uploaded to a moto ``s3://`` server on 127.0.0.1 (each s3 run on an empty
             node cache: its first epoch fetches each shard with its
             ``_latents/*.npy``, its second reads the cache); ``--rounds`` rounds,
             interleaved: the median step and loader wait of each, their ratio, and the
             loader wait of the first (cold cache) against the second epoch (warm).
  bytes      per-sample bytes of a stored latent against the export's JPEG: the
             sample export's solid colours and the demo's photo-like images, at q92
             (the exporter's default), 512 and 1024; latents for a KL VAE with
             16 channels at fp16 (the Flux VAE) and for the tiny one.

    python benchmarks/bench_latents.py [--samples 48] [--batches 10] [--json OUT.json]
    python benchmarks/bench_latents.py --parts s3 [--rounds 3] [--json OUT.json]
"""

from __future__ import annotations

import argparse
import io
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

from prx_data.core.runtime import RunOptions

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "benchmarks"))


def _job(root: str, vae: str) -> dict:
    from prx_data.pipelines.latents import LatentsConfig, run_latents

    first = run_latents(
        LatentsConfig(
            out=root,
            vae=vae,
            run=RunOptions(progress=False, engine="local"),
        )
    )
    t0 = time.perf_counter()
    again = run_latents(
        LatentsConfig(
            out=root,
            vae=vae,
            run=RunOptions(progress=False, engine="local"),
            replace=True,
            dtype="float32",
        )
    )
    wall = time.perf_counter() - t0
    return {
        "samples": first.samples,
        "shards": first.shards,
        "run_samples_per_s": round(first.samples_per_s, 2),
        "rerun_samples_per_s": round(again.encoded_samples / wall, 2),
        "npy_bytes_per_sample_fp16": round(first.bytes_written / first.encoded_samples),
    }


def _fit(
    root: str,
    vae: str,
    t5: str,
    work: Path,
    source: str,
    duration: str,
    run_name: str,
    local: str | None = None,
):
    """``build_trainer`` + ``fit`` of ``smoke_latent_cached_cpu.yaml`` on ``root`` for
    ``duration``; returns the clock: per batch, its epoch, its step and its loader wait."""
    from composer.core import Callback

    from prx_data.train.config import load_config
    from prx_data.train.trainer import build_trainer

    class Clock(Callback):
        def __init__(self) -> None:
            self.step: list[float] = []
            self.wait: list[float] = []
            self.epoch: list[int] = []  # of each loader wait, from 0
            self._epochs = -1
            self._t = 0.0

        def epoch_start(self, state, logger) -> None:
            self._epochs += 1

        def before_dataloader(self, state, logger) -> None:
            self._t = time.perf_counter()

        def after_dataloader(self, state, logger) -> None:
            self.wait.append(time.perf_counter() - self._t)
            self.epoch.append(self._epochs)

        def batch_start(self, state, logger) -> None:
            self._t = time.perf_counter()

        def batch_end(self, state, logger) -> None:
            self.step.append(time.perf_counter() - self._t)

    overrides = [
        f"text_encoder.name_or_path={t5}",
        f"vae.name_or_path={vae}",
        f"vae.source={source}",
        f"variables.data_root={root}",
        f"variables.run_name={run_name}",
        f"trainer.save_folder={work / '{run_name}'}",
        "trainer.autoresume=false",
        f"trainer.max_duration={duration}",
        f"trainer.save_interval={duration}",
        "data.global_batch_size=4",
        "eval.enabled=false",
        "sampling.enabled=false",
        "metrics.enabled=false",
        "logging.log_to_console=false",
        "logging.progress_bar=false",
    ]
    if local is not None:
        overrides.append(f"data.datasets.0.local={local}")
    cfg = load_config(REPO / "configs" / "train" / "smoke_latent_cached_cpu.yaml", overrides)
    clock = Clock()
    trainer = build_trainer(cfg, callbacks=[clock])
    trainer.fit()
    trainer.close()
    return clock


def _step(root: str, vae: str, t5: str, work: Path, source: str, batches: int) -> dict:
    clock = _fit(root, vae, t5, work, source, f"{batches}ba", f"bench-{source}")
    steps, waits = clock.step[2:], clock.wait[2:]  # past the warm-up
    return {
        "step_s": round(statistics.median(steps), 4),
        "loader_wait_s": round(statistics.median(waits), 4),
    }


def _s3(root: str, vae: str, t5: str, work: Path, rounds: int) -> dict:
    """Precomputed-latent training from the export on local disk and from the same export
    on moto ``s3://`` (loopback), two epochs each, rounds interleaved (local, s3, local,
    ...); each s3 run starts on an empty node cache, so its first epoch fetches every
    shard with its ``_latents/*.npy`` and its second reads them from the cache."""
    from bench_attach import moto_bucket

    from tests.exportkit import upload_tree

    with moto_bucket("bench"):
        remote = "s3://bench/ex"
        t0 = time.perf_counter()
        upload_tree(root, remote)
        upload_s = time.perf_counter() - t0
        runs: dict[str, list] = {"local": [], "s3": []}
        cached_npy = []  # per s3 run: the latents files its node cache holds after it
        load = [os.getloadavg()[0]]
        for r in range(rounds):
            runs["local"].append(_fit(root, vae, t5, work, "precomputed", "2ep", f"local{r}"))
            cache = str(work / f"cache{r}")
            runs["s3"].append(
                _fit(remote, vae, t5, work, "precomputed", "2ep", f"s3-{r}", local=cache)
            )
            cached_npy.append(sum(f.endswith(".npy") for _, _, fs in os.walk(cache) for f in fs))
            load.append(os.getloadavg()[0])

    def summary(clocks: list) -> dict:
        # Past each run's 2 warm-up batches; all runs' batches pooled.
        steps = [s for c in clocks for s in c.step[2:]]
        waits = [w for c in clocks for w in c.wait[2:]]
        out = {
            "batches_per_run": len(clocks[0].step),
            "step_s": round(statistics.median(steps), 4),
            "loader_wait_s": round(statistics.median(waits), 4),
            "runs_step_s": [round(statistics.median(c.step[2:]), 4) for c in clocks],
            "runs_loader_wait_s": [round(statistics.median(c.wait[2:]), 4) for c in clocks],
        }
        for e in (0, 1):  # every batch of the epoch, its first included
            ws = [w for c in clocks for w, k in zip(c.wait, c.epoch, strict=True) if k == e]
            sums = [sum(w for w, k in zip(c.wait, c.epoch, strict=True) if k == e) for c in clocks]
            out[f"epoch{e + 1}_loader_wait"] = {
                "median_s": round(statistics.median(ws), 4),
                "max_s": round(max(ws), 4),
                "total_s_per_run": [round(x, 3) for x in sums],
            }
        return out

    loc, s3 = summary(runs["local"]), summary(runs["s3"])
    return {
        "rounds": rounds,
        "upload_s": round(upload_s, 2),
        "load_avg_1min_per_round": [round(x, 2) for x in load],
        "s3_cached_npy_files_per_run": cached_npy,
        "local": loc,
        "s3": s3,
        "s3_over_local_step": round(s3["step_s"] / loc["step_s"], 2),
        "s3_over_local_loader_wait": round(s3["loader_wait_s"] / loc["loader_wait_s"], 2),
    }


def _jpeg_bytes() -> dict:
    from PIL import Image

    from prx_data.core.sample_data import photo_like

    out = {}
    for side in (512, 1024):
        sizes = []
        for seed in range(8):
            im, _ = photo_like(side, side, seed)
            buf = io.BytesIO()
            im.convert("RGB").save(buf, "JPEG", quality=92)
            sizes.append(len(buf.getvalue()))
        solid = io.BytesIO()
        Image.new("RGB", (side, side), (1, 2, 3)).save(solid, "JPEG", quality=90)
        out[str(side)] = {
            "photo_like_jpeg_q92_bytes": round(statistics.median(sizes)),
            "sample_export_jpeg_bytes": len(solid.getvalue()),
            "latent_kl16_fp16_bytes": (side // 8) ** 2 * 16 * 2,
            "latent_tiny_kl4_fp16_bytes": (side // 8) ** 2 * 4 * 2,
        }
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--samples", type=int, default=48)
    p.add_argument("--batches", type=int, default=10)
    p.add_argument(
        "--parts",
        default="job,step,bytes",
        help="comma-separated, of job, step, bytes, s3 (default: job,step,bytes)",
    )
    p.add_argument("--rounds", type=int, default=3, help="s3: interleaved local/s3 rounds")
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    parts = set(args.parts.split(","))
    if parts - {"job", "step", "bytes", "s3"}:
        p.error(f"--parts: unknown {sorted(parts - {'job', 'step', 'bytes', 's3'})}")

    from prx_data.export.sample import make_sample_export
    from prx_data.train.text_encoder import save_tiny_t5
    from prx_data.train.vae import save_tiny_autoencoder

    work = Path(tempfile.mkdtemp(prefix="bench-latents-"))
    vae = save_tiny_autoencoder(str(work / "vae"))
    t5 = save_tiny_t5(str(work / "t5"))
    ex = make_sample_export(str(work / "export"), {"512/1.000": args.samples}, samples_per_part=16)
    result: dict = {}
    if "job" in parts:
        result["job"] = _job(ex.root, vae)
        # The float32 rerun replaced the fp16 latents; training reads either.
    else:
        from prx_data.pipelines.latents import LatentsConfig, run_latents

        run_latents(
            LatentsConfig(out=ex.root, vae=vae, run=RunOptions(progress=False, engine="local"))
        )
    if "step" in parts:
        enc = _step(ex.root, vae, t5, work, "encode", args.batches)
        pre = _step(ex.root, vae, t5, work, "precomputed", args.batches)
        result["step"] = {
            "image": "512x512",
            "device_batch": 4,
            "in_step_encode": enc,
            "precomputed": pre,
            "step_ratio": round(enc["step_s"] / pre["step_s"], 2),
        }
    if "s3" in parts:
        result["s3"] = _s3(ex.root, vae, t5, work, args.rounds)
    if "bytes" in parts:
        result["bytes"] = _jpeg_bytes()
    text = json.dumps(result, indent=1)
    print(text)
    if args.json:
        Path(args.json).write_text(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
