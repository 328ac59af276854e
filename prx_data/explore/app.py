"""``python -m prx_data.explore --table URI``: browse a Lance image table in a web browser.

Live caption search (BM25 full text, or an exact id), a paged thumbnail grid
whose cards show every caption column, the labels, the duplicate state and
the id; click an image to see visually similar ones (vector search on the
source's embedding or the pixel descriptor). Filters: tier, aspect-ratio
bucket, image quality, drop-downs for label columns with few values, and
typed exact-match fields for columns with unbounded values (``id`` prefix,
``dup_of``), and a numeric column (scores, image-quality fields, numeric
attributes: every float column and struct field) with a min/max range and a
sort, high or low first. The cluster view shows an image's near duplicates
side by side: its neighbours by the CLIP image embedding above semantic
dedup's cosine threshold, with the member semdedup would keep marked.

Paging is by offset, so a page costs one bounded scan whatever the table
size. Thumbnails for a page are made by a small background pool as soon as
the page is served (cached ahead), so a search never waits behind them.

A small stdlib HTTP server with a JSON API and static files; it binds to
127.0.0.1 unless told otherwise. The page never puts table text into HTML:
captions are inserted with ``textContent``, and a Content-Security-Policy
forbids inline scripts, so a caption such as ``<script>`` stays text.

Hardened against other sites and exhaustion: only requests whose ``Host``
names a loopback name, the bound host or an allowed name are served (421
otherwise: DNS rebinding cannot turn "binds 127.0.0.1" into remote access);
``offset`` and page sizes are bounded (400 beyond); a fixed pool of HTTP
workers with a bounded queue answers 503 when full instead of starting a
thread per request; the thumbnail queue is bounded and images that would
decode to more than :data:`THUMB_MAX_PIXELS` are refused (422); a thumbnail
not ready in time is a 504. The table is never changed at start-up unless
asked (``build_indexes`` / ``--build-indexes``, ``descriptors="yes"``);
otherwise the explorer prints what it would build and runs with what exists.
"""

from __future__ import annotations

import concurrent.futures
import errno
import io
import json
import mimetypes
import os
import queue
import re
import socket
import sys
import threading
import time
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler, HTTPServer
from importlib import resources
from typing import Any
from urllib.parse import parse_qs, urlparse

import pyarrow as pa
import pyarrow.compute as pc
from PIL import Image

from prx_data.columns import descriptors
from prx_data.core import descriptor
from prx_data.core import quality as Q
from prx_data.core import schema as S
from prx_data.core.buckets import DEFAULT_SPEC
from prx_data.core.errors import PrxDataError, UsageError
from prx_data.core.flags import REQUIRED, flag
from prx_data.core.imaging import ImageError, decode, open_image
from prx_data.table import lance_ops as T
from prx_data.table import search
from prx_data.table.resolution import column_sql, numeric_columns

DEFAULT_HOST = "127.0.0.1"
DEFAULT_PORT = 8765
#: Descriptors are computed at start-up without asking when at most this many are missing.
AUTO_DESCRIPTOR_ROWS = 50_000
MAX_LABEL_VALUES = 40
THUMB_SIZE = 256
THUMB_CACHE = 4000
#: Background threads making thumbnails ahead of the browser asking for them.
THUMB_WORKERS = 2
#: Thumbnails waiting for (or being made by) that pool; a page's prefetch beyond it is skipped.
THUMB_QUEUE = 512
#: Bytes the thumbnail LRU may hold (large sizes are up to a few hundred kB each).
THUMB_CACHE_BYTES = 256 << 20
#: An image whose decode (after the JPEG DCT draft) has more pixels is refused: ~120 MB of RGB.
THUMB_MAX_PIXELS = 40_000_000
#: Seconds a thumbnail request waits for the pool before it is answered 504.
THUMB_TIMEOUT_S = 30.0
MIN_THUMB, MAX_THUMB = 32, 1024
#: Largest page (``k``) a request may ask for; more is a 400.
MAX_PAGE = 200
#: Deepest ``offset`` a request may ask for (a filtered page costs O(offset)); more is a 400.
MAX_OFFSET = 1_000_000
#: HTTP worker threads, and connections that may wait for one; beyond both: 503.
HTTP_WORKERS = 8
HTTP_QUEUE = 32
#: Seconds a client may take to send its request before the worker drops it.
REQUEST_TIMEOUT_S = 20.0
#: Host header names always served (with any port): loopback only.
LOOPBACK_HOSTS = ("127.0.0.1", "localhost", "[::1]")
#: Deepest full-text result a page can reach (BM25 top-k is computed up to here).
MAX_RANKED = 10_000
#: Deepest ``offset`` of a page sorted by a score: each such page is a top-k sort of
#: ``offset + k`` rows, so it is bounded far below :data:`MAX_OFFSET`.
MAX_SORTED_OFFSET = 10_000
#: Default cosine of the cluster view: semantic dedup's default threshold
#: (``prx_data.skips.semdedup.DEFAULT_THRESHOLD``), so the view shows what it would merge.
CLUSTER_COSINE = 0.95
#: Members of a stored cluster the view reads (clusters average ``cluster_size`` rows).
MAX_CLUSTER_MEMBERS = 4096
#: The dedup job's column: the keeper's id on duplicates, null elsewhere.
DUP_OF = "dup_of"
CSP = (
    "default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self'; "
    "connect-src 'self'; base-uri 'none'; form-action 'none'; frame-ancestors 'none'"
)
#: Columns never offered as label filters.
NOT_LABELS = {S.ID, S.IMAGE, S.CAPTION, "source_file", "metadata", descriptor.COLUMN, S.EMBEDDING}
#: Columns offered as typed exact-match fields whatever their sample looks like.
ALWAYS_FIELDS = (DUP_OF,)
#: Image-quality filter values -> Lance SQL.
QUALITY_FILTERS = {
    "low": f"({Q.LOW_INFORMATION_SQL})",
    "ok": f"{Q.COLUMN} IS NOT NULL AND NOT ({Q.LOW_INFORMATION_SQL})",
    "unmeasured": f"{Q.COLUMN} IS NULL",
}


