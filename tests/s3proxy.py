"""Test double: the forwarding half of the fault-injecting S3 proxies in front of moto.

Each test's handler decides which requests fail and how; everything else is
relayed here, byte for byte, to the moto server on loopback. :class:`RuleProxy`
is a whole proxy whose faults a test picks per request with a function.
"""

from __future__ import annotations

import http.client
import threading
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer


def send_error(handler: BaseHTTPRequestHandler, status: int, code: str) -> None:
    """Answer with an S3-style XML error (the body botocore parses for its retry decision)."""
    err = f"<Error><Code>{code}</Code><Message>injected</Message></Error>".encode()
    handler.send_response(status)
    handler.send_header("Content-Length", str(len(err)))
    handler.end_headers()
    handler.wfile.write(err)


def relay(handler: BaseHTTPRequestHandler, upstream: int, body: bytes | None) -> None:
    """Send the handler's request (with ``body``, already read) to ``upstream`` and copy back
    the answer."""
    conn = http.client.HTTPConnection("127.0.0.1", upstream, timeout=30)
    try:
        headers = {k: v for k, v in handler.headers.items() if k.lower() != "connection"}
        conn.request(handler.command, handler.path, body=body, headers=headers)
        resp = conn.getresponse()
        data = resp.read()
        handler.send_response(resp.status)
        for k, v in resp.getheaders():
            if k.lower() not in ("transfer-encoding", "connection", "content-length"):
                handler.send_header(k, v)
        # A HEAD answer carries the object's length without a body.
        length = resp.getheader("Content-Length") if handler.command == "HEAD" else str(len(data))
        handler.send_header("Content-Length", length or "0")
        handler.end_headers()
        if handler.command != "HEAD":
            handler.wfile.write(data)
    finally:
        conn.close()


def forward_only(handler: BaseHTTPRequestHandler, upstream: int, body: bytes | None) -> None:
    """Send the handler's request to ``upstream`` and drop the answer (a lost response)."""
    conn = http.client.HTTPConnection("127.0.0.1", upstream, timeout=30)
    try:
        headers = {k: v for k, v in handler.headers.items() if k.lower() != "connection"}
        conn.request(handler.command, handler.path, body=body, headers=headers)
        conn.getresponse().read()
    finally:
        conn.close()


class RuleProxy(ThreadingHTTPServer):
    """Forwards to moto; ``rule(method, path)`` picks each request's fault, at any time.

    A rule answers ``None`` (relay), ``"stall"`` (hold the request unanswered
    until :meth:`release`: a store that never answers), ``"lost-answer"``
    (relay it, then answer 500 as if the answer was lost on the way), or
    ``(status, code)`` (an S3 error instead of relaying). ``log`` records
    ``(method, path, fault)`` per request. A context manager that serves on
    loopback and releases every stalled request on exit.
    """

    daemon_threads = True

    def __init__(self, upstream: int, rule: Callable[[str, str], object] | None = None):
        self.upstream = upstream
        self.rule = rule or (lambda method, path: None)
        self.log: list[tuple[str, str, object]] = []
        self.released = threading.Event()
        self.lock = threading.Lock()
        super().__init__(("127.0.0.1", 0), _RuleHandler)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server_address[1]}"

    def seen(self, method: str, suffix: str, fault: object = None) -> int:
        """How many requests ``method`` on a path ending in ``suffix`` met ``fault``."""
        with self.lock:
            return sum(
                1 for m, p, f in self.log if m == method and p.endswith(suffix) and f == fault
            )

    def release(self) -> None:
        self.released.set()

    def __enter__(self) -> RuleProxy:
        threading.Thread(target=self.serve_forever, daemon=True).start()
        return self

    def __exit__(self, *exc) -> None:
        self.release()
        self.shutdown()
        self.server_close()


class _RuleHandler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"

    def log_message(self, *args):
        pass

    def _forward(self):
        srv: RuleProxy = self.server  # type: ignore[assignment]
        path = self.path.split("?", 1)[0]
        n = int(self.headers.get("Content-Length") or 0)
        body = self.rfile.read(n) if n else None
        with srv.lock:
            fault = srv.rule(self.command, path)
            srv.log.append((self.command, path, fault))
        if fault == "stall":
            srv.released.wait(120)
            self.close_connection = True
            return
        if fault == "lost-answer":
            forward_only(self, srv.upstream, body)
            send_error(self, 500, "InternalError")
            return
        if isinstance(fault, tuple):
            send_error(self, *fault)
            return
        relay(self, srv.upstream, body)

    do_GET = do_PUT = do_POST = do_HEAD = do_DELETE = _forward
