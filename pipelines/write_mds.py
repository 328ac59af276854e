"""Ray Data graph for the export: work units -> export tasks -> merge + report.

One task per work unit (a row range of a Lance fragment); each task opens the
table itself, so rows never travel through the object store. Tasks run in
parallel on every CPU Ray offers, locally or across a cluster. Unless told
otherwise (``min_units``), a fresh export plans at least
:data:`UNITS_PER_CPU` units per CPU of the cluster, so a table of a few
hundred rows still uses every core; the count is pinned in the export's
config, so ``--resume`` plans the same units on any cluster.

Skip lists (:mod:`prx_data.skips.lists`) survive every export of a table:
``--overwrite`` first records the old tree's lists in the table's registry
(refusing, before anything is deleted, a list whose ids cannot be recovered
unless ``drop_lists`` names it), and every export, fresh or not, binds every
registered list to its new shards by row id before its report is written.

Between the units and the merge, the pack stage (:mod:`prx_data.export.pack`)
concatenates each bucket's parts into shards of about ``shard_size``: one
Ray task per pack, or threads on the driver when the whole export is small
(:data:`DRIVER_PACK_BYTES`), since a Ray Data stage costs seconds to start.
The merge, and the skip lists bound after it, then see only packs.

A small job does not start Ray at all: a table of at most ``driver_rows``
rows (:data:`DRIVER_UNIT_ROWS`), exported where the job would start a private
local Ray runtime, runs its work units and packs on threads of the driver
(:func:`prx_data.core.runtime.local_ray_cpus` tells, starting nothing). The
units, parts and bytes are those of the Ray path: the unit count comes from
the CPUs that runtime would have. A job joining a cluster, or one run where
Ray is already up, takes the Ray path whatever its size.
"""

from __future__ import annotations

import os
import sys
import time
import warnings
from collections.abc import Iterable, Iterator
from dataclasses import asdict, dataclass, replace

from tqdm.auto import tqdm

from prx_data.core import storage
from prx_data.core.imaging import check_codec
from prx_data.core.runtime import ensure_ray, local_ray_cpus, unit_dataset
from prx_data.core.storage import storage_env
from prx_data.export.layout import foreign_entries, imap_bounded, list_top, remove_stale_parts
from prx_data.export.lock import ExportLock
from prx_data.export.pack import Pack, done_packs, plan_packs, write_pack
from prx_data.export.unit import (
    ExportConfig,
    ExportError,
    ExportReport,
    UnitResult,
    WorkUnit,
    check_out_location,
    done_parts,
    export_unit,
    finalize,
    open_table,
    plan_units,
    prepare_output,
    release_table_version,
)

#: Work units per cluster CPU when ``min_units`` is not given. Units cost the same
#: in rows, not in time (image sizes vary), so the last one ends late while other
#: cores idle; that tail is about half a unit, so more units shrink it. The cost
#: per unit (open the table, one part folder) did not show in the benchmark at 8
#: or 16 per CPU on 318 photos; 8 keeps parts of a small table at tens of rows.
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
#: start (``ray.init``, then worker processes importing the export stack) costs 5-15 s,
#: more than such a table's work. 64 rows of 24-MP photos are about 30 CPU-seconds.
DRIVER_UNIT_ROWS = 64


def auto_min_units(
    ray_address: str | None = None, num_cpus: int | None = None, cpus: int | None = None
) -> int:
    """``UNITS_PER_CPU`` x the CPUs of the Ray cluster (started or joined here), or x
    ``cpus`` when the units run on that many driver threads instead (no Ray started)."""
    if cpus is not None:
        return UNITS_PER_CPU * max(1, cpus)
    ensure_ray(ray_address, num_cpus)
    import ray

    return UNITS_PER_CPU * max(1, int(ray.cluster_resources().get("CPU", 1)))


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

    def __call__(self, row: dict) -> dict:
        unit = WorkUnit(int(row["fragment_id"]), int(row["start"]), int(row["count"]))
        result = export_unit(self.cfg, unit)
        return {"part": result.part, "result": result.to_json()}


class _PackTask:
    """Callable shipped to Ray workers: writes one pack, returns it."""

    def __init__(self, cfg: ExportConfig):
        self.cfg = cfg

    def __call__(self, row: dict) -> dict:
        return {"pack": write_pack(self.cfg, Pack.from_json(row["pack"])).to_json()}