@dataclass(frozen=True)
class ExploreConfig:
    """What to serve and how. The table is only changed when ``build_indexes`` or
    ``descriptors="yes"`` asks for it."""

    table: str = flag(REQUIRED, "--table", help="Lance table URI")
    host: str = flag(
        DEFAULT_HOST,
        "--host",
        help="address to bind (default: %(default)s, this machine only; use 0.0.0.0 only "
        "on a trusted network: there is no authentication)",
    )
    port: int = flag(
        DEFAULT_PORT,
        "--port",
        type=int,
        help=f"port (default: {DEFAULT_PORT}; with --check any free one; 0: any free)",
    )
    page_size: int = flag(
        48,
        "--page-size",
        type=int,
        help=f"thumbnails per query, 1 to {MAX_PAGE} (default: %(default)s)",
    )
    #: auto: compute with ``build_indexes`` on tables up to AUTO_DESCRIPTOR_ROWS | yes | no
    descriptors: str = flag(
        "auto",
        "--descriptors",
        choices=("auto", "yes", "no"),
        help="pixel descriptors for similar-image search when the table has no vector "
        f"column: auto = with --build-indexes, if at most {AUTO_DESCRIPTOR_ROWS:,} rows "
        "(default); yes = compute them now (changes the table); no = never",
    )
    build_indexes: bool = flag(
        False,
        "--build-indexes",
        help="change the table at start if it lacks them: build the full-text (captions), "
        "BTREE (id) and vector indexes, and compute pixel descriptors (see --descriptors). "
        "Each adds a table version; without this flag the table is unchanged and each "
        "missing piece is printed as a 'would ...' line",
    )
    storage_options: dict | None = None
    #: Host header names served besides the loopback names and ``host``.
    allowed_hosts: tuple[str, ...] = flag(
        (),
        "--allow-host",
        append=True,
        metavar="NAME",
        help="also serve requests whose Host header is NAME (with any port), e.g. this "
        "machine's name when binding 0.0.0.0; repeatable. Loopback names (127.0.0.1, "
        "localhost, [::1]) and --host are always served; any other Host gets 421, so a "
        "DNS-rebinding page cannot read the table",
    )
    workers: int = HTTP_WORKERS
    queue: int = HTTP_QUEUE
    thumb_queue: int = THUMB_QUEUE
    thumb_timeout_s: float = THUMB_TIMEOUT_S

    def __post_init__(self) -> None:
        if not 1 <= self.page_size <= MAX_PAGE:
            raise UsageError(f"page size {self.page_size} is out of range: use 1 to {MAX_PAGE}")
        if self.descriptors not in ("auto", "yes", "no"):
            raise UsageError(f"descriptors must be auto, yes or no, not {self.descriptors!r}")
        if self.workers < 1 or self.queue < 0 or self.thumb_queue < 1:
            raise UsageError("workers and thumb_queue must be at least 1, queue at least 0")
        if not self.thumb_timeout_s > 0:
            raise UsageError(f"thumb_timeout_s must be positive, not {self.thumb_timeout_s}")
        for name in self.allowed_hosts:
            if _host_name(name) is None:
                raise UsageError(f"allowed host {name!r} is not a host name or IP address")


class RequestError(PrxDataError):
    """A request the server answers with ``status`` and a one-line ``message``."""

    def __init__(self, status: int, message: str):
        super().__init__(message)
        self.status = status
        self.message = message


@dataclass(frozen=True)
class Refused:
    """A thumbnail that will not be made (cached like one that was): why, for the 422."""

    reason: str


