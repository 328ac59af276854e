"""The score job: one pixel scorer of :mod:`prx_data.columns.scores` as a column job.

Graph (:mod:`prx_data.columns.runner`)::

    read image (+ caption) / the CLIP embedding of rows without a score   one unit per fragment
      -> map_batches(ClipScorer | ClassifierScorer, ActorPoolStrategy)    one model per actor (GPU)
         or map_batches(aesthetic_batch)                                  tasks: a small head
      -> driver: each finished fragment's <prefix>_* columns written once, checkpointed

Image data files are never rewritten and a killed run resumes; a row that
cannot be scored keeps null values and its reason in ``<prefix>_error``.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Any

import pyarrow as pa

from prx_data.columns.scores import (
    SCORERS,
    ClassifierScorer,
    ClipScorer,
    aesthetic_batch,
    cached_head,
    class_column,
    class_labels,
    error_column,
    resolve_device,
    vector_type,
)
from prx_data.columns.writeback import ColumnReport, pending_filter
from prx_data.core.errors import UsageError
from prx_data.core.flags import REQUIRED, flag
from prx_data.core.reports import JobReport
from prx_data.core.runtime import RunOptions, run_field
from prx_data.table.search import CLIP_IMAGE_COLUMN

__all__ = ["ScoreConfig", "ScoreReport", "build_job", "run_score", "score_outputs"]


@dataclass(frozen=True)
class ScoreConfig:
    """One score job: which scorer, its model, where its columns go, how it runs."""

    table: str = flag(REQUIRED, "--table", help="Lance table URI")
    scorer: str = flag(REQUIRED, "scorer", choices=SCORERS, help="what to compute")
    model: str = flag(
        REQUIRED,
        "--model",
        help="Hugging Face model name or local path (aesthetic: the head's weights file; "
        "set HF_HUB_OFFLINE=1 to use only local files)",
    )
    prefix: str | None = flag(None, "--prefix", help="column prefix (default: the scorer's name)")
    embedding_column: str = flag(
        CLIP_IMAGE_COLUMN,
        "--embedding-column",
        help="aesthetic: the CLIP image embedding column it reads (default: %(default)s)",
    )
    caption_column: str = flag(
        "caption", "--caption-column", help="clip: the text (default: %(default)s)"
    )
    device: str = flag(
        "auto",
        "--device",
        help="cpu, cuda or cuda:N; cuda gives each replica one GPU (default: auto)",
    )
    #: engine, Ray cluster, CPUs, progress bar: the same for every job (``--engine``, ...).
    run: RunOptions = run_field()
    replicas: int = flag(1, "--replicas", type=int, help="model actors (default: %(default)s)")
    batch_size: int = flag(
        64, "--batch-size", type=int, help="rows per model call (default: %(default)s)"
    )
    limit: int | None = flag(None, "--limit", type=int, help="score at most this many rows")
    commit_every: int = flag(
        16, "--commit-every", type=int, help="fragments per commit (default: %(default)s)"
    )
    storage_options: dict | None = field(default=None, hash=False)

    def __post_init__(self) -> None:
        if self.scorer not in SCORERS:
            raise UsageError(f"scorer must be one of {', '.join(SCORERS)}, got {self.scorer!r}")
        if self.replicas < 1 or self.batch_size < 1:
            raise UsageError("replicas and batch_size must be >= 1")

    @property
    def column_prefix(self) -> str:
        return self.prefix or self.scorer


_RUN_FIELDS = frozenset(f.name for f in fields(ColumnReport))
#: How a model failure's reason starts (``prx_data.columns.scores``); other reasons are images.
MODEL_FAILURE = "model_error"


@dataclass
class ScoreReport(JobReport):
    """What a score job did: the column runner's report (``run``) and the scorer's view of it."""

    table: str
    scorer: str
    columns: list[str]
    run: ColumnReport | None = None

    counted = "rows"

    def __post_init__(self) -> None:
        if self.run is None:
            self.run = ColumnReport(self.table, list(self.columns))

    def __getattr__(self, name: str):
        """The column runner's counts (``pending``, ``written``, ``seconds``, ...) are read
        from ``run``, not copied."""
        if name in _RUN_FIELDS and "run" in self.__dict__:
            return getattr(self.__dict__["run"], name)
        raise AttributeError(name)

    @property
    def job_label(self) -> str:
        return f"score {self.scorer}"

    @property
    def failures(self) -> dict[str, int]:
        """Rows that could not be scored (retried next run), by reason."""
        return dict(self.run.reasons)

    @property
    def rows(self) -> int:
        return self.run.rows

    @property
    def scored(self) -> int:
        return self.rows - sum(self.failures.values())

    @property
    def failed(self) -> int:
        """Rows the model failed on in this run (``--max-error-rate`` counts these)."""
        return sum(n for r, n in self.failures.items() if r.startswith(MODEL_FAILURE))

    @property
    def unreadable(self) -> int:
        """Rows whose image did not decode (missing, empty, not an image): drops, by reason."""
        return sum(self.failures.values()) - self.failed

    @property
    def total(self) -> int:
        return self.rows

    def failure_details(self, report_json: str | None = None) -> str:
        return f"the reasons above, and {self.columns[-1]} in {self.table}"

    def text(self) -> str:
        r = self.run
        rate = r.rows / r.seconds if r.seconds else 0.0
        lines = [
            f"{self.scorer}: {r.rows:,} rows in {r.seconds:.1f}s ({rate:,.0f} rows/s), "
            f"{self.scored:,} scored, {self.failed:,} failed, {self.unreadable:,} unreadable"
            + (f", {r.recovered_rows:,} recovered from a killed run" if r.recovered_rows else ""),
            f"columns: {', '.join(self.columns)} (table version {r.final_version})",
        ]
        for reason, n in sorted(self.failures.items(), key=lambda kv: -kv[1])[:10]:
            lines.append(f"  {n:>8,}  {reason}")
        return "\n".join(lines)

    def to_dict(self) -> dict:
        """The run's counts at the top level (as before), then the scorer's."""
        own = super().to_dict()
        own.pop("run")
        return {
            **self.run.to_dict(),
            **own,
            "scored": self.scored,
            "failed": self.failed,
            "unreadable": self.unreadable,
            "failures": self.failures,
        }


def _model_config(model: str):
    """The model's config; a name that resolves to no model fails here, in one line."""
    from transformers import AutoConfig

    try:
        return AutoConfig.from_pretrained(model)
    except OSError as e:  # how transformers reports an unknown id or a directory without a model
        raise UsageError(
            f"--model {model!r}: {str(e).splitlines()[0]} (give a Hugging Face model id or a "
            "local model directory)"
        ) from None


