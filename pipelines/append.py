"""``write_mds --append``: the table's new and changed rows added to a complete export.

The steps, under the export's lease (:class:`~prx_data.export.lock.ExportLock`, as every
export run and list update holds it), read top to bottom in :meth:`AppendSink.run`:

1. refusals: a tree that is not a complete export of ours, ``--overwrite``, settings that
   differ from the export's (a sample must be made as the old ones were);
2. the plan (:mod:`prx_data.export.append`): the table compared with what the export
   last saw, by id; written to ``_progress/append/`` before any unit runs;
3. the units (:func:`prx_data.export.unit.export_unit` on an
   :class:`~prx_data.export.spec.AppendUnit`), on threads or Ray like an export's, the
   ledger's opt-outs left out while they write (:mod:`prx_data.export.removals`);
4. the pack stage over the new parts only, at ``--shard-size``;
5. the report goes, then each touched bucket's ``index.json`` gains the new packs after
   its old entries (old shards untouched), the id index and ``dropped.parquet`` are
   rebuilt, the ``deleted`` and ``replaced`` lists recorded and materialised, the row
   record and the config's ``table_version`` moved to the version reached;
6. ``report.json`` last, then the plan is removed.

A kill anywhere leaves the old indexes (before 5) or a tree without a report (after):
never one that looks complete and misses shards. ``--append --resume`` keeps the plan,
the finished units and packs, removes what was half written, and redoes the rest.
"""

from __future__ import annotations

import json
import os
import time
import warnings
from dataclasses import asdict, dataclass, replace

import pyarrow as pa
import pyarrow.compute as pc
from prx_data.pipelines.write_mds import DRIVER_UNIT_ROWS, placement, run_packs, unit_env

from prx_data.core import storage
from prx_data.core.runtime import Resources, RunOptions, map_units
from prx_data.core.schema import REPORT_NAME
from prx_data.export import append as A
from prx_data.export.idindex import (
    IdIndex,
    IdIndexError,
    extend_id_index,
    lookup_or_manifests,
    open_index,
    write_id_index,
)
from prx_data.export.layout import read_report
from prx_data.export.lock import ExportLock
from prx_data.export.merge import ExportReport, Merged, done_parts, merge_dropped, write_report
from prx_data.export.naming import CONFIG_NAME, ExportError
from prx_data.export.pack import done_packs, plan_packs
from prx_data.export.prepare import (
    check_out_location,
    open_table,
    pin_table_version,
    release_table_version,
    resolve_caption_columns,
)
from prx_data.export.removals import write_keys
from prx_data.export.safety import foreign_entries, list_top
from prx_data.export.spec import (
    AppendUnit,
    ExportConfig,
    UnitResult,
    kept_parts,
    normalise,
    published_parts,
    resume_flags,
)
from prx_data.export.unit import export_unit


class _AppendTask:
    """Callable shipped to Ray workers: runs one append unit, returns its counts."""

    def __init__(self, cfg: ExportConfig):
        self.cfg = cfg

    def __call__(self, row: dict) -> str:
        return export_unit(self.cfg, AppendUnit.from_json(row["unit"])).to_json()


def run_append(
    cfg: ExportConfig,
    run: RunOptions,
    *,
    resume: bool = False,
    overwrite: bool = False,
    driver_rows: int = DRIVER_UNIT_ROWS,
) -> ExportReport:
    """Add the table's rows that the export at ``cfg.out`` does not hold yet; the report.

    ``resume``: finish an append that was killed. ``overwrite`` is refused: an append adds
    to the export, an overwrite replaces it.
    """
    if overwrite:
        raise A.AppendError(
            "--append and --overwrite cannot be combined: --append adds to the export at "
            "--out, --overwrite replaces it; choose one"
        )
    try:
        cfg.encode.check()
    except ValueError as e:
        raise ExportError(str(e)) from None
    check_out_location(cfg.out)
    if not storage.is_remote(cfg.table) and not os.path.exists(cfg.table):
        raise ExportError(f"--table {cfg.table} does not exist")
    if not list_top(cfg.out):
        raise A.AppendError(
            f"nothing to append to: {cfg.out} holds no export; export the table first "
            "(python -m prx_data.write_mds without --append)"
        )
    with ExportLock(cfg.out) as lock:
        return AppendSink(cfg, run, resume=resume, driver_rows=driver_rows).run(lock)


