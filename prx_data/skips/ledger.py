"""The corpus ledger: one log of removals for every table of a corpus, bound to no table file.

* **Where.** By default the ledger of a table is ``_prx_ledger.lance`` in the folder
  that holds the table (``data/photos.lance`` -> ``data/_prx_ledger.lance``), so a
  table rebuilt or re-ingested beside the old one shares it. ``--ledger URI`` or
  ``$PRX_LEDGER`` names another (local, ``s3://``, ``gs://``).
* **What.** The log of :mod:`prx_data.skips.log` (commit-ordered entries ``seq = base``
  = the Lance version their commit creates). An opt-out entry also carries the row's
  content keys (``sha256`` of its source bytes, ``phash``) and ``optout = true``:
  :meth:`Ledger.optout_keys` is the key set every export applies while it writes
  (:mod:`prx_data.export.removals`).
* **Fenced.** An append holds the ledger's lease and commits at exactly the version
  it read (:func:`prx_data.table.lance_ops.append_at_version`): a writer paused
  past its lease whose successor committed is refused by the store itself.
* **Identity.** A ledger has a random identity and its home (the URI it was made at)
  in its schema metadata; every export records both (:mod:`prx_data.skips.export_state`).
  A ledger found away from its home while its home still holds a ledger of the same
  identity is a *copy*, and is refused until one of them is removed or given its
  own identity (:meth:`Ledger.fork`). A ledger moved whole (its home gone) is
  accepted.
* **Migration.** The per-table registries of earlier versions
  (``data/photos.lists.lance``) are adopted on first use: their state is imported
  in one commit, and the adoption is recorded (registry log identity -> seq) in
  the same commit, so it happens once and loses nothing.
"""

from __future__ import annotations

import json
import logging
import uuid
from collections.abc import Callable, Iterable

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from prx_data.core import storage
from prx_data.core.errors import Conflict, NotFound
from prx_data.core.keys import KeySet
from prx_data.core.lease import Lease
from prx_data.skips import sidecar as SL
from prx_data.skips.errors import ListError
from prx_data.skips.log import (
    ADD,
    LOG_SCHEMA,
    REGISTRY,
    concat_entries,
    conform_entries,
    latest,
    log_rows,
    state,
)
from prx_data.skips.place import (
    ADOPTED_KEY,
    COMMIT_ATTEMPTS,
    HOME_KEY,
    LEDGER_ID_KEY,
    LOG_ID_KEY,
    canonical,
    default_ledger_uri,
    identity_at,
    lease_at,
    lease_path,
    ledger_uri,
    registry_uri,
    schema_meta,
    table_identity,
)

log = logging.getLogger(__name__)