class Explorer:
    """The query side of the app: everything the HTTP handler calls (testable without HTTP)."""

    def __init__(self, cfg: ExploreConfig):
        self.cfg = cfg
        self.uri = cfg.table
        self._lock = threading.Lock()
        self._thumbs: OrderedDict[tuple[str, int], bytes | Refused | None] = OrderedDict()
        self._cache_bytes = 0
        self._pending: dict[tuple[str, int], Future] = {}
        self._ranked_cache: OrderedDict[tuple, tuple[pa.Table, bool]] = OrderedDict()
        self._pool = ThreadPoolExecutor(THUMB_WORKERS, thread_name_prefix="thumbs")
        self.prepare()

    # -- set-up --------------------------------------------------------------------
    def prepare(self) -> None:
        """Open the table; compute descriptors and build indexes only if configured to.

        Without ``build_indexes`` nothing is written: each missing piece is
        printed as one ``would ...`` line and the explorer runs with what exists.
        """
        ds = T.open_table(self.uri, self.cfg.storage_options)
        would: list[str] = []
        vec = search.vector_column(ds)
        vectors = ds.count_rows(f"{T.quote(vec)} IS NOT NULL") if vec else 0
        if vec is None and self.cfg.descriptors != "no":
            rows = ds.count_rows()
            if self.cfg.descriptors == "yes" or (
                self.cfg.build_indexes and rows <= AUTO_DESCRIPTOR_ROWS
            ):
                print(f"computing pixel descriptors for {rows:,} rows (for similar images)")
                descriptors.compute_descriptors(self.uri, storage_options=self.cfg.storage_options)
                ds = T.open_table(self.uri, self.cfg.storage_options)
                vec = search.vector_column(ds)
                vectors = ds.count_rows(f"{T.quote(vec)} IS NOT NULL") if vec else 0
            elif rows > AUTO_DESCRIPTOR_ROWS:
                print(
                    f"{rows:,} rows have no vector; similar images are off. Run with "
                    "--descriptors yes (or prx_data.columns.descriptors.compute_descriptors) "
                    "to enable them."
                )
            else:
                would.append(
                    f"compute pixel descriptors for {rows:,} rows (until then: no similar images)"
                )
                vec, vectors = descriptor.COLUMN, rows
        missing = self._missing_indexes(ds, vec, vectors)
        if missing and self.cfg.build_indexes:
            print("building search indexes:", ", ".join(sorted(missing)))
            search.build_indexes(self.uri, storage_options=self.cfg.storage_options)
            ds = T.open_table(self.uri, self.cfg.storage_options)
        else:
            would += [
                f"build {kind} index on {col} ({why})" for col, (kind, why) in missing.items()
            ]
        for line in would:
            print("would", line)
        if would:
            print("the table is unchanged: start with --build-indexes to build the above")
        self._load(ds)
        self._checked = time.monotonic()

    @staticmethod
    def _missing_indexes(ds, vec: str | None, vectors: int) -> dict[str, tuple[str, str]]:
        """{column: (index kind, what it gives)} that :func:`search.build_indexes` would add."""
        have = set(search.indexed_columns(ds))
        text = "full-text search; until then the search box matches ids only"
        want = {c: ("an INVERTED", text) for c in search.caption_columns(ds)}
        want[S.ID] = ("a BTREE", "fast id lookups")
        if vec is not None and vectors >= search.MIN_ROWS_FOR_ANN:
            want[vec] = (f"an {search.DEFAULT_VECTOR_INDEX}", "fast similar-image search")
        return {c: v for c, v in want.items() if c not in have}

    def _load(self, ds) -> None:
        """Derive everything the queries need from one table version."""
        self.ds = ds
        self.vector = search.vector_column(ds)
        self.captions = search.caption_columns(ds)
        indexed = search.indexed_columns(ds)
        self.text_columns = [c for c in self.captions if c in indexed]
        self.labels, self.fields = self._label_columns()
        # A label with one value in the whole sample tells nothing on a card (still a filter).
        self.card_labels = [c for c, values in self.labels.items() if len(values) > 1]
        self.has_quality = Q.COLUMN in ds.schema.names
        # Numeric columns and struct fields (scores, image quality, numeric attributes):
        # range filters, sorting and values on cards.
        self.scores = numeric_columns(ds.schema)
        # The cluster view compares CLIP image embeddings (what semantic dedup clusters).
        clip = search.CLIP_IMAGE_COLUMN in ds.schema.names
        self.cluster_column = search.CLIP_IMAGE_COLUMN if clip else self.vector

    def _label_columns(self) -> tuple[dict[str, list[str]], list[str]]:
        """String columns: few distinct values (in a sample) -> drop-down; else a typed field.

        String and boolean fields of struct columns (structured attributes such
        as ``attributes.style``, ``attributes.text_present``) with few values
        are drop-downs too, named ``<column>.<field>``.
        """
        labels: dict[str, list[str]] = {}
        self.bool_labels: set[str] = set()
        cols = [
            f.name
            for f in self.ds.schema
            if f.name not in NOT_LABELS
            and not search.is_caption_column(f.name)
            and (pa.types.is_string(f.type) or pa.types.is_large_string(f.type))
        ]
        fields = [c for c in ALWAYS_FIELDS if c in cols]
        candidates = [c for c in cols if c not in fields]
        if candidates:
            sample = self.ds.to_table(columns=candidates, limit=20_000)
            for c in candidates:
                values = sample[c].drop_null().unique()
                if 0 < len(values) <= MAX_LABEL_VALUES:
                    labels[c] = sorted(values.to_pylist())
                elif len(values) > MAX_LABEL_VALUES:
                    fields.append(c)
        nested = [
            (f.name, c.name, pa.types.is_boolean(c.type))
            for f in self.ds.schema
            if pa.types.is_struct(f.type) and f.name not in NOT_LABELS
            for c in (f.type.field(i) for i in range(f.type.num_fields))
            if "." not in c.name and (pa.types.is_string(c.type) or pa.types.is_boolean(c.type))
        ]
        if nested:
            sample = self.ds.to_table(columns=sorted({h for h, _, _ in nested}), limit=20_000)
            for head, name, is_bool in nested:
                values = pc.struct_field(sample[head], name).drop_null().unique().to_pylist()
                key = f"{head}.{name}"
                if is_bool and values:
                    labels[key] = ["false", "true"]
                    self.bool_labels.add(key)
                elif 0 < len(values) <= MAX_LABEL_VALUES:
                    labels[key] = sorted(values)
        return labels, fields

    # -- queries ---------------------------------------------------------------------
    def meta(self) -> dict[str, Any]:
        return {
            "table": self.uri,
            "rows": self.ds.count_rows(),
            "text_columns": self.text_columns,
            "caption_columns": self.captions,
            "vector_column": self.vector,
            "tiers": [str(t) for t in DEFAULT_SPEC.tiers] + ["too_small"],
            "aspects": list(search.aspect_ranges()) + ["out_of_range"],
            "labels": self.labels,
            "fields": [S.ID, *self.fields],
            "quality": list(QUALITY_FILTERS) if self.has_quality else [],
            "quality_column": Q.COLUMN if self.has_quality else None,
            "scores": self.scores,
            "cluster_column": self.cluster_column,
            "cluster_cosine": CLUSTER_COSINE,
            "page_size": self.cfg.page_size,
        }

    def _filter(self, params: dict[str, str]) -> str | None:
        labels = {
            k[len("label.") :]: v
            for k, v in params.items()
            if k.startswith("label.") and k[len("label.") :] in self.labels
        }
        clauses = []
        for col in [c for c in labels if "." in c]:  # struct fields: attributes
            value = labels.pop(col)
            if not value:
                continue
            if col in self.bool_labels:
                if value not in ("true", "false"):
                    raise UsageError(f"label.{col} must be true or false, got {value[:20]!r}")
                clauses.append(f"{column_sql(col)} = {value}")
            else:
                clauses.append(f"{column_sql(col)} = {search.sql_str(value)}")
        base = search.filter_sql(
            tier=params.get("tier") or None, aspect=params.get("aspect") or None, labels=labels
        )
        if base:
            clauses.append(base)
        quality = params.get("quality") or ""
        if quality:
            if not self.has_quality or quality not in QUALITY_FILTERS:
                raise UsageError(
                    f"unknown quality filter {quality!r}"
                    + ("" if self.has_quality else f" (the table has no {Q.COLUMN} column)")
                )
            clauses.append(f"({QUALITY_FILTERS[quality]})")
        prefix = (params.get("field.id") or "").strip()
        if prefix:
            clauses.append(f"starts_with({S.ID}, {search.sql_str(prefix)})")
        for col in self.fields:
            value = (params.get("field." + col) or "").strip()
            if value:
                clauses.append(f"{T.quote(col)} = {search.sql_str(value)}")
        for col in self.scores:  # min.<score> / max.<score>: an inclusive range
            for key, op in (("min.", ">="), ("max.", "<=")):
                value = (params.get(key + col) or "").strip()
                if value:
                    try:
                        bound = float(value)
                    except ValueError:
                        bound = float("nan")
                    if bound != bound or bound in (float("inf"), float("-inf")):
                        raise UsageError(f"{key}{col} must be a number, got {value!r}")
                    clauses.append(f"{column_sql(col)} {op} {bound!r}")
        return " AND ".join(clauses) or None

    def _columns(self) -> list[str]:
        names = self.ds.schema.names
        want = [S.ID, S.WIDTH, S.HEIGHT, *self.captions, *self.fields]
        want += [c.split(".", 1)[0] for c in self.labels]
        if self.has_quality:
            want.append(Q.COLUMN)
        want += [c.split(".", 1)[0] for c in self.scores]
        return [c for c in dict.fromkeys(want) if c in names]

    def _sort(self, params: dict[str, str]) -> tuple[str, bool] | None:
        """``sort=<numeric column>`` and ``order=desc|asc`` (default desc); None without sort."""
        col = (params.get("sort") or "").strip()
        order = (params.get("order") or "desc").strip()
        if not col:
            return None
        if col not in self.scores:
            raise UsageError(
                f"cannot sort by {col[:60]!r}: use one of the numeric columns "
                + (", ".join(self.scores) or "(the table has none)")
            )
        if order not in ("asc", "desc"):
            raise UsageError(f"order must be asc or desc, not {order[:20]!r}")
        return col, order == "asc"

    def _rows(self, t: pa.Table, score: str | None = None) -> list[dict[str, Any]]:
        out = []
        for r in t.to_pylist():
            q = r.get(Q.COLUMN)
            item = {
                "id": r[S.ID],
                "caption": r.get(S.CAPTION),
                "captions": {c: r.get(c) for c in self.captions},
                "labels": {
                    c: (str(v).lower() if isinstance(v, bool) else v)
                    for c in self.card_labels
                    if (v := _value(r, c)) is not None
                },
                "dup_of": r.get(DUP_OF),
                "width": r.get(S.WIDTH),
                "height": r.get(S.HEIGHT),
                "quality": q,
                "scores": {c: v for c in self.scores if (v := _value(r, c)) is not None},
                "low_information": bool(
                    q and Q.is_low_information(q["std"], q["entropy"], q["flat"])
                ),
            }
            if score and score in r:
                item["score"] = r[score]
            out.append(item)
        self.prefetch([i["id"] for i in out])
        return out

    def refresh(self, min_interval_s: float = 5.0) -> None:
        """Follow new table versions (columns added by other jobs) at most every few seconds."""
        now = time.monotonic()
        if now - self._checked < min_interval_s:
            return
        self._checked = now
        latest = T.open_table(self.uri, self.cfg.storage_options)
        if latest.version != self.ds.version:
            with self._lock:
                self._load(latest)
                self._thumbs.clear()
                self._cache_bytes = 0

    def search(self, params: dict[str, str]) -> dict[str, Any]:
        """One page of results: text search when ``q`` is given, else browse; both filtered.

        ``offset``/``k`` page through the results; ``next_offset`` is null on
        the last page. A query that is exactly a row id puts that row first.
        """
        self.refresh()
        q = (params.get("q") or "").strip()
        k = int_param(params, "k", self.cfg.page_size, 1, MAX_PAGE)
        sort = self._sort(params)
        offset = int_param(params, "offset", 0, 0, MAX_SORTED_OFFSET if sort else MAX_OFFSET)
        where = self._filter(params)
        cols = self._columns()
        page: dict[str, Any] = {"query": q, "offset": offset, "k": k}
        exact: list[dict[str, Any]] = []
        if q:
            id_where = f"{S.ID} = {search.sql_str(q)}" + (f" AND ({where})" if where else "")
            exact = self._rows(self.ds.to_table(columns=cols, filter=id_where, limit=1))
        if q and self.text_columns:
            t = self._ranked(q, where, cols, offset + k + 1, k)
            if sort:  # the ranked window (the best MAX_RANKED hits), reordered by the score
                t = _sorted(t, *sort)
            rows = self._rows(t.slice(offset, k + 1), "_score")
            page["mode"] = "text"
        elif q:
            rows, page["mode"] = [], "id"
        else:
            order = None
            if sort:  # a top-k sort (offset + k + 1 rows held); ties and nulls in a fixed order
                from lance.dataset import ColumnOrdering

                order = [
                    ColumnOrdering(sort[0], ascending=sort[1], nulls_first=False),
                    ColumnOrdering(S.ID, ascending=True),
                ]
            t = self.ds.to_table(
                columns=cols, filter=where, offset=offset, limit=k + 1, order_by=order
            )
            rows = self._rows(t)
            page["mode"] = "browse"
        more = len(rows) > k
        rows = rows[:k]
        if exact:  # the query is a row id: show that row, not captions that share its words
            rows, more, page["mode"] = exact, False, "id"
        page["results"] = rows
        if sort:
            page["sort"], page["order"] = sort[0], "asc" if sort[1] else "desc"
            more = more and offset + k <= MAX_SORTED_OFFSET
        page["next_offset"] = offset + k if more else None
        return page

    def _ranked(self, q: str, where: str | None, cols: list[str], need: int, k: int) -> pa.Table:
        """The top ``need`` full-text hits, ranked once and kept, so pages never overlap.

        BM25 ties (equal captions) come back in any order from one query to the
        next, so each page re-querying would repeat or skip rows. The ranked
        window is cached per (table version, query, filter), ties broken by
        id, and grown fourfold when a page reaches past it.
        """
        key = (self.ds.version, q, where, tuple(cols))
        with self._lock:
            hit = self._ranked_cache.get(key)
        if hit is not None and (hit[1] or hit[0].num_rows >= need):
            return hit[0]
        window = min(max(need, 4 * k, 4 * (hit[0].num_rows if hit else 0)), MAX_RANKED)
        t = search.text_search(
            self.ds, q, k=window, columns=cols, search_columns=self.text_columns, filter=where
        )
        if t.num_rows:
            t = t.sort_by([("_score", "descending"), (S.ID, "ascending")])
        with self._lock:
            self._ranked_cache[key] = (t, t.num_rows < window)
            while len(self._ranked_cache) > 64:
                self._ranked_cache.popitem(last=False)
        return t

    def similar(self, params: dict[str, str]) -> dict[str, Any]:
        row_id = params.get("id") or ""
        k = int_param(params, "k", 24, 1, MAX_PAGE)
        if self.vector is None:
            return {"id": row_id, "results": [], "error": "no vector column"}
        try:
            t = search.similar(
                self.ds,
                row_id,
                k=k,
                column=self.vector,
                columns=self._columns(),
                filter=self._filter(params),
            )
        except KeyError:
            return {"id": row_id, "results": [], "error": "no vector for this image"}
        return {"id": row_id, "results": self._rows(t, "_distance")}

    def cluster(self, params: dict[str, str]) -> dict[str, Any]:
        """An image and its near duplicates side by side: the cluster semantic dedup would merge.

        When semantic dedup stored the image's cluster (``semdedup_cluster``),
        the view shows that cluster's members (:meth:`_stored_cluster`).
        Otherwise it is the image's nearest neighbours by the CLIP image
        embedding (else the table's vector column) with cosine >= ``cosine``,
        the image itself included, ordered as semdedup ranks members: largest
        width x height first, then smallest id. The first is the one it keeps.
        """
        row_id = params.get("id") or ""
        k = int_param(params, "k", 24, 1, MAX_PAGE)
        raw = (params.get("cosine") or "").strip()
        try:
            cosine = float(raw) if raw else CLUSTER_COSINE
        except ValueError:
            cosine = float("nan")
        if not -1.0 <= cosine <= 1.0:
            raise UsageError(f"cosine must be a number from -1 to 1, got {raw[:40]!r}")
        col = self.cluster_column
        out: dict[str, Any] = {"id": row_id, "column": col, "cosine": cosine, "members": []}
        if col is None:
            return {**out, "error": "no vector column"}
        stored = self._stored_cluster(row_id, col, cosine, k)
        if stored is not None:
            return {**out, **stored}
        vec = search.vector_of(self.ds, row_id, col)
        if vec is None:
            return {**out, "error": "no vector for this image"}
        t = search.vector_search(self.ds, vec, k=k + 1, column=col, columns=self._columns())
        t = t.filter(pc.less_equal(t["_distance"], 1.0 - cosine + 1e-6))
        members = self._rows(t, "_distance")
        for m in members:
            m["cosine"] = round(1.0 - float(m.pop("score")), 4)
        if row_id not in {m["id"] for m in members}:  # an ANN index may miss the query itself
            members = (
                self._rows(
                    self.ds.to_table(
                        columns=self._columns(),
                        filter=f"{S.ID} = {search.sql_str(row_id)}",
                        limit=1,
                    )
                )
                + members
            )
            members[0]["cosine"] = 1.0
        members.sort(key=lambda m: (-((m["width"] or 0) * (m["height"] or 0)), m["id"]))
        return {**out, "members": members, "keeper": members[0]["id"] if members else None}

    def _stored_cluster(self, row_id: str, col: str, cosine: float, k: int) -> dict | None:
        """The image's cluster as semantic dedup stored it (``semdedup_cluster``), else None.

        Members are ranked as semdedup ranks them; the kept one is the first
        within ``cosine`` of the image, and the view lists the members within
        ``cosine`` of it (each with its stored best cosine to a better member).
        """
        import numpy as np

        cl, best = search.SEMDEDUP_CLUSTER_COLUMN, search.SEMDEDUP_COSINE_COLUMN
        if cl not in self.ds.schema.names:
            return None
        me = self.ds.to_table(columns=[cl], filter=f"{S.ID} = {search.sql_str(row_id)}", limit=1)
        if me.num_rows == 0 or me[cl][0].as_py() is None:
            return None
        c = int(me[cl][0].as_py())
        cols = list(dict.fromkeys([*self._columns(), best, col]))
        t = self.ds.to_table(
            columns=cols,
            filter=f"{T.quote(cl)} = {c} AND {T.quote(col)} IS NOT NULL",
            limit=MAX_CLUSTER_MEMBERS,
        )
        ids = t[S.ID].to_pylist()
        if row_id not in ids:
            return None
        area = [
            (w or 0) * (h or 0)
            for w, h in zip(t[S.WIDTH].to_pylist(), t[S.HEIGHT].to_pylist(), strict=True)
        ]
        order = sorted(range(len(ids)), key=lambda i: (-area[i], ids[i]))
        vec = np.asarray(t[col].combine_chunks().flatten(), np.float32).reshape(len(ids), -1)
        vec = vec / np.maximum(np.linalg.norm(vec, axis=1, keepdims=True), 1e-12)
        near = vec @ vec[ids.index(row_id)]
        kept = next(i for i in order if near[i] >= cosine - 1e-6)
        to_kept = vec @ vec[kept]
        pick = [i for i in order if to_kept[i] >= cosine - 1e-6][:k]
        members = self._rows(t.take(pick))
        for m, i in zip(members, pick, strict=True):
            m["cosine"] = round(float(to_kept[i]), 4)
            m["semdedup_cosine"] = t[best][i].as_py()
        return {"members": members, "keeper": ids[kept], "cluster": c, "stored": True}

    def row(self, row_id: str) -> dict[str, Any] | None:
        cols = [
            c for c in self.ds.schema.names if c not in (S.IMAGE, S.EMBEDDING, descriptor.COLUMN)
        ]
        t = self.ds.to_table(columns=cols, filter=f"{S.ID} = {search.sql_str(row_id)}", limit=1)
        if t.num_rows == 0:
            return None
        return {
            k: (v if isinstance(v, (str, int, float, bool, type(None))) else str(v))
            for k, v in t.to_pylist()[0].items()
        }

    def prefetch(self, ids: list[str], size: int = THUMB_SIZE) -> None:
        """Queue thumbnails for ``ids`` on the background pool (one read for the whole page).

        Best effort: ids beyond the bounded queue are left for their own request.
        """
        with self._lock:
            self._queue_locked(ids, size)

    def _queue_locked(self, ids: list[str], size: int) -> int:
        """Queue what fits of ``ids`` (caller holds the lock); returns how many were queued."""
        todo = [i for i in ids if (i, size) not in self._thumbs and (i, size) not in self._pending]
        todo = todo[: max(0, self.cfg.thumb_queue - len(self._pending))]
        if todo:
            fut = self._pool.submit(self._make_thumbs, todo, size)
            for i in todo:
                self._pending[(i, size)] = fut
        return len(todo)

    def _make_thumbs(self, ids: list[str], size: int) -> None:
        try:
            ds = self.ds
            where = f"{S.ID} IN ({', '.join(search.sql_str(i) for i in ids)})"
            t = ds.to_table(columns=[S.ID, S.IMAGE], filter=where)
            found = dict(zip(t[S.ID].to_pylist(), t[S.IMAGE].to_pylist(), strict=True))
            for i in ids:
                data = _thumb_bytes(found.get(i), size)
                with self._lock:
                    old = self._thumbs.pop((i, size), None)
                    self._cache_bytes -= len(old) if isinstance(old, bytes) else 0
                    self._thumbs[(i, size)] = data
                    self._cache_bytes += len(data) if isinstance(data, bytes) else 0
                    self._pending.pop((i, size), None)
                    while len(self._thumbs) > THUMB_CACHE or self._cache_bytes > THUMB_CACHE_BYTES:
                        _, gone = self._thumbs.popitem(last=False)
                        self._cache_bytes -= len(gone) if isinstance(gone, bytes) else 0
        finally:
            with self._lock:
                for i in ids:
                    self._pending.pop((i, size), None)

    def thumbnail(self, row_id: str, size: int = THUMB_SIZE) -> bytes | None:
        """JPEG thumbnail of a row's image (None if unknown id or undecodable); LRU-cached.

        Served from the cache the page's prefetch filled; a row not prefetched
        (another size, or an evicted entry) is made on the pool all the same.
        Raises :class:`RequestError`: 422 for an image too large to decode, 503
        when the thumbnail queue is full, 504 when it is not ready in time.
        """
        key = (row_id, size)
        for _ in range(2):
            with self._lock:
                if key in self._thumbs:
                    self._thumbs.move_to_end(key)
                    return _served(self._thumbs[key])
                fut = self._pending.get(key)
                if fut is None and self._queue_locked([row_id], size):
                    fut = self._pending.get(key)
            if fut is None:
                raise RequestError(
                    HTTPStatus.SERVICE_UNAVAILABLE,
                    f"the thumbnail queue is full ({self.cfg.thumb_queue} images); retry shortly",
                )
            try:
                fut.result(timeout=self.cfg.thumb_timeout_s)
            except concurrent.futures.TimeoutError:
                raise RequestError(
                    HTTPStatus.GATEWAY_TIMEOUT,
                    f"thumbnail not ready within {self.cfg.thumb_timeout_s:g} s "
                    "(the server is busy); retry shortly",
                ) from None
        with self._lock:
            return _served(self._thumbs.get(key))

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)


