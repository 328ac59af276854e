"""Twin tars: one folder per modality holding same-named tars with the same keys.

::

    root/image/00000.tar      (00000/abc.jpg, ...)
    root/image/wdinfo.json    (optional wids manifest: {"shardlist": [{"url", "nsamples"}]})
    root/caption/00000.tar    (00000/abc.txt, ...)
    root/<other>/00000.tar    (text or JSON members, kept as JSON text in ``metadata``)

Two ways to pair the modalities of a shard:

- **zip** (default): positional; the i-th sample of every modality belongs
  to the i-th image. A key that differs from the image's is noted
  (``key_mismatch:<modality>``) but kept, as positional readers do.
- **index**: a parquet key list (``keys=...``; a ``key`` column, else the
  first string column) says which samples to load. Images are streamed and
  matched by key, so missing keys and any order in the list or the tars
  are tolerated. Keys of the list found in no shard are counted as
  ``key_not_found``; images not in the list as ``not_in_key_list``.

A modality whose tar is missing (or lacks a sample) leaves those rows
without it, counted as ``missing_modality:<name>``.
"""

from __future__ import annotations

import functools
import json
import os
import posixpath
from collections import Counter
from collections.abc import Iterator

import pyarrow as pa
import pyarrow.parquet as pq

from prx_data.core.errors import UsageError
from prx_data.ingest.common import (
    METADATA,
    SOURCE_FILE,
    Counts,
    Plan,
    RowBuilder,
    WorkUnit,
    caption_from_json,
    decode_text,
)
from prx_data.ingest.webdataset import image_field, is_tar, iter_samples

KIND = "twintar"
EXTRA_FIELDS = [pa.field(SOURCE_FILE, pa.string()), pa.field(METADATA, pa.string())]
IMAGE_DIRS = ("image", "images", "img", "jpg")
CAPTION_DIRS = ("caption", "captions", "txt", "text")
MANIFEST = "wdinfo.json"
FOUND = "internal:keys_found"


def _modalities(root: str) -> list[str]:
    if not os.path.isdir(root):
        return []
    return sorted(
        d
        for d in os.listdir(root)
        if os.path.isdir(os.path.join(root, d))
        and any(is_tar(f) or f == MANIFEST for f in os.listdir(os.path.join(root, d)))
    )


def _image_dir(mods: list[str]) -> str | None:
    return next((m for m in IMAGE_DIRS if m in mods), None)


def detect(path: str) -> bool:
    mods = _modalities(path)
    return _image_dir(mods) is not None and len(mods) >= 2


def _shards(root: str, image_dir: str, counts: Counts) -> list[str]:
    """Shard file names, from the image manifest when there is one."""
    folder = os.path.join(root, image_dir)
    manifest = os.path.join(folder, MANIFEST)
    on_disk = sorted(f for f in os.listdir(folder) if is_tar(f))
    if not os.path.exists(manifest):
        return on_disk
    with open(manifest, encoding="utf-8") as f:
        info = json.load(f)
    listed = [posixpath.basename(s["url"]) for s in info.get("shardlist", [])]
    present = [s for s in listed if s in on_disk]
    if len(present) < len(listed):
        counts.dropped("missing_shard", len(listed) - len(present))
    return present


@functools.lru_cache(maxsize=4)
def read_keys(path: str) -> frozenset[str]:
    """The key list of index mode (cached per worker process)."""
    table = pq.read_table(path)
    if "key" in table.column_names:
        col = table["key"]
    else:
        names = [
            f.name
            for f in table.schema
            if pa.types.is_string(f.type) or pa.types.is_large_string(f.type)
        ]
        if not names:
            raise UsageError(f"key list {path!r} has no string column")
        col = table[names[0]]
    return frozenset(k for k in col.to_pylist() if k is not None)


