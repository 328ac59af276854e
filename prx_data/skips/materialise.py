"""The materialisation: an export's lists made the state of the log, in every form.

An export's ``_lists/<name>.parquet`` (the ids) and its ``.skip`` sidecars (the
ids bound to sample positions through the export's id index) are a function of
the log up to a position recorded in ``_lists/registry`` (``position``: the
registry version; ``local``: the last export-only seq;
:mod:`prx_data.skips.export_state`). :func:`materialise` runs under the
export's lease and reads the log *after* taking it, so two of them, or one and
a list update, cannot interleave; it is idempotent and rewrites or deletes every
form of each list it touches (store file and sidecars), so a list the log
emptied stops being skipped everywhere.

A touched list is brought forward from the entries after the recorded position
alone when that position is a known prefix of the log (:func:`_delta_lists`,
:func:`_apply_changes`, :func:`_patch_sidecars`), else rebound whole from the
log (:func:`_rebind`). This module holds the only writer of sidecars
(:func:`_write_positions`); :mod:`prx_data.skips.sidecar` is their format and
readers.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from prx_data.core import confined, storage
from prx_data.core.errors import OutOfRange, UnknownName
from prx_data.core.lease import Lease
from prx_data.export import bounded, layout
from prx_data.skips import sidecar as SL
from prx_data.skips.bind import bind
from prx_data.skips.errors import ListError
from prx_data.skips.export_state import (
    STATE_FORMAT,
    ExportState,
    export_entries,
    read_local,
    read_state,
    read_store_file,
    rebase_local,
    samples_total,
    sidecar_names,
    state_for,
    store_names,
    write_state,
    write_store_list,
)
from prx_data.skips.ledger import Ledger
from prx_data.skips.log import (
    ADD,
    REMOVE,
    STORE_FILE_SCHEMA,
    concat_entries,
    latest,
    source_text,
    state,
    store_rows,
)

log = logging.getLogger(__name__)


def materialise(
    root: str,
    reg: Ledger | None,
    lease: Lease,
    *,
    names: Iterable[str] | None = None,
    full: bool = False,
    missing: dict[str, pa.Array] | None = None,
) -> dict[str, dict]:
    """Make the export's lists the state of the log (registry up to its head, and the export's
    own entries); the export's ``lease`` must be held. Touches the lists changed since the
    recorded position, ``names``, and (``full``) every list. Returns
    ``{list: {ids, samples, shards, share, source}}`` for the lists it wrote.

    A touched list is updated from the entries after the recorded position alone (only
    those ids are bound, only their shards' sidecars rewritten) when that position is a
    known prefix of the log (:func:`_delta_lists`); otherwise, and with ``full``, it is
    rebound whole from the log.
    """
    old = read_state(root)
    old = old if old is not None and old.format == STATE_FORMAT else None
    if reg is not None:
        rebase_local(root, lease, reg, old)
    st = state_for(root, reg) if reg is not None else (old or ExportState())
    if reg is not None:
        head, log_id = reg.position()
    else:
        head, log_id = st.position, st.log_id
    local = read_local(root)
    local_seq = int(pc.max(local["seq"]).as_py() or 0) if len(local) else 0
    if full or (not st.lists and not names):
        touched = None
    else:
        touched = set(names or ())
        if reg is not None:
            touched |= reg.touched(st.position, head)
        if local_seq > st.local:
            newer = local.filter(pc.greater(local["seq"], st.local))
            touched |= set(pc.unique(newer["list"]).to_pylist())
    delta = _delta_lists(old, reg, head, log_id, local, touched)
    if old is not None and (touched is None or touched):
        lease.check()
        write_state(root, old.copy(dirty=True))  # cleared by the last write below
    total = old.total if delta and old is not None and old.total is not None else None
    total = samples_total(root) if total is None else total
    report: dict[str, dict] = {}
    rebind = None if touched is None else touched - delta
    if delta:
        done, failed = _apply_changes(
            root, reg, lease, old, st, head, local, delta, set(names or ()), missing, total
        )
        report.update(done)
        rebind = (rebind or set()) | failed
    if rebind is None or rebind:
        report.update(_rebind(root, reg, lease, st, head, rebind, names, missing, total))
    st.position, st.local = head, max(st.local, local_seq)
    st.log_id, st.total, st.dirty = log_id, total, False
    st.counts = {n: c for n, c in st.counts.items() if n in st.lists}
    lease.check()
    write_state(root, st)
    return report


def _delta_lists(
    old: ExportState | None,
    reg: Ledger | None,
    head: int,
    log_id: str | None,
    local: pa.Table,
    touched: set[str] | None,
) -> set[str]:
    """The touched lists whose materialised form can be brought to ``head`` from the entries
    after the recorded position alone.

    That holds when every such entry is ordered after every entry the forms already
    reflect: registry entries after ``position`` are (their ``base`` is their commit), and
    export-only entries after ``local`` are when their ``base`` is at least ``position``
    and the earlier ones' at most (an import of an unlogged list has ``base = -1``: it is
    older than the registry, so that list is rebound). Everything is rebound when the
    position is not a known prefix of this log (no state, another table, another log
    identity, a position past the head), or a materialisation was interrupted (``dirty``).
    """
    if touched is None or old is None or old.dirty or old.total is None:
        return set()
    p = old.position
    if reg is not None and (
        old.table_id != reg.table_id or not log_id or old.log_id != log_id or p > head
    ):
        return set()
    bad: set[str] = set()
    if len(local):
        seq, base = local["seq"], local["base"]
        early = pc.and_(pc.less_equal(seq, old.local), pc.greater(base, p))
        late = pc.and_(pc.greater(seq, old.local), pc.less(base, p))
        bad = set(pc.unique(local.filter(pc.or_(early, late))["list"]).to_pylist())
    return {n for n in touched - bad if n not in old.lists or n in old.counts}


def _apply_changes(
    root: str,
    reg: Ledger | None,
    lease: Lease,
    old: ExportState,
    st: ExportState,
    head: int,
    local: pa.Table,
    names: set[str],
    asked: set[str],
    missing: dict[str, pa.Array] | None,
    total: int,
) -> tuple[dict[str, dict], set[str]]:
    """Bring ``names`` from the recorded position to ``head`` by their entries since then.

    Returns (report rows, lists that could not be updated so and must be rebound: a store
    without kinds, a sidecar that does not match its shard)."""
    got = [reg.entries(names, upto=head, after=old.position)] if reg is not None and head else []
    mine = local.filter(
        pc.and_(
            pc.greater(local["seq"], old.local),
            pc.is_in(local["list"], value_set=pa.array(sorted(names), pa.string())),
        )
    )
    last = latest(concat_entries([*got, mine]))
    changes = {n: last.filter(pc.equal(last["list"], n)) for n in names} if len(last) else {}
    keys: dict[str, pa.Array] = {}
    for n, c in changes.items():
        keys[f"+{n}"] = c.filter(pc.equal(c["op"], ADD))["id"].combine_chunks()
        keys[f"-{n}"] = c.filter(pc.equal(c["op"], REMOVE))["id"].combine_chunks()
    want = [f"+{n}" for n in sorted(asked & set(changes))] if missing is not None else []
    bound = bind(root, keys, want_missing=want)
    report: dict[str, dict] = {}
    failed: set[str] = set()
    for n in sorted(names):
        c = changes.get(n)
        if c is None or not len(c):
            if n in old.lists:
                report[n] = _report_row(old.counts[n], total, old.lists[n])
            continue
        have = STORE_FILE_SCHEMA.empty_table()
        if n in old.lists:
            have = read_store_file(root, n)
            if have is None:
                failed.add(n)
                continue
        keep = have.filter(pc.invert(pc.is_in(have["id"], value_set=c["id"].combine_chunks())))
        adds = c.filter(pc.equal(c["op"], ADD))
        new = pa.concat_tables([keep, store_rows(adds, STORE_FILE_SCHEMA)]).sort_by("id")
        lease.check()  # fenced: nothing is written after the lease was lost
        try:
            d_samples, d_shards = _patch_sidecars(
                root, n, bound[f"+{n}"].positions, bound[f"-{n}"].positions, lease
            )
        except SL.SkipListError as e:
            log.warning("%s: list %r is rebound whole (%s)", root, n, e)
            failed.add(n)
            continue
        write_store_list(root, n, new)
        if want and f"+{n}" in want and bound[f"+{n}"].missing is not None:
            missing[n] = bound[f"+{n}"].missing
        was = old.counts.get(n, {"ids": 0, "samples": 0, "shards": 0})
        if not len(new):
            st.lists.pop(n, None)
            st.counts.pop(n, None)
            continue
        st.lists[n] = source_text(pc.unique(new["kind"]).to_pylist())
        st.counts[n] = {
            "ids": len(new),
            "samples": was["samples"] + d_samples,
            "shards": was["shards"] + d_shards,
        }
        report[n] = _report_row(st.counts[n], total, st.lists[n])
    return report, failed


def _report_row(counts: Mapping[str, int], total: int, source: str) -> dict:
    return {
        "ids": counts["ids"],
        "samples": counts["samples"],
        "shards": counts["shards"],
        "share": round(counts["samples"] / total, 6) if total else 0.0,
        "source": source,
    }


def _patch_sidecars(
    root: str,
    name: str,
    add: Mapping[tuple[str, str], np.ndarray],
    remove: Mapping[tuple[str, str], np.ndarray],
    lease: Lease,
) -> tuple[int, int]:
    """Add and remove sample positions in the list's sidecars of those shards only.

    Returns (change in samples skipped, change in shards with a sidecar)."""
    indexes: dict[str, dict[str, layout.ShardInfo]] = {}
    positions: dict[tuple[str, str], np.ndarray] = {}
    existing: set[tuple[str, str]] = set()
    d_samples = d_shards = 0
    for key in sorted(set(add) | set(remove)):
        bucket, shard = key
        if bucket not in indexes:
            indexes[bucket] = {s.basename: s for s in layout.read_index(root, bucket)}
        try:
            was = SL.read_sidecar(root, bucket, indexes[bucket][shard], name).indices
            was = was.astype(np.int64)
            existing.add(key)
        except FileNotFoundError:
            was = np.zeros(0, np.int64)
        now = np.setdiff1d(was, remove.get(key, np.zeros(0, np.int64)))
        now = np.union1d(now, add.get(key, np.zeros(0, np.int64)))
        positions[key] = now
        d_samples += len(now) - len(was)
        d_shards += int(len(now) > 0) - int(len(was) > 0)
    lease.check()
    _write_positions(root, name, positions, replace=True, existing=existing)
    return d_samples, d_shards


def _rebind(
    root: str,
    reg: Ledger | None,
    lease: Lease,
    st: ExportState,
    head: int,
    names: set[str] | None,
    asked: Iterable[str] | None,
    missing: dict[str, pa.Array] | None,
    total: int,
) -> dict[str, dict]:
    """Rebind ``names`` (None: every list any form of the export holds) whole from the log."""
    entries, _ = export_entries(root, reg, names, upto=head)
    lists = state(entries, kinds=True)
    if names is None:
        # Every list any form of the export holds: those the log emptied are cleared.
        names = set(lists) | set(st.lists) | set(store_names(root)) | sidecar_names(root)
    want = sorted(set(asked or ()) & set(lists)) if missing is not None else []
    bound = bind(root, {n: t["id"].combine_chunks() for n, t in lists.items()}, want_missing=want)
    if missing is not None:
        missing.update({n: bound[n].missing for n in want if bound[n].missing is not None})
    report: dict[str, dict] = {}
    for n in sorted(names):
        lease.check()  # fenced: nothing is written after the lease was lost
        t = lists.get(n)
        write_store_list(root, n, t)
        positions = bound[n].positions if t is not None else {}
        w = _write_sidecars(root, n, positions, replace=True, lock=lease)
        if t is None:
            st.lists.pop(n, None)
            st.counts.pop(n, None)
            continue
        st.lists[n] = source_text(pc.unique(t["kind"]).to_pylist())
        st.counts[n] = {"ids": len(t), "samples": bound[n].samples, "shards": w["shards_written"]}
        report[n] = _report_row(st.counts[n], total, st.lists[n])
    return report


# --- the sidecars ---------------------------------------------------------------------------


@dataclass
class SidecarWrite:
    """What one write of a list's sidecars did."""

    name: str
    shards_written: int = 0
    samples_listed: int = 0