def _value(row: dict[str, Any], column: str) -> Any:
    """A row's value of ``column`` or ``struct.field`` (None when missing)."""
    head, _, field = column.partition(".")
    v = row.get(head)
    if field:
        v = v.get(field) if isinstance(v, dict) else None
    return v


def _sorted(t: pa.Table, column: str, ascending: bool) -> pa.Table:
    """``t`` by ``column`` (or ``struct.field``), nulls last, ties by id."""
    head, _, field = column.partition(".")
    key = t[head]
    if field:
        key = pc.struct_field(key, field)
    t = t.append_column("__sort", key)
    order = "ascending" if ascending else "descending"
    t = t.sort_by([("__sort", order), (S.ID, "ascending")], null_placement="at_end")
    return t.drop_columns(["__sort"])


def int_param(params: dict[str, str], name: str, default: int, lo: int, hi: int) -> int:
    """A whole-number query parameter in [lo, hi]; anything else is a ValueError (a 400)."""
    raw = (params.get(name) or "").strip()
    if not raw:
        return default
    if not (raw.isascii() and raw.isdigit()):
        raise UsageError(f"{name} must be a whole number from {lo} to {hi:,}, not {raw[:40]!r}")
    if len(raw) > len(str(hi)) or not lo <= int(raw) <= hi:
        raise UsageError(f"{name}={raw[:40]} is out of range: use {lo} to {hi:,}")
    return int(raw)


