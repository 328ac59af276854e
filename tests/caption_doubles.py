"""Test double: a local OpenAI-compatible chat-completions server.

Not a feature and not a model. It implements just enough of
``POST /v1/chat/completions`` for the ``openai`` backend's real HTTP code
(payloads, data-URL images, concurrency, retries, error handling) to be
exercised on 127.0.0.1. Its answers are computed from the request (image
size and mean colour, or keywords of a caption), so tests can check that
what the pipeline stored came from the row it sent. It can be told to fail
the next requests with an HTTP status or by stalling past the client's
timeout.
"""

from __future__ import annotations

import base64
import io
import json
import threading
import time
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from PIL import Image

#: A responder gets the decoded image (or None) and the prompt text and
#: returns ``(content, finish_reason)``.
Responder = Callable[[Image.Image | None, str], tuple[str, str]]


def describe_image(image: Image.Image | None, prompt: str) -> tuple[str, str]:
    """Default answer: the image's size and dominant channel, as one sentence."""
    if image is None:
        return label_caption(image, prompt)
    r, g, b = (sum(c) / len(c) for c in zip(*image.getdata(), strict=True))
    colour = max((r, "red"), (g, "green"), (b, "blue"))[1]
    return f"A plain {colour} image of {image.width} by {image.height} pixels.", "stop"


def label_caption(image: Image.Image | None, prompt: str) -> tuple[str, str]:
    """Default text answer: a label chosen from keywords of the caption in the prompt.

    The packaged prompt quotes the caption between triple quotes; only that
    part is read (the instructions themselves mention every label).
    """
    parts = prompt.split('"""')
    low = (parts[1] if len(parts) >= 3 else prompt).lower()
    if "weird" in low:
        return "I am not sure what you mean.", "stop"
    if "document" in low or "letters" in low:
        return "Text.", "stop"
    if "unclothed" in low:
        return "nsfw", "stop"
    return "Answer: visual", "stop"


class ChatServer:
    """Threaded HTTP server on 127.0.0.1; use as a context manager."""

    def __init__(self, responder: Responder = describe_image, model: str = "test-model"):
        self.responder = responder
        self.model = model
        self.lock = threading.Lock()
        #: Failures to apply to the next requests, in order: an HTTP status
        #: (429, 503, 400, ...) or ``"stall"`` (sleep ``stall_s`` first).
        self.failures: list[int | str] = []
        self.stall_s = 1.0
        self.requests = 0
        self.failed = 0
        self.image_sizes: list[tuple[int, int]] = []
        self.max_in_flight = 0
        self.last_body: dict = {}
        self._in_flight = 0
        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), self._handler())
        self.httpd.daemon_threads = True
        self._thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)

    @property
    def base_url(self) -> str:
        host, port = self.httpd.server_address[:2]
        return f"http://{host}:{port}/v1"

    def fail_next(self, *failures: int | str) -> None:
        with self.lock:
            self.failures.extend(failures)

    def __enter__(self) -> ChatServer:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()

    def _handler(self):
        server = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):  # keep test output quiet
                pass

            def _send(self, status: int, body: dict, headers: dict | None = None) -> None:
                data = json.dumps(body).encode()
                try:
                    self.send_response(status)
                    self.send_header("Content-Type", "application/json")
                    self.send_header("Content-Length", str(len(data)))
                    for k, v in (headers or {}).items():
                        self.send_header(k, v)
                    self.end_headers()
                    self.wfile.write(data)
                except (BrokenPipeError, ConnectionResetError):
                    pass  # the client gave up (timeout test)

            def do_POST(self):
                length = int(self.headers.get("Content-Length", 0))
                body = json.loads(self.rfile.read(length) or b"{}")
                with server.lock:
                    server.last_body = body
                    server.requests += 1
                    failure = server.failures.pop(0) if server.failures else None
                    server._in_flight += 1
                    server.max_in_flight = max(server.max_in_flight, server._in_flight)
                try:
                    self._serve(body, failure)
                finally:
                    with server.lock:
                        server._in_flight -= 1

            def _serve(self, body: dict, failure: int | str | None) -> None:
                if self.path != "/v1/chat/completions":
                    return self._send(404, {"error": {"message": f"no route {self.path}"}})
                if failure == "stall":
                    # The client abandons a stalled request at its timeout and may retry while
                    # this handler still sleeps: not a request the client has in flight.
                    with server.lock:
                        server._in_flight -= 1
                    time.sleep(server.stall_s)
                    with server.lock:
                        server._in_flight += 1
                elif failure is not None:
                    with server.lock:
                        server.failed += 1
                    headers = {"Retry-After": "0"} if failure == 429 else None
                    return self._send(
                        int(failure), {"error": {"message": "injected failure"}}, headers
                    )
                if body.get("model") != server.model:
                    return self._send(
                        404, {"error": {"message": f"model {body.get('model')!r} not served"}}
                    )
                try:
                    content = body["messages"][-1]["content"]
                    image, prompt = None, content if isinstance(content, str) else ""
                    if not isinstance(content, str):
                        for part in content:
                            if part["type"] == "text":
                                prompt = part["text"]
                            elif part["type"] == "image_url":
                                url = part["image_url"]["url"]
                                head, b64 = url.split(",", 1)
                                if not head.startswith("data:image/") or not head.endswith(
                                    ";base64"
                                ):
                                    raise ValueError(f"not a base64 image data URL: {head}")
                                image = Image.open(io.BytesIO(base64.b64decode(b64))).convert("RGB")
                    max_tokens = int(body["max_tokens"])
                except (KeyError, ValueError, TypeError, OSError) as e:
                    return self._send(400, {"error": {"message": f"bad request: {e}"}})
                if image is not None:
                    with server.lock:
                        server.image_sizes.append(image.size)
                text, finish = server.responder(image, prompt)
                words = text.split(" ")
                if len(words) > max_tokens:  # crude token limit, like a real server
                    text, finish = " ".join(words[:max_tokens]), "length"
                self._send(
                    200,
                    {
                        "id": "chatcmpl-test",
                        "object": "chat.completion",
                        "model": server.model,
                        "choices": [
                            {
                                "index": 0,
                                "message": {"role": "assistant", "content": text},
                                "finish_reason": finish,
                            }
                        ],
                    },
                )

        return Handler
