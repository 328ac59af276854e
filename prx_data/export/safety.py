"""Confinement and deletion: what an export may name, and what the exporter may delete.

Indexes and manifests are data: every shard name and column encoding they
carry is checked before a reader joins it to a path or decodes it
(:func:`load_index`). A tree is deleted or resumed only when it is provably an
export of ours (:func:`foreign_entries`), and deletions never follow a link
(:func:`remove_tree`, :func:`remove_stale_parts`, :func:`clear_export`).
"""

from __future__ import annotations

import functools
import json
import os
import posixpath
import re
import shutil
import stat
from collections.abc import Iterable, Mapping, Sequence

from prx_data.core import confined, storage
from prx_data.core.errors import PrxDataError
from prx_data.core.schema import MDS_COLUMNS, REPORT_NAME
from prx_data.export.naming import (
    AR_RE,
    COLUMNS_DIR,
    CONFIG_NAME,
    DROPPED_NAME,
    FILE_KEYS,
    IDS_INDEX_NAME,
    INDEX_NAME,
    LATENTS_DIR,
    LEASE_NAME,
    LIST_NAME_PATTERN,
    LISTS_DIR,
    LISTS_FILE_RE,
    LOCK_NAME,
    MARKER_FORMAT,
    MARKER_NAME,
    PART_RE,
    PART_SHARD_RE,
    PROGRESS_DIR,
    SHARD_FILE_PATTERN,
    SHARD_FILE_RE,
    SIDECAR_SUFFIX,
    TIER_RE,
    WRITING_DIR,
    content_part_name,
)

__all__ = [
    "UnsafeIndexError",
    "check_bucket",
    "check_index_entries",
    "check_manifest_shards",
    "check_stream_basenames",
    "columns_problem",
    "foreign_entries",
    "has_proof",
    "list_top",
    "load_index",
    "remove_stale_parts",
]


class UnsafeIndexError(PrxDataError, ValueError):
    """An index (or manifest) names a file outside the layout the exporter writes."""


def check_shard_basename(index_path: str, basename: object, *, in_part: bool = False) -> str:
    """Refuse a shard name that could escape the export, naming the file it came from.

    Streaming joins ``local + basename`` with no check, so ``../../victim`` or
    ``/etc/passwd`` in an index would be read (and our tools would write next
    to it). A merged index names ``<part>/shard.NNNNN.mds[.ext]``; a part's
    own index (``in_part``) names ``shard.NNNNN.mds[.ext]``. Anything else is
    refused: absolute, ``..``, backslashes, empty segments, other names.
    """
    pattern = SHARD_FILE_RE if in_part else PART_SHARD_RE
    if not isinstance(basename, str) or not pattern.fullmatch(basename):
        want = "shard.NNNNN.mds[.zstd]" if in_part else "<part>/shard.NNNNN.mds[.zstd]"
        why = why_unsafe(basename)
        raise UnsafeIndexError(
            f"{index_path}: refusing shard name {basename!r}{why}; an export written by "
            f"prx_data.write_mds names {want} with <part> like {content_part_name(0)}"
        )
    return basename


def check_stream_basenames(index_path: str, directory: str, basenames: Iterable[object]) -> None:
    """Refuse a file name of a plain MDS index that could leave its (local) dataset directory.

    The format allows any relative path (``shard.00000.mds``, and subpaths such
    as ``<sub>/shard.00000.mds`` from ``merge_index``), so exactly those are
    accepted: refused are non-strings, empty names, NUL, backslashes, absolute
    or drive-letter names, ``..`` segments, and names that a symlink inside
    ``directory`` leads out of it.
    """
    root = os.path.realpath(directory)
    inside = root.rstrip(os.sep) + os.sep  # resolved paths below: a prefix test is exact
    parents: dict[str, str] = {}  # resolved once per directory: one lstat per file after that
    for name in basenames:
        why = why_unsafe(name, plain=True)
        if not why:
            head, tail = posixpath.split(name)  # type: ignore[arg-type]
            if head not in parents:
                parents[head] = os.path.realpath(os.path.join(root, head))
            target = os.path.join(parents[head], tail)
            try:
                st = os.lstat(target)
            except FileNotFoundError:  # a missing shard: the reader says so when it needs it
                st = None
            if st is not None and stat.S_ISLNK(st.st_mode):
                target = os.path.realpath(target)
                st = os.stat(target) if os.path.exists(target) else None
            if target != root and not target.startswith(inside):
                why = f" (a symlink leads out of {directory} to {target})"
            elif st is not None and not stat.S_ISREG(st.st_mode):
                why = f" ({target} is not a regular file)"
        if why:
            raise UnsafeIndexError(
                f"{index_path}: refusing shard name {name!r}{why}; shard names must be "
                "relative paths inside the dataset directory"
            )


