"""Typed run configuration: dataclasses, loaded from YAML with ``key=value`` overrides.

The schema is an omegaconf *structured* config, so a misspelt key or a value of
the wrong type fails while loading, with the dotted key in the message, rather
than hours later inside the trainer. The YAML layout follows llm-foundry: one
section per concern plus a free ``variables:`` block for ``${variables.x}``
interpolation.
"""

from __future__ import annotations

import math
import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml
from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException


class ConfigError(ValueError):
    """A run configuration is invalid; the message names the offending key."""


@dataclass
class ModelConfig:
    """Size of the PRX transformer (pixel space: RGB patches go straight in)."""

    #: Pixels per patch side. 16 at the 512 tier gives 1024 tokens (PRX Pixel).
    patch_size: int = 16
    hidden_size: int = 1792
    depth: int = 16
    num_heads: int = 28
    mlp_ratio: float = 3.5
    #: RoPE dims per axis (must sum to hidden_size / num_heads); None splits evenly.
    axes_dim: list[int] | None = None
    theta: int = 10000
    #: Text feature width; None takes the text encoder's hidden size.
    context_in_dim: int | None = None
    #: Image channels: 3 for pixel space.
    in_channels: int = 3
    gradient_checkpointing: bool = False
    #: Optional directory or hub id of a saved PRXTransformer2DModel to start from.
    pretrained: str | None = None


@dataclass
class FlowConfig:
    """Rectified flow: x_t = (1 - t) x0 + t noise, t ~ sigmoid(N(mean, std)), target noise - x0."""

    logit_mean: float = 0.0
    logit_std: float = 1.0


@dataclass
class TextEncoderConfig:
    """Frozen text encoder run inside the training step (no precomputed features)."""

    #: Hub id or local directory of any transformers encoder (T5, T5Gemma, Qwen text tower).
    name_or_path: str = "google/t5-v1_1-xxl"
    #: Tokenizer location when it differs from the model's.
    tokenizer: str | None = None
    max_length: int = 256
    #: "auto" = bfloat16 on CUDA, float32 on CPU; or "float32", "bfloat16", "float16".
    dtype: str = "auto"
    #: Which hidden state to use: -1 is the last layer, -2 the one before, ...
    layer: int = -1


@dataclass
class CaptionColumn:
    """One caption column and its relative chance of being picked for a sample."""

    name: str = "caption"
    weight: float = 1.0


@dataclass
class DatasetConfig:
    """One export tree to stream; mirrors ``prx_data.stream.dataset.DatasetSpec``."""

    root: str = "???"
    #: Local cache directory for a remote root (None: streaming picks a temp dir).
    local: str | None = None
    #: Mixing: give either proportion (relative weight), repeat, or choose.
    proportion: float | None = None
    repeat: float | None = None
    choose: int | None = None
    #: Skip lists to apply by name; None applies all that exist, [] applies none.
    skip_lists: list[str] | None = None


@dataclass
class DataConfig:
    datasets: list[DatasetConfig] = field(default_factory=list)
    #: Training resolution tier (512, 1024, ...).
    tier: int = 512
    #: Also stream higher tiers, downsized to the same-ratio shape of `tier`.
    include_higher_tiers: bool = False
    caption_columns: list[CaptionColumn] = field(default_factory=lambda: [CaptionColumn()])
    #: Probability of replacing the caption with "" (classifier-free guidance).
    caption_dropout: float = 0.1
    #: Samples per optimizer step over all ranks; kept fixed across elastic resumes.
    global_batch_size: int = 256
    #: Per-rank batch; None derives global_batch_size / world_size.
    device_batch_size: int | None = None
    num_workers: int = 8
    prefetch_factor: int | None = None
    persistent_workers: bool = True
    pin_memory: bool = True
    shuffle: bool = True
    shuffle_seed: int = 9176
    #: "per_stream" (each global batch from one bucket; the epoch does not depend on the
    #: world size, so elastic resumes are exact) or "device_per_stream" (each device batch
    #: from one bucket).
    batching_method: str = "per_stream"
    #: Buckets too small for one planning unit: "error" (default) or "drop" them.
    small_buckets: str = "error"
    num_canonical_nodes: int | None = None
    #: Consecutive ranks that see the same samples (tensor/context parallel groups); only
    #: global_batch_size / replication samples per step are unique, and that is what is counted.
    replication: int | None = None
    epoch_size: int | None = None
    #: Resuming onto a changed sample space (a skip list added, other weights): "error"
    #: (default) or "restart_epoch" (start the epoch over with the current lists).
    on_change: str = "error"
    #: Extra StreamingDataset keyword arguments (cache_limit, predownload, ...).
    streaming: dict[str, Any] = field(default_factory=dict)
    #: "module:function" building the dataset instead of prx_data.stream.dataset.BucketedDataset;
    #: called as fn(data_config, device_batch_size) and must return a StreamingDataset.
    factory: str | None = None


