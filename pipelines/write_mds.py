"""Ray Data graph for the export: work units -> export tasks -> merge + report.

One task per work unit (a row range of a Lance fragment); each task opens the
table itself, so rows never travel through the object store. Tasks run in
parallel on every CPU Ray offers, locally or across a cluster. Unless told
otherwise (``min_units``), a fresh export plans at least
:data:`UNITS_PER_CPU` units per CPU of the cluster, so a table of a few
hundred rows still uses every core; the count is pinned in the export's
config, so ``--resume`` plans the same units on any cluster.

Skip lists (:mod:`prx_data.skips`) survive every export of a table:
``--overwrite`` first carries the old tree's export-only entries into the
table's registry (refusing, before anything is deleted, a list whose ids
cannot be recovered unless ``may_drop_lists`` names it), and every export, fresh
or not, materialises the log under its lease before its report is written.

Between the units and the merge, the pack stage (:mod:`prx_data.export.pack`)
concatenates each bucket's parts into shards of about ``shard_size``: one
Ray task per pack, or threads on the driver when the whole export is small
(:data:`DRIVER_PACK_BYTES`), since a Ray Data stage costs seconds to start.
The merge, and the skip lists bound after it, then see only packs.

Units and packs run through :func:`prx_data.core.runtime.map_units`. A small
job does not start Ray at all: under ``engine="auto"`` a table of at most
``driver_rows`` rows (:data:`DRIVER_UNIT_ROWS`) runs its work units and packs
on threads of the driver, one per CPU a private local Ray would have
(:func:`prx_data.core.runtime.place` decides, starting nothing). The units,
parts and bytes are those of the Ray path, even when a Ray already runs in
the process; a job given a cluster takes the Ray path whatever its size.
"""

from __future__ import annotations

import os
import time
import warnings
from collections.abc import Iterable
from dataclasses import asdict, dataclass, replace

from prx_data.core import heap, storage
from prx_data.core.runtime import (
    Placement,
    Resources,
    RunOptions,
    map_units,
    place,
    placement_cpus,
)
from prx_data.core.storage import storage_env
from prx_data.export.append import plan_path, write_record
from prx_data.export.idindex import write_id_index
from prx_data.export.lock import ExportLock
from prx_data.export.merge import ExportReport, merge, write_report
from prx_data.export.naming import ExportError
from prx_data.export.pack import Pack, done_packs, plan_packs, write_pack
from prx_data.export.pack import preload_writer as preload_pack_writer
from prx_data.export.prepare import (
    Prepared,
    check_before_work,
    open_source,
    prepare_output,
    release_table_version,
)
from prx_data.export.removals import write_keys
from prx_data.export.safety import foreign_entries, list_top, remove_stale_parts
from prx_data.export.spec import ExportConfig, UnitResult, WorkUnit, kept_parts
from prx_data.export.unit import export_unit

#: Work units per cluster CPU when ``min_units`` is not given. Units cost the same
#: in rows, not in time (image sizes vary), so the last one ends late while other
#: cores idle; that tail is about half a unit, so more units shrink it. The cost
#: per unit (open the table, one part folder) did not show at this count
#: (benchmarks/results/export_startup.md); it keeps parts of a small table at tens of rows.
#: Tables above ``rows_per_task`` x units are cut by ``rows_per_task`` anyway.
UNITS_PER_CPU = 8

#: Exports whose shards total at most this many bytes are packed by threads on the
#: driver (reading and writing a few hundred MB is shorter than starting a Ray Data
#: stage); larger ones by one Ray task per pack, on every CPU of the cluster.
DRIVER_PACK_BYTES = 256 << 20
#: Threads packing on the driver (each holds at most one pack's shard in memory).
DRIVER_PACK_THREADS = 2

#: Tables of at most this many rows run their work units (then their packs) on threads
#: of the driver when the job would otherwise start a local Ray runtime for them: that
#: start (``ray.init``, then worker processes importing the export stack) costs more
#: than such a table's work (benchmarks/results/export_startup.md).
DRIVER_UNIT_ROWS = 64


def unit_env(cfg: ExportConfig) -> dict[str, str] | None:
    """What the export's Ray workers start with: the storage settings, and glibc's heap
    kept between images (:mod:`prx_data.core.heap`) unless ``--release-buffers``."""
    return {**storage_env(), **heap.worker_env(cfg.keep_heap)} or None


