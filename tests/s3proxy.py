"""Test double: the forwarding half of the fault-injecting S3 proxies in front of moto.

Each test's handler decides which requests fail and how; everything else is
relayed here, byte for byte, to the moto server on loopback.
"""

from __future__ import annotations

import http.client
from http.server import BaseHTTPRequestHandler


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