def _expect_model(cfg: ScoreConfig, config: Any, ok: bool, expected: str) -> None:
    """One line naming the model type found and the one this scorer needs, before any work."""
    if ok:
        return
    archs = list(getattr(config, "architectures", None) or [])
    found = archs[0] if archs else type(config).__name__
    raise UsageError(
        f"--model {cfg.model!r} is a {found} (model_type {config.model_type!r}); "
        f"score {cfg.scorer} needs {expected}"
    )


def score_outputs(cfg: ScoreConfig) -> tuple[pa.Schema, list[str], str]:
    """(output schema, columns read, value column that marks a row done) for ``cfg``."""
    p = cfg.column_prefix
    err = pa.field(error_column(p), pa.string())
    if cfg.scorer == "clip":
        config = _model_config(cfg.model)
        _expect_model(cfg, config, config.model_type == "clip", "a CLIPModel (model_type 'clip')")
        dim = int(config.projection_dim)
        schema = pa.schema(
            [
                pa.field(f"{p}_image_embedding", vector_type(dim)),
                pa.field(f"{p}_text_embedding", vector_type(dim)),
                pa.field(f"{p}_score", pa.float32()),
                err,
            ]
        )
        return schema, ["image", cfg.caption_column], f"{p}_image_embedding"
    if cfg.scorer == "aesthetic":
        cached_head(cfg.model)  # a bad file fails here, in one line, before any work
        schema = pa.schema([pa.field(f"{p}_score", pa.float32()), err])
        return schema, [cfg.embedding_column], f"{p}_score"
    config = _model_config(cfg.model)
    archs = list(getattr(config, "architectures", None) or [])
    _expect_model(
        cfg,
        config,
        not archs or any(a.endswith("ForImageClassification") for a in archs),
        "an image classifier (an ...ForImageClassification checkpoint)",
    )
    labels = class_labels(config)
    cols = [class_column(p, label) for label in labels]
    if len(set(cols)) != len(cols):
        raise UsageError(f"the class names of {cfg.model!r} collide as columns: {cols}")
    schema = pa.schema(
        [pa.field(f"{p}_label", pa.string()), *(pa.field(c, pa.float32()) for c in cols), err]
    )
    return schema, ["image"], f"{p}_label"


