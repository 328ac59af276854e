"""Which ledger an export follows: the one place that answers it, for every list command.

An export records the corpus ledger it follows (:mod:`prx_data.skips.ledger`):
its identity and where it lives (relative to the export first, then absolute).
``--ledger`` (or ``--table``, whose folder's ledger it names) must be that ledger;
a recorded ledger that is missing or replaced is an error naming it, never an
empty list. Exports from before the ledger recorded their table's identity
instead: they find the table as before and follow the ledger beside it, which
adopts the table's old registry. A reference read from an export never decides
alone which ledger is written: an export whose ledger and table are not found is
refused for writes unless ``--export-only``, ``--ledger`` or ``--table`` says
where they go.

:func:`require_export` refuses, before anything is created, a path that holds no export.
"""

from __future__ import annotations

import json
import logging
import os

from prx_data.core import storage
from prx_data.core.errors import NotFound
from prx_data.core.schema import REPORT_NAME
from prx_data.export import layout, naming
from prx_data.skips.errors import ListError
from prx_data.skips.export_state import STATE_FORMAT, ExportState, read_state
from prx_data.skips.ledger import Ledger
from prx_data.skips.place import LEDGER_ENV, identity_at, ledger_uri, read_table_id, table_identity

log = logging.getLogger(__name__)


def _candidates(root: str, st: ExportState | None) -> list[str]:
    out = []
    if st is not None and st.table_rel and not storage.is_remote(root):
        out.append(os.path.normpath(os.path.join(root, st.table_rel)))
    if st is not None and st.table:
        out.append(st.table)
    cfg_table = table_of(root)
    if cfg_table:
        out.append(cfg_table)
    return list(dict.fromkeys(out))


def _recorded_ledger(root: str, st: ExportState) -> Ledger:
    """The ledger the export recorded, where it recorded it; missing or replaced: an error."""
    places = []
    if st.ledger_rel and not storage.is_remote(root):
        places.append(os.path.normpath(os.path.join(root, st.ledger_rel)))
    if st.ledger:
        places.append(st.ledger)
    for uri in dict.fromkeys(places):
        got = identity_at(uri)
        if got == st.ledger_id:
            return Ledger(uri, table=_found_table(root, st), table_id=st.table_id)
        if got is not None:
            raise ListError(
                f"{root} follows ledger {st.ledger_id}, but {uri} holds ledger {got} (replaced); "
                "restore the ledger, or name where it lives now with --ledger URI"
            )
    raise ListError(
        f"{root} follows ledger {st.ledger_id} at {st.ledger}, which is missing; restore it, "
        "or name where it lives now with --ledger URI (an export never takes a missing ledger "
        "for an empty one)"
    )


def _found_table(root: str, st: ExportState) -> str | None:
    for c in _candidates(root, st):
        if st.table_id and read_table_id(c) == st.table_id:
            return c
    return None


def check_recorded(root: str, st: ExportState | None, led: Ledger) -> Ledger:
    """``led``, when it is the ledger the export recorded (or it recorded none)."""
    if st is None or not st.ledger_id:
        return led
    got = led.identity
    if got != st.ledger_id:
        where = "no ledger" if got is None else f"ledger {got}"
        raise ListError(
            f"{root} follows ledger {st.ledger_id} (at {st.ledger}), and {led.uri} holds "
            f"{where}; pass --ledger {st.ledger} (or where it lives now)"
        )
    return led


def resolve(
    root: str,
    table: str | None = None,
    *,
    ledger: str | None = None,
    export_only: bool = False,
    strict: bool = True,
) -> Ledger | None:
    """The ledger the export's lists are recorded in (None: export-only).

    ``ledger`` (or ``$PRX_LEDGER``), else ``table``'s folder's ledger, must be the one the
    export recorded. Without either, the recorded ledger is used where it lives (missing or
    replaced: an error); an export from before ledgers finds its table by identity, as
    before, and follows the ledger beside it. An export that names nothing is export-only;
    one whose table is not found is refused when ``strict`` and export-only otherwise.
    """
    if export_only:
        return None
    st = read_state(root) if storage.exists(root) else None
    st = st if st is not None and st.format == STATE_FORMAT else None
    recorded = st.table_id if st is not None else None
    if ledger or os.environ.get(LEDGER_ENV) or table:
        if table:
            tid = table_identity(table)
            if recorded and recorded != tid and not (st and st.ledger_id):
                raise ListError(
                    f"{root} holds the lists of another table (identity {recorded}; {table} is "
                    f"{tid}); pass the table it was exported from, or --export-only"
                )
            led = Ledger.for_table(table, ledger)
        else:
            led = Ledger(ledger_uri(None, ledger), table=_found_table(root, st) if st else None)
        return check_recorded(root, st, led)
    if st is not None and st.ledger_id:
        return _recorded_ledger(root, st)
    if st is not None and st.ledger:
        # Bound to a ledger that held nothing yet (so no identity to record): it follows
        # that ledger, never the one beside its table (a --ledger export would lose every
        # opt-out recorded after it).
        return Ledger(st.ledger, table=_found_table(root, st), table_id=recorded)
    names = _candidates(root, st)
    if recorded:
        for c in names:
            if read_table_id(c) == recorded:
                return Ledger.for_table(c)
    if not names:
        return None
    if not strict:
        log.warning("%s: its table is not found with its identity; lists are export-only", root)
        return None
    why = (
        f"was exported from table {recorded} (last seen at {names[0]}), which is not found there"
        if recorded
        else f"names table {names[0]} but records no identity of it (written before tables had "
        "one, or received from elsewhere)"
    )
    raise ListError(
        f"{root} {why}, so the change cannot be recorded in its ledger: pass --ledger URI or "
        "--table URI (where the table lives now), or --export-only to change only this export"
    )


def require_export(root: str) -> None:
    """Refuse, before anything is created, a path that holds no export: a typo must not look
    like a request that was carried out."""
    from prx_data.export.adopt import is_plain_tree
    from prx_data.export.safety import has_proof

    if storage.exists(root) and (
        has_proof(root) or is_plain_tree(root) or layout.list_buckets(layout.tree(root))
    ):
        return  # a plain MDS tree is told how to adopt it by the command itself
    what = "does not exist" if not storage.exists(root) else "holds no export"
    raise NotFound(
        f"{root} {what}: give the root of an export (python -m prx_data.write_mds --out); "
        "nothing was recorded"
    )


def table_of(root: str) -> str | None:
    """The table an export was made from (its pinned config, or a rewrite's report)."""
    for name in (naming.CONFIG_NAME, REPORT_NAME):
        try:
            obj = json.loads(storage.read_bytes(storage.join(root, *name.split("/"))))
        except (FileNotFoundError, ValueError):
            continue
        t = obj.get("table") if isinstance(obj, dict) else None
        if isinstance(t, str) and t and not t.startswith("("):
            return t
    return None


# --- what the export holds ------------------------------------------------------------------


__all__ = ["check_recorded", "require_export", "resolve", "table_of"]