class Ledger:
    """The corpus's log of list entries (see the module docstring).

    ``table``: the table a job works on (its registry is adopted on first use, and
    exports made from it record it); not part of the ledger's identity.
    """

    def __init__(self, uri: str, *, table: str | None = None, table_id: str | None = None):
        from prx_data.table.lance_ops import lance_storage_options

        self.uri = canonical(uri)
        self.table = canonical(table) if table else None
        self.table_id = table_id
        self.options = lance_storage_options(self.uri)

    @classmethod
    def for_table(cls, table: str, ledger: str | None = None) -> Ledger:
        """The ledger ``table`` follows (``ledger`` or ``$PRX_LEDGER`` win over the default
        beside it), with the registries of earlier versions adopted on first use."""
        out = cls(ledger_uri(table, ledger), table=table, table_id=table_identity(table))
        out.adopt_registries()
        return out

    # --- reading -----------------------------------------------------------------------

    def _open(self, version: int | None = None):
        from prx_data.table.lance_ops import open_table

        try:
            ds = open_table(self.uri, self.options, version=version)
        except NotFound:
            return None
        meta = schema_meta(ds)
        if LEDGER_ID_KEY not in meta or "seq" not in ds.schema.names:
            raise ListError(
                f"{self.uri} is not a prx-data ledger (no ledger identity); move it away or "
                "name the ledger with --ledger URI"
            )
        home = meta.get(HOME_KEY, b"").decode()
        if (
            version is None
            and home
            and home != self.uri
            and identity_at(home) == self.identity_of(ds)
        ):
            raise ListError(
                f"two ledgers claim identity {self.identity_of(ds)}: {home} and {self.uri} (a "
                "copy); keep one: remove the copy, or give it its own identity with "
                f"`python -m prx_data.skips ledger fork {self.uri}`"
            )
        return ds

    @staticmethod
    def identity_of(ds) -> str | None:
        return schema_meta(ds).get(LEDGER_ID_KEY, b"").decode() or None

    @property
    def identity(self) -> str | None:
        """The ledger's identity (None: it does not exist yet)."""
        return self.identity_of(self._open())

    def exists(self) -> bool:
        return self._open() is not None

    def head(self) -> int:
        """The ledger's position: the Lance version of its last commit (0: none yet)."""
        return self.position()[0]

    def position(self) -> tuple[int, str | None]:
        """(head, the log's identity): a position is only a prefix within one log."""
        ds = self._open()
        if ds is None:
            return 0, None
        return ds.version, schema_meta(ds).get(LOG_ID_KEY, b"").decode() or None

    def adopted(self) -> dict[str, int]:
        """{registry log identity or URI: the seq its state was imported at}."""
        raw = schema_meta(self._open()).get(ADOPTED_KEY)
        try:
            got = json.loads(raw) if raw else {}
        except ValueError:
            return {}
        return {str(k): int(v) for k, v in got.items()} if isinstance(got, dict) else {}

    def entries(
        self, names: Iterable[str] | None = None, *, upto: int | None = None, after: int = 0
    ) -> pa.Table:
        """Entries (of ``names``) with ``after < seq <= upto`` (``upto``: a version read before)."""
        if names is not None and not list(names):
            return LOG_SCHEMA.empty_table()
        ds = self._open(upto)
        if ds is None:
            return LOG_SCHEMA.empty_table()
        where = [w for w in (names_filter(names), f"seq > {after}" if after else None) if w]
        return conform_entries(ds.to_table(filter=" AND ".join(where) or None))

    def touched(self, after: int, upto: int) -> set[str]:
        """Lists with an entry in ``after < seq <= upto``."""
        if upto <= after:
            return set()
        ds = self._open(upto)
        if ds is None:
            return set()
        t = ds.to_table(columns=["list"], filter=f"seq > {after}")
        return set(pc.unique(t["list"]).to_pylist())

    def state(self, names: Iterable[str] | None = None) -> dict[str, pa.Table]:
        return state(self.entries(names))

    def optout_entries(self) -> pa.Table:
        """The opt-out entries whose (list, id) the log still holds: an opt-out is undone
        only by a later ``remove`` of the same (list, id).

        Only what decides reaches memory: the opt-out adds (the key columns), and the full
        history of the few (list, id) pairs that some ``remove`` names. Opt-outs are seldom
        undone, so no sort over the whole ledger is needed.
        """
        ds = self._open()
        if ds is None or "optout" not in ds.schema.names:
            return LOG_SCHEMA.empty_table()
        adds = conform_entries(ds.to_table(filter="optout = true AND op = 'add'"))
        if not len(adds):
            return adds
        removed = ds.to_table(columns=["list", "id"], filter="op = 'remove'")
        if not len(removed):
            return adds
        contested = pc.unique(pc.binary_join_element_wise(removed["list"], removed["id"], "\x00"))
        hit = pc.is_in(
            pc.binary_join_element_wise(adds["list"], adds["id"], "\x00"), value_set=contested
        )
        clean = adds.filter(pc.invert(hit))
        ids = pc.unique(adds.filter(hit)["id"]).to_pylist()
        if not ids:
            return clean
        parts = [
            conform_entries(ds.to_table(filter=pc.field("id").isin(ids[i : i + 4096])))
            for i in range(0, len(ids), 4096)
        ]
        history = concat_entries(parts)
        key = pc.binary_join_element_wise(history["list"], history["id"], "\x00")
        last = latest(history.filter(pc.is_in(key, value_set=contested)))
        kept = last.filter(pc.and_(pc.equal(last["op"], ADD), pc.fill_null(last["optout"], False)))
        return concat_entries([clean, kept])

    def optout_keys(self) -> KeySet:
        """Every opted-out row's keys: what an export leaves out while it writes."""
        t = self.optout_entries()
        if not len(t):
            return KeySet.empty()
        return KeySet.of(t["id"], t["sha256"], t["phash"])

    # --- writing -----------------------------------------------------------------------

    def lease(self) -> Lease:
        return lease_at(lease_path(self.uri), "ledger writer")

    def append(
        self,
        make: Callable[[int], pa.Table | None],
        *,
        metadata: Callable[[dict[bytes, bytes], int], dict[str, str]] | None = None,
    ) -> int:
        """Commit ``make(seq)``'s rows at ``seq`` = the version this commit creates.

        Holds the ledger's lease, so ``make`` sees every earlier commit, and the
        commit itself is conditional on the version read (fenced by the store).
        ``metadata(current, seq)`` gives schema metadata set by the same commit.
        Returns the seq (0: ``make`` had nothing to write).
        """
        from prx_data.table.lance_ops import append_at_version

        last: Exception | None = None
        with self.lease() as lease:
            for _ in range(COMMIT_ATTEMPTS):
                ds = self._open()
                v = 0 if ds is None else ds.version
                rows = make(v + 1)
                if rows is None or not len(rows):
                    return 0
                rows = conform_entries(rows.replace_schema_metadata(None))
                meta = metadata(schema_meta(ds), v + 1) if metadata is not None else None
                lease.check()
                try:
                    got = append_at_version(
                        self.uri,
                        rows,
                        None if ds is None else v,
                        self.options,
                        schema=self._new_schema(meta) if ds is None else None,
                        metadata=meta if ds is not None else None,
                    )
                except Conflict as e:
                    last = e
                    continue
                if got != v + 1:
                    raise ListError(
                        f"{self.uri}: committed version {got}, expected {v + 1}; another writer "
                        "committed without the ledger's lease: stop it and run this again"
                    )
                return got
        raise ListError(
            f"{self.uri}: another writer kept committing without the ledger's lease ({last}); "
            "nothing of this request was recorded: stop it and run this again"
        )

    def _new_schema(self, meta: dict[str, str] | None) -> pa.Schema:
        base = {
            LEDGER_ID_KEY.decode(): uuid.uuid4().hex,
            LOG_ID_KEY.decode(): uuid.uuid4().hex,
            HOME_KEY.decode(): self.uri,
        }
        return LOG_SCHEMA.with_metadata({**base, **(meta or {})})

    def fork(self) -> str:
        """Give this ledger (a copy) its own identity and home; returns the new identity.

        Exports bound to the original then refuse this one: they follow the original.
        """
        new = uuid.uuid4().hex
        with self.lease() as lease:
            from prx_data.table.lance_ops import open_table

            try:
                ds = open_table(self.uri, self.options)
            except NotFound:
                raise ListError(f"{self.uri}: no ledger there") from None
            lease.check()
            ds.update_schema_metadata(
                {
                    LEDGER_ID_KEY.decode(): new,
                    LOG_ID_KEY.decode(): uuid.uuid4().hex,
                    HOME_KEY.decode(): self.uri,
                }
            )
        return new

    def rehome(self) -> None:
        """Record the ledger's current URI as its home (after a move; see :meth:`_open`)."""
        ds = self._open()
        if ds is None or schema_meta(ds).get(HOME_KEY, b"").decode() == self.uri:
            return
        with self.lease() as lease:
            lease.check()
            self._open().update_schema_metadata({HOME_KEY.decode(): self.uri})

    # --- migration ---------------------------------------------------------------------

    def registries(self) -> list[str]:
        """Registries of earlier versions this ledger takes over: the table's own, and every
        ``*.lists.lance`` beside a ledger at its default place."""
        out = []
        if self.table:
            out.append(registry_uri(self.table))
            folder = self.table.rsplit("/", 1)[0]
            if default_ledger_uri(self.table) == self.uri and storage.exists(folder):
                for name in storage.list_dirs(folder):
                    if name.endswith(".lists.lance"):
                        out.append(storage.join(folder, name))
        return sorted(set(out))

    def adopt_registries(self) -> dict[str, int]:
        """Adopt every registry of :meth:`registries` not adopted yet; {registry: ids imported}."""
        done = {}
        for reg in self.registries():
            n = self.adopt(reg)
            if n is not None:
                done[reg] = n
        return done

    def adopt(self, registry: str) -> int | None:
        """Import the state of an earlier version's registry in one commit (None: nothing to
        adopt, or adopted before). Its opt-out entries become opt-outs of the ledger."""
        from prx_data.table.lance_ops import open_table

        try:
            reg = open_table(registry, self.options)
        except NotFound:
            return None
        key = schema_meta(reg).get(LOG_ID_KEY, b"").decode() or canonical(registry)
        if key in self.adopted():
            return None
        old = _registry_state(reg)

        def make(seq: int) -> pa.Table:
            parts = []
            for name, t in old.items():
                rows = log_rows(name, t["id"], ADD, t, seq=seq, base=seq, kind=REGISTRY, export="")
                optout = pc.fill_null(pc.equal(t["command"], "optout"), False)
                parts.append(
                    rows.set_column(rows.schema.get_field_index("optout"), "optout", optout)
                )
            return pa.concat_tables(parts)

        def meta(current: dict[bytes, bytes], seq: int) -> dict[str, str]:
            try:
                have = json.loads(current.get(ADOPTED_KEY) or b"{}")
            except ValueError:
                have = {}
            return {ADOPTED_KEY.decode(): json.dumps({**have, key: seq}, sort_keys=True)}

        n = sum(len(t) for t in old.values())
        if n:
            self.append(make, metadata=meta)
        elif self.exists():  # nothing to import: only remember that it was looked at
            with self.lease() as lease:
                ds = self._open()
                lease.check()
                ds.update_schema_metadata(meta(schema_meta(ds), ds.version))
        else:
            return 0
        log.warning("%s: adopted the skip-list registry %s (%d ids)", self.uri, registry, n)
        return n