def _served(entry: bytes | Refused | None) -> bytes | None:
    if isinstance(entry, Refused):
        raise RequestError(HTTPStatus.UNPROCESSABLE_ENTITY, entry.reason)
    return entry


def _thumb_bytes(data: bytes | None, size: int) -> bytes | Refused | None:
    """The thumbnail JPEG; None if undecodable; :class:`Refused` if the decode is too large.

    The size is read from the header first: a JPEG is decoded through its DCT
    draft (at most 1/8 per side), so only what would really be decoded counts.
    """
    if not data:
        return None
    try:
        im = open_image(data)
        if im.format == "JPEG":
            im.draft("RGB", (size, size))
        w, h = im.size
    except ImageError as e:
        if e.reason == "decompression_bomb":
            return Refused(f"image refused: a decompression bomb ({e.detail})")
        return None
    except (OSError, ValueError, SyntaxError):  # a header Pillow opens but cannot draft
        return None
    if w * h > THUMB_MAX_PIXELS:
        return Refused(
            f"image refused: it decodes to {w}x{h} pixels, over the thumbnail limit of "
            f"{THUMB_MAX_PIXELS:,}"
        )
    try:
        im = decode(data, draft_to=(size, size))
    except ImageError:
        return None
    im.thumbnail((size, size), Image.Resampling.LANCZOS)
    buf = io.BytesIO()
    im.save(buf, "JPEG", quality=85)
    return buf.getvalue()


