"""WebDataset tars: members ``<key>.<field>`` grouped into samples, one tar per work unit.

The sample key is the member path up to the first ``.`` of its base name
(the WebDataset convention), so ``a/b/x.left.jpg`` belongs to ``a/b/x``.
The image is the first member with an image extension; the caption comes
from ``.txt`` (or ``.caption``), else from ``.json`` (``caption``/``text``
key), whose other keys are kept as JSON text in ``metadata``
(img2dataset's url, status, original size...).

A tar that cannot be opened is counted as ``corrupt_tar`` and skipped; a
tar that breaks in the middle keeps the samples read before the break and
is counted the same way. The other tars load normally.
"""

from __future__ import annotations

import glob
import os
import posixpath
import tarfile
import zlib
from collections.abc import Iterator

import pyarrow as pa

from prx_data.core import storage
from prx_data.core.errors import UsageError
from prx_data.ingest.common import (
    IMAGE_EXTENSIONS,
    METADATA,
    SOURCE_FILE,
    Counts,
    Plan,
    RowBuilder,
    WorkUnit,
    caption_from_json,
    decode_text,
)

KIND = "webdataset"
EXTRA_FIELDS = [pa.field(SOURCE_FILE, pa.string()), pa.field(METADATA, pa.string())]
TAR_SUFFIXES = (".tar", ".tar.gz", ".tgz")


def split_member(name: str) -> tuple[str, str]:
    """``dir/key.field.ext`` -> (``dir/key``, ``field.ext``)."""
    head, base = posixpath.split(name)
    stem, _, field = base.partition(".")
    return (posixpath.join(head, stem) if head else stem), field.lower()


def is_tar(path: str) -> bool:
    return path.endswith(TAR_SUFFIXES)


def list_tars(path: str) -> list[str]:
    """A tar, a glob pattern, or a folder of tars (searched recursively), sorted."""
    if is_tar(path) and not any(c in path for c in "*?["):
        return [path]
    if any(c in path for c in "*?["):
        return sorted(glob.glob(path))
    return [storage.join(path, p) for p in storage.list_files(path) if is_tar(p)]


def detect(path: str) -> bool:
    if is_tar(path) or (any(c in path for c in "*?[") and any(is_tar(p) for p in glob.glob(path))):
        return True
    if storage.is_remote(path) or not os.path.isdir(path):
        return False
    files = storage.list_files(path, recursive=False)
    return any(is_tar(f) for f in files)


def plan(path: str, source: str | None = None) -> Plan:
    tars = list_tars(path)
    if not tars:
        raise UsageError(f"no tar files at {path!r}")
    root = path if os.path.isdir(path) else os.path.dirname(path)
    if source is None:
        base = path.rstrip("/")
        source = posixpath.basename(base if os.path.isdir(base) else os.path.dirname(base) or base)
        source = source or "webdataset"
    units = [WorkUnit(KIND, source, {"tar": t, "root": root}) for t in tars]
    return Plan(units, list(EXTRA_FIELDS), Counts(), None)


def _open_tar(path: str) -> tarfile.TarFile:
    if storage.is_remote(path):
        fs, p = storage.filesystem(path)
        return tarfile.open(fileobj=fs.open_input_stream(p), mode="r|*")
    return tarfile.open(path, mode="r|*")


def iter_samples(path: str, counts: Counts) -> Iterator[tuple[str, dict[str, bytes]]]:
    """(key, {field: bytes}) for consecutive members sharing a key. Counts a corrupt tar."""
    current: str | None = None
    fields: dict[str, bytes] = {}
    try:
        with _open_tar(path) as tf:
            for member in tf:
                if not member.isfile():
                    continue
                key, field = split_member(member.name)
                if posixpath.basename(key).startswith(".") or not field:
                    continue
                f = tf.extractfile(member)
                data = f.read() if f is not None else b""
                if key != current:
                    if current is not None:
                        yield current, fields
                    current, fields = key, {}
                fields.setdefault(field, data)
    except (tarfile.TarError, EOFError, OSError, ValueError, zlib.error):
        # The sample being read when the tar broke may be incomplete: keep what we have.
        counts.dropped("corrupt_tar")
    if current is not None:
        yield current, fields


def image_field(fields: dict[str, bytes]) -> str | None:
    for field in fields:
        if field.rsplit(".", 1)[-1] in IMAGE_EXTENSIONS:
            return field
    return None


def caption_and_meta(fields: dict[str, bytes], counts: Counts) -> tuple[str | None, str | None]:
    meta = None
    caption = None
    has_text = False
    for name in ("txt", "caption", "text"):
        if name in fields:
            has_text = True
            caption = decode_text(fields[name], counts)
            break
    if "json" in fields:
        json_caption, meta = caption_from_json(fields["json"], counts if not has_text else Counts())
        if not has_text:
            caption = json_caption
    elif not has_text:
        counts.kept("caption_missing")
    return caption, meta


def load(unit: WorkUnit, counts: Counts) -> pa.Table:
    tar = unit.args["tar"]
    root = unit.args.get("root") or ""
    rel_tar = (
        os.path.relpath(tar, root)
        if root and not storage.is_remote(tar)
        else posixpath.basename(tar)
    )
    rows = RowBuilder(unit.source, counts)
    for key, fields in iter_samples(tar, counts):
        img = image_field(fields)
        if img is None:
            counts.dropped("sample_without_image")
            continue
        caption, meta = caption_and_meta(fields, counts)
        rows.add(
            key, fields[img], caption, **{SOURCE_FILE: f"{rel_tar}:{key}.{img}", METADATA: meta}
        )
    return rows.table(EXTRA_FIELDS)
