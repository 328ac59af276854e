"""Caption-based labelling (visual / text / nsfw) as a streaming Ray Data job.

A text-only language model reads each caption, never the image, and
answers "would you look at this image, or read it?". A cheap rule-based
filter (``prx_data/prompts/classify_rules.txt``) labels the clear cases
first; only the rest reach the model. ``rules_only`` skips the model and
labels every unmatched row ``visual``.

Graph (:mod:`prx_data.columns.runner`)::

    read rows with a caption and no label              tasks, one per fragment (or row range)
      -> map_batches(rule_labels)                      tasks
      -> map_batches(ClassifyActor, ActorPoolStrategy) unless rules_only
      -> driver: each finished fragment's <column> and <column>_error written once

Labels: ``visual``, ``text``, ``nsfw``, or ``unknown`` when the answer
could not be parsed (counted; recompute with ``redo=("unknown",)``). A row
whose request failed keeps a null label, so the next run retries it. Both
kinds of failure keep their reason in ``<column>_error`` (``backend: ...``,
``model: unparseable answer``); it is null for labelled rows.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import lru_cache

import pyarrow as pa
from prx_data.pipelines.caption import REASON

from prx_data.columns import labels as L
from prx_data.columns.backends import (
    BackendSpec,
    FailureGuard,
    GenerationConfig,
    ModelJobConfig,
    Request,
    make_spec,
)
from prx_data.columns.prompts import fill_caption, load_classify_prompt
from prx_data.columns.runner import ColumnJob, Step, run_column_job
from prx_data.columns.writeback import ColumnReport, pending_filter
from prx_data.core import schema as S
from prx_data.core.errors import UsageError
from prx_data.core.flags import flag
from prx_data.core.schema import error_column

__all__ = [
    "ClassifyConfig",
    "run_classify",
]

_RULE = "__rule"


@dataclass(frozen=True)
class ClassifyConfig(ModelJobConfig):
    """One labelling run; the flags of ``python -m prx_data.classify``. ``backend`` and
    ``model`` may be None with ``rules_only``."""

    column: str = flag(
        "label", "--column", help="column to write the labels to (default: %(default)s)"
    )
    source_column: str = flag(
        "caption_vlm",
        "--source-column",
        help="caption column the model reads (default: %(default)s)",
    )
    prompt_file: str | None = flag(
        None,
        "--prompt-file",
        help="prompt template with a {caption} placeholder "
        "(default: the packaged prx_data/columns/prompts_txt/classify.txt)",
    )
    rules_file: str | None = flag(
        None,
        "--rules-file",
        help="rules file, one '<label>: <regex>' per line "
        "(default: the packaged prx_data/columns/prompts_txt/classify_rules.txt)",
    )
    rules_only: bool = flag(
        False,
        "--rules-only",
        help="label with the rules alone, no model: unmatched rows become 'visual'",
    )
    #: Apply the rules before the model (rows they match skip the model).
    use_rules: bool = flag(True, "--no-rules", negate=True, help="send every caption to the model")
    generation: GenerationConfig = field(default_factory=lambda: GenerationConfig(max_tokens=8))

    def __post_init__(self) -> None:
        self.check((*L.LABELS, L.UNKNOWN), "label(s)")
        if self.column in (S.ID, S.IMAGE, S.CAPTION, self.source_column):
            raise UsageError(f"refusing to write labels into the {self.column!r} column")
        if not self.rules_only and not (self.backend and self.model):
            raise UsageError(
                "a backend and a model are required unless rules_only is set "
                "(--backend, --model, or --rules-only)"
            )
        if self.rules_only and not self.use_rules:
            raise UsageError("rules_only needs the rules (drop --no-rules)")


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
    return pa.table(
        {
            S.ID: batch[S.ID],
            column: batch[_RULE],
            error_column(column): pa.nulls(batch.num_rows, pa.string()),
            REASON: batch[REASON],
        }
    )


def no_rules(batch: pa.Table) -> pa.Table:
    """Without the rule filter every row goes to the model."""
    n = batch.num_rows
    return batch.append_column(_RULE, pa.nulls(n, pa.string())).append_column(
        REASON, pa.nulls(n, pa.string())
    )


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
        errors: list[str | None] = [None] * len(result)
        todo = [i for i, r in enumerate(result) if r is None]
        gens = self.backend([Request(fill_caption(self.template, captions[i])) for i in todo])
        self.guard.update(gens)
        for i, g in zip(todo, gens, strict=True):
            if g.error is not None:
                reasons[i] = errors[i] = f"backend: {g.error}"[:120]
                continue  # stays null: retried on the next run
            result[i] = L.parse_label(g.text)
            reasons[i] = "model: unparseable answer" if result[i] == L.UNKNOWN else "model"
            if result[i] == L.UNKNOWN:
                errors[i] = reasons[i]
        return pa.table(
            {
                S.ID: batch[S.ID],
                self.column: pa.array(result, pa.string()),
                error_column(self.column): pa.array(errors, pa.string()),
                REASON: pa.array(reasons, pa.string()),
            }
        )

    def __del__(self):
        backend = getattr(self, "backend", None)
        if backend is not None:
            backend.close()


def classify_job(cfg: ClassifyConfig, spec: BackendSpec | None, template: str | None) -> ColumnJob:
    """The column job: captions -> rule labels -> model labels (unless rules only)."""
    from prx_data.table.lance_ops import open_table

    existing = open_table(cfg.table, cfg.storage_options).schema.names
    if cfg.source_column not in existing:
        raise UsageError(f"table {cfg.table!r} has no column {cfg.source_column!r} to classify")
    where = pending_filter(
        existing,
        cfg.column,
        redo=cfg.redone,
        require=[cfg.source_column],
        include_missing=not cfg.only,
    )
    batch_size = spec.batch_size if spec else 1024
    if cfg.use_rules:
        steps = [
            Step(
                rule_labels,
                kwargs={
                    "source_column": cfg.source_column,
                    "rules_file": cfg.rules_file,
                    "rules_only": cfg.rules_only,
                },
                batch_size=batch_size,
            )
        ]
    else:
        steps = [Step(no_rules, batch_size=batch_size)]
    if cfg.rules_only:
        steps.append(Step(rules_as_labels, kwargs={"column": cfg.column}))
    else:
        assert spec is not None and template is not None
        steps.append(
            Step(
                ClassifyActor,
                constructor_args=(spec, template, cfg.column, cfg.source_column),
                batch_size=spec.batch_size,
                actors=spec.replicas,
                num_cpus=spec.num_cpus,
                num_gpus=spec.num_gpus,
            )
        )
    return ColumnJob(
        table=cfg.table,
        outputs=pa.schema(
            [pa.field(cfg.column, pa.string()), pa.field(error_column(cfg.column), pa.string())]
        ),
        read_columns=[S.ID, cfg.source_column],
        steps=steps,
        where=where,
        limit=cfg.limit,
        batch_size=batch_size,
        commit_every=cfg.commit_every,
        count_column=cfg.column,
        reason_column=REASON,
        storage_options=cfg.storage_options,
        run=cfg.run,
        desc=f"classify {cfg.column}",
    )


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
    report = run_column_job(classify_job(cfg, spec, template))
    if not report.pending:
        report.notes.append(why_nothing_to_do(cfg))
    return report


def why_nothing_to_do(cfg: ClassifyConfig) -> str:
    """Why a run found no row to label: the column it read, how many rows have a usable value
    there, and what to pass instead (a caption column that has values, or the caption job).
    Counts with filters on the string columns, only on a run that did nothing."""
    from prx_data.table.lance_ops import open_table, quote

    ds = open_table(cfg.table, cfg.storage_options)

    def usable(col: str) -> int:
        return ds.count_rows(filter=f"{quote(col)} IS NOT NULL AND {quote(col)} != ''")

    total = ds.count_rows()
    have = usable(cfg.source_column)
    src = cfg.source_column
    if have:
        return (
            f"nothing to do: {have:,} of {total:,} rows have a {src!r} value and every one "
            f"already has a {cfg.column!r} label (--only error or --only <label> redoes some)"
        )
    others = [
        f.name
        for f in ds.schema
        if f.name != src
        and f.name.startswith(S.CAPTION)
        and not S.is_job_column(f.name)
        and (pa.types.is_string(f.type) or pa.types.is_large_string(f.type))
    ]
    counted = sorted(((usable(c), c) for c in others[:8]), key=lambda x: (-x[0], x[1]))
    best = next(((n, c) for n, c in counted if n), None)
    hint = (
        f"pass --source-column {best[1]} ({best[0]:,} rows have one)"
        if best
        else f"fill {src!r} first (python -m prx_data.caption --column {src})"
    )
    return f"nothing to do: {src!r} has a usable value in 0 of {total:,} rows; {hint}"
