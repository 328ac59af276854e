"""VLM re-captioning as a column job (Ray Data) that writes columns back to Lance.

Graph (:mod:`prx_data.columns.runner`)::

    read pending rows of the pinned version           tasks, one per fragment (or row range)
      -> map_batches(prepare_images)                  tasks: decode, fit pixel budget, JPEG
      -> map_batches(CaptionActor, ActorPoolStrategy) one backend per actor (GPU)
      -> driver: each finished fragment's <column>, <column>_status, <column>_error
         written once (by row address), checkpointed, committed in batches

A killed run keeps every committed and checkpointed fragment; a rerun
picks up the rest. Every row ends with a status: ``ok`` (caption stored),
``empty``, ``looping``, ``truncated``, ``error`` (the backend failed) or
``unreadable`` (the image did not decode: a drop, not counted by
``--max-error-rate``; caption left null), and every row that is not ``ok``
has the reason in ``<column>_error`` (e.g. ``image: empty_file``,
``image: not_an_image``, ``image: truncated``, ``backend: http 503``,
``flagged: looping``).

With ``schema_file`` (``--schema``) the job asks for structured attributes
instead (:mod:`prx_data.columns.structured`): the schema guides generation
where the backend can, every output is parsed and validated, and
``<column>`` is a struct column typed from the schema. An output that is
not JSON or fails the schema gets status ``invalid`` (``truncated`` when the
token limit cut it off) with the validator's message in ``<column>_error``,
and is never stored.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, replace

import pyarrow as pa

from prx_data.columns import checks
from prx_data.columns.backends import (
    BackendSpec,
    FailureGuard,
    ModelJobConfig,
    Request,
    make_spec,
)
from prx_data.columns.images import DEFAULT_MAX_PIXELS, fit_image
from prx_data.columns.prompts import load_attributes_prompt, load_prompt
from prx_data.columns.runner import ColumnJob, Step, run_column_job
from prx_data.columns.writeback import ColumnReport, pending_filter
from prx_data.core import schema as S
from prx_data.core.errors import UsageError
from prx_data.core.flags import flag
from prx_data.core.schema import error_column, status_column

__all__ = [
    "CaptionConfig",
    "run_caption",
]

#: Internal column carrying why a row was flagged (counted in the report).
REASON = "__reason"
_IMAGE_OK = "__image"


@dataclass(frozen=True)
class CaptionConfig(ModelJobConfig):
    """One captioning run; the flags of ``python -m prx_data.caption``."""

    column: str | None = flag(
        None,
        "--column",
        help="column to write the captions to; its status goes to COLUMN_status "
        "(default: caption_vlm, or attributes with --schema)",
    )
    #: A JSON schema file: write structured attributes (a struct column) instead of captions.
    schema_file: str | None = flag(
        None,
        "--schema",
        metavar="FILE",
        help="JSON schema of structured attributes to ask for (an object schema; e.g. "
        "configs/attributes.schema.json, or 'attributes' for that example as shipped in the "
        "package). Supported: type object/array/string/boolean/"
        "integer/number, properties, required, enum, items, additionalProperties, bounds",
    )
    prompt_file: str | None = flag(
        None,
        "--prompt-file",
        help="text file with the instruction (default: the packaged "
        "prx_data/columns/prompts_txt/caption.txt, one dense, visually grounded paragraph of "
        "~100-200 words; with --schema: attributes.txt, whose {schema} is replaced by the "
        "schema)",
    )
    max_pixels: int = flag(
        DEFAULT_MAX_PIXELS,
        "--max-pixels",
        type=int,
        help="downsize images to at most this many pixels before sending them "
        "(default: %(default)s = 1280 patches of 28x28, Qwen-VL's usual budget)",
    )

    def __post_init__(self) -> None:
        if self.column is None:  # frozen: set the default the schema implies once
            object.__setattr__(self, "column", "attributes" if self.schema_file else "caption_vlm")
        self.check(checks.STATUSES, "status(es)")
        if not (self.backend and self.model):
            raise UsageError("a backend and a model are required (--backend, --model)")
        if self.column in (S.ID, S.IMAGE, S.CAPTION):
            raise UsageError(f"refusing to write captions into the {self.column!r} column")
        if self.max_pixels < 28 * 28:
            raise UsageError(f"max_pixels must be at least 784, got {self.max_pixels}")
        if self.schema_file is not None:
            from prx_data.columns.structured import load_schema

            load_schema(self.schema_file)  # a bad schema stops here, before any work


# --- the caption graph --------------------------------------------------------


def prepare_images(batch: pa.Table, max_pixels: int) -> pa.Table:
    """Decode and fit each image to the pixel budget; bad bytes get a reason instead."""
    from prx_data.core.imaging import ImageError

    images: list[bytes | None] = []
    reasons: list[str | None] = []
    for data in batch[S.IMAGE].to_pylist():
        try:
            if data is None:
                raise ImageError("no_image")
            images.append(fit_image(data, max_pixels)[0])
            reasons.append(None)
        except ImageError as e:
            images.append(None)
            reasons.append(f"image: {e.reason}")
        except Exception as e:  # an unmapped decoder failure costs its row, not the job
            images.append(None)
            reasons.append(f"image: decode_error ({type(e).__name__})")
    return pa.table(
        {
            S.ID: batch[S.ID],
            _IMAGE_OK: pa.array(images, pa.large_binary()),
            REASON: pa.array(reasons, pa.string()),
        }
    )


class _BackendActor:
    """One backend per actor; the column, status and error columns a batch returns."""

    def __init__(self, spec: BackendSpec, prompt: str, column: str):
        self.backend = spec.build()
        self.prompt = prompt
        self.column = column
        self.status = status_column(column)
        self.error = error_column(column)
        self.guard = FailureGuard()

    def _generate(self, batch: pa.Table) -> tuple[list, list, list[int], list]:
        """(images, reasons, rows sent, generations) for the rows that decoded."""
        images = batch[_IMAGE_OK].to_pylist()
        reasons = batch[REASON].to_pylist()
        todo = [i for i, im in enumerate(images) if im is not None]
        gens = self.backend([Request(self.prompt, images[i]) for i in todo])
        self.guard.update(gens)
        return images, reasons, todo, gens

    def _table(
        self, batch: pa.Table, values: pa.Array, statuses: list[str], errors: list, reasons: list
    ) -> pa.Table:
        return pa.table(
            {
                S.ID: batch[S.ID],
                self.column: values,
                self.status: pa.array(statuses, pa.string()),
                self.error: pa.array(
                    [
                        None if st == checks.OK else e
                        for st, e in zip(statuses, errors, strict=True)
                    ],
                    pa.string(),
                ),
                REASON: pa.array(reasons, pa.string()),
            }
        )

    def __del__(self):
        backend = getattr(self, "backend", None)
        if backend is not None:
            backend.close()


class CaptionActor(_BackendActor):
    """Holds one backend; captions a batch and applies the output checks."""

    def __init__(self, spec: BackendSpec, prompt: str, column: str, limits: checks.LoopLimits):
        super().__init__(spec, prompt, column)
        self.limits = limits

    def __call__(self, batch: pa.Table) -> pa.Table:
        images, reasons, todo, gens = self._generate(batch)
        captions: list[str | None] = [None] * len(images)
        statuses = [checks.UNREADABLE] * len(images)  # rows not sent: their image did not decode
        for i, g in zip(todo, gens, strict=True):
            status, text = checks.check(g.text, g.finish_reason, g.error, self.limits)
            statuses[i], captions[i] = status, text
            if status == checks.ERROR:
                reasons[i] = f"backend: {g.error}"[:120]
            elif status != checks.OK:
                reasons[i] = f"flagged: {status}"
        return self._table(batch, pa.array(captions, pa.string()), statuses, reasons, reasons)


class AttributesActor(_BackendActor):
    """Holds one backend; asks for JSON attributes, validates them and builds the struct.

    ``<column>_error`` gets the validator's full message for the row; the run
    report counts the coarse reason (``invalid: schema``, ``invalid: not JSON``).
    """

    def __init__(self, spec: BackendSpec, prompt: str, column: str, schema_json: str):
        from prx_data.columns.structured import Validator

        super().__init__(spec, prompt, column)
        self.validator = Validator(json.loads(schema_json))

    def __call__(self, batch: pa.Table) -> pa.Table:
        images, reasons, todo, gens = self._generate(batch)
        details = list(reasons)
        values: list[dict | None] = [None] * len(images)
        statuses = [checks.UNREADABLE] * len(images)  # rows not sent: their image did not decode

        def flag(i: int, status: str, why: str) -> None:
            statuses[i] = status
            details[i] = f"{status}: {why}"
            reasons[i] = f"{status}: {why.split(':', 1)[0]}"

        for i, g in zip(todo, gens, strict=True):
            if g.error is not None:
                statuses[i] = checks.ERROR
                details[i] = reasons[i] = f"backend: {g.error}"[:120]
            elif not checks.clean(g.text):
                statuses[i] = checks.EMPTY
                details[i] = reasons[i] = f"flagged: {checks.EMPTY}"
            else:
                value, why = self.validator.parse(g.text)
                if value is None:
                    cut = g.finish_reason == "length"
                    flag(i, checks.TRUNCATED if cut else checks.INVALID, why or "")
                else:
                    statuses[i], values[i] = checks.OK, value
        array, unfit = self.validator.to_arrow(values)
        for i, why in enumerate(unfit):
            if why is not None:
                flag(i, checks.INVALID, why)
        return self._table(batch, array, statuses, details, reasons)


def caption_job(
    cfg: CaptionConfig,
    spec: BackendSpec,
    prompt: str,
    limits: checks.LoopLimits,
    schema: dict | None = None,
) -> ColumnJob:
    """The column job: pending rows -> prepared images -> captions (or attributes), statuses
    and reasons."""
    from prx_data.columns.structured import arrow_type, canonical
    from prx_data.table.lance_ops import open_table

    existing = open_table(cfg.table, cfg.storage_options).schema.names
    st = status_column(cfg.column)
    where = pending_filter(existing, st, cfg.column, cfg.redone, include_missing=not cfg.only)
    if schema is None:
        value_type: pa.DataType = pa.string()
        actor = Step(
            CaptionActor,
            constructor_args=(spec, prompt, cfg.column, limits),
            batch_size=spec.batch_size,
            actors=spec.replicas,
            num_cpus=spec.num_cpus,
            num_gpus=spec.num_gpus,
        )
    else:
        value_type = arrow_type(schema)
        actor = Step(
            AttributesActor,
            constructor_args=(spec, prompt, cfg.column, canonical(schema)),
            batch_size=spec.batch_size,
            actors=spec.replicas,
            num_cpus=spec.num_cpus,
            num_gpus=spec.num_gpus,
        )
    return ColumnJob(
        table=cfg.table,
        outputs=pa.schema(
            [
                pa.field(cfg.column, value_type),
                pa.field(st, pa.string()),
                pa.field(error_column(cfg.column), pa.string()),
            ]
        ),
        read_columns=[S.ID, S.IMAGE],
        steps=[
            Step(
                prepare_images,
                kwargs={"max_pixels": cfg.max_pixels},
                batch_size=spec.batch_size,
                zero_copy_batch=True,
            ),
            actor,
        ],
        where=where,
        limit=cfg.limit,
        batch_size=spec.batch_size or 256,
        commit_every=cfg.commit_every,
        count_column=st,
        reason_column=REASON,
        storage_options=cfg.storage_options,
        run=cfg.run,
        desc=f"caption {cfg.column}",
    )


def run_caption(
    cfg: CaptionConfig,
    spec: BackendSpec | None = None,
    limits: checks.LoopLimits | None = None,
) -> ColumnReport:
    """Caption the rows of ``cfg.table`` that lack ``cfg.column``; returns the report.

    ``spec`` overrides the backend named in ``cfg`` (any :class:`Backend`
    subclass works, e.g. for benchmarks). With ``cfg.schema_file`` the schema
    is added to the spec's generation settings (guided decoding), also to a
    given ``spec``.
    """
    from prx_data.columns.structured import canonical, load_schema

    schema = load_schema(cfg.schema_file) if cfg.schema_file else None
    if schema is None:
        prompt = load_prompt(cfg.prompt_file)
    else:
        prompt = load_attributes_prompt(cfg.prompt_file, schema)
    if spec is None:
        spec = make_spec(
            cfg.backend,
            cfg.model,
            cfg.generation,
            cfg.backend_options,
            replicas=cfg.replicas,
            batch_size=cfg.batch_size,
        )
    if schema is not None:
        spec = replace(spec, generation=replace(spec.generation, json_schema=canonical(schema)))
    return run_column_job(caption_job(cfg, spec, prompt, limits or checks.LoopLimits(), schema))