@dataclass
class OptimizerConfig:
    #: "adamw" (torch) or "decoupled_adamw" (composer).
    name: str = "adamw"
    lr: float = 1e-4
    betas: list[float] = field(default_factory=lambda: [0.9, 0.95])
    eps: float = 1e-8
    weight_decay: float = 0.0


@dataclass
class SchedulerConfig:
    #: "constant_with_warmup", "cosine_with_warmup" or "linear_with_warmup".
    name: str = "constant_with_warmup"
    t_warmup: str = "0ba"
    #: Final LR multiplier for the cosine and linear schedules.
    alpha_f: float = 0.0


@dataclass
class EMAConfig:
    enabled: bool = False
    half_life: str = "1000ba"
    update_interval: str | None = None
    ema_start: str = "0.0dur"


@dataclass
class TrainerConfig:
    max_duration: str = "1ep"
    run_name: str | None = None
    save_folder: str | None = None
    autoresume: bool = False
    save_interval: str = "1000ba"
    #: Checkpoints to keep (-1 keeps all).
    save_num_checkpoints_to_keep: int = -1
    #: Start from this checkpoint (ignored when autoresume finds one).
    load_path: str | None = None
    load_weights_only: bool = False
    #: "auto" = amp_bf16 on CUDA, fp32 on CPU; or any composer precision name.
    precision: str = "auto"
    #: "auto" = gpu when CUDA is available, else cpu.
    device: str = "auto"
    #: Split each device batch into microbatches of this size (None: no split).
    device_train_microbatch_size: int | None = None
    seed: int = 17
    dist_timeout: float = 600.0
    ema: EMAConfig = field(default_factory=EMAConfig)


@dataclass
class LoggingConfig:
    console_log_interval: str = "10ba"
    log_to_console: bool = True
    progress_bar: bool = False
    #: Composer FileLogger path pattern (None: off), e.g. "{run_name}/logs-rank{rank}.txt".
    file: str | None = None
    #: Window (batches) for samples/s and the data-wait fraction.
    window_size: int = 100
    #: Directory for per-rank logs of consumed sample ids (None: off).
    sample_ids_dir: str | None = None
    wandb_project: str | None = None
    tensorboard_dir: str | None = None


@dataclass
class TrainConfig:
    variables: dict[str, Any] = field(default_factory=dict)
    model: ModelConfig = field(default_factory=ModelConfig)
    flow: FlowConfig = field(default_factory=FlowConfig)
    text_encoder: TextEncoderConfig = field(default_factory=TextEncoderConfig)
    data: DataConfig = field(default_factory=DataConfig)
    optimizer: OptimizerConfig = field(default_factory=OptimizerConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)


_PRECISIONS = {"auto", "fp32", "amp_fp16", "amp_bf16", "amp_fp8"}
_DTYPES = {"auto", "float32", "bfloat16", "float16"}
_OPTIMIZERS = {"adamw", "decoupled_adamw"}
_SCHEDULERS = {"constant_with_warmup", "cosine_with_warmup", "linear_with_warmup"}
_BATCHING = {"device_per_stream", "per_stream"}


#: Composer time strings: a number and a unit (epochs, batches, samples, tokens, fraction).
_TIME = re.compile(r"^\d+(\.\d+)?(ep|ba|sp|tok|dur)$")


def _check_time(key: str, value: str | None, *, optional: bool = False) -> None:
    if value is None and optional:
        return
    if value is None or not _TIME.match(str(value)):
        _fail(key, f"{value!r} is not a time like 10ba, 2ep, 5000sp or 0.5dur")


def _fail(key: str, msg: str) -> None:
    raise ConfigError(f"{key}: {msg}")


def _omegaconf_error(exc: OmegaConfBaseException, where: str) -> ConfigError:
    key = getattr(exc, "full_key", None) or "?"
    first = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
    return ConfigError(f"{key}: {first} ({where})")


