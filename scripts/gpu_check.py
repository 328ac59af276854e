#!/usr/bin/env python
"""One prepared GPU check of the training and captioning paths; prints one summary table.

Steps, in order, each in its own process with its own time limit:

  train     a tiny PRX, 50 steps in bf16 on a small bucketed export: loss finite and
            decreasing (mean of the last 10 steps below the first 10)
  data      the same run's data-wait fraction and samples/s
  decode    data.decode=device: nvJPEG batch decode of 2048-tier JPEGs to a 512 shape on
            the GPU (images/s), against the loader's CPU path on one core
  eval      one held-out eval (per-band flow loss) and one sample grid PNG
  fsdp      FSDP (FULL_SHARD, activation checkpointing) on one GPU, 10 steps
  latent    latent-space PRX: a tiny AutoencoderKL (bf16) encodes each batch in the step,
            50 steps: loss finite and decreasing; one sample grid through PRXPipeline
  metrics   one FID / CMMD / DINO-MMD evaluation (tiny random metric models) of generated vs
            held-out images; values finite, JSON written
  vllm      the vLLM caption backend on a tiny Qwen2-VL built from a config, 20 rows

Without CUDA every step prints "skipped: no CUDA". ``--device cpu`` runs the
training steps on the CPU in fp32 with fewer steps (how the tests check the
wiring). Nothing is downloaded: the text encoder and the VLM are tiny random
models built here, the export is fabricated (solid colours).

    scripts/gpu_check.sh                 # on a GPU machine, under 10 minutes on one H200
    python scripts/gpu_check.py --device cpu --steps train,eval --train-steps 6
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

STEPS = ("train", "data", "decode", "eval", "fsdp", "latent", "metrics", "vllm")
#: Seconds per step process (the whole check stays under 10 minutes on one H200).
LIMITS = {
    "train": 150,
    "decode": 60,
    "eval": 90,
    "fsdp": 90,
    "latent": 120,
    "metrics": 90,
    "vllm": 150,
}
SMOKE = REPO / "configs" / "train" / "smoke_cpu.yaml"


# --- steps (run in a child process) ---------------------------------------------------------


def _export(work: Path) -> str:
    from tests.exportkit import make_export

    root = work / "export"
    if not (root / "512").exists():
        make_export(str(root), {"512/1.000": 96, "512/0.778": 64}, samples_per_part=32)
    return str(root)


def _encoder(work: Path) -> str:
    from prx_data.train.text_encoder import save_tiny_t5

    path = work / "tiny-t5"
    if not (path / "config.json").exists():
        save_tiny_t5(str(path))
    return str(path)


class _LossRecorder:
    """Composer callback collecting the training loss of every batch."""

    def __new__(cls):
        from composer.core import Callback

        class Recorder(Callback):
            def __init__(self) -> None:
                self.losses: list[float] = []

            def after_train_batch(self, state, logger) -> None:
                self.losses.append(float(state.loss))

        return Recorder()


def _config(work: Path, args, run: str, extra: list[str]):
    from prx_data.train.config import load_config

    gpu = args.device == "gpu"
    return load_config(
        SMOKE,
        [
            f"variables.data_root={_export(work)}",
            f"variables.run_name={run}",
            f"text_encoder.name_or_path={_encoder(work)}",
            "text_encoder.max_length=32",
            "data.include_higher_tiers=false",
            "data.small_buckets=error",
            f"data.global_batch_size={16 if gpu else 4}",
            f"data.num_workers={2 if gpu else 0}",
            "data.persistent_workers=false",
            f"model.patch_size={16 if gpu else 32}",
            f"model.hidden_size={256 if gpu else 64}",
            f"model.num_heads={4 if gpu else 2}",
            f"model.depth={4 if gpu else 1}",
            f"trainer.device={args.device}",
            f"trainer.precision={'amp_bf16' if gpu else 'fp32'}",
            f"trainer.save_folder={work / '{run_name}' / 'checkpoints'}",
            "trainer.autoresume=false",
            "trainer.save_interval=1000ba",
            f"sampling.folder={work / '{run_name}' / 'samples'}",
            "optimizer.lr=1e-3",
            "logging.log_to_console=false",
            *extra,
        ],
    )


def step_train(work: Path, args) -> dict:
    from prx_data.train.callbacks import DataWaitMonitor
    from prx_data.train.trainer import build_trainer

    n = args.train_steps
    cfg = _config(
        work,
        args,
        "train",
        [f"trainer.max_duration={n}ba", "eval.enabled=false", "sampling.enabled=false"],
    )
    rec = _LossRecorder()
    trainer = build_trainer(cfg, callbacks=[rec])
    t0 = time.perf_counter()
    trainer.fit()
    wall = time.perf_counter() - t0
    wait = next(c for c in trainer.state.callbacks if isinstance(c, DataWaitMonitor))
    samples = int(trainer.state.timestamp.sample)
    trainer.close()
    losses = rec.losses
    k = max(1, min(10, len(losses) // 3))
    first, last = sum(losses[:k]) / k, sum(losses[-k:]) / k
    finite = all(math.isfinite(x) for x in losses)
    ok = finite and len(losses) == n and last < first
    return {
        "ok": ok,
        "detail": f"{n} steps {cfg.trainer.precision}: loss {first:.4f} -> {last:.4f}"
        + ("" if finite else " (NOT FINITE)"),
        "data": {
            "ok": 0.0 <= wait.fraction < 1.0,
            "detail": f"data-wait {wait.fraction:.1%}, {samples / wall:.1f} samples/s "
            f"({samples} samples in {wall:.1f} s, fit wall time)",
        },
    }


def step_decode(work: Path, args) -> dict:
    import io

    import numpy as np
    import torch
    from PIL import Image

    from prx_data.stream.decode import decode_batch, decode_to

    yy, xx = np.mgrid[0:1536, 0:2048].astype(np.float32)
    jpegs = []
    for k in range(8):
        arr = np.stack(
            [
                127 + 100 * np.sin(xx / (30 + k)) * np.cos(yy / 23.0),
                127 + 90 * np.cos((xx + yy) / (50 + k)),
                127 + 80 * np.sin(np.hypot(xx - 600, yy - 700) / (29 + k)),
            ],
            -1,
        )
        buf = io.BytesIO()
        Image.fromarray(arr.clip(0, 255).astype(np.uint8)).save(buf, "JPEG", quality=92)
        jpegs.append(buf.getvalue())
    batch = jpegs * 4  # 32 images per call, like one device batch
    device = "cuda" if args.device == "gpu" else "cpu"
    decode_batch(batch[:2], (512, 384), device)  # warm-up (nvJPEG handles, kernels)
    if device == "cuda":
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    rounds = 5 if device == "cuda" else 1
    for _ in range(rounds):
        out = decode_batch(batch, (512, 384), device)
    if device == "cuda":
        torch.cuda.synchronize()
    dev_rate = rounds * len(batch) / (time.perf_counter() - t0)
    t0 = time.perf_counter()
    for data in jpegs:
        decode_to(data, (512, 384))
    cpu_rate = len(jpegs) / (time.perf_counter() - t0)
    ok = tuple(out.shape) == (len(batch), 3, 384, 512)
    return {
        "ok": ok,
        "detail": f"2048->512: {dev_rate:.0f} img/s on {device} (batched) vs "
        f"{cpu_rate:.1f} img/s loader path on one CPU core",
    }


def step_eval(work: Path, args) -> dict:
    from PIL import Image

    from prx_data.train.evaluation import TOTAL
    from prx_data.train.sampling import SampleGrid, grid_size
    from prx_data.train.trainer import build_trainer

    cfg = _config(
        work,
        args,
        "eval",
        [
            "trainer.max_duration=2ba",
            "eval.enabled=true",
            "eval.interval=2ba",
            "eval.holdout_fraction=0.2",
            f"eval.global_batch_size={8 if args.device == 'gpu' else 2}",
            "eval.device_batch_size=null",
            "sampling.enabled=true",
            "sampling.interval=2ba",
            "sampling.shapes=[[64,64],[64,96]]",
            "sampling.steps=4",
        ],
    )
    trainer = build_trainer(cfg)
    trainer.fit()
    metrics = {k: float(v.compute()) for k, v in trainer.state.eval_metrics["eval"].items()}
    grid = next(c for c in trainer.state.callbacks if isinstance(c, SampleGrid))
    paths = list(grid.written)
    trainer.close()
    want = grid_size(len(cfg.sampling.prompts), len(cfg.sampling.seeds), cfg.sampling.shapes)
    size = Image.open(paths[-1]).size if paths else None
    ok = math.isfinite(metrics[TOTAL]) and size == want
    bands = ", ".join(f"{k.split('_t')[-1]}: {v:.3f}" for k, v in metrics.items() if k != TOTAL)
    return {
        "ok": ok,
        "detail": f"eval loss {metrics[TOTAL]:.4f} ({bands}); grid {size} at {paths[-1] if paths else '-'}",
    }


def step_fsdp(work: Path, args) -> dict:
    from prx_data.train.trainer import build_trainer

    cfg = _config(
        work,
        args,
        "fsdp",
        [
            "trainer.max_duration=10ba",
            "eval.enabled=false",
            "sampling.enabled=false",
            "parallelism.fsdp.enabled=true",
            "parallelism.fsdp.sharding_strategy=FULL_SHARD",
            "parallelism.fsdp.activation_checkpointing=true",
        ],
    )
    rec = _LossRecorder()
    trainer = build_trainer(cfg, callbacks=[rec])
    trainer.fit()
    wrapped = type(trainer.state.model.transformer).__name__
    trainer.close()
    ok = len(rec.losses) == 10 and all(math.isfinite(x) for x in rec.losses)
    return {
        "ok": ok,
        "detail": f"10 steps, loss {rec.losses[0]:.4f} -> {rec.losses[-1]:.4f}, transformer is {wrapped}",
    }


def _tiny_vae(work: Path) -> str:
    from prx_data.train.vae import save_tiny_autoencoder

    return save_tiny_autoencoder(str(work / "tiny-vae"))


def step_latent(work: Path, args) -> dict:
    from PIL import Image

    from prx_data.train.sampling import SampleGrid
    from prx_data.train.trainer import build_trainer

    n = args.train_steps
    gpu = args.device == "gpu"
    cfg = _config(
        work,
        args,
        "latent",
        [
            f"vae.name_or_path={_tiny_vae(work)}",
            "vae.dtype=auto",
            f"model.patch_size={2 if gpu else 4}",
            f"trainer.max_duration={n}ba",
            "eval.enabled=false",
            "sampling.enabled=true",
            f"sampling.interval={n}ba",
            "sampling.shapes=[[64,64]]",
            "sampling.steps=4",
        ],
    )
    rec = _LossRecorder()
    trainer = build_trainer(cfg, callbacks=[rec])
    vae_dtype = str(trainer.state.model.vae.dtype).replace("torch.", "")
    t0 = time.perf_counter()
    trainer.fit()
    wall = time.perf_counter() - t0
    grid = next(c for c in trainer.state.callbacks if isinstance(c, SampleGrid))
    paths = list(grid.written)
    trainer.close()
    losses = rec.losses
    k = max(1, min(10, len(losses) // 3))
    first, last = sum(losses[:k]) / k, sum(losses[-k:]) / k
    finite = all(math.isfinite(x) for x in losses)
    size = Image.open(paths[-1]).size if paths else None
    ok = finite and len(losses) == n and last < first and size is not None
    return {
        "ok": ok,
        "detail": f"{n} steps {cfg.trainer.precision}, VAE {vae_dtype}: loss {first:.4f} -> "
        f"{last:.4f}{'' if finite else ' (NOT FINITE)'}, {n / wall:.1f} steps/s; "
        f"PRXPipeline grid {size}",
    }


def step_metrics(work: Path, args) -> dict:
    from prx_data.train.metrics import GenerationMetrics, save_tiny_metric_models
    from prx_data.train.trainer import build_trainer

    tiny = save_tiny_metric_models(str(work))
    gpu = args.device == "gpu"
    cfg = _config(
        work,
        args,
        "metrics",
        [
            f"vae.name_or_path={_tiny_vae(work)}",
            f"model.patch_size={2 if gpu else 4}",
            "trainer.max_duration=2ba",
            "eval.enabled=true",
            "eval.interval=2ba",
            "eval.holdout_fraction=0.2",
            f"eval.global_batch_size={8 if gpu else 2}",
            "eval.device_batch_size=null",
            "sampling.enabled=false",
            "metrics.enabled=true",
            "metrics.interval=2ba",
            f"metrics.num_samples={16 if gpu else 4}",
            "metrics.steps=4",
            f"metrics.fid_model={tiny['fid']}",
            f"metrics.clip_model={tiny['clip']}",
            f"metrics.dino_model={tiny['dino']}",
        ],
    )
    trainer = build_trainer(cfg)
    t0 = time.perf_counter()
    trainer.fit()
    wall = time.perf_counter() - t0
    cb = next(c for c in trainer.state.callbacks if isinstance(c, GenerationMetrics))
    trainer.close()
    values = cb.history[-1][1] if cb.history else {}
    ok = bool(values) and all(math.isfinite(v) for v in values.values()) and bool(cb.written)
    shown = ", ".join(f"{k} {v:.4g}" for k, v in values.items())
    return {
        "ok": ok,
        "detail": f"{cfg.metrics.num_samples} samples: {shown or 'none'}; fit {wall:.1f} s; "
        f"{cb.written[-1] if cb.written else 'no JSON'}",
    }


def step_vllm(work: Path, args) -> dict:
    import importlib.util
    import io

    if importlib.util.find_spec("vllm") is None:
        return {"ok": None, "detail": "skipped: vllm not installed (pip install -e '.[vllm]')"}
    from PIL import Image

    from prx_data.columns.backends import GenerationConfig, Request, VLLMBackend
    from prx_data.core.tinymodels import build_tiny_vlm

    path = build_tiny_vlm(work / "tiny-vlm", hidden_size=256, vision_embed_dim=128)
    backend = VLLMBackend(
        str(path),
        GenerationConfig(max_tokens=16, temperature=0.0),
        engine_kwargs={
            "max_model_len": 1024,
            "gpu_memory_utilization": 0.2,
            "enforce_eager": True,
            "mm_processor_kwargs": {"min_pixels": 56 * 56, "max_pixels": 112 * 112},
        },
    )
    requests = []
    for i in range(20):
        buf = io.BytesIO()
        Image.new("RGB", (96, 80), (i * 12 % 255, 80, 160)).save(buf, "JPEG")
        requests.append(Request("Describe the image.", buf.getvalue()))
    t0 = time.perf_counter()
    gens = backend(requests)
    wall = time.perf_counter() - t0
    backend.close()
    good = sum(1 for g in gens if g.text is not None)
    return {"ok": good == 20, "detail": f"{good}/20 captions in {wall:.1f} s"}


RUNNERS = {
    "train": step_train,
    "decode": step_decode,
    "eval": step_eval,
    "fsdp": step_fsdp,
    "latent": step_latent,
    "metrics": step_metrics,
    "vllm": step_vllm,
}


# --- driver ---------------------------------------------------------------------------------


def _child(step: str, work: Path, args) -> int:
    out = RUNNERS[step](work, args)
    Path(args.result).write_text(json.dumps(out))
    return 0


def _run_step(step: str, work: Path, args) -> dict:
    result = work / f"{step}.json"
    cmd = [
        sys.executable,
        str(Path(__file__).resolve()),
        "--child",
        step,
        "--result",
        str(result),
        "--work",
        str(work),
        "--device",
        args.device,
        "--train-steps",
        str(args.train_steps),
    ]
    env = dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1")
    env["PYTHONPATH"] = str(REPO) + os.pathsep + env.get("PYTHONPATH", "")
    # The CPU wiring check is slower per step than the GPU (and CPU machines are shared).
    limit = LIMITS[step] * (1 if args.device == "gpu" else 5)
    t0 = time.perf_counter()
    try:
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=limit, cwd=REPO)
    except subprocess.TimeoutExpired:
        return {"ok": False, "detail": f"timed out after {limit} s", "wall": limit}
    wall = time.perf_counter() - t0
    if proc.returncode != 0 or not result.exists():
        tail = (proc.stderr or proc.stdout).strip().splitlines()[-3:]
        (work / f"{step}.log").write_text(proc.stdout + proc.stderr)
        return {"ok": False, "detail": f"exit {proc.returncode}: {' | '.join(tail)}", "wall": wall}
    out = json.loads(result.read_text())
    out["wall"] = wall
    return out


def _table(rows: list[tuple[str, str, float | None, str]]) -> str:
    lines = [f"{'step':<6} {'result':<8} {'time':>7}  detail", "-" * 78]
    for step, status, wall, detail in rows:
        t = f"{wall:6.1f}s" if wall is not None else "      -"
        lines.append(f"{step:<6} {status:<8} {t}  {detail}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        description="Prepared GPU check: bf16 training, data wait, eval + sample grid, FSDP "
        "and the vLLM caption backend; prints one summary table.",
    )
    p.add_argument(
        "--device",
        choices=["gpu", "cpu"],
        default="gpu",
        help="gpu (default; every step is skipped without CUDA) or cpu (fp32 wiring check)",
    )
    p.add_argument(
        "--steps",
        default=",".join(STEPS),
        help=f"comma-separated steps to run, in order (default: {','.join(STEPS)})",
    )
    p.add_argument(
        "--train-steps", type=int, default=50, help="optimizer steps of the train step (50)"
    )
    p.add_argument("--work", help="scratch folder (default: a new temporary folder)")
    p.add_argument("--child", choices=sorted(RUNNERS), help=argparse.SUPPRESS)
    p.add_argument("--result", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    work = Path(args.work or tempfile.mkdtemp(prefix="prx-gpu-check-"))
    work.mkdir(parents=True, exist_ok=True)
    if args.child:
        return _child(args.child, work, args)

    steps = [s.strip() for s in args.steps.split(",") if s.strip()]
    unknown = sorted(set(steps) - set(STEPS))
    if unknown:
        p.error(f"unknown step(s) {unknown}; choose from {', '.join(STEPS)}")
    import torch

    cuda = torch.cuda.is_available()
    device_line = torch.cuda.get_device_name(0) if cuda else "no CUDA device"
    rows: list[tuple[str, str, float | None, str]] = []
    failed = False
    train_out: dict | None = None
    for step in steps:
        if args.device == "gpu" and not cuda:
            rows.append((step, "skipped", None, "skipped: no CUDA"))
            continue
        if step == "vllm" and args.device != "gpu":
            rows.append((step, "skipped", None, "skipped: vLLM needs CUDA"))
            continue
        if step == "fsdp" and args.device != "gpu":
            rows.append((step, "skipped", None, "skipped: Composer's FSDP needs CUDA"))
            continue
        if step == "data":
            if train_out is None:
                train_out = _run_step("train", work, args)
            d = train_out.get("data") or {"ok": False, "detail": "train step failed"}
            status = "ok" if d["ok"] else "FAIL"
            failed |= not d["ok"]
            rows.append((step, status, None, d["detail"]))
            continue
        out = _run_step(step, work, args)
        if step == "train":
            train_out = out
        status = {True: "ok", False: "FAIL", None: "skipped"}[out["ok"]]
        failed |= out["ok"] is False
        rows.append((step, status, out.get("wall"), out["detail"]))
    print(f"prx-data GPU check on {device_line} ({args.device}); scratch {work}")
    print(_table(rows))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