def run_packs(
    cfg: ExportConfig,
    packs: list[Pack],
    *,
    check=lambda: None,
    ray_address: str | None = None,
    num_cpus: int | None = None,
    progress: bool = False,
    on_driver: bool = False,
) -> dict[str, dict[str, int]]:
    """Write every pack; returns {bucket: {pack: samples}} for :func:`finalize`.

    The driver handles one small record per pack (never a sample): a plan, a
    task and a result each. ``on_driver``: threads of the driver whatever the
    size (a job whose units ran there has no Ray to hand the packs to).
    """
    bar = tqdm(total=len(packs), desc="pack", unit="pack", disable=not progress, file=sys.stderr)
    if on_driver or sum(p.nbytes for p in packs) <= DRIVER_PACK_BYTES:
        done = imap_bounded(lambda p: write_pack(cfg, p), packs, DRIVER_PACK_THREADS)
    else:
        ensure_ray(ray_address, num_cpus)
        remote_args: dict = {"num_cpus": 1}
        env = storage_env()
        if env:
            remote_args["runtime_env"] = {"env_vars": env}
        ds = unit_dataset([{"pack": p.to_json()} for p in packs]).map(_PackTask(cfg), **remote_args)
        done = (Pack.from_json(row["pack"]) for row in ds.iter_rows())
    out: dict[str, dict[str, int]] = {}
    for p in done:
        check()
        out.setdefault(p.bucket, {})[p.name] = p.samples
        bar.update(1)
    bar.close()
    if sum(len(v) for v in out.values()) != len(packs):
        raise RuntimeError(f"{len(packs)} packs planned, {sum(map(len, out.values()))} reported")
    return {b: dict(sorted(v.items())) for b, v in sorted(out.items())}


def run_export(
    cfg: ExportConfig,
    *,
    overwrite: bool = False,
    resume: bool = False,
    ray_address: str | None = None,
    num_cpus: int | None = None,
    progress: bool = True,
    drop_lists: tuple[str, ...] = (),
    driver_rows: int = DRIVER_UNIT_ROWS,
) -> ExportReport:
    """Export ``cfg.table`` to bucketed MDS under ``cfg.out`` and return the report.

    The whole run holds the output's lock (:mod:`prx_data.export.lock`): a
    second run or a ``--resume`` on the same ``--out`` is refused meanwhile.
    ``drop_lists`` names skip lists of the tree being overwritten that may be
    left behind because their ids cannot be recovered (any other list is kept).
    A table of at most ``driver_rows`` rows that would get a private local Ray
    runtime runs on threads of this process instead (0: always Ray); the
    export it writes is the same.
    """
    try:
        check_codec(cfg.codec, cfg.resample, cfg.draft_margin)
    except ValueError as e:
        raise ExportError(str(e)) from None
    check_out_location(cfg.out)
    created = not storage.is_remote(cfg.out) and not os.path.exists(cfg.out)
    try:
        with ExportLock(cfg.out) as lock:
            if lock.took_over:
                warnings.warn(f"{cfg.out}: took over {lock.took_over}", UserWarning, stacklevel=2)
            return _run_locked(
                cfg,
                lock,
                overwrite,
                resume,
                ray_address,
                num_cpus,
                progress,
                time.perf_counter(),
                tuple(drop_lists),
                driver_rows,
            )
    except BaseException:
        if created and os.path.isdir(cfg.out) and not os.listdir(cfg.out):
            os.rmdir(cfg.out)  # a refused run leaves no trace
        raise


