"""The operations on skip lists: update, sync, carry, snapshot, remove, and their reports.

Every operation that changes an export runs under the export's lease
(:func:`~prx_data.skips.export_state.export_lease`): it records its entries in
the log first (the table's registry, or with ``export_only`` the export's own
log) and then materialises the export from the log read afterwards
(:func:`~prx_data.skips.materialise.materialise`).

**Carrying.** ``write_mds --overwrite`` and ``skips rewrite`` carry the old
tree's export-only entries into the registry, each only where the registry
holds nothing newer for that id (:func:`carry`); a new tree without a registry
gets them as its own entries (:func:`snapshot_local`).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from prx_data.core.lease import Lease
from prx_data.skips import sidecar as SL
from prx_data.skips.errors import ListError
from prx_data.skips.export_state import (
    PENDING_BASE,
    append_local,
    export_entries,
    export_lease,
    read_local,
    read_state,
    read_store_list,
    samples_total,
    store_names,
)
from prx_data.skips.ledger import Ledger
from prx_data.skips.log import (
    ADD,
    EXPORT_ONLY,
    LOG_SCHEMA,
    REGISTRY,
    REMOVE,
    Provenance,
    concat_entries,
    conform_entries,
    latest,
    log_rows,
    state,
    unique_ids,
)
from prx_data.skips.materialise import materialise
from prx_data.skips.recover import import_rows, import_unlogged, unlogged
from prx_data.skips.which import resolve

#: A list that leaves out more than this share of an export is reported with a warning.
WARN_SHARE = 0.10
#: Lists that name samples of one tree, not rows of the table (``write_mds --append``'s:
#: rows deleted since, and old samples of rows exported again). Never carried into the
#: registry nor into another tree: a tree written afresh holds no such sample.
TREE_LISTS = frozenset({"deleted", "replaced"})


@dataclass
class ListUpdate:
    """What one add / remove / replace did."""

    name: str
    export: str
    ids_requested: int
    #: Ids the list holds afterwards in this export.
    ids_in_list: int
    #: Requested ids that are in no manifest of this export (kept in the list all the same).
    ids_not_in_export: int
    missing_ids: list[str]
    shards_written: int
    samples_listed: int
    stale_sidecars_removed: int = 0
    #: The registry the update was recorded in (None: only this export).
    registry: str | None = None
    registry_changes: dict[str, int] = field(default_factory=dict)
    #: Share of the export's samples the list leaves out, and the warning above WARN_SHARE.
    share: float = 0.0
    warning: str | None = None


def _view(root: str, reg: Ledger | None, name: str) -> pa.Array:
    """The ids list ``name`` holds for this export now (the log's state)."""
    entries, _ = export_entries(root, reg, [name])
    t = state(entries).get(name)
    return t["id"].combine_chunks() if t is not None else pa.array([], pa.string())


def _quiet_resolve(root: str) -> Ledger | None:
    try:
        return resolve(root, strict=False)
    except ListError:
        return None


def _change_rows(
    name: str, ids: pa.Array, mode: str, have: pa.Array, prov: Provenance, **kw
) -> pa.Table:
    """Entries that make the list ``mode`` ``ids`` given what it holds (``have``)."""
    if mode == "add":
        return log_rows(name, ids, ADD, prov, **kw)
    if mode == "remove":
        return log_rows(name, ids, REMOVE, prov, **kw)
    gone = have.filter(pc.invert(pc.is_in(have, value_set=ids)))
    return concat_entries(
        [log_rows(name, gone, REMOVE, prov, **kw), log_rows(name, ids, ADD, prov, **kw)]
    )


def update_list(
    root: str,
    name: str,
    ids: Iterable[str] | pa.Array | None,
    prov: Provenance,
    *,
    mode: str = "add",
    table: str | None = None,
    ledger: str | None = None,
    export_only: bool = False,
    registry: Ledger | None = None,
    keys: pa.Table | None = None,
) -> ListUpdate:
    """Add ids to / remove ids from / replace the list ``name``, then materialise the export.

    ``mode="remove"`` with ``ids=None`` removes the whole list (every id it
    holds for this export). Everything happens under the export's lease: the
    entry goes to the ledger (or, ``export_only``, to the export's own log),
    and the export's lists are materialised from the log read afterwards.
    ``keys`` (``id``, ``sha256``, ``phash``): the added ids are opt-outs with these
    content keys (:mod:`prx_data.skips.content`), applied by every later export.
    """
    SL.validate_name(name)
    if mode not in ("add", "remove", "replace"):
        raise ValueError(f"unknown mode {mode!r}")
    whole = ids is None
    req = None if whole else unique_ids(ids)
    with export_lease(root) as lease:
        reg = registry
        if reg is None:
            reg = resolve(root, table, ledger=ledger, export_only=export_only)
        view = reg if reg is not None else _quiet_resolve(root)  # what materialises the export
        import_unlogged(root, lease)
        # A registry entry is based on its own commit; an export-only one on the registry
        # position this export has seen (its order against later registry entries).
        seen: int | None = None
        if reg is None:
            # Out of reach: newer than everything until the export meets its ledger again.
            seen = view.head() if view is not None else PENDING_BASE

        def rows(seq: int) -> pa.Table:
            # What the list holds (under the lease) matters only to a whole-list remove and
            # a replace; an add or a remove of given ids is its entries alone.
            needs = whole or mode == "replace"
            have = _view(root, reg if reg is not None else view, name) if needs else req
            return _change_rows(
                name,
                have if whole else req,
                mode,
                have,
                prov,
                seq=seq,
                base=seq if seen is None else seen,
                kind=REGISTRY if reg is not None else EXPORT_ONLY,
                export=root,
                keys=keys if mode == "add" else None,
            )

        if reg is not None:
            changes = {"seq": reg.append(rows)}
        else:
            changes = {"local_seq": append_local(root, lease, rows)}
        lost: dict[str, pa.Array] = {}
        done = materialise(root, view, lease, names=[name], missing=lost)
        missing: list[str] = []
        if mode != "remove" and req is not None and len(req) and name in lost:
            missing = lost[name].filter(pc.is_in(lost[name], value_set=req)).to_pylist()
    requested = 0 if req is None else len(req)
    r = done.get(name, {"ids": 0, "samples": 0, "shards": 0, "share": 0.0})
    return ListUpdate(
        name=name,
        export=root,
        ids_requested=requested,
        ids_in_list=r["ids"],
        ids_not_in_export=len(missing),
        missing_ids=missing,
        shards_written=r["shards"],
        samples_listed=r["samples"],
        registry=reg.uri if reg is not None else None,
        registry_changes=changes,
        share=r["share"],
        warning=share_warning(name, r["share"], root),
    )


def sync(
    root: str, table: str | None = None, *, ledger: str | None = None, drop: Iterable[str] = ()
) -> dict[str, dict]:
    """Materialise every list of the export from the log (``skips sync``); idempotent.

    Reads the log after taking the export's lease. A list the log emptied
    leaves the export in every form (store and sidecars).
    """
    with export_lease(root) as lease:
        reg = resolve(root, table, ledger=ledger, strict=bool(table or ledger))
        import_unlogged(root, lease, drop)
        return materialise(root, reg, lease, full=True)


def carry(src: str, reg: Ledger, *, drop: Iterable[str] = ()) -> int:
    """Record ``src``'s export-only entries (and lists the log does not hold yet) in ``reg``,
    each where the registry holds nothing newer for that id. Returns the entries carried."""
    found = unlogged(src, read_state(src), drop)
    local = concat_entries([read_local(src), import_rows(found, 0, src) if found else None])
    drop = set(drop) | TREE_LISTS
    if drop:
        local = local.filter(pc.invert(pc.is_in(local["list"], value_set=pa.array(sorted(drop)))))
    last = latest(local)
    if not len(last):
        return 0
    names = sorted(pc.unique(last["list"]).to_pylist())
    counted: dict[str, int] = {}

    def make(seq: int) -> pa.Table:
        theirs = latest(reg.entries(names)).select(["list", "id", "seq"])
        theirs = theirs.rename_columns(["list", "id", "rseq"])
        j = last.join(theirs, keys=["list", "id"], join_type="left outer")
        newer = j.filter(pc.or_kleene(pc.is_null(j["rseq"]), pc.less_equal(j["rseq"], j["base"])))
        n = len(newer)
        out = newer.drop_columns(["rseq"])
        for col, val in (("seq", seq), ("base", seq)):
            out = out.set_column(out.schema.get_field_index(col), col, pa.array(np.full(n, val)))
        kind = pa.array(np.full(n, REGISTRY, np.int8))
        out = out.set_column(out.schema.get_field_index("kind"), "kind", kind)
        counted["n"] = n
        return conform_entries(out)

    reg.append(make)
    return counted.get("n", 0)


def snapshot_local(src: str, dst: str, lease: Lease, *, drop: Iterable[str] = ()) -> None:
    """Give ``dst`` (a new tree without a registry) ``src``'s lists as its own entries."""
    entries, _ = export_entries(src, None, None)
    found = unlogged(src, read_state(src), drop)
    lists = state(concat_entries([entries, import_rows(found, 0, src) if found else None]))
    lists = {n: t for n, t in lists.items() if n not in set(drop) | TREE_LISTS}
    if lists:
        append_local(dst, lease, lambda seq: import_rows(lists, seq, src))


def record_tree_changes(
    root: str,
    lease: Lease,
    reg: Ledger | None,
    changes: Mapping[str, tuple[pa.Array, pa.Array]],
    prov: Provenance,
) -> int:
    """Record ``{list: (ids added, ids removed)}`` as the export's own entries, under the
    export's ``lease`` that the caller holds (``write_mds --append``'s :data:`TREE_LISTS`).

    Only the log changes here; the caller materialises the export afterwards. Returns
    the export-only log's new position.
    """
    base = reg.head() if reg is not None else PENDING_BASE

    def rows(seq: int) -> pa.Table:
        out = []
        for name, (add, remove) in sorted(changes.items()):
            SL.validate_name(name)
            for ids, op in ((remove, REMOVE), (add, ADD)):
                if len(ids):
                    kw = dict(seq=seq, base=base, kind=EXPORT_ONLY, export=root)
                    out.append(log_rows(name, unique_ids(ids), op, prov, **kw))
        return concat_entries(out)

    return append_local(root, lease, rows)


def remove_list(reg: Ledger, name: str, prov: Provenance) -> int:
    """Remove every id of list ``name`` from the registry (``write_mds --drop-list``)."""
    SL.validate_name(name)

    def make(seq: int) -> pa.Table:
        t = reg.state([name]).get(name)
        if t is None:
            return LOG_SCHEMA.empty_table()
        return log_rows(name, t["id"], REMOVE, prov, seq=seq, base=seq, kind=REGISTRY, export="")

    return reg.append(make)


def lists_of(root: str, reg: Ledger | None, *, drop: Iterable[str] = ()) -> dict[str, pa.Table]:
    """{list: ids} the export holds by the log's state, with lists the log does not hold yet
    (raises :class:`UncarriableList` for one whose ids cannot be recovered, unless dropped)."""
    entries, _ = export_entries(root, reg, None)
    found = unlogged(root, read_state(root), drop)
    lists = state(concat_entries([entries, import_rows(found, 0, root) if found else None]))
    return {n: t for n, t in lists.items() if n not in set(drop)}


def list_ids(root: str, name: str, *, export_only: bool = False) -> pa.Array:
    """Every id list ``name`` holds for the export (its log's state)."""
    return _view(root, None if export_only else _quiet_resolve(root), name)


def lists_text(lists: Mapping[str, Mapping]) -> list[str]:
    out = []
    for n, v in lists.items():
        line = f"  {n}: {v['ids']:,} ids, {v['samples']:,} samples skipped in {v['shards']} shards"
        if "share" in v:
            line += f" ({100 * v['share']:.1f}% of the export; from {v.get('source') or '?'})"
        out.append(line)
    return out


# --- reports --------------------------------------------------------------------------------


def applied(root: str) -> dict[str, dict]:
    """{list: {ids, samples, share, source}} of every list the export holds now."""
    st = read_state(root)
    total = samples_total(root)
    out = {}
    stats = SL.skip_stats(root)
    for n in store_names(root):
        t = read_store_list(root, n)
        samples = sum(r.skipped for r in stats.get(n, []))
        out[n] = {
            "ids": 0 if t is None else len(t),
            "samples": samples,
            "share": samples / total if total else 0.0,
            "source": (st.lists.get(n, "") if st is not None else "") or "sidecars",
        }
    return out


def share_warning(name: str, share: float, root: str) -> str | None:
    """The warning for a list that leaves out more than :data:`WARN_SHARE` of an export."""
    if share <= WARN_SHARE:
        return None
    return (
        f"warning: list {name!r} leaves out {100 * share:.1f}% of {root} (above "
        f"{100 * WARN_SHARE:.0f}%); if it came from a trial, undo it with: python -m "
        f"prx_data.skips remove {root} {name}"
    )


__all__ = [
    "ListUpdate",
    "WARN_SHARE",
    "applied",
    "carry",
    "list_ids",
    "lists_of",
    "lists_text",
    "optouts_present",
    "remove_list",
    "share_warning",
    "snapshot_local",
    "sync",
    "update_list",
]


def optouts_present(root: str, reg: Ledger | None = None) -> dict[str, int] | None:
    """{opt-out list: its samples still physically in the export's shards} (hidden by
    sidecars, not yet purged); None when the export's ledger is not reachable.

    An export written after an opt-out holds none of its samples (the write-time
    filter); one written before holds them until ``skips rewrite --purge-optouts``.
    """
    from prx_data.skips.bind import bind

    if reg is None:
        try:
            reg = resolve(root, strict=False)
        except ListError:
            return None
        if reg is None:
            return None
    t = reg.optout_entries()
    if not len(t):
        return {}
    lists = {
        n: t.filter(pc.equal(t["list"], n))["id"].combine_chunks()
        for n in sorted(pc.unique(t["list"]).to_pylist())
    }
    return {n: b.samples for n, b in bind(root, lists).items()}