def auto_min_units(placement: Placement) -> int:
    """``UNITS_PER_CPU`` x the CPUs the units get: the driver threads, or the Ray cluster's."""
    return UNITS_PER_CPU * placement_cpus(placement)


@dataclass
class ProgressTotals:
    """Running totals for the progress bar: O(1) per finished unit, not a re-sum of all results."""

    units: int = 0
    samples: int = 0

    @classmethod
    def of(cls, results: Iterable[UnitResult]) -> ProgressTotals:
        """Totals of the units already done (a resume's markers): one pass, once."""
        totals = cls()
        for r in results:
            totals.add(r)
        return totals

    def add(self, r: UnitResult, replaces: UnitResult | None = None) -> None:
        """Count one finished unit (``replaces``: an earlier report of the same part)."""
        if replaces is not None:
            self.units -= 1
            self.samples -= replaces.written
        self.units += 1
        self.samples += r.written

    def postfix(self) -> dict[str, int]:
        return {"samples": self.samples}


class _ExportTask:
    """Callable shipped to Ray workers: runs one work unit, returns its counts."""

    def __init__(self, cfg: ExportConfig):
        self.cfg = cfg

    def __call__(self, row: dict) -> str:
        unit = WorkUnit(int(row["fragment_id"]), int(row["start"]), int(row["count"]))
        return export_unit(self.cfg, unit).to_json()


class _PackTask:
    """Callable shipped to Ray workers: writes one pack, returns it."""

    def __init__(self, cfg: ExportConfig):
        self.cfg = cfg

    def __call__(self, pack: str) -> str:
        return write_pack(self.cfg, Pack.from_json(pack)).to_json()


def run_packs(
    cfg: ExportConfig,
    packs: list[Pack],
    *,
    check=lambda: None,
    placement: Placement | None = None,
    num_cpus: int | None = None,
    progress: bool = False,
    on_driver: bool = False,
) -> dict[str, dict[str, int]]:
    """Write every pack; returns {bucket: {pack: samples}} for :func:`prx_data.export.merge.merge`.

    The driver handles one small record per pack (never a sample): a plan, a
    task and a result each. Packs go to threads of the driver when they are
    small (:data:`DRIVER_PACK_BYTES`) or ``on_driver`` (a job whose units ran
    there has no Ray to hand them to), else to ``placement`` (default: Ray).
    """
    if on_driver or sum(p.nbytes for p in packs) <= DRIVER_PACK_BYTES:
        placement = Placement(threads=DRIVER_PACK_THREADS)
    elif placement is None or not placement.on_ray:
        placement = Placement(threads=None, num_cpus=num_cpus)
    done = map_units(
        _PackTask(cfg),
        [p.to_json() for p in packs],
        placement,
        Resources(num_cpus=1, env=storage_env() or None),
        desc="pack",
        progress=progress,
        unit_name="pack",
    )
    out: dict[str, dict[str, int]] = {}
    for text in done:
        p = Pack.from_json(text)
        check()
        out.setdefault(p.bucket, {})[p.name] = p.samples
    if sum(len(v) for v in out.values()) != len(packs):
        raise RuntimeError(f"{len(packs)} packs planned, {sum(map(len, out.values()))} reported")
    return {b: dict(sorted(v.items())) for b, v in sorted(out.items())}


@dataclass(frozen=True)
class ListChanges:
    """What an export run changes in the table's skip lists before it writes.

    Args:
        may_drop_lists: skip lists of the tree being overwritten that may be left behind
            because their ids cannot be recovered (any other list is kept).
        unregister_lists: lists removed from the table's ledger first (undoing a trial).
    """

    may_drop_lists: tuple[str, ...] = ()
    unregister_lists: tuple[str, ...] = ()

    def __post_init__(self) -> None:  # a list or a generator from a caller: kept as a tuple
        object.__setattr__(self, "may_drop_lists", tuple(self.may_drop_lists))
        object.__setattr__(self, "unregister_lists", tuple(self.unregister_lists))


