"""Skip lists: sets of row ids that leave samples out of an export without rewriting it.

There is one source of truth per corpus, the ledger (a log of list entries beside the
tables), and everything else is derived from it. The rooms, each one concern, lowest
first (each imports only those above it in this list)::

    errors        ListError, UncarriableList
    content       an opt-out follows the image: content keys of rows, and the byte
                  copies, equal pHashes and dedup groups in every table of the corpus
    sidecar       the .skip sidecar format and its readers (what the loader applies)
    log           the entries (LOG_SCHEMA), their order, their content keys, and the
                  state they decide
    place         where a ledger lives and who it is: the default beside the tables,
                  --ledger / PRX_LEDGER, table identity, the metadata's names
    ledger        the corpus ledger: the log, copies, fenced appends, adoption of the
                  per-table registries of earlier versions
    export_state  one export's store files, its _lists/registry state, its own log,
                  its lease
    which         which ledger an export follows (resolve), and the refusal of a path
                  that holds no export
    bind          row ids <-> sample positions in an export's shards
    recover       lists the log does not hold yet (sidecars only, pre-log stores)
    materialise   an export's lists made the log's state, store and sidecars; the
                  only writer of sidecars
    ops           update, sync, carry, snapshot, remove; reports

:mod:`~prx_data.skips.optout`, :mod:`~prx_data.skips.dedup`,
:mod:`~prx_data.skips.semdedup` and :mod:`~prx_data.skips.rewrite` build on
:mod:`~prx_data.skips.ops`; :mod:`~prx_data.skips.reader` is the skip-aware shard reader.
See docs/STREAMING.md (skip lists: one corpus ledger).
"""

#: The rooms are modules, imported by path (``from prx_data.skips import ops``).
__all__ = [
    "bind",
    "content",
    "dedup",
    "errors",
    "export_state",
    "ledger",
    "log",
    "materialise",
    "ops",
    "optout",
    "reader",
    "recover",
    "rewrite",
    "semdedup",
    "sidecar",
]
