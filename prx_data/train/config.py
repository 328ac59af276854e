"""Typed run configuration: dataclasses, loaded from YAML with ``key=value`` overrides.

The schema is an omegaconf *structured* config, so a misspelt key or a value of
the wrong type fails while loading, with the dotted key in the message, rather
than hours later inside the trainer. The YAML layout follows llm-foundry: one
section per concern plus a free ``variables:`` block for ``${variables.x}``
interpolation.
"""

from __future__ import annotations

import dataclasses
import math
import re
import typing
import warnings
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml
from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from prx_data.core.errors import PrxDataError, read_user_text
from prx_data.stream.spec import DatasetSpec


class ConfigError(PrxDataError, ValueError):
    """A run configuration is invalid; the message names the offending key."""


@dataclass
class ModelConfig:
    """Size of the PRX transformer (pixel space by default; latent space with ``vae:``)."""

    #: Patch side in the transformer's input grid: pixels without a VAE (16 at the 512 tier
    #: gives 1024 tokens, PRX Pixel), latent cells with one (2 on a Flux VAE's 8x grid).
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
    #: Input channels: None follows the data (3 for pixels, the VAE's latent_channels).
    in_channels: int | None = None
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
    """Frozen text encoder, run inside the training step or read as precomputed columns."""

    #: Hub id or local directory of any transformers encoder (T5, T5Gemma, Qwen text tower).
    name_or_path: str = "google/t5-v1_1-xxl"
    #: Tokenizer location when it differs from the model's.
    tokenizer: str | None = None
    max_length: int = 256
    #: "auto" = bfloat16 on CUDA, float32 on CPU; or "float32", "bfloat16", "float16".
    dtype: str = "auto"
    #: Which hidden state to use: -1 is the last layer, -2 the one before, ...
    layer: int = -1
    #: "encode": the encoder runs in every step; "precomputed": the step reads each caption
    #: column C's attached latent_C_<encoder> and attention_mask_C_<encoder>
    #: (``python -m prx_data.attach OUT --table T --columns C --text-encoder PATH``), checked
    #: against this encoder's weights digest, max_length and layer (it still encodes prompts
    #: for sampling and held-out evaluation).
    source: str = "encode"
    #: The <encoder> part of those column names (None: name_or_path's last part, lower case).
    precomputed_name: str | None = None


@dataclass
class VAEConfig:
    """Frozen diffusers autoencoder: train in its latent space, images encoded in the step.

    ``name_or_path`` None keeps pixel space. AutoencoderKL (Flux, SD) and
    AutoencoderDC (DC-AE) are read from the checkpoint's ``_class_name``.
    Latents are ``(z - shift_factor) * scaling_factor``, the factors taken from
    the VAE's config unless set here (``PRXPipeline`` decodes with the same).
    """

    #: Hub id or local directory of a diffusers autoencoder (None: pixel space).
    name_or_path: str | None = None
    #: Folder inside name_or_path (e.g. "vae" of a whole pipeline repo).
    subfolder: str | None = None
    #: "auto" = bfloat16 on CUDA, float32 on CPU; or "float32", "bfloat16", "float16".
    dtype: str = "auto"
    #: Override the config's scaling/shift factor (None: the VAE config's; shift None -> 0).
    scaling_factor: float | None = None
    shift_factor: float | None = None
    #: AutoencoderKL posterior: "mode" (its mean; deterministic) or "sample".
    posterior: str = "mode"
    #: Tiled encode/decode (2048/4096 tiers): bounded activation memory per image.
    tiling: bool = False
    #: Tile side in pixels when tiling (None: the VAE's default).
    tile_size: int | None = None
    #: "encode": the encoder runs in every step; "precomputed": the loader serves the latents
    #: ``python -m prx_data.latents`` stored beside each export (the decoder still samples).
    source: str = "encode"


@dataclass
class CaptionColumn:
    """One caption column and its relative chance of being picked for a sample."""

    name: str = "caption"
    weight: float = 1.0


#: ``data.datasets`` and ``eval.datasets`` entries: the stream's own dataset type, so a
#: YAML entry takes exactly the keys ``DatasetSpec(...)`` takes in a notebook.
DatasetConfig = DatasetSpec


