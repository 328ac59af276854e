"""Pins: Lance tags that keep the table version a job reads safe from cleanup.

An export reads one table version for its whole life, a pause included
(``--resume`` must read the same rows), and a column job reads one version
while it runs. ``table compact --cleanup`` (Lance's ``cleanup_old_versions``)
deletes every version but the latest, except tagged ones. So each job tags
the version it reads, under a name derived from what identifies the job (the
export's ``--out``, the column job's name): a resumed or rerun job finds its
own tag and moves it, and the job deletes it when it finishes. A killed job
leaves its tag behind, which is what keeps a paused export resumable;
``python -m prx_data.table tags`` lists the tags and ``untag`` removes stale
ones.
"""

from __future__ import annotations

import hashlib
import os
import re
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import datetime, timezone
from typing import Any

from prx_data.core import storage

#: Every tag a job of this project creates starts with this.
PREFIX = "prx-"
EXPORT_PREFIX = PREFIX + "export-"
COLUMN_PREFIX = PREFIX + "col-"


def _digest(text: str, n: int) -> str:
    return hashlib.sha256(text.encode()).hexdigest()[:n]


def export_pin(out: str) -> str:
    """The tag of the export writing to ``out`` (one name however ``out`` is spelled locally)."""
    where = out.rstrip("/") if storage.is_remote(out) else os.path.realpath(out)
    return EXPORT_PREFIX + _digest(where, 16)


def column_pin(job_name: str) -> str:
    """The tag of the column job ``job_name`` (Lance allows only ``[A-Za-z0-9._-]`` in tags)."""
    safe = re.sub(r"[^A-Za-z0-9._-]+", "_", job_name)[:40]
    return f"{COLUMN_PREFIX}{safe}-{_digest(job_name, 8)}"


def pin(ds, name: str, version: int, **metadata: str) -> None:
    """Tag ``version`` of ``ds``'s table as ``name``, moving the tag if it names another one.

    ``metadata`` (what the job is, what it writes) is stored with the tag for
    ``table tags``.
    """
    current = ds.tags.list().get(name)
    if current is None:
        try:
            ds.tags.create(name, version)
        except ValueError:  # created meanwhile by the same job's other run: move it below
            current = ds.tags.list().get(name)
            if current is None:
                raise
    if current is not None and (current.get("version"), current.get("branch")) != (version, None):
        ds.tags.update(name, version)
    meta = {"since": datetime.now(timezone.utc).isoformat(timespec="seconds"), **metadata}
    ds.tags.replace_metadata(name, {k: str(v) for k, v in meta.items()})


def unpin(ds, name: str) -> bool:
    """Delete the tag ``name``; False when there was none."""
    try:
        ds.tags.delete(name)
    except ValueError:  # "Ref not found"
        return False
    return True


@contextmanager
def pinned(ds, name: str, table: str, **metadata: str) -> Iterator[None]:
    """Hold tag ``name`` on ``ds``'s version while a job reads it, so a cleanup meanwhile keeps it.

    A killed job leaves its tag; its next run moves and removes it. A failed
    removal only warns, so it never hides the job's own outcome.
    """
    pin(ds, name, ds.version, **metadata)
    try:
        yield
    finally:
        try:
            unpin(ds, name)
        except OSError as e:
            warnings.warn(
                f"could not remove tag {name} from {table} ({e}); remove it with "
                f"`python -m prx_data.table untag {table} {name}`",
                UserWarning,
                stacklevel=3,
            )


def list_tags(ds) -> list[dict[str, Any]]:
    """Every tag of the table: name, version, created and its metadata (job, target, since)."""
    rows = []
    for name, tag in sorted(ds.tags.list().items()):
        rows.append(
            {
                "name": name,
                "version": tag.get("version"),
                "branch": tag.get("branch"),
                "created_at": tag.get("created_at"),
                "metadata": dict(tag.get("metadata") or {}),
            }
        )
    return rows


def describe(tag: dict[str, Any]) -> str:
    """One line for a tag from :func:`list_tags`."""
    meta = tag["metadata"]
    what = meta.get("job", "")
    target = meta.get("out") or meta.get("column") or ""
    since = meta.get("since") or (tag["created_at"].isoformat() if tag["created_at"] else "")
    detail = ", ".join(
        x for x in (f"{what} {target}".strip(), f"since {since}" if since else "") if x
    )
    return f"{tag['name']} (version {tag['version']}" + (f": {detail})" if detail else ")")