def _parse_override(item: str) -> tuple[str, Any]:
    key, sep, raw = item.partition("=")
    if not sep or not key.strip():
        raise ConfigError(f"override {item!r} is not of the form key=value")
    try:
        value = yaml.safe_load(raw) if raw != "" else ""
    except yaml.YAMLError as exc:
        raise ConfigError(f"{key}: cannot parse value {raw!r}: {exc}") from None
    return key.strip(), value


def load_config(
    path: str | Path | None = None,
    overrides: Sequence[str] = (),
    *,
    data: dict[str, Any] | None = None,
) -> TrainConfig:
    """Build a validated :class:`TrainConfig` from YAML, a dict and ``key=value`` overrides.

    Overrides use dotted keys with list indices, e.g. ``data.datasets.0.proportion=0.3``;
    values are parsed as YAML (``[1,2]``, ``null``, ``true``). Raises :class:`ConfigError`
    naming the key for unknown keys, wrong types and invalid values.
    """
    schema = OmegaConf.structured(TrainConfig)
    OmegaConf.set_struct(schema, True)
    # Free-form mappings: any key is allowed there.
    OmegaConf.set_struct(schema.variables, False)
    OmegaConf.set_struct(schema.data.streaming, False)
    cfg: DictConfig = schema
    if path is not None:
        text = Path(path).read_text()
        try:
            loaded = yaml.safe_load(text) or {}
        except yaml.YAMLError as exc:
            raise ConfigError(f"{path}: not valid YAML: {exc}") from None
        if not isinstance(loaded, dict):
            raise ConfigError(f"{path}: top level must be a mapping of sections")
        try:
            cfg = OmegaConf.merge(cfg, OmegaConf.create(loaded))
        except OmegaConfBaseException as exc:
            raise _omegaconf_error(exc, str(path)) from None
    if data:
        try:
            cfg = OmegaConf.merge(cfg, OmegaConf.create(data))
        except OmegaConfBaseException as exc:
            raise _omegaconf_error(exc, "dict") from None
    for item in overrides:
        key, value = _parse_override(item)
        try:
            OmegaConf.update(cfg, key, value, merge=True)
        except OmegaConfBaseException as exc:
            raise _omegaconf_error(exc, f"override {item!r}") from None
    try:
        OmegaConf.resolve(cfg)
        obj: TrainConfig = OmegaConf.to_object(cfg)  # type: ignore[assignment]
    except OmegaConfBaseException as exc:
        raise _omegaconf_error(exc, "resolving") from None
    validate(obj)
    return obj


