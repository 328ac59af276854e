"""``python -m prx_data.explore --table URI``: browse a Lance image table in a web browser.

Live caption search (BM25 full text, or an exact id), a paged thumbnail grid
whose cards show every caption column, the labels, the duplicate state and
the id; click an image to see visually similar ones (vector search on the
source's embedding or the pixel descriptor). Filters: tier, aspect-ratio
bucket, image quality, drop-downs for label columns with few values, and
typed exact-match fields for columns with unbounded values (``id`` prefix,
``dup_of``).

Paging is by offset, so a page costs one bounded scan whatever the table
size. Thumbnails for a page are made by a small background pool as soon as
the page is served (cached ahead), so a search never waits behind them.

A small stdlib HTTP server with a JSON API and static files; it binds to
127.0.0.1 unless told otherwise. The page never puts table text into HTML:
captions are inserted with ``textContent``, and a Content-Security-Policy
forbids inline scripts, so a caption such as ``<script>`` stays text.
"""

from __future__ import annotations

import io
import json
import mimetypes
import os
import threading
import time
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from importlib import resources
from typing import Any
from urllib.parse import parse_qs, urlparse

import pyarrow as pa
from PIL import Image

from prx_data.columns import descriptors
from prx_data.core import descriptor
from prx_data.core import quality as Q
from prx_data.core import schema as S
from prx_data.core.buckets import DEFAULT_SPEC
from prx_data.core.imaging import ImageError, decode
from prx_data.table import lance_ops as T
from prx_data.table import search

DEFAULT_HOST = "127.0.0.1"
DEFAULT_PORT = 8765
#: Descriptors are computed at start-up without asking when at most this many are missing.
AUTO_DESCRIPTOR_ROWS = 50_000
MAX_LABEL_VALUES = 40
THUMB_SIZE = 256
THUMB_CACHE = 4000
#: Background threads making thumbnails ahead of the browser asking for them.
THUMB_WORKERS = 2
MAX_PAGE = 500
#: Deepest full-text result a page can reach (BM25 top-k is computed up to here).
MAX_RANKED = 10_000
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


@dataclass
class ExploreConfig:
    table: str
    host: str = DEFAULT_HOST
    port: int = DEFAULT_PORT
    page_size: int = 48
    descriptors: str = "auto"  # auto | yes | no
    build_indexes: bool = True
    storage_options: dict | None = None


