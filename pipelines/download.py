"""The download job: fill image bytes for rows that have a URL and no image.

Rows that ingest kept with only a URL (``probe_error = missing_image``)
become ordinary rows: ``image``, ``width``, ``height``, ``format`` and
``probe_error`` are filled as ingest would have filled them, and two job
columns say what happened, for the explorer and for later runs:
``download_status`` (one of :data:`prx_data.download.fetch.STATUSES`) and
``download_error`` (the reason: ``http_404``, ``timeout``, ``too_large``,
``x_robots_tag:noai``, ``refused_address``...).

How rows are placed: a Lance fragment keeps each column in one data file for
all its rows, so setting the image of *some* rows of a fragment means either
rewriting that fragment's whole image column (the column-job runner's
write, which copies the images the fragment already holds) or moving the
filled rows. This job moves them: the fetch tasks write the rows they filled
as new, uncommitted fragments (every column, written once, where the bytes
were fetched: :func:`stage_rows`), and each commit on the driver adds those
fragments and deletes the rows from their old fragments with deletion
vectors, in one ``Update`` checked against the version it read. Only row
addresses and fragment metadata reach the driver. No image a fragment already holds is read or written
again, so a retry of the 2 % that failed costs 2 %, and the report measures
bytes written against bytes downloaded. Planning, work units, the pinned
version and the Ray Data stages are the column-job runner's
(:func:`prx_data.columns.runner.iter_results`).

Exactly once: a row is pending while its status is null, and it leaves that
state only in the commit that writes its result, so a killed run loses at
most the rows since its last commit (``commit_rows`` / ``commit_bytes`` /
``commit_seconds``) and the next run fetches only what is still pending.
Each URL is fetched once per table: rows whose URL already has an ``ok`` row,
or appears earlier among the pending rows, are marked ``duplicate`` and
then filled from that row (also on a later run, when it was killed first).
"""

from __future__ import annotations

import json
import time
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field, fields, replace
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from prx_data.core import schema as S
from prx_data.core.errors import Conflict, UsageError
from prx_data.core.flags import REQUIRED, flag, mebibytes
from prx_data.core.keys import sha256_hex
from prx_data.core.reports import FailureCounts
from prx_data.core.runtime import RunOptions, run_field
from prx_data.download import fetch as F

__all__ = [
    "DEFAULT_MAX_ERROR_RATE",
    "DownloadConfig",
    "run_download",
]

STATUS = S.status_column("download")
ERROR = S.error_column("download")
OUTPUTS = pa.schema([pa.field(STATUS, pa.string()), pa.field(ERROR, pa.string())])
#: URL column names tried in order when none is given (LAION, COYO, DataComp, CC12M: ``url``).
URL_NAMES = ("url", "URL", "image_url", "img_url", "src_url")
#: Content-hash column names tried in order when none is given. A list's own ``sha256``
#: (DataComp) is ingested as ``src_sha256``: a table's ``sha256`` is the digest of the bytes
#: it holds (prx_data.core.keys), null until a row is fetched, so it comes last (older tables
#: kept a list's column under that name).
HASH_NAMES = ("src_sha256", "md5", "MD5", "src_md5", "sha256")
#: ``only`` selector for every row without an image for a reason worth retrying:
#: transient, permanent and refused (after ``--allow-private`` changed, say).
FAILED = "failed"
#: ``--max-error-rate`` of the download CLI: the open web loses many URLs of any list
#: (dead links, opt-outs), so only a run that lost nearly every row fails.
DEFAULT_MAX_ERROR_RATE = 0.9
ROWADDR = "_rowaddr"
#: Per-row bookkeeping the fetch step adds for the report; never written.
_HOST, _RECEIVED, _FETCHED = "_dl_host", "_dl_received", "_dl_fetched"
#: What :func:`stage_rows` hands the driver instead of the rows: the image bytes each
#: row got, and (on a batch's first row) the staged fragments and the bytes they hold.
_IMAGE_LEN, _STAGED, _WRITTEN = "_dl_image_len", "_dl_staged", "_dl_written"


@dataclass(frozen=True)
class DownloadConfig:
    """One download run over ``table`` (see the module docstring)."""

    table: str = flag(REQUIRED, "--table", help="Lance table URI")
    url_column: str | None = flag(
        None,
        "--url-column",
        "--url-col",
        help="column holding the URL (default: every one of url, URL, image_url, img_url, "
        "src_url the table has, in turn: a table fed by a CSV and a LAION parquet has both url "
        "and URL rows)",
    )
    hash_column: str | None = flag(
        None,
        "--hash-column",
        help="column of expected content hashes, hex md5, sha1 or sha256 by length (default: "
        "sha256 or md5 when the table has one); bytes that do not match are not stored and "
        "the row gets download_error hash_mismatch",
    )
    check_hashes: bool = flag(
        True,
        "--no-hash-check",
        negate=True,
        help="store the bytes whatever the hash column says",
    )
    only: tuple[str, ...] = flag(
        (),
        "--only",
        append=True,
        metavar="SELECTOR",
        help=f"redo rows fetched before instead of new ones: '{FAILED}' (transient, "
        "permanent and refused rows), a status (transient, permanent, refused, opted_out), or a "
        "reason such as http_503 or timeout ('*' matches any text: 'http_5*'); repeatable",
    )
    limit: int | None = flag(None, "--limit", type=int, help="fetch at most this many rows")
    fetch: F.FetchConfig = field(default_factory=F.FetchConfig)
    #: engine, Ray cluster, CPUs, progress bar: the same for every job (``--engine``, ...).
    run: RunOptions = run_field()
    batch_size: int = flag(
        1024,
        "--batch-size",
        type=int,
        help="rows per fetch call; a call ends with its slowest row, so keep it many times "
        "--threads (default: %(default)s)",
    )
    rows_per_unit: int = 4096
    task_cpus: float = flag(
        0.5,
        "--task-cpus",
        type=float,
        help="Ray CPUs per fetch task: 0.5 runs two per CPU so that one's slow rows overlap "
        "another's work (default: %(default)s)",
    )
    #: A commit happens after this many rows, bytes or seconds, whichever comes first.
    commit_rows: int = flag(
        8192,
        "--commit-rows",
        type=int,
        help="rows per commit; a killed run refetches at most these (default: %(default)s)",
    )
    commit_bytes: int = flag(
        256 * 2**20,
        "--commit-mb",
        type=mebibytes,
        metavar="MIB",
        help="MiB buffered before a commit (default: 256)",
    )
    commit_seconds: float = 60.0
    storage_options: dict | None = None
    #: Called with the number of commits so far after each commit (progress hooks; tests).
    on_commit: Callable[[int], None] | None = field(default=None, compare=False, repr=False)

    def __post_init__(self) -> None:
        if self.limit is not None and self.limit < 0:
            raise UsageError("limit must be >= 0")
        for name in ("batch_size", "rows_per_unit", "commit_rows", "commit_bytes"):
            if getattr(self, name) < 1:
                raise UsageError(f"{name} must be >= 1")
        if self.task_cpus <= 0:
            raise UsageError("task_cpus must be > 0")