_HOST = re.compile(r"(\[[0-9a-f:.]+\]|[a-z0-9._-]+)(?::[0-9]{1,5})?", re.ASCII)


def _host_name(value: str) -> str | None:
    """The name part of a Host header (lower case, IPv6 in brackets), None if malformed."""
    value = value.strip().lower()
    if ":" in value and not value.startswith("[") and value.count(":") > 1:
        value = f"[{value}]"  # a bare IPv6 address (as --host takes it)
    m = _HOST.fullmatch(value)
    return m.group(1) if m else None


def allowed_host_names(cfg: ExploreConfig) -> frozenset[str]:
    """The Host names served: loopback, the bound host and ``cfg.allowed_hosts``."""
    names = {*LOOPBACK_HOSTS, *(n for n in map(_host_name, cfg.allowed_hosts) if n)}
    bound = _host_name(cfg.host) if cfg.host else None
    if bound and bound not in ("0.0.0.0", "[::]"):
        names.add(bound)
    return frozenset(names)


# --- HTTP ---------------------------------------------------------------------------------

_PLACEHOLDER = None


def _placeholder() -> bytes:
    global _PLACEHOLDER
    if _PLACEHOLDER is None:
        buf = io.BytesIO()
        Image.new("RGB", (64, 64), (200, 200, 200)).save(buf, "PNG")
        _PLACEHOLDER = buf.getvalue()
    return _PLACEHOLDER