def run_export(
    cfg: ExportConfig,
    run: RunOptions,
    *,
    overwrite: bool = False,
    resume: bool = False,
    lists: ListChanges = ListChanges(),
    driver_rows: int = DRIVER_UNIT_ROWS,
) -> ExportReport:
    """Export ``cfg.table`` to bucketed MDS under ``cfg.out`` and return the report.

    The whole run holds the output's lock (:mod:`prx_data.export.lock`): a
    second run or a ``--resume`` on the same ``--out`` is refused meanwhile.

    Args:
        cfg: the export's settings (:class:`~prx_data.export.spec.ExportConfig`).
        run: where and how it runs (:class:`~prx_data.core.runtime.RunOptions`: engine,
            Ray address, CPUs, progress bar).
        overwrite: replace an export of ours at ``cfg.out``.
        resume: finish the interrupted export at ``cfg.out`` with the same settings.
        lists: changes to the table's skip lists first (:class:`ListChanges`).
        driver_rows: under ``engine="auto"``, a table of at most this many rows with no
            cluster named runs on threads of this process (0: always Ray); the export
            it writes is the same.
    """
    if cfg.append:
        raise ExportError(
            "run_export writes a whole export; add to one with "
            "prx_data.pipelines.append.run_append (write_mds --append)"
        )
    try:
        cfg.encode.check()
    except ValueError as e:
        raise ExportError(str(e)) from None
    check_before_work(cfg, overwrite=overwrite, resume=resume)  # before Ray or the table
    sink = ExportSink(
        cfg, run, overwrite=overwrite, resume=resume, lists=lists, driver_rows=driver_rows
    )
    try:
        with ExportLock(cfg.out) as lock:
            if lock.took_over:
                warnings.warn(f"{cfg.out}: took over {lock.took_over}", UserWarning, stacklevel=2)
            todo = sink.on_write_start(lock)
            return sink.on_write_complete(sink.write(todo))
    except BaseException as e:
        sink.on_write_failed(e)
        raise