def _write_sidecars(
    root: str,
    name: str,
    positions: Mapping[tuple[str, str], np.ndarray],
    *,
    replace: bool,
    lock: Lease | None = None,
) -> dict[str, int]:
    """Write the list's sidecars; ``replace`` also deletes its sidecars on other shards."""
    if lock is not None:
        lock.check()
    res = _write_positions(root, name, positions, replace=replace)
    stale = 0
    if replace:
        paths = []
        for bucket in layout.list_buckets(root):
            shards = layout.read_index(root, bucket)
            for shard in SL.list_sidecars(root, bucket, shards).get(name, []):
                if (bucket, shard) not in positions:
                    paths.append(
                        layout.rel_join(root, f"{bucket}/{SL.sidecar_basename(shard, name)}")
                    )
        bounded.map_io(storage.delete, paths, storage.is_remote(root))
        stale = len(paths)
    return {
        "shards_written": res.shards_written,
        "samples_listed": res.samples_listed,
        "stale": stale,
    }


def _write_positions(
    export_root: str,
    name: str,
    skips: Mapping[tuple[str, str], Iterable[int]],
    *,
    replace: bool = False,
    existing: set[tuple[str, str]] | None = None,
) -> SidecarWrite:
    """Write sample indices ``{(bucket, shard basename): indices}`` into the list's sidecars.

    The one writer of sidecars: the caller holds the export's lease and is the log's
    materialisation. Indices are merged with an existing sidecar of the same name (the same
    indices again rewrite identical bytes); ``replace=True`` overwrites the given shards'
    sidecars instead (an empty set removes the shard from the list). Everything is validated
    before anything is written, and writes are confined to the export. ``existing``: the
    given shards that have a sidecar of the list, when the caller knows (saves listing
    their buckets)."""
    SL.validate_name(name)
    result = SidecarWrite(name)
    by_bucket: dict[str, dict[str, list]] = {}
    for (bucket, shard), idx in skips.items():
        by_bucket.setdefault(bucket, {}).setdefault(shard, []).append(
            np.asarray(idx if isinstance(idx, np.ndarray) else list(idx), np.int64)
        )
    remote = storage.is_remote(export_root)
    box = confined.confined(export_root)
    # Validate everything first, so bad input writes nothing.
    jobs = []
    for bucket, per_shard in sorted(by_bucket.items()):
        shards = {s.basename: s for s in layout.read_index(export_root, bucket)}
        if existing is None:
            have = set(SL.list_sidecars(export_root, bucket, list(shards.values())).get(name, []))
        else:
            have = {s for b, s in existing if b == bucket}
        for base, arrs in sorted(per_shard.items()):
            if base not in shards:
                raise UnknownName(
                    f"shard {base!r} is not in the index of bucket {bucket!r} under {export_root}"
                )
            info = shards[base]
            target = layout.rel_join(export_root, f"{bucket}/{SL.sidecar_basename(base, name)}")
            if not remote and os.path.isdir(target):  # one stat: never a traceback mid-write
                raise ListError(
                    f"{target}: a directory where the sidecar file belongs; remove or rename it"
                )
            idx = np.unique(np.concatenate(arrs)) if arrs else np.zeros(0, np.int64)
            if len(idx) and (idx[0] < 0 or idx[-1] >= info.samples):
                bad = int(idx[-1] if idx[-1] >= info.samples else idx[0])
                raise OutOfRange(
                    f"{bucket}/{base}: sample index {bad} is outside 0..{info.samples - 1}"
                )
            jobs.append((bucket, info, idx, base in have))

    def write(job) -> int:
        bucket, info, idx, has_old = job
        path = layout.rel_join(export_root, f"{bucket}/{SL.sidecar_basename(info.basename, name)}")
        if has_old and not replace:
            old = SL.read_sidecar(export_root, bucket, info, name).indices.astype(np.int64)
            idx = np.union1d(old, idx)
        # Writes are confined to the export like reads: never through a link out of it.
        if not len(idx):
            if has_old:  # replace with nothing: the shard leaves the list
                box.delete(path)
            return 0
        box.write_atomic(path, SL.SkipList(name, info, idx.astype(np.uint32)).to_bytes())
        return len(idx)

    for n in bounded.map_io(write, jobs, remote):
        result.shards_written += bool(n)
        result.samples_listed += n
    return result


__all__ = [
    "materialise",
]