def _registry_state(ds) -> dict[str, pa.Table]:
    """A registry's current state by its own rule (commit-ordered, or clock-ordered legacy)."""
    if "seq" in ds.schema.names:
        return state(conform_entries(ds.to_table()))
    t = ds.to_table()
    if not len(t):
        return {}
    rank = pc.if_else(pc.equal(t["op"], ADD), 1, 0)
    order = pa.table({"i": pa.array(np.arange(len(t))), "at": t["at"], "rank": rank})
    order = order.sort_by([("at", "ascending"), ("rank", "descending")])
    seq = np.empty(len(t), np.int64)
    seq[order["i"].to_numpy()] = np.arange(1, len(t) + 1)
    entries = pa.table(
        {
            "seq": pa.array(seq),
            "base": pa.array(seq),
            "kind": pa.array(np.zeros(len(t), np.int8)),
            "list": t["list"],
            "id": t["id"],
            "op": t["op"],
            "at": t["at"],
            "command": t["command"],
            "reason": t["reason"],
        }
    )
    return state(conform_entries(entries))


def names_filter(names: Iterable[str] | None) -> str | None:
    if names is None:
        return None
    names = sorted(set(names))
    return "list IN (" + ", ".join(f"'{SL.validate_name(n)}'" for n in names) + ")"


__all__ = ["Ledger"]