class Explorer:
    """The query side of the app: everything the HTTP handler calls (testable without HTTP)."""

    def __init__(self, cfg: ExploreConfig):
        self.cfg = cfg
        self.uri = cfg.table
        self._lock = threading.Lock()
        self._thumbs: OrderedDict[tuple[str, int], bytes | None] = OrderedDict()
        self._pending: dict[tuple[str, int], Future] = {}
        self._ranked_cache: OrderedDict[tuple, tuple[pa.Table, bool]] = OrderedDict()
        self._pool = ThreadPoolExecutor(THUMB_WORKERS, thread_name_prefix="thumbs")
        self.prepare()

    # -- set-up --------------------------------------------------------------------
    def prepare(self) -> None:
        """Compute missing descriptors and indexes as configured, then open the table."""
        ds = T.open_table(self.uri, self.cfg.storage_options)
        if search.vector_column(ds) is None and self.cfg.descriptors != "no":
            missing = ds.count_rows()
            if self.cfg.descriptors == "yes" or missing <= AUTO_DESCRIPTOR_ROWS:
                print(f"computing pixel descriptors for {missing:,} rows (for similar images)")
                descriptors.compute_descriptors(self.uri, storage_options=self.cfg.storage_options)
            else:
                print(
                    f"{missing:,} rows have no vector; similar images are off. Run with "
                    "--descriptors yes (or prx_data.core.descriptors.compute_descriptors) to enable them."
                )
        ds = T.open_table(self.uri, self.cfg.storage_options)
        if self.cfg.build_indexes:
            have = {f for i in ds.list_indices() for f in i["fields"]}
            want = set(search.caption_columns(ds)) | {S.ID}
            vec = search.vector_column(ds)
            if vec and ds.count_rows() >= search.MIN_ROWS_FOR_ANN:
                want.add(vec)
            if not want <= have:
                print("building search indexes:", ", ".join(sorted(want - have)))
                search.build_indexes(self.uri, storage_options=self.cfg.storage_options)
        self._load(T.open_table(self.uri, self.cfg.storage_options))
        self._checked = time.monotonic()

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

    def _label_columns(self) -> tuple[dict[str, list[str]], list[str]]:
        """String columns: few distinct values (in a sample) -> drop-down; else a typed field."""
        labels: dict[str, list[str]] = {}
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
            "page_size": self.cfg.page_size,
        }

    def _filter(self, params: dict[str, str]) -> str | None:
        labels = {
            k[len("label.") :]: v
            for k, v in params.items()
            if k.startswith("label.") and k[len("label.") :] in self.labels
        }
        clauses = []
        base = search.filter_sql(
            tier=params.get("tier") or None, aspect=params.get("aspect") or None, labels=labels
        )
        if base:
            clauses.append(base)
        quality = params.get("quality") or ""
        if quality:
            if not self.has_quality or quality not in QUALITY_FILTERS:
                raise ValueError(
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
        return " AND ".join(clauses) or None

    def _columns(self) -> list[str]:
        names = self.ds.schema.names
        want = [S.ID, S.WIDTH, S.HEIGHT, *self.captions, *self.labels, *self.fields]
        if self.has_quality:
            want.append(Q.COLUMN)
        return [c for c in dict.fromkeys(want) if c in names]

    def _rows(self, t: pa.Table, score: str | None = None) -> list[dict[str, Any]]:
        out = []
        for r in t.to_pylist():
            q = r.get(Q.COLUMN)
            item = {
                "id": r[S.ID],
                "caption": r.get(S.CAPTION),
                "captions": {c: r.get(c) for c in self.captions},
                "labels": {c: r.get(c) for c in self.card_labels if r.get(c) is not None},
                "dup_of": r.get(DUP_OF),
                "width": r.get(S.WIDTH),
                "height": r.get(S.HEIGHT),
                "quality": q,
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

    def search(self, params: dict[str, str]) -> dict[str, Any]:
        """One page of results: text search when ``q`` is given, else browse; both filtered.

        ``offset``/``k`` page through the results; ``next_offset`` is null on
        the last page. A query that is exactly a row id puts that row first.
        """
        self.refresh()
        q = (params.get("q") or "").strip()
        k = max(1, min(int(params.get("k") or self.cfg.page_size), MAX_PAGE))
        offset = max(0, int(params.get("offset") or 0))
        where = self._filter(params)
        cols = self._columns()
        page: dict[str, Any] = {"query": q, "offset": offset, "k": k}
        exact: list[dict[str, Any]] = []
        if q:
            id_where = f"{S.ID} = {search.sql_str(q)}" + (f" AND ({where})" if where else "")
            exact = self._rows(self.ds.to_table(columns=cols, filter=id_where, limit=1))
        if q and self.text_columns:
            t = self._ranked(q, where, cols, offset + k + 1, k)
            rows = self._rows(t.slice(offset, k + 1), "_score")
            page["mode"] = "text"
        elif q:
            rows, page["mode"] = [], "id"
        else:
            t = self.ds.to_table(columns=cols, filter=where, offset=offset, limit=k + 1)
            rows = self._rows(t)
            page["mode"] = "browse"
        more = len(rows) > k
        rows = rows[:k]
        if exact:  # the query is a row id: show that row, not captions that share its words
            rows, more, page["mode"] = exact, False, "id"
        page["results"] = rows
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
        k = min(int(params.get("k") or 24), 200)
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
        """Queue thumbnails for ``ids`` on the background pool (one read for the whole page)."""
        with self._lock:
            todo = [
                i for i in ids if (i, size) not in self._thumbs and (i, size) not in self._pending
            ]
            if not todo:
                return
            fut = self._pool.submit(self._make_thumbs, todo, size)
            for i in todo:
                self._pending[(i, size)] = fut

    def _make_thumbs(self, ids: list[str], size: int) -> None:
        try:
            ds = self.ds
            where = f"{S.ID} IN ({', '.join(search.sql_str(i) for i in ids)})"
            t = ds.to_table(columns=[S.ID, S.IMAGE], filter=where)
            found = dict(zip(t[S.ID].to_pylist(), t[S.IMAGE].to_pylist(), strict=True))
            for i in ids:
                data = _thumb_bytes(found.get(i), size)
                with self._lock:
                    self._thumbs[(i, size)] = data
                    self._pending.pop((i, size), None)
                    while len(self._thumbs) > THUMB_CACHE:
                        self._thumbs.popitem(last=False)
        finally:
            with self._lock:
                for i in ids:
                    self._pending.pop((i, size), None)

    def thumbnail(self, row_id: str, size: int = THUMB_SIZE) -> bytes | None:
        """JPEG thumbnail of a row's image (None if unknown id or undecodable); LRU-cached.

        Served from the cache the page's prefetch filled; a row not prefetched
        (another size, or an evicted entry) is made on the pool all the same.
        """
        key = (row_id, size)
        for _ in range(2):
            with self._lock:
                if key in self._thumbs:
                    self._thumbs.move_to_end(key)
                    return self._thumbs[key]
                fut = self._pending.get(key)
            if fut is None:
                self.prefetch([row_id], size)
                with self._lock:
                    fut = self._pending.get(key)
            if fut is not None:
                fut.result(timeout=60)
        with self._lock:
            return self._thumbs.get(key)

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)


def _thumb_bytes(data: bytes | None, size: int) -> bytes | None:
    if not data:
        return None
    try:
        im = decode(data, draft_to=(size, size))
    except ImageError:
        return None
    im.thumbnail((size, size), Image.Resampling.LANCZOS)
    buf = io.BytesIO()
    im.save(buf, "JPEG", quality=85)
    return buf.getvalue()


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


class ExploreServer(ThreadingHTTPServer):
    daemon_threads = True

    def handle_error(self, request, client_address) -> None:
        """Client disconnects are routine: no traceback for them; anything else is reported."""
        import sys

        if isinstance(sys.exc_info()[1], CLIENT_GONE):
            return
        super().handle_error(request, client_address)

    def server_close(self) -> None:
        super().server_close()
        app = getattr(self, "app", None)
        if app is not None:
            app.close()


def make_handler(app: Explorer) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        server_version = "prx-explore"

        def handle(self) -> None:
            try:
                super().handle()
            except CLIENT_GONE:
                self.close_connection = True

        def log_message(self, fmt, *args):  # quiet by default
            if os.environ.get("PRX_EXPLORE_LOG"):
                super().log_message(fmt, *args)

        def _send(self, status: int, body: bytes, ctype: str, cache: bool = False) -> None:
            self.send_response(status)
            self.send_header("Content-Type", ctype)
            self.send_header("Content-Length", str(len(body)))
            self.send_header("Content-Security-Policy", CSP)
            self.send_header("X-Content-Type-Options", "nosniff")
            self.send_header("Referrer-Policy", "no-referrer")
            self.send_header("Cache-Control", "max-age=3600" if cache else "no-store")
            self.end_headers()
            self.wfile.write(body)

        def _json(self, obj: Any, status: int = 200) -> None:
            self._send(status, json.dumps(obj).encode(), "application/json; charset=utf-8")

        def do_GET(self) -> None:  # noqa: N802 (http.server's naming)
            url = urlparse(self.path)
            params = {k: v[-1] for k, v in parse_qs(url.query).items()}
            try:
                if url.path in ("/", "/index.html"):
                    self._send(200, _static("index.html") or b"", "text/html; charset=utf-8")
                elif url.path.startswith("/static/"):
                    name = url.path[len("/static/") :]
                    body = _static(name)
                    if body is None:
                        self._json({"error": "not found"}, 404)
                    else:
                        ctype = mimetypes.guess_type(name)[0] or "application/octet-stream"
                        self._send(200, body, ctype)
                elif url.path == "/api/meta":
                    self._json(app.meta())
                elif url.path == "/api/search":
                    self._json(app.search(params))
                elif url.path == "/api/similar":
                    self._json(app.similar(params))
                elif url.path == "/api/row":
                    row = app.row(params.get("id", ""))
                    self._json(
                        row if row is not None else {"error": "not found"}, 200 if row else 404
                    )
                elif url.path == "/api/thumb":
                    size = max(32, min(1024, int(params.get("size") or THUMB_SIZE)))
                    data = app.thumbnail(params.get("id", ""), size)
                    if data is None:
                        self._send(200, _placeholder(), "image/png")
                    else:
                        self._send(200, data, "image/jpeg", cache=True)
                else:
                    self._json({"error": "not found"}, 404)
            except ValueError as e:  # bad filter values and the like
                self._json({"error": str(e)}, int(HTTPStatus.BAD_REQUEST))

    return Handler


def serve(cfg: ExploreConfig) -> ThreadingHTTPServer:
    """Build the app and an HTTP server bound to ``cfg.host:cfg.port`` (port 0: any free one)."""
    app = Explorer(cfg)
    server = ExploreServer((cfg.host, cfg.port), make_handler(app))
    server.app = app  # type: ignore[attr-defined]
    return server
