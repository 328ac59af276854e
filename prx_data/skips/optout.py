"""Opt-outs: leave listed samples out of every bucket and tier of an export, without rewriting it.

``python -m prx_data.optout --export OUT --name optout-2026-11 --ids FILE``
(or ``--table URI --where SQL``, or ``--source-ids FILE``) turns the request
into row ids, finds their samples through the export's ``ids.parquet``
manifests and adds them to the named skip list (:mod:`prx_data.skips.sidecar`).
Lists are merged, never shrunk: running the same request again leaves the
sidecars byte-identical, and a later request under the same name adds to it.

Once the skipped share of an export grows past about 10 %, rewrite it
without the skipped samples: ``python -m prx_data.skips rewrite OUT NEW_OUT``.
``python -m prx_data.skips add`` takes row ids and queries too; this command
adds source keys and a per-tier report with that hint.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass, field

from prx_data.core.errors import UsageError

#: Above this skipped share an export is worth rewriting (the PRX recipe).
REWRITE_HINT_SHARE = 0.10


def read_id_file(path: str, column: str = "id") -> list[str]:
    """Ids from a text file (one per line; blank lines and ``#`` comments ignored) or a parquet column."""
    from prx_data.core import storage

    if path.endswith(".parquet"):
        import pyarrow.parquet as pq

        fs, p = storage.filesystem(path)
        try:
            t = pq.read_table(p, filesystem=fs)
        except FileNotFoundError:
            raise UsageError(f"{path}: no such id file") from None
        if column not in t.column_names:
            raise UsageError(f"{path}: no column {column!r} (has {t.column_names})")
        return [v for v in t[column].to_pylist() if v]
    try:
        text = storage.read_bytes(path).decode("utf-8-sig")
    except FileNotFoundError:
        raise UsageError(
            f"{path}: no such id file; give a text file of row ids (one per line) or a "
            "parquet file with an id column"
        ) from None
    except UnicodeDecodeError as e:
        raise UsageError(f"{path}: not UTF-8 text ({e.reason}); give one row id per line") from None
    out = []
    for line in text.splitlines():
        line = line.strip()
        if line and not line.startswith("#"):
            out.append(line)
    return out


def ids_from_source_ids(
    keys: Iterable[str],
    *,
    source: str | None = None,
    table: str | None = None,
    storage_options: dict | None = None,
) -> list[str]:
    """Row ids (``"<source>/<key>"``) for item keys as the source knows them.

    With ``source`` the ids are built directly. Otherwise every source named
    in the table's ``source`` column is tried and only ids present in the
    table are returned (:func:`resolve_source_ids` says which keys found none).
    """
    found = resolve_source_ids(keys, source=source, table=table, storage_options=storage_options)
    return sorted({i for ids in found.values() for i in ids})


def resolve_source_ids(
    keys: Iterable[str],
    *,
    source: str | None = None,
    table: str | None = None,
    storage_options: dict | None = None,
) -> dict[str, list[str]]:
    """``{key: [row ids]}`` for every requested key; ``[]`` where the table has no such row.

    Keeping the keys that match nothing lets the report list them instead of
    letting them vanish before counting.
    """
    keys = sorted(set(keys))
    if source is not None:
        return {k: [f"{source}/{k}"] for k in keys}
    if table is None:
        raise UsageError("source ids need --source NAME or --table URI to become row ids")
    import pyarrow as pa
    import pyarrow.compute as pc

    from prx_data.core import schema as S
    from prx_data.table.lance_ops import open_table

    t = open_table(table, storage_options).to_table(columns=[S.ID, S.SOURCE])
    sources = [s for s in pc.unique(t[S.SOURCE]).to_pylist() if s is not None]
    pairs = [(k, f"{s}/{k}") for s in sources for k in keys]
    candidates = pa.array([c for _, c in pairs], pa.string())
    hit = pc.is_in(candidates, value_set=t[S.ID]).to_pylist()
    out: dict[str, list[str]] = {k: [] for k in keys}
    for (k, c), h in zip(pairs, hit, strict=True):
        if h:
            out[k].append(c)
    return {k: sorted(v) for k, v in out.items()}


@dataclass
class OptOutReport:
    export: str
    name: str
    #: Requested keys as given (row ids, or source keys with --source-ids), deduplicated.
    ids_requested: int
    #: How many of them matched no sample of this export (or no row of the table).
    ids_not_in_export: int
    shards_written: int
    samples_in_list: int
    #: {bucket: samples skipped by this list}
    buckets: dict[str, int] = field(default_factory=dict)
    #: {tier: samples skipped by this list}
    tiers: dict[str, int] = field(default_factory=dict)
    #: Share of the export skipped by all lists together.
    skipped_share_all_lists: float = 0.0
    #: Every requested key that matched nothing, sorted.
    not_matched: list[str] = field(default_factory=list)
    #: The file the CLI wrote ``not_matched`` to (one per line), if any.
    not_matched_file: str | None = None
    #: The corpus ledger the ids were recorded in (None: only this export).
    registry: str | None = None
    #: {rule: rows it took out}: the requested ids, and the rows found through their
    #: content keys (byte-identical copies, equal pHash) and dedup groups in every table
    #: of the corpus (:mod:`prx_data.skips.content`).
    by_rule: dict[str, int] = field(default_factory=dict)
    #: Tables of the corpus with no ``sha256`` column (ingested before it was recorded):
    #: byte-identical copies there were not looked for.
    tables_without_sha256: list[str] = field(default_factory=list)
    #: Ids the list holds, in this export and not (later exports of the table skip them all).
    ids_in_list: int = 0
    #: Share of the export this list leaves out, and the warning when it is above 10 %.
    share: float = 0.0
    warning: str | None = None

    def to_dict(self) -> dict:
        return asdict(self)

    def text(self) -> str:
        lines = [
            f"skip list {self.name!r} on {self.export}: {self.samples_in_list:,} samples "
            f"({self.ids_requested:,} ids requested, {self.ids_not_in_export:,} not in this export)",
        ]
        if self.not_matched:
            shown = ", ".join(self.not_matched[:5])
            more = f" and {len(self.not_matched) - 5:,} more" if len(self.not_matched) > 5 else ""
            where = f"; all listed in {self.not_matched_file}" if self.not_matched_file else ""
            lines.append(f"matched nothing: {shown}{more}{where}")
        for tier, n in self.tiers.items():
            lines.append(f"  tier {tier}: {n:,}")
            lines += [
                f"    {b}: {c:,}" for b, c in self.buckets.items() if b.split("/")[0] == tier and c
            ]
        extended = {r: n for r, n in self.by_rule.items() if r != "id" and n}
        if extended:
            lines.append(
                "the same images under other ids, also left out: "
                + ", ".join(f"{n:,} by {r}" for r, n in extended.items())
            )
        for t in self.tables_without_sha256:
            lines.append(
                f"note: {t} has no sha256 column, so byte-identical copies there were not looked "
                f"for; fill it with `python -m prx_data.table sha256 {t}`, then opt out again"
            )
        if self.registry:
            lines.append(
                f"recorded in the ledger {self.registry} ({self.ids_in_list:,} ids in the list): "
                "no later export of any table of the corpus writes them"
            )
        if self.warning:
            lines.append(self.warning)
        share = self.skipped_share_all_lists
        lines.append(f"all skip lists together leave out {100 * share:.2f}% of the export")
        if share > REWRITE_HINT_SHARE:
            lines.append(
                f"that is above {100 * REWRITE_HINT_SHARE:.0f}%: consider rewriting the export without "
                f"them: python -m prx_data.skips rewrite {self.export} NEW_ROOT"
            )
        return "\n".join(lines)


def add_optout(
    export: str,
    name: str,
    ids: Iterable[str],
    *,
    keys: Mapping[str, Sequence[str]] | None = None,
    reason: str = "",
    table: str | None = None,
    ledger: str | None = None,
    export_only: bool = False,
    allow_unmatched: bool = False,
) -> OptOutReport:
    """Add the samples of ``ids`` to the skip list ``name`` in every bucket of ``export``.

    ``keys`` (from :func:`resolve_source_ids`) makes the request the source keys:
    they are what is counted, and a key is unmatched when none of its row ids
    is in the export (including keys that have no row in the table at all).
    The opt-out follows the image: rows of any table of the corpus that share a
    requested row's source bytes, pHash or dedup group are added too
    (:func:`prx_data.skips.content.expand`). Everything is recorded in the corpus
    ledger first (:mod:`prx_data.skips.ledger`) with the rows' content keys, so
    no later export writes them; ``export_only`` changes only this export.
    A request none of whose ids is in the export or in a table of the corpus is
    refused (nothing is recorded) unless ``allow_unmatched``.
    """
    import pyarrow as pa

    from prx_data.skips import sidecar as SL
    from prx_data.skips.bind import bind
    from prx_data.skips.content import corpus_tables, expand, keys_of
    from prx_data.skips.log import Provenance
    from prx_data.skips.ops import update_list
    from prx_data.skips.which import require_export, resolve, table_of

    SL.validate_name(name)
    require_export(export)
    if keys is not None:
        ids = {i for v in keys.values() for i in v}
    wanted = sorted(set(ids))
    led = None if export_only else resolve(export, table, ledger=ledger)
    folder = led.uri.rsplit("/", 1)[0] if led is not None else None
    tables = corpus_tables(folder, [t for t in (table, led and led.table, table_of(export)) if t])
    found = expand(tables, wanted)
    if not allow_unmatched and wanted and not len(found.keys):
        in_export = bind(export, {name: pa.array(wanted, pa.string())})[name]
        if not in_export.positions:
            raise UsageError(
                f"none of the {len(wanted):,} requested ids is in {export} or in a table of the "
                "corpus (check the ids, or the source with --source-ids); nothing was recorded. "
                "Pass --allow-unmatched to record them anyway (ids not ingested yet)"
            )
    every = sorted(set(wanted) | set(found.ids()))
    res = update_list(
        export,
        name,
        every,
        Provenance("optout", reason),
        registry=led,
        export_only=export_only,
        keys=keys_of(tables, every) if len(found.keys) else found.keys,
    )
    missing_req = sorted(set(res.missing_ids) & set(wanted))
    if keys is None:
        requested, not_matched = len(wanted), missing_req
    else:
        missing = set(res.missing_ids)
        requested = len(keys)
        not_matched = sorted(k for k, v in keys.items() if all(i in missing for i in v))
    stats = SL.skip_stats(export, names=[name])
    everything = SL.skip_stats(export)
    buckets = {s.bucket: s.skipped for s in stats.get(name, [])}
    tiers: dict[str, int] = {}
    for b, n in buckets.items():
        tiers[b.split("/")[0]] = tiers.get(b.split("/")[0], 0) + n
    all_rows = everything.get("*", [])
    total = sum(s.samples for s in all_rows)
    skipped = sum(s.skipped for s in all_rows)
    return OptOutReport(
        export=export,
        name=name,
        ids_requested=requested,
        ids_not_in_export=len(not_matched),
        shards_written=res.shards_written,
        samples_in_list=sum(buckets.values()),
        buckets=buckets,
        tiers=dict(sorted(tiers.items(), key=lambda kv: int(kv[0]))),
        skipped_share_all_lists=skipped / total if total else 0.0,
        not_matched=not_matched,
        registry=res.registry,
        ids_in_list=res.ids_in_list,
        share=res.share,
        warning=res.warning,
        by_rule={"id": len(wanted), **found.counts()},
        tables_without_sha256=found.unhashed,
    )


def extend_to_groups(table: str, ids, keeper, *, command: str = "dedup") -> dict[str, int]:
    """Opt out every member of a duplicate group that holds an opted-out row.

    ``ids`` are the table's rows, ``keeper[i]`` the row index of row ``i``'s group keeper
    (itself when unique, -1 without a hash). An opt-out made before the groups existed
    must not let the group's next-best member stream in its place, so the members join
    the same opt-out list in the corpus ledger, with their content keys. Returns
    {list: ids added}.
    """
    import numpy as np
    import pyarrow as pa
    import pyarrow.compute as pc

    from prx_data.skips.content import keys_of
    from prx_data.skips.ledger import Ledger
    from prx_data.skips.log import ADD, REGISTRY, Provenance, concat_entries, log_rows

    led = Ledger.for_table(table)
    opted = led.optout_entries()
    if not len(opted):
        return {}
    keeper = np.asarray(keeper)
    ids = pa.array(ids, pa.string()) if not isinstance(ids, pa.Array) else ids
    row = pc.index_in(opted["id"], value_set=ids).to_numpy(zero_copy_only=False)
    added: dict[str, pa.Array] = {}
    for name in sorted(set(opted["list"].to_pylist())):
        mine = pc.equal(opted["list"], name).to_numpy(zero_copy_only=False)
        rows = row[mine]
        rows = rows[~np.isnan(rows)].astype(np.int64) if rows.dtype.kind == "f" else rows
        roots = keeper[rows]
        roots = roots[roots >= 0]
        if not len(roots):
            continue
        members = ids.filter(pa.array(np.isin(keeper, roots)))
        have = opted.filter(pa.array(mine))["id"]
        new = members.filter(pc.invert(pc.is_in(members, value_set=have)))
        if len(new):
            added[name] = new
    if not added:
        return {}
    keys = keys_of([table], sorted({i for a in added.values() for i in a.to_pylist()}))
    prov = Provenance(command, "member of an opted-out row's duplicate group")
    led.append(
        lambda seq: concat_entries(
            [
                log_rows(n, a, ADD, prov, seq=seq, base=seq, kind=REGISTRY, export="", keys=keys)
                for n, a in added.items()
            ]
        )
    )
    return {n: len(a) for n, a in added.items()}