@dataclass
class DownloadReport(FailureCounts):
    """What a download run did: statuses, reasons, failing hosts, speed, bytes."""

    table: str
    url_column: str = ""
    #: The column whose hashes were checked ("" when none).
    hash_column: str = ""
    pending: int = 0
    rows: int = 0
    #: Rows fetched over the network (pending rows less the duplicates), and those that got an image.
    fetched: int = 0
    fetched_ok: int = 0
    statuses: dict[str, int] = field(default_factory=dict)
    reasons: dict[str, int] = field(default_factory=dict)
    #: Failed fetches per host, most first (the top 20).
    failing_hosts: dict[str, int] = field(default_factory=dict)
    #: Bytes received from servers (all attempts), and bytes of the images kept.
    bytes_downloaded: int = 0
    image_bytes: int = 0
    #: Bytes of the data files the run wrote (moved rows, every column).
    bytes_written: int = 0
    duplicates_marked: int = 0
    duplicates_filled: int = 0
    commits: int = 0
    seconds: float = 0.0
    fetch_seconds: float = 0.0
    table_version: int = 0
    final_version: int = 0

    job_label = "download"
    counted = "rows"

    @property
    def ok(self) -> int:
        return self.statuses.get(F.OK, 0)

    @property
    def failed(self) -> int:
        """Rows left without an image (judged against the CLI's lenient ``--max-error-rate``)."""
        return sum(self.failures.values())

    def failure_details(self, report_json: str | None = None) -> str:
        where = "the reasons above" + (f" and in {report_json}" if report_json else "")
        refused = self.statuses.get(F.REFUSED, 0)
        if refused and refused * 2 >= self.failed:
            where += (
                f"; {refused:,} rows were refused by the address policy (private, loopback "
                "or metadata addresses, or not http/https): for a private mirror or a local "
                "server pass --allow-private ADDR (IP, IP:PORT or network) and rerun with "
                "--only failed"
            )
        return where

    @property
    def total(self) -> int:
        return self.rows

    @property
    def failures(self) -> dict[str, int]:
        """Rows without an image by status (duplicates still waiting excluded)."""
        return {k: v for k, v in self.statuses.items() if k not in (F.OK, F.DUPLICATE)}

    @property
    def images_per_s(self) -> float:
        """Images fetched per second (rows filled from a duplicate not counted)."""
        return self.fetched_ok / self.fetch_seconds if self.fetch_seconds > 0 else 0.0

    @property
    def bytes_per_s(self) -> float:
        return self.bytes_downloaded / self.fetch_seconds if self.fetch_seconds > 0 else 0.0

    @property
    def success_rate(self) -> float:
        """Share of the fetched URLs that gave an image."""
        return self.fetched_ok / self.fetched if self.fetched else 0.0

    def text(self) -> str:
        lines = [
            f"{self.rows:,} of {self.pending:,} pending rows of {self.table} ({self.url_column}): "
            f"{self.fetched:,} fetched, {self.fetched_ok:,} ok ({self.success_rate:.1%}) in "
            f"{self.fetch_seconds:.1f} s: {self.images_per_s:,.1f} images/s, "
            f"{self.bytes_per_s / 1e6:,.2f} MB/s"
            + (f"; hashes checked against {self.hash_column}" if self.hash_column else ""),
            "  status: "
            + (", ".join(f"{k} {v:,}" for k, v in _desc(self.statuses)) or "nothing to do"),
        ]
        for reason, n in _desc(self.reasons)[:15]:
            lines.append(f"  {n:,} x {reason}")
        if self.failing_hosts:
            top = ", ".join(f"{h} {n:,}" for h, n in _desc(self.failing_hosts)[:5])
            lines.append(f"  top failing hosts: {top}")
        if self.duplicates_marked or self.duplicates_filled:
            lines.append(
                f"  duplicate URLs: {self.duplicates_marked:,} rows marked, "
                f"{self.duplicates_filled:,} filled from the row that was fetched"
            )
        lines.append(
            f"  downloaded {self.bytes_downloaded / 1e6:,.1f} MB, kept {self.image_bytes / 1e6:,.1f} "
            f"MB of images, wrote {self.bytes_written / 1e6:,.1f} MB in {self.commits:,} "
            f"commit(s) (version {self.table_version} -> {self.final_version})"
        )
        return "\n".join(lines)

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d.update(
            ok=self.ok,
            failures=self.failures,
            images_per_s=round(self.images_per_s, 2),
            bytes_per_s=round(self.bytes_per_s, 1),
            success_rate=round(self.success_rate, 4),
            seconds=round(self.seconds, 3),
            fetch_seconds=round(self.fetch_seconds, 3),
        )
        return d