def _plan_config() -> type:
    """``data.plan``'s schema: the fields of ``PlanSpec`` a YAML sets, with PlanSpec's own
    types and defaults (generated, so a plan default is written once, in PlanSpec).

    A mutable copy because the YAML loader fills it in place; ``device_batch_size``,
    ``num_workers`` and ``shuffle_block_size`` are other keys of ``data:``, and the bucket
    grid is the code's.
    """
    from prx_data.stream.planner import PlanSpec

    hints = typing.get_type_hints(PlanSpec)
    cls = dataclasses.make_dataclass(
        "PlanConfig",
        [
            (f.name, hints[f.name], field(default=f.default))
            for f in dataclasses.fields(PlanSpec)
            if f.name not in _NOT_IN_PLAN_YAML
        ],
    )
    cls.__module__ = __name__
    return cls


#: PlanSpec fields that ``data.plan`` does not hold (see :func:`_plan_config`).
_NOT_IN_PLAN_YAML = ("device_batch_size", "num_workers", "shuffle_block_size", "bucket_spec")
PlanConfig = _plan_config()
#: ``data.<key>`` spellings of before ``data.plan`` (still read, with a warning).
PLAN_KEYS = tuple(f.name for f in dataclasses.fields(PlanConfig))


@dataclass
class DataConfig:
    datasets: list[DatasetSpec] = field(default_factory=list)
    #: The bucket plan (tier, shuffle, batching, ...): ``prx_data.stream.planner.PlanSpec``'s
    #: fields, with its defaults (the per-rank batch and the workers are the keys below).
    plan: PlanConfig = field(default_factory=lambda: PlanConfig())
    caption_columns: list[CaptionColumn] = field(default_factory=lambda: [CaptionColumn()])
    #: Table columns exported with ``write_mds --keep-columns`` that each batch carries
    #: (as lists, one value per sample), e.g. [similarity, aesthetic] for conditioning or logs.
    extra_columns: list[str] = field(default_factory=list)
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
    #: Where images decode: "loader" (CPU workers; higher tiers via JPEG draft) or
    #: "device" (the loader passes bytes; the step decodes the batch on the GPU, nvJPEG).
    decode: str = "loader"
    #: Resuming onto a changed sample space (a skip list added, other weights): "error"
    #: (default), "restart_epoch" (start the epoch over with the current lists) or "continue"
    #: (skip lists added only: finish the epoch in its order without what they remove).
    on_change: str = "error"
    #: Extra StreamingDataset keyword arguments (cache_limit, predownload, ...).
    streaming: dict[str, Any] = field(default_factory=dict)
    #: "module:function" building the dataset instead of prx_data.stream.dataset.BucketedDataset;
    #: called as fn(data_config, device_batch_size) and must return a StreamingDataset.
    factory: str | None = None

    def plan_spec(self, device_batch_size: int):
        """The run's ``prx_data.stream.planner.PlanSpec``: what the loader and the planner plan.

        ``plan:`` holds its fields; the per-rank batch is derived here, the workers are
        the DataLoader's, and ``shuffle_block_size`` comes from ``streaming:``.
        """
        from prx_data.stream.planner import PlanSpec

        return PlanSpec(
            **dataclasses.asdict(self.plan),
            device_batch_size=device_batch_size,
            num_workers=self.num_workers or 1,
            shuffle_block_size=self.streaming.get("shuffle_block_size"),
        )


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
    #: MLflow experiment to log to (needs the mlflow package); None: off.
    mlflow_experiment: str | None = None
    #: MLflow tracking URI (None: MLflow's default, ./mlruns or MLFLOW_TRACKING_URI).
    mlflow_tracking_uri: str | None = None


@dataclass
class EvalConfig:
    """Held-out evaluation: flow loss at fixed noise and timesteps, per timestep band.

    ``source: slice`` holds out a deterministic fraction of the training
    datasets by a hash of the sample id; the training stream leaves those
    samples out in its sample space (like a skip list), so resumes stay exact.
    ``source: export`` evaluates on separate export trees (``datasets``).
    """

    enabled: bool = False
    #: "slice" (hash of the id, excluded from training) or "export" (separate trees).
    source: str = "slice"
    #: Share of the training samples held out when source is "slice".
    holdout_fraction: float = 0.01
    #: Changing the salt draws a different hold-out slice.
    holdout_salt: str = "eval"
    #: Export trees to evaluate on when source is "export".
    datasets: list[DatasetSpec] = field(default_factory=list)
    #: How often to evaluate (Composer eval_interval: 500ba, 1ep, ...).
    interval: str = "1000ba"
    #: Batches per evaluation over all ranks (None: the whole eval set).
    subset_num_batches: int | None = None
    #: Samples per eval step over all ranks (None: the training global batch) ...
    global_batch_size: int | None = None
    #: ... or per rank (global = this x world size, so any world size divides it).
    device_batch_size: int | None = None
    num_workers: int = 0
    #: Timestep bands: [0, 1] split evenly; each sample is scored once per band.
    num_bands: int = 4
    #: Seed for the per-sample noise and in-band timesteps (combined with the sample id).
    seed: int = 0


