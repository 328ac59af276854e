"""Test-only: a loopback HTTP server with real images and hostile responses, and URL tables.

Every route the download tests need: photos, slow, stalled and trickling
(``/trickle/<ms>``, ``/trickle-head/<ms>``: a byte per gap) responses, HTTP
errors with and without ``Retry-After``, redirect loops and redirects to a
refused port, wrong types, oversized bodies, a decompression bomb and
``X-Robots-Tag``. The server counts requests per path, so tests can check
that a URL was fetched once. Binds 127.0.0.1 only.
"""

from __future__ import annotations

import io
import struct
import threading
import time
import zlib
from collections import Counter
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import lance
import pyarrow as pa

from prx_data.core import schema as S
from prx_data.core.sample_data import photo_like


def photo(seed: int, size: tuple[int, int] = (96, 64), fmt: str = "JPEG") -> bytes:
    im, _ = photo_like(size[0], size[1], seed)
    buf = io.BytesIO()
    im.save(buf, fmt, quality=90) if fmt == "JPEG" else im.save(buf, fmt)
    return buf.getvalue()


def png_bomb(width: int = 30000, height: int = 30000) -> bytes:
    """A PNG header claiming width x height pixels (900 MP), a few dozen bytes."""

    def chunk(kind: bytes, data: bytes) -> bytes:
        return (
            struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))
        )

    ihdr = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    idat = zlib.compress(b"\x00" * 64)
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", ihdr) + chunk(b"IDAT", idat) + chunk(b"IEND", b"")