def why_unsafe(name: object, *, plain: bool = False) -> str:
    """Why ``name`` could escape its directory ("" if it cannot); ``plain``: the only checks."""
    if not isinstance(name, str):
        return " (not a string)"
    if not name:
        return " (empty)"
    if "\0" in name:
        return " (NUL byte)"
    if name.startswith(("/", "\\")) or re.match(r"[A-Za-z]:", name):
        return " (absolute path)"
    if "\\" in name:
        return " (backslash)"
    segs = name.split("/")
    if ".." in segs:
        return " (parent-directory segment)"
    if not plain and ("" in segs or "." in segs):
        return " (empty segment)"
    return ""


def columns_problem(entry: Mapping, *, export_columns: bool | frozenset = False) -> str | None:
    """Why a shard's columns are refused (None when they are fine).

    Every reader accepts only MDS shards whose every column has a safe
    encoding: streaming decodes a ``pkl`` column with ``pickle.loads``, which
    runs whatever the data says. ``export_columns`` (rewrite, verify) also
    requires the exporter's columns: ``MDS_COLUMNS`` plus ``str`` caption columns, and
    when it is a frozenset of ``(name, encoding)`` (:func:`folded_columns`), those too.
    """
    names, encs = entry.get("column_names"), entry.get("column_encodings")
    key = None
    if isinstance(names, list) and isinstance(encs, list):
        key = (tuple(names), tuple(encs))
        try:
            hash(key)
        except TypeError:  # lists or dicts in place of names
            key = None
    return _columns_problem(entry.get("format"), key, export_columns)


@functools.lru_cache(maxsize=256)
def _columns_problem(
    fmt: object, key: tuple | None, export_columns: bool | frozenset
) -> str | None:
    """:func:`columns_problem` per distinct column set (shards of an index repeat theirs)."""
    if fmt != "mds":
        return f"shard format {fmt!r} is not 'mds'"
    names, encs = key if key is not None else ((), (1,))
    if (
        len(names) != len(encs)
        or not all(isinstance(x, str) for x in (*names, *encs))
        or len(set(names)) != len(names)
    ):
        return "column_names and column_encodings are not two equal-length lists of unique strings"
    # Imported here: `import streaming` costs seconds in every export process that never reads.
    from prx_data.core.streaming_compat import is_safe_mds_encoding

    pairs = list(zip(names, encs, strict=True))
    for name, enc in pairs:
        if not is_safe_mds_encoding(enc):
            why = (
                "unpickling runs code from the data"
                if enc.split(":")[0] == "pkl"
                else "not an MDS encoding that streaming decodes without running code"
            )
            return (
                f"refusing column {name!r} with encoding {enc!r} ({why}); write it with a safe "
                "encoding such as bytes, str, int32 or json"
            )
    if export_columns:
        cols = dict(pairs)
        for name, enc in MDS_COLUMNS.items():
            if cols.get(name) != enc:
                got = "is missing" if name not in cols else f"has encoding {cols[name]!r}"
                return (
                    f"column {name!r} {got}; an export written by prx_data.write_mds has it as "
                    f"{enc!r}"
                )
        for name, enc in pairs:
            folded = export_columns if isinstance(export_columns, frozenset) else frozenset()
            if name not in MDS_COLUMNS and enc != "str" and (name, enc) not in folded:
                return (
                    f"refusing column {name!r} with encoding {enc!r}: besides "
                    "prx_data.core.schema.MDS_COLUMNS an export has only str caption columns "
                    "(and the columns its report names as folded by skips rewrite --fold-columns)"
                )
    return None


def folded_columns(report: Mapping | None) -> frozenset:
    """The ``(name, encoding)`` pairs ``skips rewrite --fold-columns`` wrote into an export's
    shards, as its report names them: pass as ``export_columns`` to accept them there too."""
    got = (report or {}).get("folded_columns") or {}
    if not isinstance(got, dict):
        return frozenset()
    return frozenset((str(k), str(v)) for k, v in got.items())