def validate(cfg: TrainConfig) -> None:
    """Checks omegaconf's type system cannot express; raises ConfigError naming the key."""
    m = cfg.model
    for name in ("patch_size", "hidden_size", "depth", "num_heads", "in_channels"):
        if getattr(m, name) <= 0:
            _fail(f"model.{name}", f"must be positive, got {getattr(m, name)}")
    if m.hidden_size % m.num_heads:
        _fail("model.hidden_size", f"{m.hidden_size} is not divisible by num_heads={m.num_heads}")
    head_dim = m.hidden_size // m.num_heads
    if m.axes_dim is not None and sum(m.axes_dim) != head_dim:
        _fail("model.axes_dim", f"{m.axes_dim} must sum to hidden_size/num_heads={head_dim}")
    if m.axes_dim is None and head_dim % 4:
        _fail("model.num_heads", f"head dim {head_dim} must be divisible by 4 for 2-D RoPE")
    if cfg.flow.logit_std <= 0:
        _fail("flow.logit_std", "must be positive")
    te = cfg.text_encoder
    if te.dtype not in _DTYPES:
        _fail("text_encoder.dtype", f"{te.dtype!r} is not one of {sorted(_DTYPES)}")
    if te.max_length <= 0:
        _fail("text_encoder.max_length", "must be positive")
    d = cfg.data
    for i, ds in enumerate(d.datasets):
        given = [k for k in ("proportion", "repeat", "choose") if getattr(ds, k) is not None]
        if len(given) > 1:
            _fail(
                f"data.datasets.{i}", f"give at most one of proportion/repeat/choose, got {given}"
            )
        if ds.proportion is not None and not ds.proportion > 0:
            _fail(f"data.datasets.{i}.proportion", "must be > 0")
    if not d.caption_columns:
        _fail("data.caption_columns", "needs at least one column")
    for i, col in enumerate(d.caption_columns):
        if not col.weight >= 0 or math.isinf(col.weight):
            _fail(f"data.caption_columns.{i}.weight", f"must be finite and >= 0, got {col.weight}")
    if sum(c.weight for c in d.caption_columns) <= 0:
        _fail("data.caption_columns", "weights must not all be zero")
    if not 0.0 <= d.caption_dropout <= 1.0:
        _fail("data.caption_dropout", f"must be in [0, 1], got {d.caption_dropout}")
    if d.global_batch_size <= 0:
        _fail("data.global_batch_size", "must be positive")
    if d.device_batch_size is not None and d.device_batch_size <= 0:
        _fail("data.device_batch_size", "must be positive")
    if d.num_workers < 0:
        _fail("data.num_workers", "must be >= 0")
    if d.batching_method not in _BATCHING:
        _fail("data.batching_method", f"{d.batching_method!r} is not one of {sorted(_BATCHING)}")
    if d.small_buckets not in ("error", "drop"):
        _fail("data.small_buckets", f"{d.small_buckets!r} is not one of error, drop")
    if d.on_change not in ("error", "restart_epoch"):
        _fail("data.on_change", f"{d.on_change!r} is not one of error, restart_epoch")
    if d.replication is not None and (d.replication < 1 or d.global_batch_size % d.replication):
        _fail(
            "data.replication",
            f"{d.replication} must be >= 1 and divide global_batch_size {d.global_batch_size}",
        )
    if d.factory is not None and ":" not in d.factory:
        _fail("data.factory", f"{d.factory!r} must look like 'package.module:function'")
    if cfg.optimizer.name not in _OPTIMIZERS:
        _fail("optimizer.name", f"{cfg.optimizer.name!r} is not one of {sorted(_OPTIMIZERS)}")
    if len(cfg.optimizer.betas) != 2:
        _fail("optimizer.betas", f"needs two values, got {cfg.optimizer.betas}")
    if cfg.optimizer.lr <= 0:
        _fail("optimizer.lr", "must be positive")
    if cfg.scheduler.name not in _SCHEDULERS:
        _fail("scheduler.name", f"{cfg.scheduler.name!r} is not one of {sorted(_SCHEDULERS)}")
    _check_time("scheduler.t_warmup", cfg.scheduler.t_warmup)
    t = cfg.trainer
    _check_time("trainer.max_duration", t.max_duration)
    _check_time("trainer.save_interval", t.save_interval)
    _check_time("trainer.ema.half_life", t.ema.half_life)
    _check_time("trainer.ema.update_interval", t.ema.update_interval, optional=True)
    _check_time("trainer.ema.ema_start", t.ema.ema_start)
    _check_time("logging.console_log_interval", cfg.logging.console_log_interval)
    if t.precision not in _PRECISIONS:
        _fail("trainer.precision", f"{t.precision!r} is not one of {sorted(_PRECISIONS)}")
    if t.device not in {"auto", "cpu", "gpu"}:
        _fail("trainer.device", f"{t.device!r} is not one of auto, cpu, gpu")
    if t.autoresume and not (t.save_folder and t.run_name):
        key = "trainer.save_folder" if not t.save_folder else "trainer.run_name"
        _fail(key, "autoresume needs both trainer.save_folder and trainer.run_name")
    if t.device_train_microbatch_size is not None and t.device_train_microbatch_size <= 0:
        _fail("trainer.device_train_microbatch_size", "must be positive")


def device_batch_size(cfg: DataConfig, world_size: int) -> int:
    """Per-rank batch: the global batch split evenly; fails if it does not divide."""
    if cfg.global_batch_size % world_size:
        _fail(
            "data.global_batch_size",
            f"{cfg.global_batch_size} is not divisible by the world size {world_size}",
        )
    derived = cfg.global_batch_size // world_size
    if cfg.device_batch_size is not None and cfg.device_batch_size != derived:
        _fail(
            "data.device_batch_size",
            f"{cfg.device_batch_size} x {world_size} ranks != global_batch_size "
            f"{cfg.global_batch_size}; drop it or make them agree",
        )
    return derived


def to_yaml(cfg: TrainConfig) -> str:
    """The fully resolved config as YAML (logged with each run for reproducibility)."""
    return OmegaConf.to_yaml(OmegaConf.structured(cfg))