class ImageServer:
    """``with ImageServer() as srv: srv.url('/img/1.jpg')``; ``srv.hits[path]`` counts requests."""

    def __init__(self, stall_s: float = 3.0, redirect_port: int | None = None):
        self.hits: Counter = Counter()
        self.times: dict[str, list[float]] = {}
        self.stall_s = stall_s
        self.redirect_port = redirect_port
        self.stop = threading.Event()
        self.inflight = 0
        self.max_inflight = 0
        self._lock = threading.Lock()
        server = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args):
                pass

            def handle(self):
                try:
                    super().handle()
                except (BrokenPipeError, ConnectionResetError):
                    pass

            def do_GET(self):
                server.hits[self.path] += 1
                server.times.setdefault(self.path, []).append(time.monotonic())
                try:
                    server.route(self, self.path, server.hits[self.path])
                except (BrokenPipeError, ConnectionResetError):
                    pass

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.httpd.daemon_threads = True
        self.port = self.httpd.server_address[1]
        self.thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)

    def use_tls(self, cert: str, key: str) -> None:
        """Serve HTTPS with this certificate (call before entering)."""
        import ssl

        ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        ctx.load_cert_chain(cert, key)
        self.httpd.socket = ctx.wrap_socket(self.httpd.socket, server_side=True)

    def __enter__(self) -> ImageServer:
        self.thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop.set()
        self.httpd.shutdown()
        self.httpd.server_close()

    def url(self, path: str) -> str:
        return f"http://127.0.0.1:{self.port}{path}"

    @property
    def allow(self) -> tuple[str, ...]:
        return (f"127.0.0.1:{self.port}",)

    # -- routes
    @staticmethod
    def send(h, status: int, body: bytes = b"", ctype: str = "image/jpeg", **headers) -> None:
        h.send_response(status)
        h.send_header("Content-Type", ctype)
        h.send_header("Content-Length", str(len(body)))
        for k, v in headers.items():
            h.send_header(k.replace("_", "-"), v)
        h.end_headers()
        h.wfile.write(body)

    def route(self, h, path: str, hit: int) -> None:
        parts = path.split("?", 1)[0].strip("/").split("/")
        kind, arg = parts[0], parts[1] if len(parts) > 1 else "0"
        seed = int("".join(c for c in arg if c.isdigit()) or 0)
        if kind == "img":
            self.send(h, 200, photo(seed))
        elif kind == "png":
            self.send(h, 200, photo(seed, fmt="PNG"), "image/png")
        elif kind == "octet":
            self.send(h, 200, photo(seed), "application/octet-stream")
        elif kind == "slow":
            with self._lock:
                self.inflight += 1
                self.max_inflight = max(self.max_inflight, self.inflight)
            time.sleep(0.3)
            with self._lock:
                self.inflight -= 1
            self.send(h, 200, photo(seed))
        elif kind == "stall":  # headers and half a body, then nothing
            body = photo(seed)
            h.send_response(200)
            h.send_header("Content-Type", "image/jpeg")
            h.send_header("Content-Length", str(len(body)))
            h.end_headers()
            h.wfile.write(body[: len(body) // 2])
            h.wfile.flush()
            self.stop.wait(self.stall_s)
        elif kind == "status":  # /status/404
            self.send(h, int(arg), b"no", "text/plain")
        elif kind == "429once":
            if hit == 1:
                self.send(h, 429, b"slow down", "text/plain", Retry_After="1")
            else:
                self.send(h, 200, photo(seed))
        elif kind == "503once":
            if hit == 1:
                self.send(h, 503, b"busy", "text/plain")
            else:
                self.send(h, 200, photo(seed))
        elif kind == "loop":
            self.send(h, 302, b"", "text/plain", Location="/loop2/x")
        elif kind == "loop2":
            self.send(h, 302, b"", "text/plain", Location="/loop/x")
        elif kind == "chain":  # /chain/N: N more redirects, then an image
            n = int(arg)
            target = f"/chain/{n - 1}" if n > 0 else "/img/3"
            self.send(h, 301, b"", "text/plain", Location=target)
        elif kind == "redirect-away":  # to another loopback port: not allowed
            self.send(
                h,
                302,
                b"",
                "text/plain",
                Location=f"http://127.0.0.1:{self.redirect_port or 9}/img/1",
            )
        elif kind == "redirect-metadata":
            self.send(h, 302, b"", "text/plain", Location="http://169.254.169.254/latest/")
        elif kind == "html":
            self.send(h, 200, b"<html>not an image</html>", "text/html")
        elif kind == "fake":  # says image, is HTML
            self.send(h, 200, b"<!doctype html><html>oops</html>", "image/jpeg")
        elif kind == "big":  # honest Content-Length over the cap
            self.send(h, 200, photo(seed) + b"\0" * 300_000)
        elif kind == "bigstream":  # no length: the cap must hold while streaming
            h.send_response(200)
            h.send_header("Content-Type", "image/jpeg")
            h.send_header("Connection", "close")
            h.end_headers()
            h.wfile.write(photo(seed))
            for _ in range(100):
                if self.stop.is_set():
                    break
                h.wfile.write(b"\0" * 65536)
            h.close_connection = True
        elif kind in ("trickle", "trickle-head"):  # /trickle/<gap ms>: a byte per gap
            gap = (int(arg) if arg.isdigit() else 500) / 1000
            body = photo(seed)
            head = (
                "HTTP/1.1 200 OK\r\nContent-Type: image/jpeg\r\n"
                f"Content-Length: {len(body)}\r\n\r\n"
            ).encode()
            if kind == "trickle":  # headers at once, then the body byte by byte
                h.wfile.write(head)
                head, body = b"", body
            else:  # even the status line comes byte by byte
                body = head + body
                head = b""
            h.wfile.flush()
            for i in range(len(body)):
                if self.stop.wait(gap):
                    break
                h.wfile.write(body[i : i + 1])
                h.wfile.flush()
            h.close_connection = True
        elif kind == "bomb":
            self.send(h, 200, png_bomb(), "image/png")
        elif kind == "noai":
            self.send(h, 200, photo(seed), X_Robots_Tag="noai")
        elif kind == "noimageai":
            self.send(h, 200, photo(seed), X_Robots_Tag="otherbot: noindex, noimageai")
        elif kind == "otherbot":  # opt-out for another agent only
            self.send(h, 200, photo(seed), X_Robots_Tag="googlebot: noai")
        else:
            self.send(h, 404, b"?", "text/plain")


def self_signed(folder, hostname: str) -> tuple[str, str]:
    """(cert.pem, key.pem) of a self-signed CA certificate for ``hostname``."""
    import datetime

    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, hostname)])
    now = datetime.datetime.now(datetime.timezone.utc)
    cert = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(name)
        .public_key(key.public_key())
        .serial_number(1)
        .not_valid_before(now - datetime.timedelta(days=1))
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(x509.SubjectAlternativeName([x509.DNSName(hostname)]), critical=False)
        .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
        .sign(key, hashes.SHA256())
    )
    cert_path, key_path = str(folder / "cert.pem"), str(folder / "key.pem")
    with open(cert_path, "wb") as f:
        f.write(cert.public_bytes(serialization.Encoding.PEM))
    with open(key_path, "wb") as f:
        f.write(
            key.private_bytes(
                serialization.Encoding.PEM,
                serialization.PrivateFormat.PKCS8,
                serialization.NoEncryption(),
            )
        )
    return cert_path, key_path


def url_table(uri: str, urls: list[str | None], rows_per_file: int = 1024, extra=None):
    """A table as ingest leaves a LAION-style parquet: url + caption, no image bytes."""
    n = len(urls)
    cols = {
        S.ID: [f"laion/{i:05d}" for i in range(n)],
        S.IMAGE: pa.nulls(n, pa.large_binary()),
        S.WIDTH: pa.nulls(n, pa.int32()),
        S.HEIGHT: pa.nulls(n, pa.int32()),
        S.FORMAT: pa.nulls(n, pa.string()),
        S.SOURCE: ["laion"] * n,
        S.CAPTION: [f"caption {i}" for i in range(n)],
        S.PROBE_ERROR: ["missing_image"] * n,
        S.SHA256: pa.nulls(n, pa.string()),
    }
    table = pa.table(cols, schema=S.TABLE_SCHEMA).append_column("url", pa.array(urls, pa.string()))
    for name, values in (extra or {}).items():
        table = table.append_column(name, values)
    return lance.write_dataset(table, uri, mode="create", max_rows_per_file=rows_per_file)
