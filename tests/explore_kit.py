"""Test-only: a small table for the explorer and a server running in a thread."""

from __future__ import annotations

import contextlib
import io
import threading

import numpy as np
import pyarrow as pa
from PIL import Image
from prx_data.pipelines.quality import compute_quality

from prx_data.core.runtime import RunOptions
from prx_data.explore.app import ExploreConfig, serve
from prx_data.table.lance_ops import update_column
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


def make_explore_table(uri: str, extra: list | None = None) -> None:
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
    make_table(uri, items + list(extra or []), max_rows_per_file=6)


def big_png(w: int, h: int) -> bytes:
    """A real, decodable PNG of w x h pixels that is a few kB (1-bit, all black)."""
    buf = io.BytesIO()
    Image.new("1", (w, h)).save(buf, "PNG")
    return buf.getvalue()


def big_jpeg(w: int, h: int) -> bytes:
    """A flat grey JPEG of w x h pixels (small on disk; its DCT draft decodes at 1/8 per side)."""
    buf = io.BytesIO()
    Image.new("L", (w, h), 128).save(buf, "JPEG", quality=50)
    return buf.getvalue()


def blank_overlay_png(w: int = 96, h: int = 64) -> bytes:
    """A fully transparent overlay: the export flattens it to pure white."""
    buf = io.BytesIO()
    Image.new("RGBA", (w, h), (20, 20, 20, 0)).save(buf, "PNG")
    return buf.getvalue()


def make_enriched_table(uri: str) -> str:
    """The explore table plus a VLM caption, its status column, labels, dup_of and quality."""
    make_explore_table(uri, extra=[("t/overlay", blank_overlay_png(), "a wallpaper overlay")])
    ids = [f"t/{c}{i}" for c in ("red", "green", "blue") for i in range(4)]
    update_column(
        uri,
        "caption_vlm",
        pa.table({"id": ids, "caption_vlm": [f"vlm says {i} crimson" for i in ids]}),
    )
    update_column(
        uri,
        "caption_vlm_status",
        pa.table({"id": ids, "caption_vlm_status": ["ok"] * len(ids)}),
    )
    labels = ["visual" if i.startswith("t/red") else "text" for i in ids]
    update_column(uri, "label", pa.table({"id": ids, "label": labels}))
    update_column(uri, "dup_of", pa.table({"id": ["t/red1", "t/red2"], "dup_of": ["t/red0"] * 2}))
    compute_quality(
        uri,
        run=RunOptions(progress=False),
    )
    return uri


def make_scored_table(uri: str) -> dict[str, float | None]:
    """The explore table with image quality, a CLIP-like embedding with planted near
    duplicates (red0..red2 within cosine 0.95 of each other; red3 and the other colours
    not) and a ``clip_score``; returns the scores by id."""
    make_explore_table(uri)
    compute_quality(
        uri,
        run=RunOptions(progress=False),
    )
    ids = [f"t/{c}{i}" for c in ("red", "green", "blue") for i in range(4)]
    axis = {"red": 0, "green": 1, "blue": 2}
    vecs = []
    for i in ids:
        v = np.zeros(4, np.float32)
        v[axis[i[2:-1]]] = 1.0
        v[3] = {"0": 0.0, "1": 0.05, "2": 0.1, "3": 0.6}[i[-1]]
        vecs.append(v / np.linalg.norm(v))
    emb = pa.FixedSizeListArray.from_arrays(pa.array(np.concatenate(vecs), pa.float32()), 4)
    update_column(uri, "clip_image_embedding", pa.table({"id": ids, "clip_image_embedding": emb}))
    scores: dict[str, float | None] = {i: float(n) / 10 for n, i in enumerate(ids)}
    scores["t/green2"] = None
    update_column(
        uri,
        "clip_score",
        pa.table({"id": ids, "clip_score": pa.array([scores[i] for i in ids], pa.float32())}),
    )
    return scores


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
