"""Training throughput and data-wait fraction, against a compute-only anchor in the same run.

    python benchmarks/train_throughput.py configs/train/smoke_cpu.yaml trainer.max_duration=30ba

1. Trains ``trainer.max_duration`` through the real stack (BucketedDataset ->
   StreamingDataLoader -> Composer) and reads samples/s and the
   ``DataWaitMonitor`` fraction (first ``--warmup`` batches excluded).
2. Anchor: the same model and optimizer stepping on one cached batch held in
   memory (no loader, no Composer), same number of steps.

The ratio fed/anchor near 1.0 means the loader keeps up; the data-wait
fraction says how much of each step is spent blocked on data. Run on an
otherwise idle machine; no checkpoints are written.
"""

from __future__ import annotations

import argparse
import json
import time

import torch
from composer.core import Callback


class _StepClock(Callback):
    """Wall time of every batch end (for throughput after warm-up)."""

    def __init__(self) -> None:
        self.ends: list[float] = []
        self.samples: list[int] = []
        self.first_batch: dict | None = None

    def after_dataloader(self, state, logger) -> None:
        if self.first_batch is None:
            self.first_batch = {
                k: (v.clone() if torch.is_tensor(v) else list(v)) for k, v in state.batch.items()
            }

    def batch_end(self, state, logger) -> None:
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        self.ends.append(time.perf_counter())
        self.samples.append(int(state.timestamp.sample))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("config", help="training YAML")
    p.add_argument("overrides", nargs="*", help="key=value overrides")
    p.add_argument("--warmup", type=int, default=5, help="batches left out of the figures")
    args = p.parse_args()

    from prx_data.train.callbacks import DataWaitMonitor
    from prx_data.train.config import load_config
    from prx_data.train.trainer import build_trainer, resolve_placement

    cfg = load_config(
        args.config,
        [
            *args.overrides,
            "trainer.save_folder=null",
            "trainer.autoresume=false",
            "logging.window_size=1000000",
            "logging.log_to_console=false",
        ],
    )
    clock = _StepClock()
    trainer = build_trainer(cfg, callbacks=[clock])
    wait = next(c for c in trainer.state.callbacks if isinstance(c, DataWaitMonitor))
    trainer.fit()
    w = args.warmup
    if len(clock.ends) <= w + 1:
        raise SystemExit(f"need more than {w + 1} batches; raise trainer.max_duration")
    fed = (clock.samples[-1] - clock.samples[w]) / (clock.ends[-1] - clock.ends[w])
    waits = list(wait.window)[-(len(clock.ends) - w - 1) :]
    wait_frac = sum(a for a, _ in waits) / sum(b for _, b in waits)

    # Anchor: the same model/optimizer on one cached batch, same precision.
    place = resolve_placement(cfg)
    model = trainer.state.model
    model = getattr(model, "module", model)
    opt = trainer.state.optimizers[0]
    batch = {
        k: (v.to(place.torch_device) if torch.is_tensor(v) else v)
        for k, v in clock.first_batch.items()
    }
    dtype = torch.bfloat16 if place.precision == "amp_bf16" else None
    steps = len(clock.ends) - w - 1
    n = batch["image"].shape[0]
    times = []
    for i in range(steps + w):
        with torch.autocast(place.torch_device.type, dtype=dtype, enabled=dtype is not None):
            loss = model.loss(model(batch), batch)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        float(loss)
        times.append(time.perf_counter())
        if i == w - 1:
            t0 = times[-1]
    anchor = n * steps / (times[-1] - t0)
    out = {
        "device": place.device,
        "precision": place.precision,
        "device_batch": n,
        "steps_measured": steps,
        "fed_samples_per_s": round(fed, 2),
        "anchor_samples_per_s": round(anchor, 2),
        "fed_over_anchor": round(fed / anchor, 3),
        "data_wait_fraction": round(wait_frac, 4),
    }
    print(json.dumps(out, indent=1))
    trainer.close()


if __name__ == "__main__":
    main()
