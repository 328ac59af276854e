"""Caption-based labelling (visual / text / nsfw) as a streaming Ray Data job.

A text-only language model reads each caption, never the image, and
answers "would you look at this image, or read it?". A cheap rule-based
filter (``prx_data/prompts/classify_rules.txt``) labels the clear cases
first; only the rest reach the model. ``rules_only`` skips the model and
labels every unmatched row ``visual``.

Graph::

    read_lance(rows with a caption and no label)
      -> map_batches(rule_labels)                      tasks
      -> map_batches(ClassifyActor, ActorPoolStrategy) unless rules_only
      -> driver: ColumnWriter -> table.update_column   <column>

Labels: ``visual``, ``text``, ``nsfw``, or ``unknown`` when the answer
could not be parsed (counted; recompute with ``redo=("unknown",)``). A row
whose request failed keeps a null label, so the next run retries it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import lru_cache

import pyarrow as pa

from pipelines.caption import REASON, drive, iter_results, read_pending
from prx_data.columns import labels as L
from prx_data.columns.backends import (
    BackendSpec,
    FailureGuard,
    GenerationConfig,
    Request,
    make_spec,
)
from prx_data.columns.prompts import fill_caption, load_classify_prompt
from prx_data.columns.writeback import ColumnReport, ColumnWriter, pending_filter
from prx_data.core import schema as S
from prx_data.core.runtime import ensure_ray

_RULE = "__rule"


@dataclass
class ClassifyConfig:
    """One labelling run. ``backend``/``model`` may be None with ``rules_only``."""

    table: str
    backend: str | None = None
    model: str | None = None
    column: str = "label"
    source_column: str = "caption_vlm"
    prompt_file: str | None = None
    rules_file: str | None = None
    #: Label with the rules alone (no model): unmatched rows become ``visual``.
    rules_only: bool = False
    #: Apply the rules before the model (rows they match skip the model).
    use_rules: bool = True
    limit: int | None = None
    generation: GenerationConfig = field(default_factory=lambda: GenerationConfig(max_tokens=8))
    backend_options: dict = field(default_factory=dict)
    replicas: int = 1
    batch_size: int | None = None
    #: Labels to compute again (e.g. ``("unknown",)``).
    redo: tuple[str, ...] = ()
    flush_rows: int = 5000
    storage_options: dict | None = None
    progress: bool = True

    def __post_init__(self) -> None:
        if self.column in (S.ID, S.IMAGE, S.CAPTION, self.source_column):
            raise ValueError(f"refusing to write labels into the {self.column!r} column")
        bad = set(self.redo) - {*L.LABELS, L.UNKNOWN}
        if bad:
            raise ValueError(f"unknown label(s) to redo: {sorted(bad)}")
        if not self.rules_only and not (self.backend and self.model):
            raise ValueError("a backend and a model are required unless rules_only is set")
        if self.rules_only and not self.use_rules:
            raise ValueError("rules_only needs the rules")


@lru_cache(maxsize=8)
def _rules(path: str | None) -> L.RuleFilter:
    return L.RuleFilter.load(path)


def rule_labels(
    batch: pa.Table, source_column: str, rules_file: str | None, rules_only: bool
) -> pa.Table:
    """Label the rows the rules are sure about; with ``rules_only`` the rest are ``visual``."""
    rules = _rules(rules_file)
    hits = [rules(c) for c in batch[source_column].to_pylist()]
    out = {
        S.ID: batch[S.ID],
        source_column: batch[source_column],
        _RULE: pa.array(hits, pa.string()),
    }
    if rules_only:
        out[_RULE] = pa.array([h or L.VISUAL for h in hits], pa.string())
    out[REASON] = pa.array([f"rules: {h}" if h else "rules: no match" for h in hits], pa.string())
    return pa.table(out)


def rules_as_labels(batch: pa.Table, column: str) -> pa.Table:
    return pa.table({S.ID: batch[S.ID], column: batch[_RULE], REASON: batch[REASON]})


class ClassifyActor:
    """Holds one text-only backend; asks it about each caption the rules left open."""

    def __init__(self, spec: BackendSpec, template: str, column: str, source_column: str):
        self.backend = spec.build()
        self.template = template
        self.column = column
        self.source_column = source_column
        self.guard = FailureGuard()

    def __call__(self, batch: pa.Table) -> pa.Table:
        captions = batch[self.source_column].to_pylist()
        result: list[str | None] = batch[_RULE].to_pylist()
        reasons = batch[REASON].to_pylist()
        todo = [i for i, r in enumerate(result) if r is None]
        gens = self.backend([Request(fill_caption(self.template, captions[i])) for i in todo])
        self.guard.update(gens)
        for i, g in zip(todo, gens, strict=True):
            if g.error is not None:
                reasons[i] = f"backend: {g.error}"[:120]
                continue  # stays null: retried on the next run
            result[i] = L.parse_label(g.text)
            reasons[i] = "model: unparseable answer" if result[i] == L.UNKNOWN else "model"
        return pa.table(
            {
                S.ID: batch[S.ID],
                self.column: pa.array(result, pa.string()),
                REASON: pa.array(reasons, pa.string()),
            }
        )

    def __del__(self):
        backend = getattr(self, "backend", None)
        if backend is not None:
            backend.close()


def build_graph(cfg: ClassifyConfig, spec: BackendSpec | None, template: str | None):
    """The Ray Data graph of pending rows -> labels, plus the row count."""
    import ray

    from prx_data.table.lance_ops import open_table

    existing = open_table(cfg.table, cfg.storage_options).schema.names
    if cfg.source_column not in existing:
        raise ValueError(f"table {cfg.table!r} has no column {cfg.source_column!r} to classify")
    where = pending_filter(existing, cfg.column, redo=cfg.redo, require=[cfg.source_column])
    ds, total = read_pending(
        cfg.table, [S.ID, cfg.source_column], where, cfg.limit, cfg.storage_options
    )
    batch_size = spec.batch_size if spec else 1024
    rules_file = cfg.rules_file if cfg.use_rules else None
    if cfg.use_rules:
        ds = ds.map_batches(
            rule_labels,
            fn_kwargs={
                "source_column": cfg.source_column,
                "rules_file": rules_file,
                "rules_only": cfg.rules_only,
            },
            batch_format="pyarrow",
            batch_size=batch_size,
        )
    else:
        ds = ds.map_batches(
            lambda b: b.append_column(_RULE, pa.nulls(b.num_rows, pa.string())).append_column(
                REASON, pa.nulls(b.num_rows, pa.string())
            ),
            batch_format="pyarrow",
        )
    if cfg.rules_only:
        ds = ds.map_batches(
            rules_as_labels, fn_kwargs={"column": cfg.column}, batch_format="pyarrow"
        )
        return ds, total
    assert spec is not None and template is not None
    ds = ds.map_batches(
        ClassifyActor,
        fn_constructor_args=(spec, template, cfg.column, cfg.source_column),
        batch_format="pyarrow",
        batch_size=spec.batch_size,
        compute=ray.data.ActorPoolStrategy(size=spec.replicas),
        num_cpus=spec.num_cpus,
        num_gpus=spec.num_gpus,
    )
    return ds, total


def run_classify(cfg: ClassifyConfig, spec: BackendSpec | None = None) -> ColumnReport:
    """Label the rows of ``cfg.table`` that have a caption but no label; returns the report."""
    if cfg.rules_file is not None or cfg.use_rules:
        _rules(cfg.rules_file)  # fail fast on a bad rules file
    template = None
    if not cfg.rules_only:
        template = load_classify_prompt(cfg.prompt_file)
        if spec is None:
            spec = make_spec(
                cfg.backend,
                cfg.model,
                cfg.generation,
                cfg.backend_options,
                replicas=cfg.replicas,
                batch_size=cfg.batch_size,
                text_only=True,
            )
    ensure_ray()
    ds, total = build_graph(cfg, spec, template)
    report = ColumnReport(cfg.table, [cfg.column])
    if total == 0:
        return report
    writer = ColumnWriter(
        cfg.table, [cfg.column], flush_rows=cfg.flush_rows, storage_options=cfg.storage_options
    )
    return drive(
        iter_results(ds), writer, report, cfg.column, total, f"classify {cfg.column}", cfg.progress
    )
