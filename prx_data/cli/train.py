"""Train PRX on bucketed MDS exports: ``python -m prx_data.train CONFIG.yaml [key=value ...]``.

``python -m prx_data.train compare RUN_A RUN_B`` plots two runs' metrics side by side.

Multi-process / multi-node through Composer's launcher::

    composer -n 8 -m prx_data.train configs/train/pretrain_512.yaml data.global_batch_size=512

The library API behind it is :mod:`prx_data.train` (``load_config`` +
``build_trainer``), usable from a notebook.
"""

from __future__ import annotations

import argparse
import logging
import sys
from collections.abc import Sequence

from prx_data.core.errors import PrxDataError

EPILOG = """\
overrides:
  Dotted keys into the YAML, values parsed as YAML, list items by index:
    trainer.max_duration=200ba  optimizer.lr=3e-4  data.plan.tier=1024
    data.datasets.0.proportion=0.7  data.datasets.1.skip_lists=[dedup,nsfw]
    model.axes_dim=null  trainer.ema.enabled=true
  An unknown key or a value of the wrong type stops before training, naming the key.

sections (see docs/TRAINING.md):
  model         PRX size: patch_size, hidden_size, depth, num_heads, mlp_ratio, ...
  flow          logit-normal timestep mean/std
  text_encoder  name_or_path, tokenizer, max_length, dtype, layer
  data          datasets (root/local/proportion/repeat/choose/skip_lists), tier,
                include_higher_tiers, caption_columns (name/weight), caption_dropout,
                global_batch_size, num_workers, shuffle_seed, batching_method, decode,
                streaming
  optimizer     name, lr, betas, eps, weight_decay
  scheduler     name, t_warmup, alpha_f
  trainer       max_duration, run_name, save_folder, autoresume, save_interval,
                load_path, precision, device, seed, ema
  logging       console_log_interval, file, window_size, sample_ids_dir, wandb_project,
                tensorboard_dir, mlflow_experiment, mlflow_tracking_uri

  eval          enabled, source (slice|export), holdout_fraction, holdout_salt, datasets,
                interval, num_bands, global_batch_size, device_batch_size, subset_num_batches, seed
  sampling      enabled, prompts, seeds, shapes, steps, guidance_scale, interval, folder
  vae           name_or_path, subfolder, dtype, scaling_factor, shift_factor, posterior,
                tiling, tile_size (latent-space PRX; null name_or_path: pixel space)
  metrics       enabled, interval, num_samples, seed, steps, guidance_scale, fid_model,
                fid_weights, clip_model, dino_model, folder
  parallelism   fsdp (enabled, version, sharding_strategy, activation_checkpointing, ...),
                compile, compile_mode

compare two runs (data ablations; see docs/TRAINING.md):
  python -m prx_data.train compare RUN_A RUN_B [--out compare.png]

resume:
  Re-run the same command with trainer.autoresume=true (needs run_name and save_folder);
  the world size may change as long as data.global_batch_size stays the same.
  Re-running a run that already reached trainer.max_duration prints so and exits 0.
"""


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m prx_data.train",
        description=(
            "Train a pixel- or latent-space PRX transformer (diffusers) with rectified flow on "
            "bucketed MDS exports, with a frozen text encoder run in the step, "
            "checkpoints and autoresume (Composer)."
        ),
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("config", help="YAML run config, e.g. configs/train/smoke_cpu.yaml")
    p.add_argument(
        "overrides",
        nargs="*",
        metavar="key=value",
        help="dotted overrides applied after the YAML (see below)",
    )
    p.add_argument(
        "--print-config",
        action="store_true",
        help="print the resolved config as YAML and exit without training",
    )
    p.add_argument(
        "--log-level",
        default="INFO",
        choices=["DEBUG", "INFO", "WARNING", "ERROR"],
        help="Python logging level for prx_data and composer (default INFO)",
    )
    return p


def build_compare_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m prx_data.train compare",
        description=(
            "Compare two runs (a data ablation: captioner A vs B, with vs without a filter): "
            "plot FID, CMMD, DINO-MMD and the held-out loss per timestep band over steps for "
            "both runs into one PNG and print a table at the last common step."
        ),
    )
    p.add_argument("run_a", help="run A: its run folder, save_folder or metrics folder")
    p.add_argument("run_b", help="run B: likewise")
    p.add_argument("--out", default="compare.png", help="PNG to write (default compare.png)")
    p.add_argument(
        "--labels", nargs=2, metavar=("A", "B"), help="legend names (default: folder names)"
    )
    return p


def compare_main(argv: Sequence[str]) -> int:
    args = build_compare_parser().parse_args(argv)
    from prx_data.train.compare import compare

    try:
        png, text = compare(args.run_a, args.run_b, args.out, tuple(args.labels or (None, None)))
    except PrxDataError as exc:
        print(f"compare: {exc}", file=sys.stderr)
        return 2
    print(text)
    print(f"\nplot: {png}")
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] == "compare":
        return compare_main(argv[1:])
    args = build_parser().parse_args(argv)
    from prx_data.train.config import load_config, to_yaml

    try:
        cfg = load_config(args.config, args.overrides)
    except PrxDataError as exc:
        print(f"config error: {exc}", file=sys.stderr)
        return 2
    if args.print_config:
        print(to_yaml(cfg), end="")
        return 0
    logging.basicConfig(
        level=args.log_level, format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    logging.getLogger("composer").setLevel(args.log_level)
    from prx_data.train.logs import quiet_logs

    quiet_logs(args.log_level)

    from prx_data.train.trainer import build_trainer, finished_message, run_is_finished

    try:
        trainer = build_trainer(cfg)
    except PrxDataError as exc:
        # Every rank plans the same data and fails the same way: one line, from rank 0.
        if _global_rank() == 0:
            print(f"error: {exc}", file=sys.stderr)
        return 2
    if run_is_finished(trainer):
        # A rerun of a finished run (e.g. a requeued job) is not a failure: say so, exit 0.
        print(finished_message(cfg, trainer), file=sys.stderr)
        trainer.close()
        return 0
    trainer.fit()
    trainer.close()
    return 0


def _global_rank() -> int:
    """This process's rank under Composer's launcher (0 when run alone)."""
    import os

    try:
        return int(os.environ.get("RANK", "0"))
    except ValueError:
        return 0


if __name__ == "__main__":
    sys.exit(main())
