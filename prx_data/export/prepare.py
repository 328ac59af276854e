"""Output preparation: check ``--out`` and the table, pin the table version, record the
config (or check it against the interrupted run's), and plan the work units.

:func:`prepare_output` returns all of it as one :class:`Prepared`, with the table
open at its pinned version: the driver opens the table once per run
(:func:`open_source`) and hands that handle on, to the placement, the plan and
the tag's release.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field, replace
from typing import Any

import pyarrow as pa

from prx_data.core import storage
from prx_data.core.errors import NotFound
from prx_data.core.schema import REPORT_NAME, is_job_column
from prx_data.export.merge import done_parts
from prx_data.export.naming import CONFIG_NAME, LEASE_NAME, LOCK_NAME, PROGRESS_DIR, ExportError
from prx_data.export.safety import (
    clear_export,
    describe_foreign,
    foreign_entries,
    list_top,
    write_export_marker,
)
from prx_data.export.spec import (
    ExportConfig,
    UnitResult,
    WorkUnit,
    caption_warnings,
    normalise,
    resume_flags,
    sample_columns,
    warn,
)
from prx_data.table.pins import export_pin, pin, unpin

#: Table columns the exporter cannot do without.
REQUIRED_COLUMNS = ("id", "image", "width", "height")


def open_table(uri: str, version: int | None = None):
    """:func:`prx_data.table.lance_ops.open_table`, failing as an :class:`ExportError`."""
    from prx_data.table import lance_ops

    try:
        return lance_ops.open_table(uri, version=version)
    except NotFound as e:
        raise ExportError(str(e)) from None


def check_table_columns(uri: str, schema: pa.Schema) -> None:
    """Refuse a table the exporter would turn into nothing but drops."""
    missing = [c for c in REQUIRED_COLUMNS if c not in schema.names]
    if missing:
        raise ExportError(
            f"table {uri} has no {', '.join(repr(c) for c in missing)} column(s) (it has "
            f"{sorted(schema.names)}); every row would be dropped. Ingest images with "
            "`python -m prx_data.ingest`, which writes id, image, width and height."
        )


def resolve_caption_columns(schema: pa.Schema, wanted: tuple[str, ...] | None) -> tuple[str, ...]:
    names = set(schema.names)
    if wanted is None:
        return tuple(
            n
            for n in schema.names
            if n.startswith("caption")
            and not is_job_column(n)
            and pa.types.is_string(schema.field(n).type)
            | pa.types.is_large_string(schema.field(n).type)
        )
    missing = [c for c in wanted if c not in names]
    if missing:
        raise ExportError(f"caption column(s) {missing} not in the table; it has {sorted(names)}")
    return wanted


def plan_units(cfg: ExportConfig, table: Any = None) -> list[WorkUnit]:
    """Cut every fragment into equal row ranges, from fragment metadata alone.

    A unit holds at most ``rows_per_task`` rows and at most ``ceil(rows /
    min_units)``, so a table of a few hundred rows still makes ``min_units``
    units. Only the manifest is read (``count_rows`` of a fragment is its
    physical rows less its deletions): no data file, no image bytes, so a
    10^8-row table plans in the time it takes to list its fragments. The plan
    depends only on the pinned table version and the settings, so reruns and
    resumes make the same units with the same part names. ``table``: the
    table already open at ``cfg.table_version`` (else it is opened here).
    """
    ds = _at_version(table, cfg.table, cfg.table_version)
    sizes = [(frag.fragment_id, frag.count_rows()) for frag in ds.get_fragments()]
    per_unit = max(1, cfg.rows_per_task)
    total = sum(n for _, n in sizes)
    if (cfg.min_units or 0) > 0 and total:
        per_unit = min(per_unit, -(-total // cfg.min_units))
    units = []
    for fragment_id, n in sizes:
        k = -(-n // per_unit)
        for i in range(k):
            start, end = i * n // k, (i + 1) * n // k
            units.append(WorkUnit(fragment_id, start, end - start))
    return units


def check_out_location(out: str) -> None:
    """A local ``--out`` must be a directory (or not exist yet, under a directory); a remote one
    must be on a supported store (:data:`prx_data.core.storage.SUPPORTED_STORES`)."""
    if storage.is_remote(out):
        storage.check_store(out)
        return
    path = os.path.abspath(out)
    if os.path.exists(path) and not os.path.isdir(path):
        raise ExportError(f"--out {out} is a file, not a directory; choose a directory")
    parent = path
    while not os.path.exists(parent):
        parent = os.path.dirname(parent)
    if not os.path.isdir(parent):
        raise ExportError(f"--out {out}: {parent} is a file, not a directory")


def check_before_work(cfg: ExportConfig, *, overwrite: bool = False, resume: bool = False) -> None:
    """Refuse what the run could not use before anything slow (starting Ray, reading the
    table): a local ``--table`` that does not exist, and the ``--out`` checks of
    :func:`check_output`."""
    check_out_location(cfg.out)  # an unsupported store first: nothing else matters then
    if not storage.is_remote(cfg.table) and not os.path.exists(cfg.table):
        raise ExportError(f"--table {cfg.table} does not exist")
    check_output(cfg.out, overwrite=overwrite, resume=resume)


def check_output(out: str, *, overwrite: bool = False, resume: bool = False) -> None:
    """Refuse an ``--out`` the run could not use, before anything slow (starting Ray, opening
    the table): a file, a non-empty folder without ``--overwrite``/``--resume``, a tree that
    is not provably ours. One listing of the top level; a tree with a live run's lock is left
    to the lock to report. :func:`prepare_output` checks again under the lock."""
    if overwrite and resume:
        raise ExportError("--overwrite and --resume are mutually exclusive")
    check_out_location(out)
    top = list_top(out)
    if LOCK_NAME in top or LEASE_NAME in top:
        return
    _refuse_entries(out, top, overwrite=overwrite, resume=resume)


def _refuse_entries(out: str, entries: list[str], *, overwrite: bool, resume: bool) -> None:
    """The refusals that need only the top-level listing (``entries``, lock files left out)."""
    if entries and (resume or overwrite):
        foreign = foreign_entries(out)
        if foreign:
            flag = "--resume" if resume else "--overwrite"
            raise ExportError(
                f"refusing to {flag} {out}: it is not provably an export written by "
                f"prx_data.write_mds, so nothing was touched. Found: {describe_foreign(foreign)}"
            )
    if entries and not resume and not overwrite:
        if REPORT_NAME in entries:
            hint = "it holds a complete export; pass --overwrite to replace it"
        elif PROGRESS_DIR in entries:
            hint = "it holds an interrupted export; pass --resume to finish it or --overwrite to start again"
        else:
            hint = "choose an empty directory"
        raise ExportError(f"output {out} is not empty: {hint}")


@dataclass(frozen=True)
class Prepared:
    """An output ready for its work units: what :func:`prepare_output` returns."""

    #: The recorded config: ``table_version`` pinned, caption columns resolved.
    cfg: ExportConfig
    #: The table, open at ``cfg.table_version`` (a ``lance.LanceDataset``).
    table: Any = field(repr=False)
    #: Every work unit of the export, in plan order.
    units: tuple[WorkUnit, ...]
    #: Results of the units an interrupted run finished (a resume's), by part.
    finished: Mapping[str, UnitResult]

    @property
    def todo(self) -> list[WorkUnit]:
        """The units still to run."""
        return [u for u in self.units if u.part not in self.finished]


def open_source(cfg: ExportConfig, *, resume: bool = False):
    """The table at the version this run will read: a resume's recorded one, else
    ``cfg.table_version``, else the latest. The one open of the table on the driver."""
    config_path = storage.join(cfg.out, CONFIG_NAME)
    if resume and storage.exists(config_path):
        try:
            version = json.loads(storage.read_bytes(config_path)).get("table_version")
        except (ValueError, AttributeError):
            version = None  # prepare_output refuses it, in its own words
        if version is not None:
            return _open_pinned(cfg, version)
    return open_table(cfg.table, cfg.table_version)


def _at_version(table: Any, uri: str, version: int | None):
    """``table`` if it is open at ``version`` (None: any), else the table opened there."""
    if table is not None and (version is None or table.version == version):
        return table
    return open_table(uri, version)


def prepare_output(
    cfg: ExportConfig, *, overwrite: bool = False, resume: bool = False, table: Any = None
) -> Prepared:
    """Check the output location, pin the table version, record the config, plan the units.

    Returns the :class:`Prepared` output: the config with ``table_version``
    pinned, the table open at it, the work units and, for a resume, the units
    already finished. ``table``: the table as :func:`open_source` opened it
    (else it is opened here). Never deletes anything unless ``overwrite`` is
    set, and resumes nothing, unless the tree is provably an export of ours
    (:func:`safety.foreign_entries`). The caller holds the run lock
    (:class:`prx_data.export.lock.ExportLock`).
    """
    if overwrite and resume:
        raise ExportError("--overwrite and --resume are mutually exclusive")
    check_out_location(cfg.out)
    entries = [e for e in list_top(cfg.out) if e not in (LOCK_NAME, LEASE_NAME)]
    config_path = storage.join(cfg.out, CONFIG_NAME)
    _refuse_entries(cfg.out, entries, overwrite=overwrite, resume=resume)
    if entries and resume:
        return _prepare_resume(cfg, config_path, table)
    ds = _at_version(table, cfg.table, cfg.table_version)
    check_table_columns(cfg.table, ds.schema)
    caps = resolve_caption_columns(ds.schema, cfg.caption_columns)
    sample_columns(replace(cfg, caption_columns=caps), ds.schema)
    if entries:  # only after every check: a refused run deletes nothing
        clear_export(cfg.out, entries)
    pinned = ExportConfig(**{**asdict(cfg), "table_version": ds.version, "caption_columns": caps})
    pinned = normalise(pinned)
    pin_table_version(pinned, ds)
    write_export_marker(cfg.out)
    storage.write_bytes_atomic(config_path, json.dumps(asdict(pinned), sort_keys=True).encode())
    warn(caption_warnings(cfg.table, caps))
    return Prepared(pinned, ds, tuple(plan_units(pinned, ds)), {})


def _prepare_resume(cfg: ExportConfig, config_path: str, table: Any) -> Prepared:
    """:func:`prepare_output` for a resume: the recorded config, checked against ``cfg``."""
    if not storage.exists(config_path):
        raise ExportError(
            f"{cfg.out} has no interrupted export to resume (no {CONFIG_NAME}: it was stopped "
            "before it started, e.g. while --overwrite deleted the old tree); start it again "
            "with --overwrite"
        )
    previous = normalise(
        ExportConfig(**{**json.loads(storage.read_bytes(config_path)), "out": cfg.out})
    )
    if table is not None and table.version == previous.table_version:
        ds = table
    else:
        ds = _open_pinned(cfg, previous.table_version)
    pin_table_version(cfg, ds)
    check_table_columns(cfg.table, ds.schema)
    caps = resolve_caption_columns(ds.schema, cfg.caption_columns)
    sample_columns(replace(cfg, caption_columns=caps), ds.schema)
    now = normalise(
        ExportConfig(
            **{
                **asdict(cfg),
                "table_version": previous.table_version,
                "caption_columns": caps,
                # an automatic unit count (None) stays the one the run started with
                "min_units": previous.min_units if cfg.min_units is None else cfg.min_units,
            }
        )
    )
    if now.fingerprint() != previous.fingerprint():
        old = previous.fingerprint()
        diff = {k: (old.get(k), v) for k, v in now.fingerprint().items() if old.get(k) != v}
        flags = resume_flags({k: was for k, (was, _) in diff.items()})
        raise ExportError(
            f"cannot resume {cfg.out}: options differ from the interrupted run {diff} "
            "(previous, now). Rerun with the same options"
            + (f" (here: {flags})" if flags else "")
            + ", or use --overwrite to start again."
        )
    warn(caption_warnings(cfg.table, caps))
    return Prepared(now, ds, tuple(plan_units(now, ds)), done_parts(cfg.out))


def _open_pinned(cfg: ExportConfig, version: int | None):
    """The table at the version an interrupted export read, or why it cannot be resumed."""
    try:
        return open_table(cfg.table, version)
    except ExportError:
        open_table(cfg.table)  # no table at all: that error
        raise ExportError(
            f"cannot resume {cfg.out}: version {version} of {cfg.table}, which it was "
            "exporting, no longer exists (old versions were cleaned up while it was paused "
            "and untagged); start again with --overwrite"
        ) from None


def pin_table_version(cfg: ExportConfig, ds) -> None:
    """Tag the version the export reads, so that ``table compact --cleanup`` keeps it.

    The tag is named after ``cfg.out`` (:func:`prx_data.table.pins.export_pin`):
    a resume or an ``--overwrite`` of the same output reuses it, and
    :func:`release_table_version` removes it once the report is written.
    """
    try:
        pin(ds, export_pin(cfg.out), ds.version, job="export", out=cfg.out)
    except OSError as e:  # e.g. read-only access to the table: export anyway, and say so
        warn(
            [
                f"could not tag version {ds.version} of {cfg.table} ({e}); a `python -m "
                "prx_data.table compact --cleanup` before this export finishes would make "
                "it impossible to --resume"
            ]
        )


def release_table_version(cfg: ExportConfig, table: Any = None) -> None:
    """Remove the export's tag (the export is complete; its version may be cleaned up).

    ``table``: the table open at any version (tags belong to the whole table).
    """
    try:
        unpin(table if table is not None else open_table(cfg.table), export_pin(cfg.out))
    except (ExportError, OSError) as e:  # the export is done; a left tag only keeps old files
        warn([f"could not remove tag {export_pin(cfg.out)} from {cfg.table}: {e}"])
