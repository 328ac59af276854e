"""Assemble a Composer ``Trainer`` from a :class:`TrainConfig`: the library API behind the CLI.

A notebook can do the same in three lines::

    cfg = load_config("configs/train/smoke_cpu.yaml", ["trainer.max_duration=4ba"])
    trainer = build_trainer(cfg)
    trainer.fit()
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from composer import Trainer
from composer.algorithms import EMA
from composer.callbacks import LRMonitor, SpeedMonitor
from composer.core import Callback, Time
from composer.devices import DeviceCPU, DeviceGPU
from composer.loggers import FileLogger, LoggerDestination
from composer.optim import (
    ConstantScheduler,
    ConstantWithWarmupScheduler,
    CosineAnnealingScheduler,
    CosineAnnealingWithWarmupScheduler,
    DecoupledAdamW,
    LinearScheduler,
    LinearWithWarmupScheduler,
)
from composer.utils import dist, reproducibility
from streaming import StreamingDataset

from prx_data.core.errors import UsageError
from prx_data.train.callbacks import DataWaitMonitor, ResumeGuard, SampleIdLogger
from prx_data.train.captions import CaptionPolicy
from prx_data.train.composer_compat import (
    drop_stale_autoresume_copy,
    multinode_safe,
)
from prx_data.train.config import ConfigError, TrainConfig, device_batch_size, metrics_folder
from prx_data.train.data import build_dataspec
from prx_data.train.model import PRXFlowModel, build_transformer
from prx_data.train.text_encoder import TextEncoder
from prx_data.train.vae import LatentCodec

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Placement:
    """Where and how a run executes, resolved from the ``auto`` settings."""

    device: str  # composer device name: "gpu" or "cpu"
    precision: str  # composer precision name
    torch_device: torch.device


def resolve_placement(cfg: TrainConfig) -> Placement:
    """``auto`` picks the GPU with bf16 autocast when CUDA is there, else CPU in fp32."""
    t = cfg.trainer
    cuda = torch.cuda.is_available()
    device = t.device if t.device != "auto" else ("gpu" if cuda else "cpu")
    if device == "gpu" and not cuda:
        raise UsageError("trainer.device: 'gpu' requested but CUDA is not available")
    precision = (
        t.precision if t.precision != "auto" else ("amp_bf16" if device == "gpu" else "fp32")
    )
    if device == "cpu" and precision != "fp32":
        raise UsageError(f"trainer.precision: {precision!r} needs a GPU; use fp32 on CPU")
    tdev = torch.device(f"cuda:{dist.get_local_rank()}") if device == "gpu" else torch.device("cpu")
    return Placement(device, precision, tdev)


def build_model(cfg: TrainConfig, device: torch.device | str | None = None) -> PRXFlowModel:
    """Text encoder and VAE (frozen, by name or path) + fresh PRX transformer + flow loss."""
    te = cfg.text_encoder
    encoder = TextEncoder.from_pretrained(
        te.name_or_path,
        tokenizer=te.tokenizer,
        max_length=te.max_length,
        dtype=te.dtype,
        layer=te.layer,
        device=device,
    )
    vae = build_vae(cfg, device)
    channels = vae.latent_channels if vae is not None else 3
    transformer = build_transformer(cfg.model, encoder.hidden_size, channels)
    cols = cfg.data.caption_columns
    policy = CaptionPolicy(
        tuple(c.name for c in cols),
        tuple(float(c.weight) for c in cols),
        cfg.data.caption_dropout,
        warn_empty=True,
    )
    precomputed = cfg.vae.source == "precomputed"
    return PRXFlowModel(transformer, encoder, policy, cfg.flow, vae=vae, precomputed=precomputed)


def build_vae(cfg: TrainConfig, device: torch.device | str | None = None) -> LatentCodec | None:
    """The frozen autoencoder of ``cfg.vae`` (None without ``vae.name_or_path``: pixel space)."""
    v = cfg.vae
    if v.name_or_path is None:
        return None
    return LatentCodec.from_pretrained(
        v.name_or_path,
        subfolder=v.subfolder,
        dtype=v.dtype,
        device=device,
        scaling_factor=v.scaling_factor,
        shift_factor=v.shift_factor,
        posterior=v.posterior,
        tiling=v.tiling,
        tile_size=v.tile_size,
    )


def check_precomputed_latents(cfg: TrainConfig, codec: LatentCodec | None) -> None:
    """Refuse, in one line, exports whose stored latents another VAE made (or that have none).

    Every export the run streams (``data.datasets``, and ``eval.datasets`` when
    evaluating on separate exports) must carry a latents record whose class,
    factors, posterior, compression and channels equal ``codec``'s.

    Args:
        cfg: the run's config (``vae.source: precomputed``).
        codec: the run's VAE (its decoder samples; its identity is what the latents need).

    Raises:
        ConfigError: an export without latents, or one whose record disagrees.
    """
    from prx_data.export import latents as latents_store

    if codec is None:
        raise ConfigError("vae.source: precomputed needs vae.name_or_path")
    roots = [d.root for d in cfg.data.datasets]
    if cfg.eval.enabled and cfg.eval.source == "export":
        roots += [d.root for d in cfg.eval.datasets]
    want = codec.identity()
    for root in dict.fromkeys(roots):
        try:
            record = latents_store.require_record(root)
        except latents_store.LatentsError as e:
            raise ConfigError(f"vae.source: {e}") from None
        diff = latents_store.vae_differences(record.get("vae") or {}, want)
        if diff:
            raise ConfigError(
                f"vae.source: the latents of {root} were made with another VAE "
                f"({'; '.join(diff)}; recorded -> this run's vae); run python -m prx_data.latents "
                f"{root} --vae {cfg.vae.name_or_path} --replace, or set vae.source: encode"
            )


def check_precomputed_text(cfg: TrainConfig, model: PRXFlowModel) -> list[str]:
    """Bind the step to the exports' stored text embeddings (``text_encoder.source: precomputed``).

    Every training export must carry, for each caption column C, the attached columns
    ``latent_C_<encoder>`` and ``attention_mask_C_<encoder>`` made by this run's encoder
    (weights digest, max_length, layer); else a one-line ConfigError. Sets the model's
    column keys and empty-caption value and returns the columns the loader must serve.
    """
    from prx_data.export import attached as A
    from prx_data.train.vae import weights_digest

    te = cfg.text_encoder
    label = te.precomputed_name or A.encoder_label(te.name_or_path)
    want = {
        "weights": weights_digest(te.name_or_path, setting="text_encoder.name_or_path"),
        "max_length": te.max_length,
        "layer": te.layer,
    }
    keys = {c.name: A.text_names(c.name, label) for c in cfg.data.caption_columns}
    empty: list = []
    for root in dict.fromkeys(d.root for d in cfg.data.datasets):
        for caption, names in keys.items():
            for name in names:
                try:
                    record = A.read_record(root, name)
                except A.AttachedError as e:
                    raise ConfigError(f"text_encoder.source: {e}") from None
                if record is None:
                    raise ConfigError(
                        f"text_encoder.source: {root} has no attached column {name!r}; run "
                        f"python -m prx_data.attach {root} --table TABLE --columns {caption} "
                        f"--text-encoder {te.name_or_path} --max-length {te.max_length}, or set "
                        "text_encoder.source: encode"
                    )
                had = (record.get("source") or {}).get("text_encoder") or {}
                diff = A.text_encoder_differences(had, want)
                if diff:
                    raise ConfigError(
                        f"text_encoder.source: {root}'s {name!r} was made by another text "
                        f"encoder ({'; '.join(diff)}; recorded -> this run's); run python -m "
                        f"prx_data.attach {root} --table TABLE --columns {caption} --text-encoder "
                        f"{te.name_or_path} --replace, or set text_encoder.source: encode"
                    )
                if len(empty) < 2:
                    empty.append(torch.from_numpy(A.empty_value(record).copy()))
    model.stored_text = keys
    model.empty_text = (empty[0].float(), empty[1].bool())
    return [n for names in keys.values() for n in names]


def build_optimizer(cfg: TrainConfig, model: PRXFlowModel) -> torch.optim.Optimizer:
    o = cfg.optimizer
    params = [p for p in model.transformer.parameters() if p.requires_grad]
    kwargs = dict(lr=o.lr, betas=tuple(o.betas), eps=o.eps, weight_decay=o.weight_decay)
    if o.name == "decoupled_adamw":
        return DecoupledAdamW(params, **kwargs)
    return torch.optim.AdamW(params, **kwargs)


def build_scheduler(cfg: TrainConfig):
    s = cfg.scheduler
    if Time.from_timestring(s.t_warmup).value == 0:
        # Composer warns about zero-length warm-ups; use the plain schedules instead.
        if s.name == "cosine_with_warmup":
            return CosineAnnealingScheduler(alpha_f=s.alpha_f)
        if s.name == "linear_with_warmup":
            return LinearScheduler(alpha_f=s.alpha_f)
        return ConstantScheduler()
    if s.name == "cosine_with_warmup":
        return CosineAnnealingWithWarmupScheduler(t_warmup=s.t_warmup, alpha_f=s.alpha_f)
    if s.name == "linear_with_warmup":
        return LinearWithWarmupScheduler(t_warmup=s.t_warmup, alpha_f=s.alpha_f)
    return ConstantWithWarmupScheduler(t_warmup=s.t_warmup)


def build_loggers(cfg: TrainConfig) -> list[LoggerDestination]:
    lg = cfg.logging
    loggers: list[LoggerDestination] = []
    if lg.file:
        loggers.append(FileLogger(filename=lg.file, capture_stdout=False, capture_stderr=False))
    if lg.wandb_project:
        from composer.loggers import WandBLogger

        loggers.append(WandBLogger(project=lg.wandb_project))
    if lg.tensorboard_dir:
        from composer.loggers import TensorboardLogger

        loggers.append(TensorboardLogger(log_dir=lg.tensorboard_dir))
    if lg.mlflow_experiment:
        from composer.loggers import MLFlowLogger

        loggers.append(
            MLFlowLogger(experiment_name=lg.mlflow_experiment, tracking_uri=lg.mlflow_tracking_uri)
        )
    return loggers


def build_callbacks(cfg: TrainConfig) -> list[Callback]:
    lg = cfg.logging
    callbacks: list[Callback] = [
        SpeedMonitor(window_size=lg.window_size),
        DataWaitMonitor(window_size=lg.window_size),
        LRMonitor(),
        ResumeGuard(cfg.data.global_batch_size, cfg.data.num_workers, holdout=_holdout_key(cfg)),
    ]
    if lg.sample_ids_dir:
        callbacks.append(SampleIdLogger(lg.sample_ids_dir))
    s = cfg.sampling
    if s.enabled:
        from prx_data.train.sampling import SampleGrid

        callbacks.append(
            SampleGrid(
                s.prompts,
                s.seeds,
                s.shapes,
                steps=s.steps,
                guidance_scale=s.guidance_scale,
                interval=s.interval or cfg.trainer.save_interval,
                folder=s.folder,
            )
        )
    folder = metrics_folder(cfg)
    if cfg.eval.enabled and folder:
        from prx_data.train.metrics import EvalLossWriter

        callbacks.append(EvalLossWriter(folder))
    m = cfg.metrics
    if m.enabled:
        from prx_data.train.metrics import GenerationMetrics, build_metrics

        callbacks.append(
            GenerationMetrics(
                build_metrics(m.fid_model, m.clip_model, m.dino_model, m.fid_weights),
                num_samples=m.num_samples,
                interval=m.interval,
                folder=folder,
                seed=m.seed,
                steps=m.steps,
                guidance_scale=m.guidance_scale,
                models={"FID": m.fid_model, "CMMD": m.clip_model, "DINO-MMD": m.dino_model},
            )
        )
    return callbacks


def _holdout_key(cfg: TrainConfig) -> str:
    """What the training sample space leaves out for eval (checked on resume)."""
    e = cfg.eval
    if not e.enabled or e.source != "slice":
        return "none"
    return f"{e.holdout_fraction!r}/{e.holdout_salt}"


def parallelism_kwargs(cfg: TrainConfig, model: PRXFlowModel) -> dict:
    """Composer ``parallelism_config`` / ``compile_config`` from ``cfg.parallelism``.

    FSDP wraps and (optionally) activation-checkpoints each PRX block; the
    text encoder is not a submodule, so it is neither sharded nor trained.
    """
    from composer.utils.parallelism import FSDP2Config, FSDPConfig

    p = cfg.parallelism
    out: dict = {}
    f = p.fsdp
    if f.enabled:
        model.transformer.fsdp_wrap_fn = is_prx_block
        model.transformer.activation_checkpointing_fn = is_prx_block
        if f.version == 2:
            fsdp = FSDP2Config(
                activation_checkpointing=f.activation_checkpointing,
                activation_cpu_offload=f.activation_cpu_offload,
                state_dict_type=f.state_dict_type,
                mixed_precision=f.mixed_precision,
            )
        else:
            fsdp = FSDPConfig(
                sharding_strategy=f.sharding_strategy,
                data_parallel_shard_degree=f.data_parallel_shard_degree,
                data_parallel_replicate_degree=f.data_parallel_replicate_degree,
                activation_checkpointing=f.activation_checkpointing,
                activation_checkpointing_reentrant=False,
                activation_cpu_offload=f.activation_cpu_offload,
                mixed_precision=f.mixed_precision,
                state_dict_type=f.state_dict_type,
                forward_prefetch=f.forward_prefetch,
                limit_all_gathers=f.limit_all_gathers,
                cpu_offload=f.cpu_offload,
                sync_module_states=True,
                use_orig_params=True,
            )
        out["parallelism_config"] = {"fsdp": fsdp}
    if p.compile:
        cc: dict = {}
        if p.compile_mode:
            cc["mode"] = p.compile_mode
        if p.compile_dynamic is not None:
            cc["dynamic"] = p.compile_dynamic
        out["compile_config"] = cc
    return out


def is_prx_block(module: torch.nn.Module) -> bool:
    """FSDP wrap unit and activation-checkpointing unit: one PRX transformer block."""
    from diffusers.models.transformers.transformer_prx import PRXBlock

    return isinstance(module, PRXBlock)


def run_is_finished(trainer: Trainer) -> bool:
    """True when the (auto)resumed state already reached ``max_duration``: fit would do nothing."""
    from composer.core import TimeUnit

    md = trainer.state.max_duration
    if md is None or md.unit == TimeUnit.DURATION:
        return False
    return bool(trainer.state.timestamp.get(md.unit) >= md)


def finished_message(cfg: TrainConfig, trainer: Trainer) -> str:
    ts = trainer.state.timestamp
    folder = str(cfg.trainer.save_folder).replace("{run_name}", str(cfg.trainer.run_name))
    return (
        f"run {cfg.trainer.run_name!r} is already finished: the checkpoint in "
        f"{folder} is at batch {int(ts.batch)} (epoch {int(ts.epoch)}), "
        f"trainer.max_duration={cfg.trainer.max_duration}. Nothing to train. To train longer, "
        "raise trainer.max_duration; to start over, pick a new trainer.run_name "
        "(or remove the checkpoints)."
    )


def build_trainer(
    cfg: TrainConfig,
    *,
    dataset: StreamingDataset | None = None,
    model: PRXFlowModel | None = None,
    callbacks: Sequence[Callback] = (),
) -> Trainer:
    """A ready-to-``fit()`` Composer Trainer for this rank.

    ``dataset`` overrides the configured stream (it must already use this
    rank's device batch size); ``model`` overrides :func:`build_model`.
    """
    place = resolve_placement(cfg)
    composer_device = DeviceGPU() if place.device == "gpu" else DeviceCPU()
    dist.initialize_dist(composer_device, timeout=cfg.trainer.dist_timeout)
    world = dist.get_world_size()
    batch = device_batch_size(cfg.data, world)
    # Same weights on every rank before DDP broadcasts them; the Trainer reseeds per rank.
    reproducibility.seed_all(cfg.trainer.seed)
    if model is None:
        model = build_model(cfg, place.torch_device)
    from prx_data.train.evaluation import holdout_for

    train_holdout = holdout_for(cfg, "train")
    if dataset is not None and train_holdout is not None:
        raise UsageError(
            "eval.source=slice with a dataset passed in: the hold-out cannot be left out of a "
            "stream built elsewhere; let build_trainer build the stream, or evaluate on a "
            "separate export (eval.source=export)"
        )
    # Tokens per image count image pixels per token side: patch x the VAE's compression.
    pixel_patch = int(getattr(model, "pixel_patch", cfg.model.patch_size))
    precomputed = cfg.vae.source == "precomputed"
    if precomputed:
        check_precomputed_latents(cfg, model.vae)
    data_cfg = cfg.data
    if cfg.text_encoder.source == "precomputed":
        stored = check_precomputed_text(cfg, model)
        data_cfg = dataclasses.replace(
            data_cfg, extra_columns=list(dict.fromkeys([*data_cfg.extra_columns, *stored]))
        )
    dataspec = build_dataspec(
        data_cfg,
        world,
        pixel_patch,
        dataset=dataset,
        holdout=train_holdout,
        latents=precomputed and dataset is None,
    )
    extra: dict = parallelism_kwargs(cfg, model)
    if cfg.eval.enabled:
        from prx_data.train.evaluation import build_evaluator

        model.configure_eval(cfg.eval.num_bands, cfg.eval.seed)
        extra["eval_dataloader"] = build_evaluator(cfg, world, pixel_patch)
        extra["eval_interval"] = cfg.eval.interval
        extra["eval_subset_num_batches"] = cfg.eval.subset_num_batches or -1
    t = cfg.trainer
    algorithms = []
    if t.ema.enabled:
        algorithms.append(
            EMA(
                half_life=t.ema.half_life,
                update_interval=t.ema.update_interval,
                ema_start=t.ema.ema_start,
            )
        )
    microbatch = t.device_train_microbatch_size or batch
    rep = cfg.data.plan.replication or 1
    log.info(
        "world size %d, device batch %d, global batch %d (%d unique per step, replication %d), "
        "%s/%s",
        world,
        batch,
        cfg.data.global_batch_size,
        cfg.data.global_batch_size // rep,
        rep,
        place.device,
        place.precision,
    )
    if t.autoresume:  # an s3:// save folder: fetch its newest checkpoint, not an old copy
        drop_stale_autoresume_copy(t.save_folder, t.run_name)
    # Autoresume and the checkpoint load run inside Trainer(): name Composer's node signal
    # files per node, so that nodes sharing save_folder do not write and remove one file.
    return multinode_safe(Trainer)(
        model=model,
        train_dataloader=dataspec,
        max_duration=t.max_duration,
        optimizers=build_optimizer(cfg, model),
        schedulers=build_scheduler(cfg),
        algorithms=algorithms,
        callbacks=[*build_callbacks(cfg), *callbacks],
        loggers=build_loggers(cfg),
        run_name=t.run_name,
        save_folder=t.save_folder,
        save_interval=t.save_interval,
        save_num_checkpoints_to_keep=t.save_num_checkpoints_to_keep,
        autoresume=t.autoresume,
        load_path=t.load_path,
        load_weights_only=t.load_weights_only,
        device=composer_device,
        precision=place.precision,
        device_train_microbatch_size=microbatch,
        seed=t.seed,
        dist_timeout=t.dist_timeout,
        progress_bar=cfg.logging.progress_bar,
        log_to_console=cfg.logging.log_to_console,
        console_log_interval=cfg.logging.console_log_interval,
        **extra,
    )


def train(cfg: TrainConfig, **kwargs) -> Trainer:
    """Build and fit; returns the trainer (for its state and logged metrics).

    A run whose autoresumed checkpoint already reached ``max_duration`` is not
    fitted again; the reason is logged (see :func:`run_is_finished`).
    """
    trainer = build_trainer(cfg, **kwargs)
    if run_is_finished(trainer):
        log.warning(finished_message(cfg, trainer))
        return trainer
    trainer.fit()
    return trainer