def _same_table(a: str, b: str) -> bool:
    if storage.is_remote(a) or storage.is_remote(b):
        return a.rstrip("/") == b.rstrip("/")
    return os.path.realpath(a) == os.path.realpath(b)


@dataclass
class AppendSink:
    """One append run (see the module docstring); :meth:`run` under the export's lease."""

    cfg: ExportConfig
    run_opts: RunOptions
    resume: bool = False
    driver_rows: int = DRIVER_UNIT_ROWS

    def run(self, lock: ExportLock) -> ExportReport:
        self.t0, self.lock = time.perf_counter(), lock
        out = self.cfg.out
        previous = self._previous()
        self._check_settings(previous)
        self._ledger()
        plan = self._current_plan()
        if plan is None:
            plan = self._plan(previous)
            if plan is None:
                return self._unchanged()
        ds = open_table(self.cfg.table, plan.version)
        write_keys(out, self.optouts)  # the ledger's opt-outs, left out while the units write
        ucfg = replace(
            previous,
            out=out,
            ledger=self.cfg.ledger,
            table_version=plan.version,
            shard_size=self.cfg.shard_size,
            rows_per_task=self.cfg.rows_per_task,
        )
        new = self._write(ucfg, plan)
        lock.check()  # the export is about to change: it must not look complete meanwhile
        for name in (REPORT_NAME, "report.txt"):
            storage.delete(storage.join(out, name))
        before, _ = open_index(out)  # current for the old indexes: then extended, not rebuilt
        A.merge_appended(out, new, lease=lock)
        lock.check()
        if open_index(out)[0] is None:  # (a resumed append may have got this far already)
            self._id_index(before, new)
        results = done_parts(out)  # every unit of the export, old and appended
        unlisted = merge_dropped(ucfg, results, lease=lock)
        lists = self._lists(plan, new)
        lock.check()
        A.write_record(out, ds)
        lock.check()
        config = normalise(replace(ucfg, ledger=previous.ledger, append=False))
        storage.write_bytes_atomic(
            storage.join(out, CONFIG_NAME), json.dumps(asdict(config), sort_keys=True).encode()
        )
        summary = {
            "version": plan.version,
            "base_version": plan.base_version,
            "baseline": plan.baseline,
            "counts": plan.counts,
            "units": len(plan.units),
            "seconds": round(time.perf_counter() - self.t0, 3),
        }
        merged = Merged(A.bucket_counts(out), tuple(unlisted))
        seconds = plan.seconds_before + time.perf_counter() - self.t0
        report = write_report(config, results, merged, seconds, lists, lease=lock, append=summary)
        release_table_version(ucfg, ds)
        A.drop_plan(out)
        return report

    def _id_index(self, before: IdIndex | None, new: dict[str, dict[str, int]]) -> None:
        """The id index extended by the new parts' rows, or (not current before the merge,
        or an extension that does not add up) built afresh from every manifest."""
        out, lock = self.cfg.out, self.lock
        if before is not None:
            try:
                extend_id_index(out, before, new, check=lock.check)
                return
            except IdIndexError as e:  # the index was left unused: built afresh
                warnings.warn(f"{out}: the id index is rebuilt ({e})", UserWarning, stacklevel=2)
        write_id_index(out, check=lock.check)

    # --- refusals and the plan -------------------------------------------------------------

    def _previous(self) -> ExportConfig:
        out = self.cfg.out
        found = foreign_entries(out)
        path = storage.join(out, CONFIG_NAME)
        if found or not storage.exists(path):
            raise A.AppendError(
                f"cannot append to {out}: it is not an export written by prx_data.write_mds "
                f"(found: {'; '.join(found[:5]) or 'no ' + CONFIG_NAME}); export the table "
                "into an empty folder first"
            )
        d = json.loads(storage.read_bytes(path))
        return normalise(ExportConfig(**{**d, "out": out, "append": False}))

    def _check_settings(self, previous: ExportConfig) -> None:
        cfg = self.cfg
        if not _same_table(cfg.table, previous.table):
            raise A.AppendError(
                f"cannot append to {cfg.out}: it was exported from {previous.table}, not "
                f"{cfg.table}; append from the same table"
            )
        if cfg.caption_columns is None:  # not given: the export's own
            caps = previous.caption_columns
        else:
            caps = resolve_caption_columns(open_table(cfg.table).schema, cfg.caption_columns)
        now = normalise(replace(cfg, caption_columns=caps, table=previous.table))
        old, new = previous.sample_settings(), now.sample_settings()
        diff = {k: (old.get(k), v) for k, v in new.items() if old.get(k) != v}
        if diff:
            flags = resume_flags({k: was for k, (was, _) in diff.items()})
            raise A.AppendError(
                f"cannot append to {cfg.out}: settings differ from the export's {diff} "
                "(export's, now); its samples and the appended ones must be made alike. "
                "Append with the export's settings"
                + (f" (here: {flags})" if flags else "")
                + ", or re-export with --overwrite"
            )

    def _ledger(self) -> None:
        from prx_data.skips.errors import ListError
        from prx_data.skips.export_state import read_state
        from prx_data.skips.ledger import Ledger
        from prx_data.skips.which import check_recorded

        try:
            self.registry = Ledger.for_table(self.cfg.table, self.cfg.ledger)
            check_recorded(self.cfg.out, read_state(self.cfg.out), self.registry)
            self.optouts = self.registry.optout_keys()
        except ListError as e:
            raise ExportError(str(e)) from None

    def _current_plan(self) -> A.AppendPlan | None:
        out = self.cfg.out
        plan = A.read_plan(out)
        complete = storage.exists(storage.join(out, REPORT_NAME))
        if plan is not None and complete and self._recorded_version() == plan.version:
            A.drop_plan(out)  # an append killed after its report: it is done
            plan = None
        if plan is not None and not self.resume:
            raise A.AppendError(
                f"an append to {out} (table version {plan.version}) was interrupted; finish "
                "it with --append --resume"
            )
        if plan is None and self.resume:
            what = "an interrupted export: finish it with --resume (without --append)"
            if complete:
                what = "no interrupted append; run --append without --resume"
            raise A.AppendError(f"nothing to resume with --append at {out}: it holds {what}")
        if plan is None and not complete:
            raise A.AppendError(
                f"cannot append to {out}: its export did not finish (no {REPORT_NAME}); "
                "finish it with --resume first"
            )
        return plan

    def _recorded_version(self) -> int | None:
        d = json.loads(storage.read_bytes(storage.join(self.cfg.out, CONFIG_NAME)))
        return d.get("table_version")

    def _plan(self, previous: ExportConfig) -> A.AppendPlan | None:
        """Compare the table with what the export saw and write the plan (None: nothing to do)."""
        out = self.cfg.out
        ds = open_table(self.cfg.table, self.cfg.table_version)
        if ds.version == previous.table_version:
            return None
        seen, kind = A.baseline(out, previous, previous.table_version)
        d = A.diff(A.table_side(ds, previous.filter), seen, 2 * ds.count_rows())
        # A new id the export still holds a sample of (a row deleted, then added again):
        # that old sample is replaced like a changed row's, and the id leaves `deleted`.
        fresh = d.todo["id"].combine_chunks()
        fresh = fresh.filter(pc.invert(pc.is_in(fresh, value_set=d.replaced)))
        again = [
            t["id"].combine_chunks().cast(pa.string())
            for t in (lookup_or_manifests(out, pc.unique(fresh)) if len(fresh) else ())
        ]
        re_added = pc.unique(pa.concat_arrays(again)) if again else pa.array([], pa.string())
        d.counts["re_added"] = len(re_added)
        if len(re_added):
            both = pa.concat_arrays([d.replaced, re_added.cast(pa.string())])
            d.replaced = both.take(pc.sort_indices(both))
        if not len(d.todo) and not len(d.deleted) and not len(d.replaced):
            return None
        pin_table_version(replace(self.cfg, table_version=ds.version), ds)
        units = A.plan_units(d.todo, self.cfg.rows_per_task, ds.version, previous.min_units)
        plan = A.AppendPlan(ds.version, previous.table_version, kind, units, d.counts)
        plan.seconds_before = float((read_report(out) or {}).get("seconds") or 0.0)
        self.lock.check()
        A.write_plan(out, plan, d)
        return plan

    def _unchanged(self) -> ExportReport:
        d = read_report(self.cfg.out) or {}
        report = ExportReport(**{k: v for k, v in d.items() if k in _REPORT_FIELDS})
        report.warnings = [
            f"nothing to append: {self.cfg.out} already holds every row of {self.cfg.table} "
            "(no new, changed or deleted row); nothing was written"
        ]
        return report

    # --- units, packs, lists ---------------------------------------------------------------

    def _write(self, ucfg: ExportConfig, plan: A.AppendPlan) -> dict[str, dict[str, int]]:
        """Run the units not done yet, pack their parts; {bucket: {new part: samples}}."""
        out = self.cfg.out
        keys = {u.part for u in plan.units}
        finished = {k: r for k, r in done_parts(out).items() if k in keys}
        if self.resume:  # what a killed append left half written goes; finished work stays
            A.remove_unlisted_parts(out, kept_parts(finished) | done_packs(out))
        todo = [u for u in plan.units if u.part not in finished]
        results: dict[str, UnitResult] = dict(finished)
        where = placement(sum(u.count for u in todo), self.run_opts, self.driver_rows)
        self.where = where
        if todo:
            for text in map_units(
                _AppendTask(ucfg),
                [{"unit": u.to_json()} for u in todo],
                where,
                Resources(num_cpus=1, env=unit_env(ucfg)),
                desc="append",
                progress=self.run_opts.progress,
                total=len(plan.units),
                initial=len(finished),
            ):
                r = UnitResult.from_json(text)
                self.lock.check()
                results[r.part] = r
        missing = keys - set(results)
        if missing:
            raise RuntimeError(f"{len(missing)} append units did not report back")
        results = {k: results[k] for k in sorted(results)}
        if ucfg.shard_size > 0 and results:
            self.lock.check()
            return run_packs(
                ucfg,
                plan_packs(out, results, ucfg.shard_size),
                check=self.lock.check,
                placement=where,
                progress=self.run_opts.progress,
                on_driver=not where.on_ray,
            )
        return {
            b: {p: r.buckets[b] for p, r in parts.items()}
            for b, parts in published_parts(results).items()
        }

    def _lists(self, plan: A.AppendPlan, new: dict[str, dict[str, int]]) -> dict[str, dict]:
        """``deleted`` and ``replaced`` recorded, then every list materialised into the tree."""
        from prx_data.skips.errors import ListError
        from prx_data.skips.log import Provenance
        from prx_data.skips.materialise import materialise
        from prx_data.skips.ops import record_tree_changes

        out, lock = self.cfg.out, self.lock
        deleted = A.read_ids(out, A.DELETED_IDS)
        replaced = A.read_ids(out, A.REPLACED_IDS)
        A.update_live(out, new, replaced)
        prov = Provenance("write_mds --append", f"table version {plan.version}")
        none = pa.array([], pa.string())
        changes = {
            A.DELETED_LIST: (deleted, replaced),  # a replaced id is not deleted any more
            A.REPLACED_LIST: (replaced, none),
        }
        try:
            lock.check()
            if len(deleted) or len(replaced):
                record_tree_changes(out, lock, self.registry, changes, prov)
            return materialise(out, self.registry, lock, full=True)
        except ListError as e:
            raise ExportError(str(e)) from None


_REPORT_FIELDS = {f for f in ExportReport.__dataclass_fields__}