def check_index_entries(
    index_path: str,
    obj: object,
    *,
    in_part: bool = False,
    export_columns: bool | frozenset = False,
    plain: bool = False,
) -> list[dict]:
    """The ``shards`` entries of a parsed index, every file name and column encoding checked.

    ``plain`` also accepts what any MDS writer names (``shard.00000.mds``,
    ``w0/shard.00000.mds`` from ``merge_index``): relative paths with no
    ``..``, empty or ``.`` segment, backslash, NUL or drive letter.
    """
    shards = obj.get("shards") if isinstance(obj, dict) else None
    if not isinstance(shards, list):
        raise UnsafeIndexError(f"{index_path}: not a streaming index (no 'shards' list)")
    for entry in shards:
        if not isinstance(entry, dict) or not isinstance(entry.get("raw_data"), dict):
            raise UnsafeIndexError(f"{index_path}: shard entry without raw_data: {entry!r:.200}")
        for key in FILE_KEYS:
            if entry.get(key):
                info = entry[key]
                name = info.get("basename") if isinstance(info, dict) else None
                if plain and not in_part and not why_unsafe(name):
                    continue
                check_shard_basename(index_path, name, in_part=in_part)
        problem = columns_problem(entry, export_columns=export_columns)
        if problem is not None:
            raise UnsafeIndexError(f"{index_path}: {problem}")
    return shards


def check_bucket(bucket: object) -> str:
    """A bucket name is ``<tier>/<ratio>`` (``512/1.000``): nothing else may reach a path."""
    if not isinstance(bucket, str) or bucket.count("/") != 1:
        raise UnsafeIndexError(
            f"bad bucket name {bucket!r}: expected <tier>/<ratio>, e.g. 512/1.000"
        )
    tier, ar = bucket.split("/")
    if not (TIER_RE.fullmatch(tier) and AR_RE.fullmatch(ar)):
        raise UnsafeIndexError(
            f"bad bucket name {bucket!r}: expected <tier>/<ratio>, e.g. 512/1.000"
        )
    return bucket


def load_index(
    path: str,
    *,
    in_part: bool = False,
    export_columns: bool | frozenset = False,
    plain: bool = False,
    root: str | None = None,
) -> list[dict]:
    """Read and check one ``index.json``: its shard entries, names confined, encodings safe.

    The file itself is read through :mod:`prx_data.core.confined` under ``root``
    (the export root; default: the index's own directory): a regular file of
    at most :data:`~prx_data.core.confined.INDEX_MAX_BYTES`, reached through no
    link out of the root.
    """
    try:
        data = confined.read(root or os.path.dirname(path), path, confined.INDEX_MAX_BYTES)
        obj = json.loads(data)
    except ValueError as e:
        if isinstance(e, confined.UnsafeFileError):
            raise
        raise UnsafeIndexError(f"{path}: not valid JSON ({e})") from None
    return check_index_entries(
        path, obj, in_part=in_part, export_columns=export_columns, plain=plain
    )


#: Top-level files an export may contain besides tier directories.
_EXPORT_ENTRIES_EXTRA = {
    PROGRESS_DIR,
    REPORT_NAME,
    "report.txt",
    DROPPED_NAME,
    LOCK_NAME,
    LEASE_NAME,
    LISTS_DIR,
    IDS_INDEX_NAME,
    LATENTS_DIR,
    COLUMNS_DIR,
}
#: What a part directory holds: shards, its index, its manifest, sidecars and temp files.
#: (Part directories themselves match ``PART_RE``, the pattern :func:`~prx_data.export.naming.part_name` makes.)
_PART_FILE_RE = re.compile(
    rf"({SHARD_FILE_PATTERN}(\.{LIST_NAME_PATTERN}{re.escape(SIDECAR_SUFFIX)})?|index\.json"
    r"|ids\.parquet)(\.tmp-[0-9a-f]+)?"
)


def list_top(out: str) -> list[str]:
    if storage.is_remote(out):
        return sorted({p.split("/")[0] for p in storage.list_files(out)})
    return sorted(os.listdir(out)) if os.path.isdir(out) else []


def write_export_marker(out: str) -> None:
    """Mark ``out`` as an export of ours (first thing written into a new export)."""
    body = json.dumps({"format": MARKER_FORMAT, "version": 1}, sort_keys=True)
    storage.write_bytes_atomic(storage.join(out, *MARKER_NAME.split("/")), body.encode())


def has_proof(out: str) -> bool:
    """The marker, or (exports written before the marker existed) a parseable export config."""
    for name in (MARKER_NAME, CONFIG_NAME):
        try:
            path = storage.join(out, *name.split("/"))
            obj = json.loads(confined.read(out, path, confined.SMALL_MAX_BYTES))
        except (FileNotFoundError, OSError, ValueError):
            continue
        if name == MARKER_NAME and isinstance(obj, dict) and obj.get("format") == MARKER_FORMAT:
            return True
        if name == CONFIG_NAME and isinstance(obj, dict) and {"table", "tiers"} <= set(obj):
            return True
    return False