@dataclass
class SamplingConfig:
    """Sample grids: fixed prompts and seeds, Euler flow sampling with CFG, per checkpoint."""

    enabled: bool = False
    prompts: list[str] = field(
        default_factory=lambda: ["a photo of a red fox in the snow", "a city street at night"]
    )
    #: One grid column per seed and shape.
    seeds: list[int] = field(default_factory=lambda: [0, 1])
    #: Image shapes as [width, height]; multiples of model.patch_size.
    shapes: list[list[int]] = field(default_factory=lambda: [[512, 512]])
    steps: int = 28
    guidance_scale: float = 4.0
    #: How often to sample (None: at trainer.save_interval); always at the end of training.
    interval: str | None = None
    #: Folder for the PNG grids; "{run_name}" is filled in.
    folder: str = "runs/{run_name}/samples"


#: The generation metrics and the ``metrics:`` key of the model each one needs (null: off).
METRIC_MODELS = (("FID", "fid_model"), ("CMMD", "clip_model"), ("DINO-MMD", "dino_model"))


@dataclass
class MetricsConfig:
    """FID, CMMD and DINO-MMD of generated vs held-out real images (needs ``eval.enabled``).

    One image per held-out sample (up to ``num_samples`` over all ranks), from
    its own caption, at its shape, from noise seeded by its id and ``seed``.
    A model key set to null turns that metric off.
    """

    enabled: bool = False
    #: How often (Composer time); always at the end of training too.
    interval: str = "10000ba"
    #: Generated (and real) images per evaluation, over all ranks.
    num_samples: int = 1000
    seed: int = 0
    steps: int = 28
    guidance_scale: float = 4.0
    #: FID features: "inception" (torch-fidelity's FID Inception v3 through torchmetrics)
    #: or a transformers vision model by name or path (its pooled features).
    fid_model: str | None = "inception"
    #: Local file of the FID Inception weights (None: torch-fidelity downloads them once).
    fid_weights: str | None = None
    #: CLIP for CMMD (CLIPVisionModelWithProjection), by name or path.
    clip_model: str | None = "openai/clip-vit-large-patch14-336"
    #: DINOv2 for DINO-MMD (Dinov2Model), by name or path.
    dino_model: str | None = "facebook/dinov2-base"
    #: JSON per evaluation, and the eval loss per band per eval; "{run_name}" is filled in.
    #: None: <trainer.save_folder>/metrics (nothing written without a local save_folder).
    folder: str | None = None


@dataclass
class FSDPSettings:
    """Composer FSDP (``parallelism_config.fsdp``); PRX blocks are the wrap units."""

    enabled: bool = False
    #: 1 (torch FSDP, composer FSDPConfig) or 2 (fully_shard, composer FSDP2Config).
    version: int = 1
    #: FULL_SHARD, SHARD_GRAD_OP, HYBRID_SHARD, _HYBRID_SHARD_ZERO2 or NO_SHARD (version 1).
    sharding_strategy: str = "FULL_SHARD"
    #: HYBRID_SHARD: ranks per shard group (-1: all ranks of a node) ...
    data_parallel_shard_degree: int = -1
    #: ... and replica groups (None: derived).
    data_parallel_replicate_degree: int | None = None
    #: Recompute each PRX block's activations in backward (memory for compute).
    activation_checkpointing: bool = False
    activation_cpu_offload: bool = False
    #: DEFAULT (params in the autocast dtype, reduce in fp32), PURE or FULL.
    mixed_precision: str = "DEFAULT"
    #: "full" (one file, gathered on rank 0) or "sharded" checkpoints.
    state_dict_type: str = "full"
    forward_prefetch: bool = False
    limit_all_gathers: bool = True
    cpu_offload: bool = False