def _run_locked(
    cfg: ExportConfig,
    lock: ExportLock,
    overwrite: bool,
    resume: bool,
    ray_address: str | None,
    num_cpus: int | None,
    progress: bool,
    t0: float,
    drop_lists: tuple[str, ...] = (),
    driver_rows: int = DRIVER_UNIT_ROWS,
) -> ExportReport:
    from prx_data.skips import lists as idlists

    registry = idlists.Registry.for_table(cfg.table)
    if overwrite and list_top(cfg.out) and not foreign_entries(cfg.out):
        # Before anything is deleted: the old tree's lists go to the table's registry,
        # which the new tree is bound from at the end (a killed run keeps them there).
        try:
            registry.migrate(idlists.collect(cfg.out, drop=drop_lists), cfg.out)
        except idlists.ListError as e:
            raise ExportError(str(e)) from None
    threads = driver_threads(cfg, driver_rows, ray_address, num_cpus)
    # Sized under the lock: starting Ray takes seconds, and a second run must meet the lock first.
    if cfg.min_units is None and not resume:  # a resume keeps the count it started with
        cfg = replace(cfg, min_units=auto_min_units(ray_address, num_cpus, cpus=threads))
    cfg = prepare_output(cfg, overwrite=overwrite, resume=resume)
    units = plan_units(cfg)
    finished = done_parts(cfg.out) if resume else {}
    if resume:  # packs with a marker are kept; half-written ones go with unfinished parts
        remove_stale_parts(cfg.out, set(finished) | done_packs(cfg.out), cfg.tiers)
    todo = [u for u in units if u.part not in finished]
    results: dict[str, UnitResult] = {p: r for p, r in finished.items()}
    if todo:
        if threads:
            done = _units_on_driver(cfg, todo, threads)
        else:
            done = _units_on_ray(cfg, todo, ray_address, num_cpus)
        bar = tqdm(
            total=len(units),
            initial=len(finished),
            desc="write_mds",
            unit="unit",
            disable=not progress,
            file=sys.stderr,
        )
        totals = ProgressTotals.of(results.values())
        for r in done:
            lock.check()
            totals.add(r, replaces=results.get(r.part))
            results[r.part] = r
            bar.update(1)
            bar.set_postfix(totals.postfix())
        bar.close()
    expected = {u.part for u in units}
    missing = expected - set(results)
    if missing:
        raise RuntimeError(f"{len(missing)} work units did not report back: {sorted(missing)[:5]}")
    lock.check()
    ordered = {p: results[p] for p in sorted(expected)}
    packed = None
    if cfg.shard_size > 0:
        packed = run_packs(
            cfg,
            plan_packs(cfg.out, ordered, cfg.shard_size),
            check=lock.check,
            ray_address=ray_address,
            num_cpus=num_cpus,
            progress=progress,
            on_driver=threads is not None,
        )

    def bind_lists() -> dict:
        lock.check()
        try:
            return idlists.sync_lists(cfg.out, registry)
        except idlists.ListError as e:
            raise ExportError(str(e)) from None

    report = finalize(
        cfg, ordered, time.perf_counter() - t0, bind_lists, check=lock.check, packs=packed
    )
    release_table_version(cfg)  # complete: the version it read need not outlive cleanup now
    return report


def driver_threads(
    cfg: ExportConfig, driver_rows: int, ray_address: str | None, num_cpus: int | None
) -> int | None:
    """Threads for running the units on the driver, or None for the Ray path.

    The driver path is for a table of at most ``driver_rows`` rows (read from the
    manifest, before anything is written) that would get a private local Ray runtime;
    it gets one thread per CPU that runtime would have, as Ray would run one unit per CPU.
    """
    if driver_rows <= 0:
        return None
    cpus = local_ray_cpus(ray_address, num_cpus)
    if cpus is None or open_table(cfg.table, cfg.table_version).count_rows() > driver_rows:
        return None
    return cpus


def _units_on_driver(cfg: ExportConfig, todo: list[WorkUnit], threads: int) -> Iterator[UnitResult]:
    """Each unit's :func:`export_unit` on a driver thread, as the Ray path runs it in a task."""
    from prx_data.core.streaming_compat import mds_writer

    mds_writer()  # imported here, once, rather than by several threads at a time
    return imap_bounded(lambda u: export_unit(cfg, u), todo, min(threads, len(todo)))


def _units_on_ray(
    cfg: ExportConfig, todo: list[WorkUnit], ray_address: str | None, num_cpus: int | None
) -> Iterator[UnitResult]:
    """One Ray task per unit (:class:`_ExportTask`), results as they finish."""
    ensure_ray(ray_address, num_cpus)
    ds = unit_dataset([asdict(u) for u in todo])
    remote_args: dict = {"num_cpus": 1}
    env = storage_env()
    if env:  # workers started before these were set would not see them
        remote_args["runtime_env"] = {"env_vars": env}
    ds = ds.map(_ExportTask(cfg), **remote_args)
    return (UnitResult.from_json(row["result"]) for row in ds.iter_rows())
