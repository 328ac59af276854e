"""``python -m prx_data.explore --table URI``: browse a Lance image table in a web browser.

Live caption search (BM25 full text), a thumbnail grid, click an image to see
visually similar ones (vector search on the source's embedding or the pixel
descriptor), and filters for tier, aspect-ratio bucket and label columns.

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
CSP = (
    "default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self'; "
    "connect-src 'self'; base-uri 'none'; form-action 'none'; frame-ancestors 'none'"
)
#: Columns never offered as label filters.
NOT_LABELS = {S.ID, S.IMAGE, S.CAPTION, "source_file", "metadata", descriptor.COLUMN, S.EMBEDDING}


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
        self._thumbs: OrderedDict[tuple[str, int], bytes] = OrderedDict()
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
        self.ds = T.open_table(self.uri, self.cfg.storage_options)
        self.vector = search.vector_column(self.ds)
        self.text_columns = [
            c for c in search.caption_columns(self.ds) if c in search.indexed_columns(self.ds)
        ]
        self.labels = self._label_columns()
        self._checked = time.monotonic()

    def _label_columns(self) -> dict[str, list[str]]:
        """String columns with few distinct values (in a sample): offered as filters."""
        out: dict[str, list[str]] = {}
        cols = [
            f.name
            for f in self.ds.schema
            if f.name not in NOT_LABELS
            and not f.name.startswith("caption")
            and (pa.types.is_string(f.type) or pa.types.is_large_string(f.type))
        ]
        if not cols:
            return out
        sample = self.ds.to_table(columns=cols, limit=20_000)
        for c in cols:
            values = sample[c].drop_null().unique().to_pylist()
            if 0 < len(values) <= MAX_LABEL_VALUES:
                out[c] = sorted(values)
        return out

    # -- queries ---------------------------------------------------------------------
    def meta(self) -> dict[str, Any]:
        return {
            "table": self.uri,
            "rows": self.ds.count_rows(),
            "text_columns": self.text_columns,
            "vector_column": self.vector,
            "tiers": [str(t) for t in DEFAULT_SPEC.tiers] + ["too_small"],
            "aspects": list(search.aspect_ranges()) + ["out_of_range"],
            "labels": self.labels,
        }

    def _filter(self, params: dict[str, str]) -> str | None:
        labels = {
            k[len("label.") :]: v
            for k, v in params.items()
            if k.startswith("label.") and k[len("label.") :] in self.labels
        }
        return search.filter_sql(
            tier=params.get("tier") or None, aspect=params.get("aspect") or None, labels=labels
        )

    def _columns(self) -> list[str]:
        return [c for c in (S.ID, S.CAPTION, S.WIDTH, S.HEIGHT) if c in self.ds.schema.names]

    def _rows(self, t: pa.Table, score: str | None = None) -> list[dict[str, Any]]:
        out = []
        for r in t.to_pylist():
            item = {
                "id": r[S.ID],
                "caption": r.get(S.CAPTION),
                "width": r.get(S.WIDTH),
                "height": r.get(S.HEIGHT),
            }
            if score and score in r:
                item["score"] = r[score]
            out.append(item)
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
                self.ds = latest
                self.vector = search.vector_column(latest)
                self.labels = self._label_columns()
                self._thumbs.clear()

    def search(self, params: dict[str, str]) -> dict[str, Any]:
        self.refresh()
        q = (params.get("q") or "").strip()
        k = min(int(params.get("k") or self.cfg.page_size), 500)
        where = self._filter(params)
        if q and self.text_columns:
            t = search.text_search(
                self.ds,
                q,
                k=k,
                columns=self._columns(),
                search_columns=self.text_columns,
                filter=where,
            )
            return {"query": q, "mode": "text", "results": self._rows(t, "_score")}
        t = self.ds.to_table(columns=self._columns(), filter=where, limit=k)
        return {"query": q, "mode": "browse", "results": self._rows(t)}

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

    def thumbnail(self, row_id: str, size: int = THUMB_SIZE) -> bytes | None:
        """JPEG thumbnail of a row's image (None if unknown id or undecodable); LRU-cached."""
        key = (row_id, size)
        with self._lock:
            if key in self._thumbs:
                self._thumbs.move_to_end(key)
                return self._thumbs[key]
        t = self.ds.to_table(
            columns=[S.IMAGE], filter=f"{S.ID} = {search.sql_str(row_id)}", limit=1
        )
        if t.num_rows == 0 or t[S.IMAGE][0].as_py() is None:
            return None
        try:
            im = decode(t[S.IMAGE][0].as_py(), draft_to=(size, size))
        except ImageError:
            return None
        im.thumbnail((size, size), Image.Resampling.LANCZOS)
        buf = io.BytesIO()
        im.save(buf, "JPEG", quality=85)
        data = buf.getvalue()
        with self._lock:
            self._thumbs[key] = data
            while len(self._thumbs) > 2000:
                self._thumbs.popitem(last=False)
        return data


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


def make_handler(app: Explorer) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        server_version = "prx-explore"

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
    server = ThreadingHTTPServer((cfg.host, cfg.port), make_handler(app))
    server.daemon_threads = True
    server.app = app  # type: ignore[attr-defined]
    return server
