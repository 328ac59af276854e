"""Image folders: ``<dir>/**/<stem>.<image ext>`` with optional ``<stem>.txt`` / ``<stem>.json``.

The row id is ``<source>/<path relative to the folder, without extension>``
so it is stable across re-ingests; the file name is kept in ``source_file``.
A ``.json`` sidecar gives the caption from its ``caption``/``text`` key and
its other keys as JSON text in ``metadata``; a ``.txt`` sidecar wins for the
caption when both exist. Two images with the same stem would share an id:
the first (by name) is kept and the others are counted as duplicates.
"""

from __future__ import annotations

import os
import posixpath
from collections import defaultdict

import pyarrow as pa

from prx_data.core import storage
from prx_data.ingest.common import (
    CAPTION_EXTENSIONS,
    IMAGE_EXTENSIONS,
    METADATA,
    SOURCE_FILE,
    Counts,
    Plan,
    RowBuilder,
    WorkUnit,
    caption_from_json,
    decode_text,
    ext_of,
    strip_ext,
)

KIND = "folder"
EXTRA_FIELDS = [pa.field(SOURCE_FILE, pa.string()), pa.field(METADATA, pa.string())]
DEFAULT_ITEMS_PER_UNIT = 256


def _list(root: str) -> list[str]:
    """Relative posix paths of all files under ``root`` (hidden entries skipped), sorted."""
    if storage.is_remote(root):
        return [
            p for p in storage.list_files(root) if not any(s.startswith(".") for s in p.split("/"))
        ]
    out = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if not d.startswith("."))
        rel = os.path.relpath(dirpath, root)
        for name in filenames:
            if name.startswith("."):
                continue
            out.append(name if rel == "." else posixpath.join(rel.replace(os.sep, "/"), name))
    return sorted(out)


def is_folder(path: str) -> bool:
    if storage.is_remote(path):
        return False
    return os.path.isdir(path) and not path.rstrip("/").endswith(".lance")


def plan(
    root: str, source: str | None = None, items_per_unit: int = DEFAULT_ITEMS_PER_UNIT
) -> Plan:
    """List the folder, pair images with sidecars, and cut into units."""
    root = root.rstrip("/") or "/"
    source = source or posixpath.basename(root) or "folder"
    counts = Counts()
    groups: dict[str, dict[str, list[str]]] = defaultdict(lambda: defaultdict(list))
    for rel in _list(root):
        ext = ext_of(rel)
        if ext in IMAGE_EXTENSIONS:
            groups[strip_ext(rel)]["image"].append(rel)
        elif ext in CAPTION_EXTENSIONS:
            groups[strip_ext(rel)][ext].append(rel)
        else:
            counts.dropped("not_an_image_file")
    items: list[list[str | None]] = []
    for stem in sorted(groups):
        g = groups[stem]
        images = sorted(g.get("image", []))
        if not images:
            counts.dropped("sidecar_without_image", sum(len(v) for v in g.values()))
            continue
        if len(images) > 1:
            counts.dropped("duplicate_id", len(images) - 1)
        txt = (g.get("txt") or g.get("caption") or g.get("cap") or [None])[0]
        js = (g.get("json") or [None])[0]
        items.append([images[0], txt, js])
    units = [
        WorkUnit(KIND, source, {"root": root, "items": items[i : i + items_per_unit]})
        for i in range(0, len(items), items_per_unit)
    ]
    return Plan(units, list(EXTRA_FIELDS), counts, _approx_row_bytes(root, items))


def _approx_row_bytes(root: str, items: list, sample: int = 64) -> float | None:
    """Mean size of a spread sample of the images (local folders only)."""
    if not items or storage.is_remote(root):
        return None
    step = max(1, len(items) // sample)
    sizes = []
    for it in items[::step][:sample]:
        try:
            sizes.append(os.path.getsize(os.path.join(root, it[0])))
        except OSError:
            continue
    return sum(sizes) / len(sizes) if sizes else None


def _read(root: str, rel: str) -> bytes:
    path = storage.join(root, rel) if storage.is_remote(root) else os.path.join(root, rel)
    if storage.is_remote(path):
        return storage.read_bytes(path)
    with open(path, "rb") as f:
        return f.read()


def _read_sidecar(root: str, rel: str | None, counts: Counts) -> bytes | None:
    if rel is None:
        return None
    try:
        return _read(root, rel)
    except OSError:
        counts.kept("sidecar_unreadable")
        return None


def load(unit: WorkUnit, counts: Counts) -> pa.Table:
    root = unit.args["root"]
    rows = RowBuilder(unit.source, counts)
    for image_rel, txt_rel, json_rel in unit.args["items"]:
        try:
            image, error = _read(root, image_rel), None
        except OSError as e:
            image, error = None, f"read_error:{type(e).__name__}"
        txt = _read_sidecar(root, txt_rel, counts)
        js = _read_sidecar(root, json_rel, counts)
        meta = None
        if js is not None:
            # The JSON's caption counts only when there is no .txt to take it from.
            json_counts = Counts() if txt is not None else counts
            caption, meta = caption_from_json(js, json_counts)
        if txt is not None or js is None:
            caption = decode_text(txt, counts)
        rows.add(
            strip_ext(image_rel),
            image,
            caption,
            error=error,
            **{SOURCE_FILE: image_rel, METADATA: meta},
        )
    return rows.table(EXTRA_FIELDS)