@dataclass
class ExportSink:
    """The export job in the shape of Ray Data's ``Datasink``, in one place.

    :meth:`on_write_start` (under the lock: lists carried, placement, output
    prepared, units planned), :meth:`write` (the work units, each by
    :class:`_ExportTask`), :meth:`on_write_complete` (pack, merge, id index,
    skip lists, report: in that order, read top to bottom) and
    :meth:`on_write_failed` (a refused run leaves no trace). The fields are
    :func:`run_export`'s arguments, as they were given.
    """

    cfg: ExportConfig
    run: RunOptions
    overwrite: bool = False
    resume: bool = False
    lists: ListChanges = ListChanges()
    driver_rows: int = DRIVER_UNIT_ROWS

    def __post_init__(self) -> None:
        self.created = not storage.is_remote(self.cfg.out) and not os.path.exists(self.cfg.out)

    def on_write_start(self, lock: ExportLock) -> list[WorkUnit]:
        """Carry and drop lists, place the work, prepare the output; returns the units to run."""
        from prx_data.skips.errors import ListError
        from prx_data.skips.export_state import read_state
        from prx_data.skips.ledger import Ledger
        from prx_data.skips.log import Provenance
        from prx_data.skips.ops import carry, remove_list
        from prx_data.skips.which import check_recorded

        cfg = self.cfg
        self.t0, self.lock = time.perf_counter(), lock
        try:
            self.registry = Ledger.for_table(cfg.table, cfg.ledger)
            ours = list_top(cfg.out) and not foreign_entries(cfg.out)
            if ours and self.resume and storage.exists(plan_path(cfg.out)):
                raise ExportError(
                    f"{cfg.out}: an append was interrupted, not the export; finish it with "
                    "--append --resume"
                )
            if ours and (self.overwrite or self.resume):
                # The tree follows a ledger: an --overwrite or a resume from a copy of the
                # table must not trade it for another (or an empty) one.
                check_recorded(cfg.out, read_state(cfg.out), self.registry)
            for name in self.lists.unregister_lists:
                remove_list(self.registry, name, Provenance("write_mds --drop-list"))
            if self.overwrite and ours:
                # Before anything is deleted: the old tree's export-only entries go to the
                # ledger where newer, and the new tree is materialised from the log at the
                # end (a killed run keeps them there).
                carry(cfg.out, self.registry, drop=self.lists.may_drop_lists)
            optouts = self.registry.optout_keys()
        except ListError as e:
            raise ExportError(str(e)) from None
        table = open_source(cfg, resume=self.resume)  # the one open of the table here
        self.where = placement(table.count_rows(), self.run, self.driver_rows)
        # Sized under the lock: starting Ray takes seconds, and a second run must meet the lock first.
        if cfg.min_units is None and not self.resume:  # a resume keeps the count it started with
            cfg = replace(cfg, min_units=auto_min_units(self.where))
        self.prepared = prepare_output(
            cfg, overwrite=self.overwrite, resume=self.resume, table=table
        )
        self.cfg = cfg = self.prepared.cfg
        write_keys(cfg.out, optouts)  # the ledger's opt-outs, left out while the units write
        if self.resume:  # packs with a marker are kept; half-written ones go with unfinished parts
            kept = kept_parts(self.prepared.finished) | done_packs(cfg.out)
            remove_stale_parts(cfg.out, kept, cfg.tiers)
        return self.prepared.todo

    def write(self, todo: list[WorkUnit]) -> dict[str, UnitResult]:
        """Run the units not done yet; returns every unit's result, in part order."""
        prepared: Prepared = self.prepared
        results: dict[str, UnitResult] = dict(prepared.finished)
        if todo:
            if not self.where.on_ray:
                from prx_data.core.streaming_compat import mds_writer

                mds_writer()  # imported here, once, rather than by several threads at a time
            elif self.cfg.shard_size > 0:
                # Packs that fit DRIVER_PACK_BYTES run on this process's threads; their
                # writer (torch) loads while the units run on Ray, not between units and packs.
                preload_pack_writer()
            totals = ProgressTotals.of(results.values())
            done = map_units(
                _ExportTask(self.cfg),
                [asdict(u) for u in todo],
                self.where,
                Resources(num_cpus=1, env=unit_env(self.cfg)),
                desc="write_mds",
                progress=self.run.progress,
                total=len(prepared.units),
                initial=len(prepared.finished),
                postfix=totals.postfix,
            )
            for text in done:
                r = UnitResult.from_json(text)
                self.lock.check()
                totals.add(r, replaces=results.get(r.part))
                results[r.part] = r
        expected = {u.part for u in prepared.units}
        missing = expected - set(results)
        if missing:
            raise RuntimeError(
                f"{len(missing)} work units did not report back: {sorted(missing)[:5]}"
            )
        return {p: results[p] for p in sorted(expected)}

    def on_write_complete(self, results: dict[str, UnitResult]) -> ExportReport:
        """The export's end, in order: pack, merge, id index, skip lists, row record, report.

        The lease is checked before each step (and each step checks it again
        before each of its writes): a run that lost it stops there. ``report.json``
        is the last file written, so a run killed between any two steps leaves a
        tree that does not look complete, and ``--resume`` redoes the end.
        """
        from prx_data.skips.errors import ListError
        from prx_data.skips.materialise import materialise

        cfg, lock = self.cfg, self.lock
        packs = None
        if cfg.shard_size > 0:  # 1. pack: each bucket's parts into shards of about shard_size
            lock.check()
            packs = run_packs(
                cfg,
                plan_packs(cfg.out, results, cfg.shard_size),
                check=lock.check,
                placement=self.where,
                progress=self.run.progress,
                on_driver=not self.where.on_ray,
            )
        seconds = time.perf_counter() - self.t0  # the report's time: start to packed
        lock.check()  # 2. merge: every bucket's index.json, then dropped.parquet
        merged = merge(cfg, results, packs, lease=lock)
        lock.check()  # 3. the id index, which the skip lists bind their ids through
        write_id_index(cfg.out, sorted(merged.buckets), check=lock.check)
        lock.check()  # 4. the skip lists: the ledger materialised into this tree
        try:
            lists = materialise(cfg.out, self.registry, lock, full=True)
        except ListError as e:
            raise ExportError(str(e)) from None
        lock.check()  # 5. the row record: ids and digests of the version read, for --append
        write_record(cfg.out, self.prepared.table)
        lock.check()  # 6. the report: report.txt, then report.json, the last file written
        report = write_report(cfg, results, merged, seconds, lists, lease=lock)
        release_table_version(cfg, self.prepared.table)  # the version need not outlive cleanup
        return report

    def on_write_failed(self, error: BaseException) -> None:
        """A run that fails leaves an ``--out`` it created only if it wrote into it."""
        out = self.cfg.out
        if self.created and os.path.isdir(out) and not os.listdir(out):
            os.rmdir(out)  # a refused run leaves no trace


def placement(rows: int, run: RunOptions, driver_rows: int = DRIVER_UNIT_ROWS) -> Placement:
    """Where the units run: :func:`prx_data.core.runtime.place` by the table's ``rows``
    (counted from the manifest, before anything is written) against ``driver_rows``
    (0: Ray)."""
    engine = "ray" if run.engine == "auto" and driver_rows <= 0 else run.engine
    return place(
        engine, size=rows, small=driver_rows, ray_address=run.ray_address, num_cpus=run.num_cpus
    )