def foreign_entries(out: str) -> list[str]:
    """What makes ``out`` not provably an export of ours (empty: safe to delete or resume).

    Proof is the exporter's marker (or config), and a tree in which every
    top-level entry is an export file or a tier directory holding only
    ``<ratio>`` bucket directories, which hold only part directories and the
    merged index. A photo folder with ``2023/`` and ``2024/`` fails on both.
    """
    found: list[str] = []
    if not has_proof(out):
        found.append(f"no {MARKER_NAME} or {CONFIG_NAME} written by the exporter")
    if storage.is_remote(out):
        for rel in storage.list_files(out):
            bits = rel.split("/")
            if bits[0] in _EXPORT_ENTRIES_EXTRA and (
                len(bits) == 1
                or bits[0] in (PROGRESS_DIR, IDS_INDEX_NAME, LATENTS_DIR, COLUMNS_DIR)
            ):
                continue
            if bits[0] == LISTS_DIR and len(bits) == 2 and LISTS_FILE_RE.fullmatch(bits[1]):
                continue
            if not _allowed_bucket_path(bits):
                found.append(rel)
        return found
    found += _symlinks(out)
    for top in sorted(os.listdir(out)):
        path = os.path.join(out, top)
        if top in _EXPORT_ENTRIES_EXTRA:
            if top in (
                PROGRESS_DIR,
                IDS_INDEX_NAME,
                LATENTS_DIR,
                COLUMNS_DIR,
            ) and not os.path.isdir(path):
                found.append(top)
            if top == LISTS_DIR:
                found += _foreign_in_lists(path)
            continue
        if not (TIER_RE.fullmatch(top) and os.path.isdir(path)):
            found.append(top)
            continue
        for ar in sorted(os.listdir(path)):
            bdir = os.path.join(path, ar)
            if not (AR_RE.fullmatch(ar) and os.path.isdir(bdir)):
                found.append(f"{top}/{ar}")
                continue
            for entry in sorted(os.listdir(bdir)):
                epath = os.path.join(bdir, entry)
                if os.path.isdir(epath):
                    if not PART_RE.fullmatch(entry):
                        found.append(f"{top}/{ar}/{entry}")
                        continue
                    for f in sorted(os.listdir(epath)):
                        if not (
                            _PART_FILE_RE.fullmatch(f) and os.path.isfile(os.path.join(epath, f))
                        ):
                            found.append(f"{top}/{ar}/{entry}/{f}")
                elif not (entry == INDEX_NAME or entry.startswith(f"{INDEX_NAME}.tmp-")):
                    found.append(f"{top}/{ar}/{entry}")
    return found


def _symlinks(out: str) -> list[str]:
    """Links anywhere in a local tree: the exporter writes none, and a delete must not follow one."""
    found = []
    for dirpath, dirs, files in os.walk(out):  # os.walk does not descend into linked dirs
        for name in dirs + files:
            if os.path.islink(os.path.join(dirpath, name)):
                rel = os.path.relpath(os.path.join(dirpath, name), out).replace(os.sep, "/")
                found.append(f"{rel} (a symbolic link)")
    return found


def _foreign_in_lists(path: str) -> list[str]:
    if not os.path.isdir(path):
        return [LISTS_DIR]
    return [
        f"{LISTS_DIR}/{f}"
        for f in sorted(os.listdir(path))
        if not (LISTS_FILE_RE.fullmatch(f) and os.path.isfile(os.path.join(path, f)))
    ]


def _allowed_bucket_path(bits: list[str]) -> bool:
    if len(bits) < 3 or not (TIER_RE.fullmatch(bits[0]) and AR_RE.fullmatch(bits[1])):
        return False
    if len(bits) == 3:
        return bits[2] == INDEX_NAME or bits[2].startswith(f"{INDEX_NAME}.tmp-")
    return len(bits) == 4 and bool(PART_RE.fullmatch(bits[2]) and _PART_FILE_RE.fullmatch(bits[3]))


def describe_foreign(found: Sequence[str], limit: int = 10) -> str:
    more = f" and {len(found) - limit} more" if len(found) > limit else ""
    return "; ".join(found[:limit]) + more


