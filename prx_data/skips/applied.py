"""Which samples a rewrite leaves out, and the lists it carries to the new export.

Before anything is written, every list is read as the ledger's state (one
that cannot be recovered refuses, naming it) and the lists the rewrite
applies are bound to shard positions: their sidecars, and every id the
ledger holds for them that the sidecars do not hold yet. After the packs,
every other list is re-bound by row id to the new shards under the new
export's lease. :mod:`prx_data.skips.rewrite` plans with the first and calls
the second; neither reads or writes a shard.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from prx_data.export import layout
from prx_data.export.append import DELETED_LIST, REPLACED_LIST
from prx_data.skips import sidecar as skiplist
from prx_data.skips.bind import bind
from prx_data.skips.errors import ListError
from prx_data.skips.export_state import export_lease
from prx_data.skips.materialise import materialise
from prx_data.skips.ops import carry, lists_of, snapshot_local
from prx_data.skips.which import resolve


@dataclass(frozen=True)
class Applied:
    """The lists a rewrite applies and the positions they skip; ``reg``: the ledger followed."""

    #: {bucket: {shard basename: sorted skipped indices}}
    skips_of: dict
    names: frozenset
    reg: object | None
    #: Only the user's --table/--ledger lets what a (possibly received) export holds be
    #: written into a ledger; otherwise the ledger is read, and the old export's own
    #: entries stay the new export's own.
    trusted: bool


def resolve_applied(
    root: str,
    buckets: Sequence[str],
    names: Sequence[str] | None,
    table: str | None,
    ledger: str | None,
    drop_lists: Sequence[str],
) -> Applied:
    """The positions the lists ``names`` (all by default) skip in each bucket of ``root``.

    An append's ``deleted`` and ``replaced`` lists are always applied: they are the
    export's own (never carried to the ledger or to ``out``), so a sample they hide that
    a rewrite kept would stream again.
    """
    if names is not None:
        names = sorted(set(names) | {DELETED_LIST, REPLACED_LIST})
    trusted = bool(table or ledger)
    try:
        reg = resolve(root, table, ledger=ledger) if trusted else resolve(root)
    except ListError:
        if trusted:
            raise
        reg = None  # the ledger is not found from here: the new export's lists are its own
    # Every list as the log's state, before anything is written: one that cannot be recovered
    # (a corrupt sidecar of a list the log does not hold) refuses.
    carried = lists_of(root, reg, drop=drop_lists)
    known = set(carried)
    skips_of: dict[str, dict] = {}
    applied: set[str] = set()
    for bucket in buckets:
        shards = layout.read_index(root, bucket, export_columns=layout.export_columns(root))
        listing = skiplist.list_sidecars(root, bucket, shards)
        known |= set(listing)
        applied |= set(listing) if names is None else set(names) & set(listing)
        skips_of[bucket] = skiplist.load_skips(root, bucket, shards, names, listing=listing)
    applied |= known if names is None else set(names) & known
    # An applied list leaves with all its ids, also those its sidecars do not hold yet.
    extra = bind(
        root,
        {n: carried[n]["id"].combine_chunks() for n in sorted(applied) if n in carried},
    )
    for b in extra.values():
        for (bk, shard), idx in b.positions.items():
            skips = skips_of.get(bk)
            if skips is not None:
                old = skips.get(shard)
                skips[shard] = idx if old is None else np.union1d(old, idx)
    return Applied(skips_of, frozenset(applied), reg, trusted)


def carry_lists(root: str, out: str, applied: Applied, drop_lists: Sequence[str]) -> dict:
    """Re-bind every list not applied to ``out`` (after its id index); returns those carried.

    The source's export-only entries go to the registry where newer (a trusted
    ledger), else they become the new export's own; then the log is materialised.
    """
    reg = applied.reg
    with export_lease(out) as lease:
        if reg is not None and applied.trusted:
            carry(root, reg, drop=drop_lists)
        else:
            snapshot_local(root, out, lease, drop=drop_lists)
        done = materialise(out, reg, lease, full=True)
    return {n: v for n, v in done.items() if n not in applied.names}
