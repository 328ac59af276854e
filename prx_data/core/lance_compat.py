"""Every edit of Lance fragment metadata the project makes, in one place, behind a version check.

Lance's public API commits fragments (``LanceOperation``) but has no call to
point a fragment at an extra data file: the column runner edits the
fragment's JSON form (``FragmentMetadata.to_json`` / ``from_json``), and the
ingest job passes staged fragments between Ray tasks as that JSON text. The
JSON layout (``files[].fields``, the ``-2`` tombstone for a field a newer
file replaces, ``column_indices``, ``file_*_version``, ``base_id``) is
Lance's internal format, so it is read and written here only, and importing
this module on an unknown pylance version fails with what to check.

When upgrading pylance, run ``tests/test_lance_compat.py`` (the contract of
each function here) and ``tests/test_column_runner.py``, then add the
version to :data:`SUPPORTED`.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from importlib.metadata import version as _dist_version
from typing import Any

#: pylance release prefixes whose fragment JSON matches what this module writes.
SUPPORTED = ("14.",)
#: The field id Lance writes in a data file's ``fields`` for a field a newer file holds.
TOMBSTONE = -2

_lance_version = _dist_version("pylance")
if not _lance_version.startswith(SUPPORTED):
    raise ImportError(
        f"prx-data was checked against pylance {', '.join(v + 'x' for v in SUPPORTED)}, found "
        f"{_lance_version}. Check that FragmentMetadata.to_json/from_json keep 'files' with "
        "'path', 'fields' (-2 for a replaced field), 'column_indices', 'file_major_version', "
        "'file_minor_version', 'file_size_bytes', 'base_id' and 'deletion_file' "
        "(tests/test_lance_compat.py), then add the version to "
        "prx_data.core.lance_compat.SUPPORTED; or pin pylance==14.0.2."
    )


def fragment_text(meta: Any) -> str:
    """A fragment's metadata as JSON text (to pass a staged fragment between processes)."""
    return json.dumps(meta.to_json())


def fragment_from_text(text: str | bytes) -> Any:
    """The ``FragmentMetadata`` of :func:`fragment_text` (or of a stored ``to_json`` dict)."""
    from lance.fragment import FragmentMetadata

    if isinstance(text, bytes):
        text = text.decode()
    return FragmentMetadata.from_json(text)


def fragment_from_dict(obj: dict) -> Any:
    """The ``FragmentMetadata`` of a ``to_json`` dict (a checkpoint keeps the dict)."""
    return fragment_from_text(json.dumps(obj))


def fragment_key(meta: Any) -> str:
    """A fragment's identity for 'unchanged since': its data files and its deletion file."""
    d = meta.to_json()
    return json.dumps({"files": d.get("files"), "deletion_file": d.get("deletion_file")})


def with_data_file(
    meta: Any,
    path: str,
    field_ids: Sequence[int],
    file_version: tuple[int, int],
    size: int | None,
) -> Any:
    """``meta`` with one more data file holding ``field_ids``, which older files stop serving.

    What ``LanceFragment.update_columns`` commits, without its join: the older
    files keep their columns but their entries for these fields become
    tombstones, so readers take the fields from ``path`` (a file under the
    table's ``data/`` folder, written with ``file_version``).
    """
    ids = [int(i) for i in field_ids]
    d = meta.to_json()
    for f in d["files"]:
        f["fields"] = [TOMBSTONE if i in ids else i for i in f["fields"]]
    d["files"].append(
        {
            "path": path,
            "fields": ids,
            "column_indices": list(range(len(ids))),
            "file_major_version": file_version[0],
            "file_minor_version": file_version[1],
            "file_size_bytes": size,
            "base_id": None,
        }
    )
    return fragment_from_dict(d)