@dataclass
class ParallelismConfig:
    fsdp: FSDPSettings = field(default_factory=FSDPSettings)
    #: Compile the model with torch.compile (Composer compile_config).
    compile: bool = False
    #: torch.compile mode: default, reduce-overhead, max-autotune, ...
    compile_mode: str | None = None
    compile_dynamic: bool | None = None


@dataclass
class TrainConfig:
    variables: dict[str, Any] = field(default_factory=dict)
    model: ModelConfig = field(default_factory=ModelConfig)
    flow: FlowConfig = field(default_factory=FlowConfig)
    text_encoder: TextEncoderConfig = field(default_factory=TextEncoderConfig)
    vae: VAEConfig = field(default_factory=VAEConfig)
    data: DataConfig = field(default_factory=DataConfig)
    optimizer: OptimizerConfig = field(default_factory=OptimizerConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    sampling: SamplingConfig = field(default_factory=SamplingConfig)
    metrics: MetricsConfig = field(default_factory=MetricsConfig)
    parallelism: ParallelismConfig = field(default_factory=ParallelismConfig)


_PRECISIONS = {"auto", "fp32", "amp_fp16", "amp_bf16", "amp_fp8"}
_DTYPES = {"auto", "float32", "bfloat16", "float16"}
_OPTIMIZERS = {"adamw", "decoupled_adamw"}
_SCHEDULERS = {"constant_with_warmup", "cosine_with_warmup", "linear_with_warmup"}
_BATCHING = {"device_per_stream", "per_stream"}
_SHARDING = {"FULL_SHARD", "SHARD_GRAD_OP", "HYBRID_SHARD", "_HYBRID_SHARD_ZERO2", "NO_SHARD"}
_FSDP_PRECISION = {"DEFAULT", "PURE", "FULL"}


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


def _moved_plan_keys(tree: Any, where: str) -> Any:
    """``tree`` with ``data.<plan key>`` moved to ``data.plan.<plan key>`` (the spelling of
    before ``data.plan``), each with a one-line warning; both spellings is an error."""
    if not isinstance(tree, dict) or not isinstance(tree.get("data"), dict):
        return tree
    data = dict(tree["data"])
    old = [k for k in PLAN_KEYS if k in data]
    if not old:
        return tree
    plan = dict(data.get("plan") or {})
    for key in old:
        if key in plan:
            raise ConfigError(
                f"{where}: data.{key} and data.plan.{key} both given; keep the second"
            )
        plan[key] = data.pop(key)
        _warn_moved(where, key)
    data["plan"] = plan
    return {**tree, "data": data}


def _warn_moved(where: str, key: str) -> None:
    warnings.warn(
        f"{where}: data.{key} is now data.plan.{key} (the old key still works for now)",
        FutureWarning,
        stacklevel=4,
    )


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
        text = read_user_text(str(path), "config file")
        try:
            loaded = yaml.safe_load(text) or {}
        except yaml.YAMLError as exc:
            raise ConfigError(f"{path}: not valid YAML: {exc}") from None
        if not isinstance(loaded, dict):
            raise ConfigError(f"{path}: top level must be a mapping of sections")
        loaded = _moved_plan_keys(loaded, str(path))
        try:
            cfg = OmegaConf.merge(cfg, OmegaConf.create(loaded))
        except OmegaConfBaseException as exc:
            raise _omegaconf_error(exc, str(path)) from None
    if data:
        data = _moved_plan_keys(data, "dict")
        try:
            cfg = OmegaConf.merge(cfg, OmegaConf.create(data))
        except OmegaConfBaseException as exc:
            raise _omegaconf_error(exc, "dict") from None
    for item in overrides:
        key, value = _parse_override(item)
        head, _, rest = key.partition(".")
        if head == "data" and rest.split(".")[0] in PLAN_KEYS:
            _warn_moved(f"override {item!r}", rest.split(".")[0])
            key = f"data.plan.{rest}"
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
        if getattr(m, name) is not None and getattr(m, name) <= 0:
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
    if te.source not in ("encode", "precomputed"):
        _fail("text_encoder.source", f"{te.source!r} is not one of encode, precomputed")
    v = cfg.vae
    if v.dtype not in _DTYPES:
        _fail("vae.dtype", f"{v.dtype!r} is not one of {sorted(_DTYPES)}")
    if v.posterior not in ("mode", "sample"):
        _fail("vae.posterior", f"{v.posterior!r} is not one of mode, sample")
    if v.scaling_factor is not None and not v.scaling_factor > 0:
        _fail("vae.scaling_factor", "must be > 0")
    if v.tile_size is not None and v.tile_size <= 0:
        _fail("vae.tile_size", "must be positive")
    if v.source not in ("encode", "precomputed"):
        _fail("vae.source", f"{v.source!r} is not one of encode, precomputed")
    if v.source == "precomputed" and v.name_or_path is None:
        _fail("vae.source", "precomputed latents need vae.name_or_path (the VAE that made them)")
    if v.source == "precomputed" and cfg.data.plan.include_higher_tiers:
        _fail(
            "vae.source",
            "precomputed latents are at each shard's own shape; set "
            "data.plan.include_higher_tiers: false (or vae.source: encode)",
        )
    if v.name_or_path is None and m.in_channels not in (None, 3):
        _fail("model.in_channels", f"{m.in_channels}: pixel space (no vae.name_or_path) has 3")
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
    clash = set(d.extra_columns) & {c.name for c in d.caption_columns}
    if clash:
        _fail("data.extra_columns", f"{sorted(clash)} are already caption columns")
    if not 0.0 <= d.caption_dropout <= 1.0:
        _fail("data.caption_dropout", f"must be in [0, 1], got {d.caption_dropout}")
    if d.global_batch_size <= 0:
        _fail("data.global_batch_size", "must be positive")
    if d.device_batch_size is not None and d.device_batch_size <= 0:
        _fail("data.device_batch_size", "must be positive")
    if d.num_workers < 0:
        _fail("data.num_workers", "must be >= 0")
    if d.plan.batching_method not in _BATCHING:
        _fail(
            "data.plan.batching_method",
            f"{d.plan.batching_method!r} is not one of {sorted(_BATCHING)}",
        )
    if d.decode not in ("loader", "device"):
        _fail("data.decode", f"{d.decode!r} is not one of loader, device")
    if d.plan.small_buckets not in ("error", "drop"):
        _fail("data.plan.small_buckets", f"{d.plan.small_buckets!r} is not one of error, drop")
    if d.on_change not in ("error", "restart_epoch", "continue"):
        _fail("data.on_change", f"{d.on_change!r} is not one of error, restart_epoch, continue")
    rep = d.plan.replication
    if rep is not None and (rep < 1 or d.global_batch_size % rep):
        _fail(
            "data.plan.replication",
            f"{rep} must be >= 1 and divide global_batch_size {d.global_batch_size}",
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
    _validate_eval(cfg)
    _validate_sampling(cfg)
    _validate_metrics(cfg)
    _validate_parallelism(cfg)


def _validate_eval(cfg: TrainConfig) -> None:
    e = cfg.eval
    if not e.enabled:
        return
    if e.source not in ("slice", "export"):
        _fail("eval.source", f"{e.source!r} is not one of slice, export")
    if e.source == "slice" and not 0.0 < e.holdout_fraction < 1.0:
        _fail("eval.holdout_fraction", f"must be in (0, 1), got {e.holdout_fraction}")
    if e.source == "export" and not e.datasets:
        _fail("eval.datasets", "source 'export' needs at least one export root")
    _check_time("eval.interval", e.interval)
    if e.num_bands < 1:
        _fail("eval.num_bands", "must be >= 1")
    if e.global_batch_size is not None and e.global_batch_size <= 0:
        _fail("eval.global_batch_size", "must be positive")
    if e.device_batch_size is not None and e.device_batch_size <= 0:
        _fail("eval.device_batch_size", "must be positive")
    if e.device_batch_size is not None and e.global_batch_size is not None:
        _fail(
            "eval.device_batch_size",
            "give eval.global_batch_size or eval.device_batch_size, not both "
            "(set the other to null)",
        )
    if e.subset_num_batches is not None and e.subset_num_batches <= 0:
        _fail("eval.subset_num_batches", "must be positive (or null for the whole eval set)")
    if e.num_workers < 0:
        _fail("eval.num_workers", "must be >= 0")


def _validate_sampling(cfg: TrainConfig) -> None:
    s = cfg.sampling
    if not s.enabled:
        return
    if not s.prompts:
        _fail("sampling.prompts", "needs at least one prompt")
    if not s.seeds:
        _fail("sampling.seeds", "needs at least one seed")
    if not s.shapes:
        _fail("sampling.shapes", "needs at least one [width, height]")
    for i, shape in enumerate(s.shapes):
        if len(shape) != 2 or any(v <= 0 or v % cfg.model.patch_size for v in shape):
            _fail(
                f"sampling.shapes.{i}",
                f"{shape} must be [width, height], positive multiples of "
                f"model.patch_size={cfg.model.patch_size}",
            )
    if s.steps < 1:
        _fail("sampling.steps", "must be >= 1")
    if s.guidance_scale < 1.0:
        _fail("sampling.guidance_scale", "must be >= 1 (1 turns guidance off)")
    _check_time("sampling.interval", s.interval, optional=True)
    if "://" in s.folder:
        _fail("sampling.folder", f"{s.folder!r}: grids are written to a local (or mounted) path")


def _validate_metrics(cfg: TrainConfig) -> None:
    m = cfg.metrics
    if not m.enabled:
        return
    if not cfg.eval.enabled:
        _fail("metrics.enabled", "needs the held-out eval stream: set eval.enabled=true")
    _check_time("metrics.interval", m.interval)
    if m.num_samples < 2:
        _fail("metrics.num_samples", "must be >= 2 (FID needs two samples per side)")
    if m.steps < 1:
        _fail("metrics.steps", "must be >= 1")
    if m.guidance_scale < 1.0:
        _fail("metrics.guidance_scale", "must be >= 1 (1 turns guidance off)")
    if not (m.fid_model or m.clip_model or m.dino_model):
        _fail("metrics.fid_model", "all of fid_model, clip_model, dino_model are null")
    if m.folder and "://" in m.folder:
        _fail("metrics.folder", f"{m.folder!r}: results are written to a local (or mounted) path")


def _validate_parallelism(cfg: TrainConfig) -> None:
    f = cfg.parallelism.fsdp
    if f.enabled:
        if f.version not in (1, 2):
            _fail("parallelism.fsdp.version", f"{f.version} is not 1 or 2")
        if f.sharding_strategy not in _SHARDING:
            _fail(
                "parallelism.fsdp.sharding_strategy",
                f"{f.sharding_strategy!r} is not one of {sorted(_SHARDING)}",
            )
        if f.version == 2 and f.sharding_strategy != "FULL_SHARD":
            _fail(
                "parallelism.fsdp.sharding_strategy",
                "FSDP version 2 shards fully; use version 1 for hybrid or grad-op sharding",
            )
        if f.mixed_precision not in _FSDP_PRECISION:
            _fail(
                "parallelism.fsdp.mixed_precision",
                f"{f.mixed_precision!r} is not one of {sorted(_FSDP_PRECISION)}",
            )
        if f.state_dict_type not in ("full", "sharded"):
            _fail("parallelism.fsdp.state_dict_type", f"{f.state_dict_type!r} is not full/sharded")
        # replication=N makes N consecutive ranks read identical samples; that only pays
        # when those ranks split one model (tensor/context parallel). FSDP is data-parallel:
        # replicated ranks would compute the same gradients and the effective batch would
        # shrink by N. Refuse rather than silently waste the compute.
        if cfg.data.plan.replication is not None and cfg.data.plan.replication > 1:
            _fail(
                "data.plan.replication",
                f"{cfg.data.plan.replication} with parallelism.fsdp: FSDP is data-parallel, so "
                "replicated ranks would train on identical samples; drop data.plan.replication "
                "(it is for tensor/context-parallel groups, which this trainer does not set up)",
            )
    elif f.activation_checkpointing or f.activation_cpu_offload:
        _fail(
            "parallelism.fsdp.activation_checkpointing",
            "applies with parallelism.fsdp.enabled=true; without FSDP use "
            "model.gradient_checkpointing=true",
        )


def metrics_folder(cfg: TrainConfig) -> str | None:
    """Where evaluation JSON goes: ``metrics.folder``, else ``<save_folder>/metrics`` if local."""
    if cfg.metrics.folder:
        return cfg.metrics.folder
    save = cfg.trainer.save_folder
    if not save or "://" in save:
        return None
    return str(Path(save) / "metrics")


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