def _static(name: str) -> bytes | None:
    if "/" in name or name.startswith("."):
        return None
    res = resources.files("prx_data.explore").joinpath("static", name)
    return res.read_bytes() if res.is_file() else None


#: A browser that navigates away or cancels a thumbnail closes its connection mid-reply.
CLIENT_GONE = (BrokenPipeError, ConnectionResetError, ConnectionAbortedError)


def _busy_reply(workers: int, waiting: int) -> bytes:
    body = json.dumps(
        {
            "error": f"the explorer is busy ({workers} workers and {waiting} waiting "
            "connections are taken); retry shortly"
        }
    ).encode()
    head = (
        "HTTP/1.0 503 Service Unavailable\r\n"
        "Content-Type: application/json; charset=utf-8\r\n"
        f"Content-Length: {len(body)}\r\nRetry-After: 1\r\nCache-Control: no-store\r\n"
        "Connection: close\r\n\r\n"
    )
    return head.encode() + body


class ExploreServer(HTTPServer):
    """An HTTP server with a fixed pool of worker threads, never a thread per request.

    At most ``workers`` requests run and ``queue`` more wait; a connection
    beyond that is answered 503 by one refusal thread (which reads its request
    head for at most a second, so the client sees the reply rather than a
    reset) and closed. Refusals beyond its own small queue are just closed.
    """

    #: Connections waiting for the refusal thread; beyond it they are closed unanswered.
    REFUSAL_QUEUE = 64

    def __init__(
        self, address, handler, *, workers: int = HTTP_WORKERS, queue_size: int = HTTP_QUEUE
    ):
        super().__init__(address, handler)
        self._slots = threading.BoundedSemaphore(workers + queue_size)
        self._workers = ThreadPoolExecutor(workers, thread_name_prefix="explore-http")
        self._busy = _busy_reply(workers, queue_size)
        self._refusals: queue.Queue[socket.socket | None] = queue.Queue(self.REFUSAL_QUEUE)
        self._refuser = threading.Thread(
            target=self._refuse_loop, name="explore-http-refuse", daemon=True
        )
        self._refuser.start()

    def process_request(self, request, client_address) -> None:
        if not self._slots.acquire(blocking=False):
            try:
                self._refusals.put_nowait(request)
            except queue.Full:
                self.shutdown_request(request)
            return
        try:
            self._workers.submit(self._work, request, client_address)
        except RuntimeError:  # shutting down
            self._slots.release()
            self.shutdown_request(request)

    def _work(self, request, client_address) -> None:
        try:
            self.finish_request(request, client_address)
        except Exception:
            self.handle_error(request, client_address)
        finally:
            self.shutdown_request(request)
            self._slots.release()

    def _refuse_loop(self) -> None:
        while (request := self._refusals.get()) is not None:
            try:
                request.settimeout(1.0)
                head = b""
                while b"\r\n\r\n" not in head and len(head) < 65536:
                    chunk = request.recv(4096)
                    if not chunk:
                        break
                    head += chunk
                request.sendall(self._busy)
            except OSError:
                pass
            finally:
                self.shutdown_request(request)

    def handle_error(self, request, client_address) -> None:
        """Client disconnects are routine: no traceback for them; anything else is reported."""
        if isinstance(sys.exc_info()[1], CLIENT_GONE):
            return
        super().handle_error(request, client_address)

    def server_close(self) -> None:
        super().server_close()
        if not hasattr(self, "_workers"):  # the bind failed: nothing of ours was started
            return
        try:
            self._refusals.put_nowait(None)
        except queue.Full:  # the refusal thread is a daemon: it ends with the process
            pass
        self._workers.shutdown(wait=False, cancel_futures=True)
        app = getattr(self, "app", None)
        if app is not None:
            app.close()