def remove_stale_parts(out: str, keep: set[str], tiers: tuple[int, ...]) -> int:
    """Delete what an interrupted run left: unfinished parts, merged indexes, temp files.

    Only names the exporter writes are touched (part directories, ``index.json``
    and its ``.tmp-*`` files, staged parts); the caller has checked the tree with
    :func:`foreign_entries` first. The report goes first, so a kill part-way
    leaves a tree the loader and ``verify`` see as unfinished. A symbolic link
    is never followed: a linked tier, bucket or part is left alone, and so is its target.
    ``keep`` holds ``<tier>/<ar>/<part>`` paths (finished units' parts, written packs), and
    bare part names kept in every bucket (the unit keys that named the parts of older versions).
    """
    for name in (REPORT_NAME, "report.txt"):
        storage.delete(storage.join(out, name))
    removed = 0
    if storage.is_remote(out):
        stale = set()
        for rel in storage.list_files(out):
            bits = rel.split("/")
            if not _allowed_bucket_path(bits):
                continue
            if len(bits) == 4 and bits[2] not in keep and "/".join(bits[:3]) not in keep:
                stale.add("/".join(bits[:3]))
            elif len(bits) == 3:  # a merge from an earlier attempt; redone at the end
                stale.add(rel)
        for p in sorted(stale):
            storage.delete(storage.join(out, p))
            removed += 1
        return removed
    remove_tree(os.path.join(out, *WRITING_DIR.split("/")))
    _remove_temp_files(os.path.join(out, PROGRESS_DIR))
    for tier in os.listdir(out):
        tdir = os.path.join(out, tier)
        if not (TIER_RE.fullmatch(tier) and os.path.isdir(tdir)):
            continue
        if os.path.islink(tdir):
            continue
        for ar in os.listdir(tdir):
            bdir = os.path.join(tdir, ar)
            if not (AR_RE.fullmatch(ar) and os.path.isdir(bdir)):
                continue
            if os.path.islink(bdir):
                continue
            for part in os.listdir(bdir):
                ppath = os.path.join(bdir, part)
                if os.path.islink(ppath):
                    continue
                kept = part in keep or f"{tier}/{ar}/{part}" in keep
                if os.path.isdir(ppath) and PART_RE.fullmatch(part) and not kept:
                    remove_tree(ppath)
                    removed += 1
                elif os.path.isdir(ppath):
                    _remove_temp_files(ppath)
                elif part == INDEX_NAME or part.startswith(f"{INDEX_NAME}.tmp-"):
                    os.remove(ppath)  # a merge from an earlier attempt; redone at the end
    return removed


def remove_tree(path: str) -> None:
    """Delete a local file or directory tree without following any symbolic link.

    A link is unlinked, never its target; ``shutil.rmtree`` unlinks links
    inside the tree rather than descending into them.
    """
    if os.path.islink(path) or os.path.isfile(path):
        os.unlink(path)
    elif os.path.isdir(path):
        shutil.rmtree(path)


def _remove_temp_files(directory: str) -> None:
    """Leftovers of :func:`storage.write_bytes_atomic` from a killed process."""
    for dirpath, _dirs, files in os.walk(directory):
        for f in files:
            if re.search(r"\.tmp-[0-9a-f]{8}\Z", f):
                os.remove(os.path.join(dirpath, f))


def check_manifest_shards(path: str, part: str, shards) -> None:
    """Shard names in a manifest are data too: each must be a shard of the manifest's own part."""
    import pyarrow.compute as pc

    for name in pc.unique(shards).to_pylist():  # a handful per part, whatever the row count
        check_shard_basename(path, name)
        if name.split("/")[0] != part:
            raise UnsafeIndexError(
                f"{path}: shard {name!r} is not in this manifest's part {part!r}"
            )


def clear_export(out: str, entries: list[str]) -> None:
    """Delete an export of ours for ``--overwrite``, so that a kill part-way never looks complete.

    The report goes first, then ``_progress`` (config and unit markers) except
    the export marker, then everything else: an interrupted overwrite leaves a
    tree that the loader and ``verify`` call unfinished, that ``--resume``
    refuses (no config), and that a second ``--overwrite`` still recognises.
    On object storage ``_progress`` goes as one prefix and the marker is
    written again at once (a kill inside that one PUT leaves a tree
    ``--overwrite`` refuses as unproven, never a complete-looking one).
    """
    first = [e for e in (REPORT_NAME, "report.txt") if e in entries]
    for e in first:
        storage.delete(storage.join(out, e))
    if PROGRESS_DIR in entries:
        progress = storage.join(out, PROGRESS_DIR)
        if storage.is_remote(out):
            storage.delete(progress)
            write_export_marker(out)
        else:
            keep = MARKER_NAME.split("/")[-1]
            for name in sorted(os.listdir(progress)):
                if name != keep:
                    storage.delete(os.path.join(progress, name))
    for e in entries:
        # Latents and attached columns are bound to the shards they came from (their
        # records): kept, never deleted.
        if e not in first and e not in (PROGRESS_DIR, LATENTS_DIR, COLUMNS_DIR):
            storage.delete(storage.join(out, e))