def build_job(cfg: ScoreConfig, **overrides: Any):
    """The :class:`~prx_data.columns.runner.ColumnJob` for ``cfg`` (``overrides``: its fields)."""
    from prx_data.columns.runner import ColumnJob, Step
    from prx_data.table import lance_ops as T

    outputs, read, done = score_outputs(cfg)
    ds = T.open_table(cfg.table, cfg.storage_options)
    names = ds.schema.names
    for col in read:
        if col not in names and col != cfg.caption_column:
            hint = " (run the clip scorer first)" if cfg.scorer == "aesthetic" else ""
            raise UsageError(f"{cfg.table!r} has no column {col!r}{hint}")
    if cfg.scorer == "clip" and cfg.caption_column not in names:
        raise UsageError(f"{cfg.table!r} has no caption column {cfg.caption_column!r}")
    where = pending_filter(names, done)
    if cfg.scorer == "aesthetic":
        has = f"{T.quote(cfg.embedding_column)} IS NOT NULL"
        where = f"({where}) AND {has}" if where else has
    p = cfg.column_prefix
    gpu = resolve_device(cfg.device).startswith("cuda")
    if cfg.scorer == "aesthetic":
        step = Step(
            aesthetic_batch,
            kwargs={"path": cfg.model, "embedding_column": cfg.embedding_column, "prefix": p},
            batch_size=cfg.batch_size,
        )
    else:
        cls = ClipScorer if cfg.scorer == "clip" else ClassifierScorer
        step = Step(
            cls,
            constructor_args=(cfg.model, p, cfg.device)
            + ((cfg.caption_column,) if cfg.scorer == "clip" else ()),
            batch_size=cfg.batch_size,
            actors=cfg.replicas,
            num_cpus=1,
            num_gpus=1 if gpu else None,
        )
    kwargs: dict[str, Any] = dict(
        table=cfg.table,
        outputs=outputs,
        read_columns=read,
        steps=[step],
        where=where,
        name=f"score-{p}",
        limit=cfg.limit,
        run=cfg.run,
        batch_size=cfg.batch_size,
        commit_every=cfg.commit_every,
        reason_column=error_column(p),
        storage_options=cfg.storage_options,
        desc=f"score {cfg.scorer} -> {p}_*",
    )
    kwargs.update(overrides)
    return ColumnJob(**kwargs)


def run_score(cfg: ScoreConfig, **overrides: Any) -> ScoreReport:
    """Run one score job (resumable); ``overrides`` set :class:`ColumnJob` fields (tests, hooks)."""
    from prx_data.columns.runner import run_column_job

    job = build_job(cfg, **overrides)
    rep = run_column_job(job)
    return ScoreReport(cfg.table, cfg.scorer, list(job.outputs.names), rep)
