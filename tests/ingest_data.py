"""Test-only builders for ingest sources: small real images, folders, tars, parquet."""

from __future__ import annotations

import io
import json
import os

from PIL import Image


def jpeg(w: int, h: int, color=(200, 30, 30), orientation: int | None = None) -> bytes:
    im = Image.new("RGB", (w, h), color)
    buf = io.BytesIO()
    if orientation is not None:
        exif = Image.Exif()
        exif[0x0112] = orientation
        im.save(buf, "JPEG", quality=85, exif=exif.tobytes())
    else:
        im.save(buf, "JPEG", quality=85)
    return buf.getvalue()


def png(w: int, h: int, mode: str = "RGBA") -> bytes:
    buf = io.BytesIO()
    Image.new(mode, (w, h)).save(buf, "PNG")
    return buf.getvalue()


def write(path: str, data: bytes | str) -> None:
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "wb") as f:
        f.write(data.encode() if isinstance(data, str) else data)


def make_folder(root: str) -> dict[str, dict]:
    """A folder with the awkward cases; returns the expected rows by id suffix."""
    write(f"{root}/a.jpg", jpeg(640, 480))
    write(f"{root}/a.txt", "a red landscape\n")
    write(f"{root}/a.png", png(8, 8))  # same stem as a.jpg: a duplicate id
    write(f"{root}/b.jpg", jpeg(300, 600, (10, 200, 10)))
    write(f"{root}/b.json", json.dumps({"caption": "a tall green thing", "score": 0.5}))
    write(f"{root}/rot.jpg", jpeg(400, 200, orientation=6))  # rotated: 200x400 after EXIF
    write(f"{root}/rot.txt", b"caf\xe9 au lait")  # latin-1, not UTF-8
    write(f"{root}/sub/broken.png", b"\x89PNG not really")
    write(f"{root}/sub/broken.txt", "   ")
    write(f"{root}/sub/deep/alpha.png", png(256, 128))
    write(f"{root}/sub/deep/alpha.json", json.dumps({"text": "transparent"}))
    write(f"{root}/README.md", "not an image")
    write(f"{root}/orphan.txt", "caption without an image")
    return {
        "a": {"width": 640, "height": 480, "format": "jpeg", "caption": "a red landscape"},
        "b": {"width": 300, "height": 600, "format": "jpeg", "caption": "a tall green thing"},
        "rot": {"width": 200, "height": 400, "format": "jpeg", "caption": "caf\ufffd au lait"},
        "sub/broken": {"width": None, "height": None, "format": None, "caption": None},
        "sub/deep/alpha": {"width": 256, "height": 128, "format": "png", "caption": "transparent"},
    }


def make_tar(path: str, members: list[tuple[str, bytes | str]]) -> None:
    """A tar with the given (name, data) members, in order."""
    import tarfile

    os.makedirs(os.path.dirname(path), exist_ok=True)
    with tarfile.open(path, "w") as tf:
        for name, data in members:
            raw = data.encode() if isinstance(data, str) else data
            info = tarfile.TarInfo(name)
            info.size = len(raw)
            tf.addfile(info, io.BytesIO(raw))