def _desc(d: dict[str, int]) -> list[tuple[str, int]]:
    return sorted(d.items(), key=lambda kv: (-kv[1], kv[0]))


# --- selection ----------------------------------------------------------------------------


def url_column(names: Sequence[str], given: str | None = None) -> str:
    """The table's URL column: ``given``, else the first of :data:`URL_NAMES`."""
    if given is not None:
        if given not in names:
            raise UsageError(f"column {given!r} is not in the table; it has {list(names)}")
        return given
    for name in URL_NAMES:
        if name in names:
            return name
    raise UsageError(
        f"the table has no URL column (looked for {', '.join(URL_NAMES)}); "
        "name it with --url-column"
    )


def url_columns(names: Sequence[str], given: str | None = None) -> list[str]:
    """The URL columns to fetch, in turn: ``given``, else every one of :data:`URL_NAMES` the
    table has (a table fed by a CSV's ``url`` and an older LAION ingest's ``URL`` has rows
    whose URL is in only one of them: the first alone would leave the others unfetched)."""
    if given is not None:
        return [url_column(names, given)]
    found = [n for n in URL_NAMES if n in names]
    return found or [url_column(names)]


def hash_column(names: Sequence[str], given: str | None = None) -> str | None:
    """The table's expected-hash column: ``given``, else the first of :data:`HASH_NAMES`."""
    if given is not None:
        if given not in names:
            raise UsageError(
                f"hash column {given!r} is not in the table; it has {list(names)} "
                "(ingest keeps the URL list's columns)"
            )
        return given
    return next((n for n in HASH_NAMES if n in names), None)


#: The probe error of a row without image bytes (ingest's, kept by failed downloads).
MISSING = "missing_image"


def pending_filter(url: str, only: Sequence[str] = ()) -> str:
    """Lance SQL for the rows to fetch: a URL, no image, and a null status (or one in ``only``).

    "No image" is ``probe_error = 'missing_image'``, never ``image IS NULL``:
    Lance evaluates that by reading the image column, every held image of the
    table (600 MB read to count 3,000 rows here), for a small string column.
    """
    from prx_data.columns import writeback
    from prx_data.table.lance_ops import quote

    statuses: list[str] = []
    errors: list[str] = []
    for sel in only:
        if sel == FAILED:
            statuses += [F.TRANSIENT, F.PERMANENT, F.REFUSED]
        elif sel in F.STATUSES:
            statuses.append(sel)
        elif "*" in sel:
            pattern = sel.replace("\\", "\\\\").replace("%", "\\%").replace("_", "\\_")
            errors.append(f"{quote(ERROR)} LIKE {writeback.sql_string(pattern.replace('*', '%'))}")
        else:
            errors.append(f"{quote(ERROR)} = {writeback.sql_string(sel)}")
    return writeback.pending_filter(
        (STATUS,),  # the job has added its columns before it plans
        STATUS,
        redo=list(dict.fromkeys(statuses)),
        redo_where=errors,
        require=[url],
        include_missing=not only,
        match=[f"{quote(S.PROBE_ERROR)} = '{MISSING}'"],
    )


#: Pending plus ``ok`` rows planned in memory at once. Above it, duplicate planning spills
#: (URL, row address) to local disk in partitions by URL hash and plans one partition at a
#: time, so the driver holds about this many URLs whatever the table's size.
PLAN_PARTITION_ROWS = 1 << 20
_SCAN_BATCH = 1 << 16
#: Scan read-ahead of the spilled plan: a fragment and a few batches at a time, so its
#: buffers do not grow with the number of fragments.
_LEAN_SCAN = {"fragment_readahead": 1, "batch_readahead": 4}
_HEX2 = pa.array([f"{i:02x}" for i in range(256)], pa.string())


def plan_duplicates(
    ds,
    url: str,
    where: str,
    limit: int | None = None,
    partition_rows: int = PLAN_PARTITION_ROWS,
) -> np.ndarray:
    """Row addresses (sorted uint64) of pending rows whose URL another row fetches.

    A pending row is a duplicate when its URL already has an ``ok`` row, or
    appears at a smaller row address among the pending rows. Reads the URL
    column of the pending rows (the first ``limit`` of them, which are the rows
    the run plans) and of ``ok`` rows in batches: Arrow sorts and hash
    lookups, nothing per row in Python, in partitions by URL hash
    (:func:`_by_url_hash`) of about ``partition_rows`` rows (the result, 8
    bytes per duplicate, is what grows with the table).
    """
    from prx_data.table.lance_ops import quote

    scans = [(where, 0, limit)]
    if STATUS in ds.schema.names:
        scans.append((f"{quote(url)} IS NOT NULL AND {quote(STATUS)} = '{F.OK}'", 1, None))

    def solve(rows: pa.Table) -> np.ndarray:
        pend = rows.filter(pc.equal(rows["k"], 0))
        ok_urls = rows.filter(pc.equal(rows["k"], 1))["u"].combine_chunks()
        return _duplicates_of(pend["u"], pend["a"], ok_urls)

    out = _by_url_hash(ds, url, scans, partition_rows, solve)
    return np.sort(np.concatenate(out)) if out else np.zeros(0, np.uint64)