def plan(path: str, source: str | None = None, *, keys: str | None = None) -> Plan:
    root = path.rstrip("/")
    mods = _modalities(root)
    image_dir = _image_dir(mods)
    if image_dir is None:
        raise UsageError(f"{path!r} has no image modality folder (one of {IMAGE_DIRS})")
    counts = Counts()
    others = [m for m in mods if m != image_dir]
    shards = _shards(root, image_dir, counts)
    source = source or posixpath.basename(root) or "twintar"
    mode = "index" if keys else "zip"
    n_keys = len(read_keys(keys)) if keys else 0
    units = [
        WorkUnit(
            KIND,
            source,
            {
                "root": root,
                "shard": s,
                "image": image_dir,
                "others": others,
                "mode": mode,
                "keys": keys,
            },
        )
        for s in shards
    ]
    plan = Plan(units, list(EXTRA_FIELDS), counts, None)
    if keys:

        def finalize(total: Counter) -> None:
            missing = n_keys - total.pop(FOUND, 0)
            if missing > 0:
                total["dropped:key_not_found"] += missing

        plan.finalize = finalize
    return plan


def _other_fields(mod: str, fields: dict[str, bytes], counts: Counts) -> tuple[str | None, dict]:
    """(caption text or None, metadata) from one non-image modality's sample."""
    if mod in CAPTION_DIRS:
        for name in ("txt", "caption", "text"):
            if name in fields:
                return decode_text(fields[name], counts), {}
        if "json" in fields:
            caption, meta = caption_from_json(fields["json"], counts)
            return caption, (json.loads(meta) if meta else {})
        return decode_text(None, counts), {}
    meta: dict = {}
    for name, data in fields.items():
        if name == "json":
            try:
                meta[mod] = json.loads(data.decode("utf-8", errors="replace"))
            except ValueError:
                counts.kept(f"bad_json:{mod}")
        elif name in ("txt", "text", "cls"):
            meta[f"{mod}.{name}"] = data.decode("utf-8", errors="replace").strip()
    return None, meta


def _iter_or_none(path: str, counts: Counts) -> Iterator[tuple[str, dict[str, bytes]]] | None:
    return iter_samples(path, counts) if os.path.exists(path) else None


def load(unit: WorkUnit, counts: Counts) -> pa.Table:
    a = unit.args
    root, shard = a["root"], a["shard"]
    rows = RowBuilder(unit.source, counts)
    images = iter_samples(os.path.join(root, a["image"], shard), counts)
    if a["mode"] == "zip":
        others = {m: _iter_or_none(os.path.join(root, m, shard), counts) for m in a["others"]}
        for key, fields in images:
            parts = {}
            for m, it in others.items():
                sample = next(it, None) if it is not None else None
                if sample is not None and sample[0] != key:
                    counts.kept(f"key_mismatch:{m}")
                parts[m] = sample[1] if sample is not None else None
            _add(rows, counts, shard, key, fields, parts)
        for m, it in others.items():
            extra = sum(1 for _ in it) if it is not None else 0
            if extra:
                counts.dropped(f"extra_samples:{m}", extra)
        return rows.table(EXTRA_FIELDS)

    wanted = read_keys(a["keys"])
    lookups: dict[str, dict[str, dict[str, bytes]] | None] = {}
    for m in a["others"]:
        it = _iter_or_none(os.path.join(root, m, shard), counts)
        lookups[m] = None if it is None else {k: f for k, f in it if k in wanted}
    found = 0
    for key, fields in images:
        if key not in wanted:
            counts.dropped("not_in_key_list")
            continue
        found += 1
        parts = {m: (lk.get(key) if lk is not None else None) for m, lk in lookups.items()}
        _add(rows, counts, shard, key, fields, parts)
    counts[FOUND] += found
    return rows.table(EXTRA_FIELDS)


def _add(rows: RowBuilder, counts: Counts, shard: str, key: str, fields: dict, parts: dict) -> None:
    img = image_field(fields)
    if img is None:
        counts.dropped("sample_without_image")
        return
    caption = None
    meta: dict = {}
    have_caption_modality = False
    for m, f in parts.items():
        if f is None:
            counts.kept(f"missing_modality:{m}")
            continue
        text, more = _other_fields(m, f, counts)
        if m in CAPTION_DIRS:
            have_caption_modality = True
            caption = text if caption is None else caption
        meta.update(more)
    if not have_caption_modality and caption is None:
        counts.kept("caption_missing")
    rows.add(
        key,
        fields[img],
        caption,
        **{
            SOURCE_FILE: f"{shard}:{key}.{img}",
            METADATA: json.dumps(meta, ensure_ascii=False, sort_keys=True) if meta else None,
        },
    )