def make_handler(app: Explorer) -> type[BaseHTTPRequestHandler]:
    hosts = allowed_host_names(app.cfg)

    class Handler(BaseHTTPRequestHandler):
        server_version = "prx-explore"
        #: A client that sends nothing holds a worker no longer than this.
        timeout = REQUEST_TIMEOUT_S

        def handle(self) -> None:
            try:
                super().handle()
            except CLIENT_GONE:
                self.close_connection = True

        def log_message(self, fmt, *args):  # quiet by default
            if os.environ.get("PRX_EXPLORE_LOG"):
                super().log_message(fmt, *args)

        def _send(
            self,
            status: int,
            body: bytes,
            ctype: str,
            cache: bool = False,
            headers: dict[str, str] | None = None,
        ) -> None:
            try:
                self._write(status, body, ctype, cache, headers)
            except TimeoutError:  # the socket timeout: a client that stopped reading
                raise ConnectionAbortedError("the client did not read the reply in time") from None

        def _write(
            self, status: int, body: bytes, ctype: str, cache: bool, headers: dict[str, str] | None
        ) -> None:
            self.send_response(status)
            self.send_header("Content-Type", ctype)
            self.send_header("Content-Length", str(len(body)))
            self.send_header("Content-Security-Policy", CSP)
            self.send_header("X-Content-Type-Options", "nosniff")
            self.send_header("Referrer-Policy", "no-referrer")
            self.send_header("Cache-Control", "max-age=3600" if cache else "no-store")
            for k, v in (headers or {}).items():
                self.send_header(k, v)
            self.end_headers()
            self.wfile.write(body)

        def _json(self, obj: Any, status: int = 200, headers: dict[str, str] | None = None) -> None:
            body = json.dumps(obj).encode()
            self._send(status, body, "application/json; charset=utf-8", headers=headers)

        def _host_ok(self) -> bool:
            """Serve only Host names on the allow-list: DNS rebinding gets a 421, no data."""
            host = self.headers.get("Host")
            if host is None:
                self._json({"error": "missing Host header"}, int(HTTPStatus.BAD_REQUEST))
                return False
            if _host_name(host) in hosts:
                return True
            self.close_connection = True
            example = f"http://127.0.0.1:{self.server.server_address[1]}/"
            self._json(
                {
                    "error": f"Host {host[:100]!r} is not served here (a guard against DNS "
                    f"rebinding); open {example} or start the explorer with --allow-host NAME"
                },
                int(HTTPStatus.MISDIRECTED_REQUEST),
            )
            return False

        def do_GET(self) -> None:  # noqa: N802 (http.server's naming)
            if not self._host_ok():
                return
            url = urlparse(self.path)
            params = {k: v[-1] for k, v in parse_qs(url.query).items()}
            try:
                self._route(url.path, params)
            except RequestError as e:
                retry = {"Retry-After": "1"} if e.status == HTTPStatus.SERVICE_UNAVAILABLE else None
                self._json({"error": e.message}, int(e.status), retry)
            except ValueError as e:  # bad filter values, out-of-range offsets and the like
                self._json({"error": str(e)}, int(HTTPStatus.BAD_REQUEST))
            except TimeoutError as e:
                self._json({"error": f"timed out: {e}"}, int(HTTPStatus.GATEWAY_TIMEOUT))
            except CLIENT_GONE:
                raise
            except Exception as e:  # a bug: answer, then let the server report the traceback
                self._json({"error": f"internal error: {type(e).__name__}"}, 500)
                raise

        def _route(self, path: str, params: dict[str, str]) -> None:
            if path in ("/", "/index.html"):
                self._send(200, _static("index.html") or b"", "text/html; charset=utf-8")
            elif path.startswith("/static/"):
                name = path[len("/static/") :]
                body = _static(name)
                if body is None:
                    self._json({"error": "not found"}, 404)
                else:
                    ctype = mimetypes.guess_type(name)[0] or "application/octet-stream"
                    self._send(200, body, ctype)
            elif path == "/api/meta":
                self._json(app.meta())
            elif path == "/api/search":
                self._json(app.search(params))
            elif path == "/api/similar":
                self._json(app.similar(params))
            elif path == "/api/cluster":
                self._json(app.cluster(params))
            elif path == "/api/row":
                row = app.row(params.get("id", ""))
                self._json(row if row is not None else {"error": "not found"}, 200 if row else 404)
            elif path == "/api/thumb":
                size = int_param(params, "size", THUMB_SIZE, MIN_THUMB, MAX_THUMB)
                data = app.thumbnail(params.get("id", ""), size)
                if data is None:
                    self._send(200, _placeholder(), "image/png")
                else:
                    self._send(200, data, "image/jpeg", cache=True)
            else:
                self._json({"error": "not found"}, 404)

    return Handler


def serve(cfg: ExploreConfig) -> ExploreServer:
    """Build the app and an HTTP server bound to ``cfg.host:cfg.port`` (port 0: any free one)."""
    app = Explorer(cfg)
    try:
        server = ExploreServer(
            (cfg.host, cfg.port), make_handler(app), workers=cfg.workers, queue_size=cfg.queue
        )
    except OSError as e:
        if e.errno != errno.EADDRINUSE:
            raise
        raise UsageError(
            f"port {cfg.port} on {cfg.host} is in use (another explorer?): pass --port 0 for "
            "any free port, or another --port"
        ) from None
    server.app = app  # type: ignore[attr-defined]
    return server
