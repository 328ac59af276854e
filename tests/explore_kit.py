"""Test-only: a small table for the explorer and a server running in a thread."""

from __future__ import annotations

import contextlib
import io
import threading

import numpy as np
from PIL import Image

from prx_data.explore.app import ExploreConfig, serve
from tests.tablekit import make_table

COLOURS = {"red": (210, 30, 30), "green": (30, 190, 40), "blue": (30, 40, 210)}
XSS_CAPTION = (
    "<script>window.__xss = 1; document.title = 'pwned'</script>"
    "<img src=x onerror=\"window.__xss = 2; document.title = 'pwned'\"> evil blue"
)


def noisy_jpeg(colour, seed: int, w: int = 96, h: int = 64) -> bytes:
    rng = np.random.default_rng(seed)
    px = np.clip(np.array(colour, np.float32) + rng.normal(0, 12, (h, w, 3)), 0, 255)
    buf = io.BytesIO()
    Image.fromarray(px.astype(np.uint8)).save(buf, "JPEG", quality=90)
    return buf.getvalue()


def make_explore_table(uri: str) -> None:
    items = []
    for ci, (name, colour) in enumerate(COLOURS.items()):
        for i in range(4):
            # Sizes vary so the tier and aspect filters have something to do.
            w, h = (96, 64) if i % 2 else (64, 64)
            items.append(
                (f"t/{name}{i}", noisy_jpeg(colour, 10 * ci + i, w, h), f"a {name} square {i}")
            )
    items.append(("t/xss", noisy_jpeg(COLOURS["blue"], 99), XSS_CAPTION))
    items.append(("t/broken", b"not an image", "a broken file"))
    make_table(uri, items, max_rows_per_file=6)


@contextlib.contextmanager
def running_server(uri: str, **kw):
    """Yield the base URL of an explorer on 127.0.0.1 (any free port)."""
    server = serve(ExploreConfig(table=uri, port=0, **kw))
    t = threading.Thread(target=server.serve_forever, daemon=True)
    t.start()
    try:
        host, port = server.server_address[:2]
        yield f"http://{host}:{port}", server
    finally:
        server.shutdown()
        server.server_close()
        t.join(timeout=10)
