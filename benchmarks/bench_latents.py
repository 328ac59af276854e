"""Precomputed latents end to end on CPU: the job's throughput, the trainer's step, the bytes.

Three parts, on the tiny random-weight models (the demo's AutoencoderKL, 8x, 4 channels):

  job        ``run_latents`` over a sample export of 512 x 512 JPEGs: samples/s of the
             whole run (VAE load included) and of the encoding alone (a second run
             with ``replace`` after the first has warmed the caches).
  step       ``build_trainer`` + ``fit`` with ``smoke_latent_cached_cpu.yaml`` on that
             export, ``vae.source: encode`` against ``precomputed``, same seed: the
             median seconds from Composer's batch_start to batch_end (the model step),
             and the median loader wait (before_dataloader to after_dataloader).
  bytes      per-sample bytes of a stored latent against the export's JPEG: the
             sample export's solid colours and the demo's photo-like images, at q92
             (the exporter's default), 512 and 1024; latents for a KL VAE with
             16 channels at fp16 (the Flux VAE) and for the tiny one.

    python benchmarks/bench_latents.py [--samples 48] [--batches 10] [--json OUT.json]
"""

from __future__ import annotations

import argparse
import io
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

from prx_data.core.runtime import RunOptions

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))


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


def _step(root: str, vae: str, t5: str, work: Path, source: str, batches: int) -> dict:
    from composer.core import Callback

    from prx_data.train.config import load_config
    from prx_data.train.trainer import build_trainer

    class Clock(Callback):
        def __init__(self) -> None:
            self.step: list[float] = []
            self.wait: list[float] = []
            self._t = 0.0

        def before_dataloader(self, state, logger) -> None:
            self._t = time.perf_counter()

        def after_dataloader(self, state, logger) -> None:
            self.wait.append(time.perf_counter() - self._t)

        def batch_start(self, state, logger) -> None:
            self._t = time.perf_counter()

        def batch_end(self, state, logger) -> None:
            self.step.append(time.perf_counter() - self._t)

    cfg = load_config(
        REPO / "configs" / "train" / "smoke_latent_cached_cpu.yaml",
        [
            f"text_encoder.name_or_path={t5}",
            f"vae.name_or_path={vae}",
            f"vae.source={source}",
            f"variables.data_root={root}",
            f"variables.run_name=bench-{source}",
            f"trainer.save_folder={work / '{run_name}'}",
            "trainer.autoresume=false",
            f"trainer.max_duration={batches}ba",
            f"trainer.save_interval={batches}ba",
            "data.global_batch_size=4",
            "eval.enabled=false",
            "sampling.enabled=false",
            "metrics.enabled=false",
            "logging.log_to_console=false",
            "logging.progress_bar=false",
        ],
    )
    clock = Clock()
    trainer = build_trainer(cfg, callbacks=[clock])
    trainer.fit()
    trainer.close()
    steps, waits = clock.step[2:], clock.wait[2:]  # past the warm-up
    return {
        "step_s": round(statistics.median(steps), 4),
        "loader_wait_s": round(statistics.median(waits), 4),
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
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)

    from prx_data.export.sample import make_sample_export
    from prx_data.train.text_encoder import save_tiny_t5
    from prx_data.train.vae import save_tiny_autoencoder

    work = Path(tempfile.mkdtemp(prefix="bench-latents-"))
    vae = save_tiny_autoencoder(str(work / "vae"))
    t5 = save_tiny_t5(str(work / "t5"))
    ex = make_sample_export(str(work / "export"), {"512/1.000": args.samples}, samples_per_part=16)
    result: dict = {"job": _job(ex.root, vae)}
    # The float32 rerun above replaced the fp16 latents; training reads either.
    enc = _step(ex.root, vae, t5, work, "encode", args.batches)
    pre = _step(ex.root, vae, t5, work, "precomputed", args.batches)
    result["step"] = {
        "image": "512x512",
        "device_batch": 4,
        "in_step_encode": enc,
        "precomputed": pre,
        "step_ratio": round(enc["step_s"] / pre["step_s"], 2),
    }
    result["bytes"] = _jpeg_bytes()
    text = json.dumps(result, indent=1)
    print(text)
    if args.json:
        Path(args.json).write_text(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