def duplicate_sources(
    ds, url: str, partition_rows: int = PLAN_PARTITION_ROWS
) -> tuple[np.ndarray, np.ndarray]:
    """``(rows, sources)``: each ``duplicate`` row's address (sorted) and the address of the
    row whose result it takes: a row with its URL and a final status, ``ok`` first, then
    the smallest address. Rows whose URL has no final row yet are left out."""
    from prx_data.table.lance_ops import quote

    u, st = quote(url), quote(STATUS)
    scans = [
        (f"{u} IS NOT NULL AND {st} = '{F.OK}'", 0, None),
        (f"{u} IS NOT NULL AND {st} <> '{F.OK}' AND {st} <> '{F.DUPLICATE}'", 1, None),
        (f"{u} IS NOT NULL AND {st} = '{F.DUPLICATE}'", 2, None),
    ]

    def solve(rows: pa.Table) -> tuple[np.ndarray, np.ndarray]:
        is_dup = pc.equal(rows["k"], 2)
        dups = rows.filter(is_dup)
        src = rows.filter(pc.invert(is_dup))
        src = src.filter(pc.is_in(src["u"], value_set=dups["u"].combine_chunks()))
        src = src.take(
            pc.sort_indices(src, [("u", "ascending"), ("k", "ascending"), ("a", "ascending")])
        )
        first = np.ones(src.num_rows, bool)
        if src.num_rows > 1:
            first[1:] = np.asarray(pc.not_equal(src["u"][1:], src["u"][:-1]))
        best = src.filter(pa.array(first)).select(["u", "a"]).rename_columns(["u", "src"])
        pairs = dups.select(["u", "a"]).join(best, keys="u", join_type="inner")
        return np.asarray(pairs["a"], np.uint64), np.asarray(pairs["src"], np.uint64)

    parts = _by_url_hash(ds, url, scans, partition_rows, solve)
    if not parts:
        return np.zeros(0, np.uint64), np.zeros(0, np.uint64)
    rows = np.concatenate([r for r, _ in parts])
    order = np.argsort(rows, kind="stable")
    return rows[order], np.concatenate([s for _, s in parts])[order]


