"""Lists the log does not hold yet, recovered as ids and imported into the log.

A list held only in sidecars (written before lists had a store, or by the
sidecar writer alone) or in a store written before the log existed is
recovered as ids (:func:`collect`: store ∪ what its sidecars skip, the
sidecars turned into ids through the manifests) and imported as export-only
adds with ``base = -1`` (:func:`import_unlogged`): older than every registry
entry, so the log decides wherever it holds anything about an id.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Mapping

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from prx_data.core import storage
from prx_data.core.lease import Lease
from prx_data.export import layout, safety
from prx_data.skips import sidecar as SL
from prx_data.skips.bind import ids_at
from prx_data.skips.errors import ListError, UncarriableList
from prx_data.skips.export_state import (
    STATE_FORMAT,
    ExportState,
    append_local,
    read_local,
    read_state,
    read_store_list,
    sidecar_names,
    store_names,
)
from prx_data.skips.log import (
    ADD,
    EXPORT_ONLY,
    Provenance,
    concat_entries,
    log_rows,
    merge_store,
    store_table,
)

log = logging.getLogger(__name__)


def unlogged(root: str, st: ExportState | None, drop=()) -> dict[str, pa.Table]:
    """Lists the log does not know: held only in sidecars, or in a store from before the log."""
    if not storage.exists(root):
        return {}
    local_lists = set(pc.unique(read_local(root)["list"]).to_pylist())
    forms = sidecar_names(root)
    if st is None or st.format != STATE_FORMAT:
        forms |= set(store_names(root))
        known: set[str] = set()
    else:
        known = set(st.lists)  # a materialised export's stores are derived, not a source
    unknown = forms - known - local_lists - set(drop)
    if not unknown:
        return {}
    found = collect(root, drop=set(drop) | (forms - unknown))
    return {n: t for n, t in sorted(found.items()) if n in unknown and len(t)}


def import_rows(found: Mapping[str, pa.Table], seq: int, root: str) -> pa.Table:
    return concat_entries(
        [
            log_rows(n, t["id"], ADD, t, seq=seq, base=-1, kind=EXPORT_ONLY, export=root)
            for n, t in sorted(found.items())
        ]
    )


def import_unlogged(root: str, lease: Lease, drop=()) -> int:
    """Record lists the log does not know as export-only adds with ``base = -1``: older than
    every registry entry, so the log decides wherever it holds anything about an id."""
    found = unlogged(root, read_state(root), drop)
    if found:
        append_local(root, lease, lambda seq: import_rows(found, seq, root))
        log.warning("%s: recorded list(s) the log did not hold yet: %s", root, sorted(found))
    return len(found)


def collect(root: str, *, drop: Iterable[str] = ()) -> dict[str, pa.Table]:
    """Every list of the tree at ``root`` as ids (store ∪ what its sidecars skip).

    A list with sidecars and no store (written before lists had one, or by the
    sidecar writer alone) is turned into ids through the manifests. A list
    whose ids cannot be recovered (unreadable store, stale or corrupt sidecar,
    missing manifest) raises :class:`UncarriableList` naming it, unless it is
    in ``drop``.
    """
    drop = {SL.validate_name(n) for n in drop}
    out: dict[str, pa.Table] = {}
    problems: dict[str, str] = {}
    for n in store_names(root):
        if n in drop:
            continue
        try:
            t = read_store_list(root, n)
        except ListError as e:
            problems[n] = str(e)
            continue
        if t is not None:
            out[n] = t
    # Lists as the loader sees them: the sidecars.
    per_list: dict[str, dict[tuple[str, str], np.ndarray]] = {}
    buckets = layout.list_buckets(root) if storage.exists(root) else []
    for bucket in buckets:
        shards = layout.read_index(root, bucket)
        listing = SL.list_sidecars(root, bucket, shards)
        for n in listing:
            if n in drop or n in problems:
                continue
            try:
                skips = SL.load_skips(root, bucket, shards, [n], listing=listing)
            except SL.SkipListError as e:
                problems[n] = str(e)
                continue
            for shard, idx in skips.items():
                per_list.setdefault(n, {})[(bucket, shard)] = idx
    ctime = _sidecar_provenance(root)
    for n, positions in sorted(per_list.items()):
        if n in problems:
            continue
        try:
            ids = ids_at(root, positions)
        except (ListError, KeyError, IndexError, safety.UnsafeIndexError) as e:
            problems[n] = str(e)
            continue
        have = out.get(n)
        if have is None:
            extra = ids
        else:
            extra = ids.filter(pc.invert(pc.is_in(ids, value_set=have["id"].combine_chunks())))
        if len(extra):
            out[n] = merge_store(have, store_table(extra, ctime))
    if problems:
        raise UncarriableList(root, problems)
    return dict(sorted(out.items()))


def _sidecar_provenance(root: str) -> Provenance:
    return Provenance(command="sidecars", reason=f"recovered from the sidecars of {root}")


__all__ = [
    "collect",
    "import_rows",
    "import_unlogged",
    "unlogged",
]