def _by_url_hash(ds, url: str, scans, partition_rows: int, solve) -> list:
    """``solve`` over the rows of ``scans`` (``(filter, kind, limit)``) as a table of
    ``u`` (URL), ``a`` (row address) and ``k`` (kind), split by URL hash so that each
    call sees every row of its URLs and about ``partition_rows`` rows in all.

    Up to ``partition_rows`` rows are one call in memory; more are spilled to a
    temporary folder by Lance's ``md5`` of the URL and solved a partition at a
    time, so the driver holds about ``partition_rows`` URLs whatever the table's size.
    """
    import shutil
    import tempfile

    import pyarrow.ipc as ipc

    from prx_data.table.lance_ops import quote

    total = 0
    for where, _, limit in scans:
        n = ds.count_rows(where)
        total += n if limit is None else min(n, limit)
    if not total:
        return []
    parts = min(-(-total // max(1, partition_rows)), len(_HEX2))
    schema = pa.schema([("u", pa.string()), ("a", pa.uint64()), ("k", pa.int8())])
    projection = {url: quote(url)}
    if parts > 1:
        projection["_h"] = f"md5({quote(url)})"

    def batches():
        for where, kind, limit in scans:
            for b in ds.scanner(
                columns=projection,
                filter=where,
                with_row_address=True,
                batch_size=_SCAN_BATCH,
                limit=limit,
                **_LEAN_SCAN,
            ).to_batches():
                if b.num_rows:
                    rows = pa.table(
                        {
                            "u": b.column(url).cast(pa.string()),
                            "a": b.column(ROWADDR),
                            "k": pa.array(np.full(b.num_rows, kind, np.int8)),
                        },
                        schema=schema,
                    )
                    yield b, rows

    if parts == 1:
        tables = [rows for _, rows in batches()]
        return [solve(pa.concat_tables(tables).combine_chunks())] if tables else []
    folder = tempfile.mkdtemp(prefix="prx-download-plan-")
    writers: dict[int, ipc.RecordBatchFileWriter] = {}
    try:
        for b, rows in batches():
            head = pc.utf8_slice_codeunits(b.column("_h").cast(pa.string()), 0, 2)
            part = np.asarray(pc.index_in(head, value_set=_HEX2)) % parts
            order = np.argsort(part, kind="stable")
            bounds = np.searchsorted(part[order], np.arange(parts + 1))
            rows = rows.take(pa.array(order))
            for p in range(parts):
                lo, hi = int(bounds[p]), int(bounds[p + 1])
                if hi > lo:
                    w = writers.get(p)
                    if w is None:
                        w = writers[p] = ipc.new_file(f"{folder}/{p}.arrow", schema)
                    w.write_table(rows.slice(lo, hi - lo))
        for w in writers.values():
            w.close()
        out = []
        for p in sorted(writers):
            with pa.memory_map(f"{folder}/{p}.arrow") as source:
                out.append(solve(ipc.open_file(source).read_all()))
        return out
    finally:
        for w in writers.values():
            try:
                w.close()
            except Exception:
                pass
        shutil.rmtree(folder, ignore_errors=True)


def _duplicates_of(urls, addrs, ok_urls) -> np.ndarray:
    """Of pending (url, address) pairs: the addresses whose URL is ok or came earlier."""
    table = pa.table({"u": urls, "a": addrs})
    order = pc.sort_indices(table, sort_keys=[("u", "ascending"), ("a", "ascending")])
    urls = pc.take(table["u"], order)
    addrs = np.asarray(pc.take(table["a"], order))
    dup = np.zeros(len(addrs), bool)
    if len(addrs) > 1:
        dup[1:] = np.asarray(pc.equal(urls[1:], urls[:-1]).fill_null(False))
    if ok_urls is not None and len(ok_urls):
        dup |= np.asarray(pc.is_in(urls, value_set=ok_urls).fill_null(False))
    return np.sort(addrs[dup]).astype(np.uint64)


# --- the fetch step (runs in Ray tasks or in this process) ------------------------------

_FETCHERS: dict[F.FetchConfig, F.Fetcher] = {}


def _fetcher(config: F.FetchConfig) -> F.Fetcher:
    """One fetcher per process and config: its pools and host gates outlive a batch."""
    fetcher = _FETCHERS.get(config)
    if fetcher is None:
        fetcher = _FETCHERS[config] = F.Fetcher(config)
    return fetcher


def fetch_batch(
    batch: pa.Table,
    *,
    url: str,
    fetch: F.FetchConfig,
    duplicates,
    hashes: str | None = None,
    slots=None,
) -> pa.Table:
    """Rows in, the same rows out with image, probe and download columns filled.

    Rows in ``duplicates`` (sorted row addresses, or their Ray object reference) are
    not fetched: they get status ``duplicate``.
    ``hashes``: the column of expected hex digests; bytes that do not match
    are dropped (``hash_mismatch``). ``slots``: the run's :class:`HostSlots` actor
    (Ray), whose per-host slots every fetch task shares.
    """
    addrs = np.asarray(batch[ROWADDR])
    if not isinstance(duplicates, np.ndarray):  # an object-store reference (Ray)
        import ray

        duplicates = ray.get(duplicates)
    is_dup = _among(addrs, duplicates)
    urls = batch[url].to_pylist()
    todo = [i for i in range(len(urls)) if not is_dup[i]]
    fetcher, todo_urls = _fetcher(fetch), [urls[i] for i in todo]
    if slots is None:
        got = fetcher.fetch_many(todo_urls)
    else:
        got = F.fetch_with_slots(fetcher, todo_urls, _ActorSlots(slots))
    results = dict(zip(todo, got, strict=True))
    if hashes is not None:
        expected = batch[hashes].to_pylist()
        for i, r in results.items():
            F.check_hash(r, expected[i])
    n = batch.num_rows
    image: list = [None] * n
    width: list = [None] * n
    height: list = [None] * n
    fmt: list = [None] * n
    probe: list = [MISSING] * n
    status: list = [F.DUPLICATE] * n
    error: list = [None] * n
    host: list = [None] * n
    received = [0] * n
    for i, r in results.items():
        status[i], error[i], host[i], received[i] = r.status, r.reason, r.host, r.received
        if r.status == F.OK:
            image[i], width[i], height[i], fmt[i], probe[i] = (
                r.data,
                r.width,
                r.height,
                r.format,
                None,
            )
    types = batch.schema
    out = batch
    for name, values in (
        (S.IMAGE, image),
        (S.WIDTH, width),
        (S.HEIGHT, height),
        (S.FORMAT, fmt),
        (S.PROBE_ERROR, probe),
        (STATUS, status),
        (ERROR, error),
    ):
        out = out.set_column(
            types.get_field_index(name), name, pa.array(values, types.field(name).type)
        )
    if S.SHA256 in types.names:  # the key an opt-out follows to byte-identical copies
        # Rows without bytes keep what they had (an older table's expected hash, for a retry).
        had = batch[S.SHA256].to_pylist()
        digests = [sha256_hex(b) if b else h for b, h in zip(image, had, strict=True)]
        i = types.get_field_index(S.SHA256)
        out = out.set_column(i, S.SHA256, pa.array(digests, pa.string()))
    out = out.append_column(_HOST, pa.array(host, pa.string()))
    out = out.append_column(_RECEIVED, pa.array(received, pa.int64()))
    return out.append_column(_FETCHED, pa.array(~is_dup))


def host_slots(fetch: F.FetchConfig, placement):
    """The run's :class:`~prx_data.download.fetch.HostSlots` as a Ray actor (no CPU of its
    own), so ``per_host`` holds across every fetch task of the cluster."""
    import ray

    from prx_data.core.runtime import ensure_ray

    ensure_ray(placement.ray_address, placement.num_cpus)
    return ray.remote(num_cpus=0)(F.HostSlots).remote(fetch.per_host)


class _ActorSlots:
    """:class:`~prx_data.download.fetch.HostSlots`' methods, called on the run's actor."""

    ttl = 60.0

    def __init__(self, actor):
        self.actor = actor

    def acquire(self, holder: str, wants) -> dict[str, int]:
        import ray

        return ray.get(self.actor.acquire.remote(holder, dict(wants)))

    def renew(self, holder: str) -> None:
        self.actor.renew.remote(holder)

    def give_back(self, holder: str, host: str, n: int = 1) -> None:
        self.actor.give_back.remote(holder, host, n)  # calls from one process keep their order

    def release(self, holder: str) -> None:
        import ray

        ray.get(self.actor.release.remote(holder))


def _among(addrs: np.ndarray, sorted_addrs: np.ndarray) -> np.ndarray:
    """Which of ``addrs`` are in ``sorted_addrs``: a binary search per row, so a batch
    costs O(batch x log duplicates), not a pass over every duplicate of the run."""
    if not len(sorted_addrs):
        return np.zeros(len(addrs), bool)
    at = np.minimum(np.searchsorted(sorted_addrs, addrs), len(sorted_addrs) - 1)
    return sorted_addrs[at] == addrs


_SCHEMAS: dict[tuple[str, int], pa.Schema] = {}


def _table_schema(table: str, version: int, storage_options: dict | None) -> pa.Schema:
    """The pinned version's schema, opened once per process (a task runs many batches)."""
    key = (table, version)
    schema = _SCHEMAS.get(key)
    if schema is None:
        from prx_data.table.lance_ops import open_table

        schema = _SCHEMAS[key] = open_table(table, storage_options, version=version).schema
    return schema


def stage_rows(
    batch: pa.Table, *, table: str, version: int, storage_options: dict | None = None
) -> pa.Table:
    """Write the filled rows of ``batch`` as new, uncommitted fragments, where they were
    fetched; hand back only what the driver needs to commit them and to report.

    The image bytes never travel to the driver: at 10^8 rows its memory and
    network would otherwise carry the whole download. The driver commits the
    staged fragments (and deletes the rows from their old fragments) in one
    ``Update``; a fragment staged by a run killed before its commit is never
    part of a version, and the rows it holds are still pending.
    """
    import lance

    from prx_data.core.lance_compat import fragment_text

    schema = _table_schema(table, version, storage_options)
    n = batch.num_rows
    staged: list = [None] * n
    written: list = [0] * n
    if n:
        new = lance.fragment.write_fragments(
            batch.select(schema.names).cast(schema),
            table,
            schema=schema,
            max_rows_per_file=max(1, n),
            storage_options=storage_options,
        )
        staged[0] = json.dumps([fragment_text(m) for m in new])
        written[0] = sum(f.file_size_bytes or 0 for m in new for f in m.data_files())
    # The fetch step's bookkeeping, when the rows come from it (filled duplicates do not).
    extra = [c for c in (_HOST, _RECEIVED, _FETCHED) if c in batch.column_names]
    keep = batch.select([ROWADDR, STATUS, ERROR, *extra])
    keep = keep.append_column(_IMAGE_LEN, pc.binary_length(batch[S.IMAGE]).cast(pa.int64()))
    keep = keep.append_column(_STAGED, pa.array(staged, pa.string()))
    return keep.append_column(_WRITTEN, pa.array(written, pa.int64()))


# --- placing rows: move into new fragments, delete from the old ones --------------------


class Mover:
    """Commits filled rows: new fragments + deletion vectors of the old rows, one Update.

    Rows come either staged (:func:`stage_rows` wrote them where they were
    fetched: only their addresses and fragment metadata are here) or whole
    (duplicates filled on the driver), written at the next :meth:`flush`.
    """

    def __init__(self, cfg: DownloadConfig, ds):
        self.cfg = cfg
        self.ds = ds
        self.schema = ds.schema
        self.buffer: list[pa.Table] = []
        self.staged: list[Any] = []
        self.addrs: list[np.ndarray] = []
        self.rows = 0
        self.nbytes = 0
        self.last = time.monotonic()
        self.commits = 0
        self.bytes_written = 0

    def add(self, rows: pa.Table) -> None:
        if _STAGED in rows.column_names:
            from prx_data.core.lance_compat import fragment_from_text

            self.addrs.append(np.asarray(rows[ROWADDR]).astype(np.uint64))
            for text in rows[_STAGED].drop_null().to_pylist():
                self.staged.extend(fragment_from_text(t) for t in json.loads(text))
            written = int(pc.sum(rows[_WRITTEN]).as_py() or 0)
            self.nbytes += written
            self.bytes_written += written
        else:
            self.buffer.append(rows)
            self.nbytes += rows.nbytes
        self.rows += rows.num_rows
        cfg = self.cfg
        if (
            self.rows >= cfg.commit_rows
            or self.nbytes >= cfg.commit_bytes
            or time.monotonic() - self.last >= cfg.commit_seconds
        ):
            self.flush()

    def flush(self) -> None:
        import lance

        self.last = time.monotonic()
        if not self.buffer and not self.staged:
            return
        new, parts = list(self.staged), list(self.addrs)
        if self.buffer:
            rows = pa.concat_tables(self.buffer)
            parts.append(np.asarray(rows[ROWADDR]).astype(np.uint64))
            written = lance.fragment.write_fragments(
                rows.select(self.schema.names).cast(self.schema),
                self.cfg.table,
                schema=self.schema,
                max_rows_per_file=max(1, rows.num_rows),
                storage_options=self.cfg.storage_options,
            )
            self.bytes_written += sum(
                f.file_size_bytes or 0 for m in written for f in m.data_files()
            )
            new.extend(written)
        self.buffer, self.staged, self.addrs, self.rows, self.nbytes = [], [], [], 0, 0
        addrs = np.concatenate(parts)
        removed, updated = [], []
        frags = addrs >> np.uint64(32)
        for fid in np.unique(frags).tolist():
            mine = addrs[frags == fid]
            frag = self.ds.get_fragment(int(fid))
            if frag is None:
                raise Conflict(
                    f"fragment {fid} of {self.cfg.table!r} went away while the download ran "
                    "(compaction?): rerun, it continues from what is committed"
                )
            meta = frag.delete(f"_rowaddr IN ({', '.join(str(int(a)) for a in mine)})")
            (removed.append(int(fid)) if meta is None else updated.append(meta))
        op = lance.LanceOperation.Update(
            removed_fragment_ids=removed, updated_fragments=updated, new_fragments=new
        )
        try:
            self.ds = lance.LanceDataset.commit(
                self.cfg.table,
                op,
                read_version=self.ds.version,
                storage_options=self.cfg.storage_options,
            )
        except Exception as e:
            if "conflict" in str(e).lower():
                raise Conflict(
                    f"{self.cfg.table!r} changed while the download ran (compaction, deletion "
                    f"or another download): {str(e).splitlines()[0]}. Rerun: it continues "
                    "from what is committed."
                ) from e
            raise
        self.commits += 1
        if self.cfg.on_commit is not None:
            self.cfg.on_commit(self.commits)


# --- duplicates -------------------------------------------------------------------------


#: Duplicate rows one fill task copies and stages.
FILL_ROWS_PER_UNIT = 1024


def fill_duplicates(
    cfg: DownloadConfig,
    url: str,
    mover: Mover,
    reasons: Counter | None = None,
    hashes: str | None = None,
) -> Counter:
    """Give every ``duplicate`` row the result of a row with its URL that has one.

    The driver pairs each duplicate with its source (:func:`duplicate_sources`:
    row addresses only); fill tasks (:func:`fill_rows`, where the fetch tasks
    run) copy image and probe columns (and, for failures, status and reason),
    check copied bytes against the row's own expected hash (``hashes``) and
    stage the rows, so no image byte passes through the driver, which commits.
    Rows whose URL has no final result yet stay ``duplicate`` for a later run.
    Returns the rows filled by the status they got (and adds their reasons to
    ``reasons``).
    """
    from prx_data.columns import runner as R
    from prx_data.core.runtime import Resources, map_units

    filled: Counter = Counter()
    rows, sources = duplicate_sources(mover.ds, url)
    if not len(rows):
        return filled
    version = mover.ds.version
    units = [
        {
            "rows": rows[k : k + FILL_ROWS_PER_UNIT].tolist(),
            "sources": sources[k : k + FILL_ROWS_PER_UNIT].tolist(),
        }
        for k in range(0, len(rows), FILL_ROWS_PER_UNIT)
    ]
    where = cfg.run.place(
        size=len(rows),
        small=R.SMALL_ROWS,
    )

    def fill(unit: dict) -> pa.Table:
        return fill_rows(
            unit,
            table=cfg.table,
            version=version,
            storage_options=cfg.storage_options,
            hashes=hashes,
        )

    for done in map_units(fill, units, where, Resources(num_cpus=cfg.task_cpus), tables=True):
        mover.add(done.select([ROWADDR, _STAGED, _WRITTEN]))
        _count(filled, done[STATUS])
        if reasons is not None:
            _count(reasons, done[ERROR])
    mover.flush()
    return filled


def fill_rows(
    unit: dict, *, table: str, version: int, storage_options: dict | None, hashes: str | None
) -> pa.Table:
    """One fill unit: the duplicate rows ``unit["rows"]`` with the image, probe and (for a
    failure) status columns of ``unit["sources"]``, staged like fetched rows
    (:func:`stage_rows`); hands back their addresses, statuses and staged fragments."""
    from prx_data.table.lance_ops import pinned_table

    ds = pinned_table(table, version, storage_options)
    addrs = pa.array(unit["rows"], pa.uint64())
    rows = ds._take_rows(unit["rows"])
    copied = _COPIED + ([S.SHA256] if S.SHA256 in ds.schema.names else [])
    src = ds._take_rows(unit["sources"], columns=copied)
    for name in copied:
        i = rows.schema.get_field_index(name)
        rows = rows.set_column(i, name, src[name].cast(rows.schema.field(name).type))
    if hashes is not None:
        rows = _recheck_hashes(rows, hashes)
    rows = rows.append_column(ROWADDR, addrs)
    staged = stage_rows(rows, table=table, version=version, storage_options=storage_options)
    return staged.select([ROWADDR, STATUS, ERROR, _STAGED, _WRITTEN])


#: What a duplicate takes from its source row.
_COPIED = [S.IMAGE, S.WIDTH, S.HEIGHT, S.FORMAT, S.PROBE_ERROR, STATUS, ERROR]


def _recheck_hashes(rows: pa.Table, hashes: str) -> pa.Table:
    """Rows filled from another row: drop bytes that do not match this row's hash."""
    cols = {n: rows[n].to_pylist() for n in (S.IMAGE, S.WIDTH, S.HEIGHT, S.FORMAT)}
    cols[S.PROBE_ERROR] = rows[S.PROBE_ERROR].to_pylist()
    cols[STATUS], cols[ERROR] = rows[STATUS].to_pylist(), rows[ERROR].to_pylist()
    changed = False
    for i, (want, status) in enumerate(zip(rows[hashes].to_pylist(), cols[STATUS], strict=True)):
        if status != F.OK:
            continue
        r = F.check_hash(F.FetchResult(url="", status=F.OK, data=cols[S.IMAGE][i]), want)
        if r.status != F.OK:
            changed = True
            for n in (S.IMAGE, S.WIDTH, S.HEIGHT, S.FORMAT):
                cols[n][i] = None
            cols[S.PROBE_ERROR][i] = MISSING
            cols[STATUS][i], cols[ERROR][i] = r.status, r.reason
    if not changed:
        return rows
    for name, values in cols.items():
        i = rows.schema.get_field_index(name)
        rows = rows.set_column(i, name, pa.array(values, rows.schema.field(name).type))
    return rows


# --- the job ------------------------------------------------------------------------------


def run_download(cfg: DownloadConfig) -> DownloadReport:
    """Fetch every pending row's URL into the table (see the module docstring)."""
    from prx_data.table.lance_ops import open_table

    start = time.perf_counter()
    names = open_table(cfg.table, cfg.storage_options).schema.names
    report: DownloadReport | None = None
    for url in url_columns(names, cfg.url_column):
        run = cfg
        if cfg.limit is not None and report is not None:
            if report.rows >= cfg.limit:
                break
            run = replace(cfg, limit=cfg.limit - report.rows)
        part = _run_column(run, url, start)
        report = part if report is None else _combine(report, part)
    assert report is not None
    return report


def _combine(a: DownloadReport, b: DownloadReport) -> DownloadReport:
    """One report of two runs over URL columns in turn: counts added, versions first -> last."""
    out = DownloadReport(a.table)
    for f in fields(DownloadReport):
        x, y = getattr(a, f.name), getattr(b, f.name)
        if f.name == "url_column":
            value = f"{x}, {y}"
        elif f.name in ("table", "hash_column", "table_version"):
            value = x
        elif f.name in ("final_version", "seconds"):
            value = y
        elif isinstance(x, dict):
            value = dict(Counter(x) + Counter(y))
        elif isinstance(x, (int, float)):
            value = x + y
        else:
            value = x
        setattr(out, f.name, value)
    out.failing_hosts = dict(_desc(out.failing_hosts)[:20])
    return out


def _run_column(cfg: DownloadConfig, url: str, start: float) -> DownloadReport:
    """Fetch the pending rows whose URL is in column ``url``."""
    from prx_data.columns import runner as R
    from prx_data.table.lance_ops import open_table
    from prx_data.table.pins import column_pin, pinned

    report = DownloadReport(cfg.table)
    ds = open_table(cfg.table, cfg.storage_options)
    report.url_column = url
    if cfg.check_hashes:
        report.hash_column = hash_column(ds.schema.names, cfg.hash_column) or ""
    missing = [
        c for c in (S.IMAGE, S.WIDTH, S.HEIGHT, S.FORMAT, S.PROBE_ERROR) if c not in ds.schema.names
    ]
    if missing:
        raise UsageError(
            f"{cfg.table!r} lacks the table columns {missing}: make it with "
            "`python -m prx_data.ingest` (rows without bytes get probe_error = missing_image)"
        )
    R.ensure_columns(cfg.table, OUTPUTS, cfg.storage_options)
    # Duplicates a killed run marked but did not fill.
    early = Mover(cfg, open_table(cfg.table, cfg.storage_options))
    hashes = report.hash_column or None
    report.duplicates_filled = fill_duplicates(cfg, url, early, hashes=hashes).total()
    report.commits, report.bytes_written = early.commits, early.bytes_written
    ds = early.ds
    # Tag the version the fetch tasks read, so a cleanup meanwhile keeps its files (the
    # fragments this run empties leave the latest version while tasks still read them).
    with pinned(ds, column_pin(STATUS), cfg.table, job="download", column=STATUS):
        return _run_pinned(cfg, ds, report, url, start)


def _run_pinned(cfg: DownloadConfig, ds, report: DownloadReport, url: str, start: float):
    from tqdm.auto import tqdm

    from prx_data.columns import runner as R

    report.table_version = ds.version
    mover = Mover(cfg, ds)
    where = pending_filter(url, cfg.only)
    duplicates = plan_duplicates(ds, url, where, cfg.limit)
    report.duplicates_marked = len(duplicates)
    job = R.ColumnJob(
        table=cfg.table,
        outputs=OUTPUTS,
        read_columns=list(ds.schema.names),
        steps=[
            R.Step(
                fetch_batch,
                kwargs={
                    "url": url,
                    "fetch": cfg.fetch,
                    "duplicates": duplicates,
                    "hashes": report.hash_column or None,
                },
                batch_size=cfg.batch_size,
            ),
            R.Step(
                stage_rows,
                kwargs={
                    "table": cfg.table,
                    "version": ds.version,
                    "storage_options": cfg.storage_options,
                },
                batch_size=cfg.batch_size,
            ),
        ],
        where=where,
        limit=cfg.limit,
        run=replace(cfg.run, progress=False),  # the download's own bar counts rows
        batch_size=cfg.batch_size,
        rows_per_unit=cfg.rows_per_unit,
        storage_options=cfg.storage_options,
        read_cpus=cfg.task_cpus,
    )
    placement, units, expected = R.plan(job, R.pending_counts(ds, where))
    if placement.on_ray and units:  # fetch tasks in many processes: one per-host budget
        import ray

        fetch_kwargs = job.steps[0].kwargs
        fetch_kwargs["slots"] = host_slots(cfg.fetch, placement)
        # Once in the object store (shared per node), not inside every task's arguments.
        fetch_kwargs["duplicates"] = ray.put(duplicates)
    report.pending = sum(expected.values())
    statuses: Counter = Counter()
    reasons: Counter = Counter()
    hosts: Counter = Counter()
    t0 = time.perf_counter()
    bar = tqdm(total=report.pending, desc="download", unit="row", disable=not cfg.run.progress)
    try:
        for batch in R.iter_results(job, units, ds.version, placement) if units else ():
            if not batch.num_rows:
                continue
            fetched = batch[_FETCHED]
            st = batch[STATUS]
            _count(statuses, st)
            _count(reasons, batch[ERROR])
            failed = pc.and_(fetched, pc.not_equal(st, F.OK)).fill_null(False)
            _count(hosts, batch[_HOST].filter(failed))
            report.rows += batch.num_rows
            report.fetched += int(pc.sum(fetched).as_py() or 0)
            report.fetched_ok += int(pc.sum(pc.and_(fetched, pc.equal(st, F.OK))).as_py() or 0)
            report.bytes_downloaded += int(pc.sum(batch[_RECEIVED]).as_py() or 0)
            report.image_bytes += int(pc.sum(batch[_IMAGE_LEN]).as_py() or 0)
            mover.add(batch.select([ROWADDR, _STAGED, _WRITTEN]))
            bar.update(batch.num_rows)
            bar.set_postfix(
                ok=statuses[F.OK], failed=report.fetched - statuses[F.OK], refresh=False
            )
        mover.flush()
        report.fetch_seconds = time.perf_counter() - t0
        late = fill_duplicates(cfg, url, mover, reasons, hashes=report.hash_column or None)
        report.duplicates_filled += late.total()
        # Rows marked duplicate in this run and filled now count under the status they got.
        statuses[F.DUPLICATE] -= min(statuses[F.DUPLICATE], late.total())
        statuses.update(late)
        statuses += Counter()  # drops zero counts
    finally:
        bar.close()
        report.statuses = dict(statuses)
        report.reasons = dict(reasons)
        report.failing_hosts = dict(_desc(dict(hosts))[:20])
        report.commits += mover.commits
        report.bytes_written += mover.bytes_written
        report.final_version = mover.ds.version
        report.seconds = time.perf_counter() - start
    return report


def _count(counter: Counter, values) -> None:
    from prx_data.columns.writeback import count_into

    count_into(counter, values)
