"""The export tree: one module owns its layout, so the exporter, rewrite, dedup, opt-out,
the loader and the tests all read and write the same thing.

::

    out/
      report.json                      written last: the export is complete
      report.txt
      dropped.parquet                  id, reason, detail of every dropped or failed row
      .prx-export.lock                 the run lock (local); .prx-export.lease on object storage
      _progress/export.marker          written first: proof that the tree is an export of ours
      _progress/config                 the pinned export config (JSON text, not *.json)
      _progress/dropped/<part>.parquet a unit's dropped rows, merged into dropped.parquet
      _progress/<part>.done            one marker per finished work unit
      _progress/writing/<part>.<hex>/  a unit's parts while it writes them (local): renamed
                                       into the buckets once fsynced, then the marker
      <tier>/<ar>/index.json           merged bucket index, written atomically
      <tier>/<ar>/<part>/index.json    the part's own MDSWriter index
      <tier>/<ar>/<part>/shard.NNNNN.mds[.zstd]
      <tier>/<ar>/<part>/ids.parquet   manifest: shard (as in the merged index), index, id
      <tier>/<ar>/<part>/shard.NNNNN.mds.<name>.skip   skip-list sidecars
      _progress/packed/<tier>/<ar>/<pack>  a written pack (JSON: its unit parts, counts)
      _lists/<name>.parquet            a skip list's row ids + provenance (sidecars derive from it)
      _lists/registry                  the lists' state: table identity, log position (JSON)
      _lists/_local.parquet            the export's own (export-only) list log entries
      _ids.lance/                      id index: id -> bucket, shard, index (Lance, BTREE on id;
                                       :mod:`prx_data.export.idindex`), rebuilt after every merge

``<part>`` names a work unit, ``f<fragment:06d>-<start:09d>`` (:func:`part_name`), or,
once the pack stage ran, a pack of consecutive unit parts of the bucket,
``p<ordinal:06d>-<first unit part>`` (:func:`pack_name`, :mod:`prx_data.export.pack`).
The merged index is built by :func:`merge_bucket`, our documented equivalent
of ``streaming.base.util.merge_index``: it prefixes each shard basename with
its part, sorts parts, writes with sorted keys and replaces the file
atomically, so reruns give identical bytes and a reader never sees half an
index (streaming's version writes in place and downloads remote parts).
"""

from __future__ import annotations

import functools
import hashlib
import io
import json
import os
import posixpath
import re
import shutil
import stat
from collections import deque
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import TypeVar

import pyarrow as pa
import pyarrow.parquet as pq

from prx_data.core import confined, storage
from prx_data.core.errors import NotFound, PrxDataError
from prx_data.core.schema import MANIFEST_NAME, MDS_COLUMNS, REPORT_NAME

T = TypeVar("T")
R = TypeVar("R")


def part_name(fragment_id: int, start: int) -> str:
    """The part (work unit) directory name: stable for a table version and unit plan."""
    return f"f{fragment_id:06d}-{start:09d}"


def pack_name(ordinal: int, first_part: str) -> str:
    """A pack's directory name: its place in the bucket and the first unit part it holds."""
    return f"p{ordinal:06d}-{first_part}"


# Every name pattern here is used with ``fullmatch`` (``$`` would accept a trailing newline)
# and spells digits ``[0-9]`` (``\d`` also matches other scripts' digits, e.g. ``٥١٢``).
#: What :func:`part_name` produces (widths are minimums: more fragments widen them).
UNIT_PART_PATTERN = r"f[0-9]{6,}-[0-9]{9,}"
#: What :func:`pack_name` produces: a pack of consecutive unit parts (``prx_data.export.pack``).
PACK_PATTERN = rf"p[0-9]{{6,}}-{UNIT_PART_PATTERN}"
#: A part directory of a bucket: a work unit's part, or a pack of them.
PART_PATTERN = rf"(?:{UNIT_PART_PATTERN}|{PACK_PATTERN})"
#: A shard file as MDSWriter names it, raw or compressed (streaming's compression extensions).
SHARD_FILE_PATTERN = r"shard\.[0-9]{5,}\.mds(?:\.(?:br|bz2|gz|snappy|zstd))?"
_PART_RE = re.compile(PART_PATTERN)
_SHARD_FILE_RE = re.compile(SHARD_FILE_PATTERN)
_SHARD_RE = re.compile(rf"{PART_PATTERN}/{SHARD_FILE_PATTERN}")
#: A shard name in an export's merged index: ``<part>/shard.NNNNN.mds[.ext]``.
PART_SHARD_RE = _SHARD_RE
#: Index entry keys that name a file (streaming joins each to the dataset directory).
_FILE_KEYS = ("raw_data", "zip_data", "raw_meta", "zip_meta")


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
    pattern = _SHARD_FILE_RE if in_part else _SHARD_RE
    if not isinstance(basename, str) or not pattern.fullmatch(basename):
        want = "shard.NNNNN.mds[.zstd]" if in_part else "<part>/shard.NNNNN.mds[.zstd]"
        why = _why_unsafe(basename)
        raise UnsafeIndexError(
            f"{index_path}: refusing shard name {basename!r}{why}; an export written by "
            f"prx_data.write_mds names {want} with <part> like {part_name(0, 0)}"
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
        why = _why_unsafe(name, plain=True)
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


def _why_unsafe(name: object, *, plain: bool = False) -> str:
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


def columns_problem(entry: Mapping, *, export_columns: bool = False) -> str | None:
    """Why a shard's columns are refused (None when they are fine).

    Every reader accepts only MDS shards whose every column has a safe
    encoding: streaming decodes a ``pkl`` column with ``pickle.loads``, which
    runs whatever the data says. ``export_columns`` (rewrite, verify) also
    requires the exporter's columns: ``MDS_COLUMNS`` plus ``str`` caption columns.
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
def _columns_problem(fmt: object, key: tuple | None, export_columns: bool) -> str | None:
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
            if name not in MDS_COLUMNS and enc != "str":
                return (
                    f"refusing column {name!r} with encoding {enc!r}: besides "
                    "prx_data.core.schema.MDS_COLUMNS an export has only str caption columns"
                )
    return None


def check_index_entries(
    index_path: str,
    obj: object,
    *,
    in_part: bool = False,
    export_columns: bool = False,
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
        for key in _FILE_KEYS:
            if entry.get(key):
                info = entry[key]
                name = info.get("basename") if isinstance(info, dict) else None
                if plain and not in_part and not _why_unsafe(name):
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
    if not (_TIER_RE.fullmatch(tier) and _AR_RE.fullmatch(ar)):
        raise UnsafeIndexError(
            f"bad bucket name {bucket!r}: expected <tier>/<ratio>, e.g. 512/1.000"
        )
    return bucket


def load_index(
    path: str,
    *,
    in_part: bool = False,
    export_columns: bool = False,
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


def marker_path(out: str, part: str) -> str:
    """Where a finished work unit leaves its marker (the unit's counts, JSON text)."""
    return storage.join(out, PROGRESS_DIR, f"{part}.done")


def list_markers(out: str) -> list[str]:
    """Paths of every progress marker under ``out`` (one listing of ``_progress``)."""
    root = storage.join(out, PROGRESS_DIR)
    return [
        storage.join(root, rel) for rel in storage.list_files(root, suffix=".done", recursive=False)
    ]


PROGRESS_DIR = "_progress"


CONFIG_NAME = "_progress/config"


#: Written first by the exporter, before any shard: the proof that a tree is one of ours.
MARKER_NAME = "_progress/export.marker"
MARKER_FORMAT = "prx-data export"

#: The run lock on a local --out (held with flock) and the lease object on object storage.
LOCK_NAME = ".prx-export.lock"
LEASE_NAME = ".prx-export.lease"

DROPPED_NAME = "dropped.parquet"
DROPPED_DIR = "_progress/dropped"
#: Where a work unit stages its parts on a local --out (one folder per attempt).
WRITING_DIR = "_progress/writing"

#: A skip-list name (used with ``fullmatch``; ``$`` would accept a trailing newline). Names
#: become file-name parts: a sidecar is ``<shard basename>.<name>`` + :data:`SIDECAR_SUFFIX`,
#: a list's ids are ``_lists/<name>.parquet``.
LIST_NAME_PATTERN = r"[a-z0-9][a-z0-9._-]{0,63}"
LIST_NAME_RE = re.compile(LIST_NAME_PATTERN)
#: Suffix of a skip-list sidecar next to its shard (:mod:`prx_data.skips.sidecar`).
SIDECAR_SUFFIX = ".skip"

#: The export's skip lists as row ids (:mod:`prx_data.skips.lists`): one parquet per list
#: (never ``*.json``: streaming's ``merge_index`` would take it for an index), the
#: reference to the table's registry, and the lock that serialises updates.
LISTS_DIR = "_lists"
LISTS_REF_NAME = "registry"
LISTS_LOCK_NAME = ".lock"
LISTS_FILE_RE = re.compile(
    rf"(registry|\.lock|_local\.parquet|{LIST_NAME_PATTERN}\.parquet)(\.tmp-[0-9a-f]+)?"
)

#: The export's id index (a Lance table, :mod:`prx_data.export.idindex`): written at
#: finalize, rebuilt by whatever rewrites shards.
IDS_INDEX_NAME = "_ids.lance"

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
}

#: What a part directory holds: shards, its index, its manifest, sidecars and temp files.
#: (Part directories themselves match ``_PART_RE``, the pattern :func:`part_name` makes.)
_PART_FILE_RE = re.compile(
    rf"({SHARD_FILE_PATTERN}(\.{LIST_NAME_PATTERN}{re.escape(SIDECAR_SUFFIX)})?|index\.json"
    r"|ids\.parquet)(\.tmp-[0-9a-f]+)?"
)


class ExportError(PrxDataError):
    """A problem with the export's configuration or output location."""


def list_top(out: str) -> list[str]:
    if storage.is_remote(out):
        return sorted({p.split("/")[0] for p in storage.list_files(out)})
    return sorted(os.listdir(out)) if os.path.isdir(out) else []


def write_export_marker(out: str) -> None:
    """Mark ``out`` as an export of ours (first thing written into a new export)."""
    body = json.dumps({"format": MARKER_FORMAT, "version": 1}, sort_keys=True)
    storage.write_bytes_atomic(storage.join(out, *MARKER_NAME.split("/")), body.encode())


def _has_proof(out: str) -> bool:
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
    if not _has_proof(out):
        found.append(f"no {MARKER_NAME} or {CONFIG_NAME} written by the exporter")
    if storage.is_remote(out):
        for rel in storage.list_files(out):
            bits = rel.split("/")
            if bits[0] in _EXPORT_ENTRIES_EXTRA and (
                len(bits) == 1 or bits[0] in (PROGRESS_DIR, IDS_INDEX_NAME)
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
            if top in (PROGRESS_DIR, IDS_INDEX_NAME) and not os.path.isdir(path):
                found.append(top)
            if top == LISTS_DIR:
                found += _foreign_in_lists(path)
            continue
        if not (_TIER_RE.fullmatch(top) and os.path.isdir(path)):
            found.append(top)
            continue
        for ar in sorted(os.listdir(path)):
            bdir = os.path.join(path, ar)
            if not (_AR_RE.fullmatch(ar) and os.path.isdir(bdir)):
                found.append(f"{top}/{ar}")
                continue
            for entry in sorted(os.listdir(bdir)):
                epath = os.path.join(bdir, entry)
                if os.path.isdir(epath):
                    if not _PART_RE.fullmatch(entry):
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
    if len(bits) < 3 or not (_TIER_RE.fullmatch(bits[0]) and _AR_RE.fullmatch(bits[1])):
        return False
    if len(bits) == 3:
        return bits[2] == INDEX_NAME or bits[2].startswith(f"{INDEX_NAME}.tmp-")
    return len(bits) == 4 and bool(_PART_RE.fullmatch(bits[2]) and _PART_FILE_RE.fullmatch(bits[3]))


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
    ``keep`` holds part names (kept in every bucket) and ``<tier>/<ar>/<pack>`` paths.
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
        if not (_TIER_RE.fullmatch(tier) and os.path.isdir(tdir)):
            continue
        if os.path.islink(tdir):
            continue
        for ar in os.listdir(tdir):
            bdir = os.path.join(tdir, ar)
            if not (_AR_RE.fullmatch(ar) and os.path.isdir(bdir)):
                continue
            if os.path.islink(bdir):
                continue
            for part in os.listdir(bdir):
                ppath = os.path.join(bdir, part)
                if os.path.islink(ppath):
                    continue
                kept = part in keep or f"{tier}/{ar}/{part}" in keep
                if os.path.isdir(ppath) and _PART_RE.fullmatch(part) and not kept:
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


def write_manifest(bucket_dir: str, part: str, id_list: list[str]) -> int:
    """ids.parquet: (shard basename as in the merged index, index in shard, id).

    Returns the part's shard bytes (uncompressed), which the pack stage plans by.
    """
    shard_col, idx_col = [], []
    nbytes = 0
    for shard in load_index(storage.join(bucket_dir, part, INDEX_NAME), in_part=True):
        nbytes += int(shard["raw_data"]["bytes"])
        base = posixpath.join(part, shard["raw_data"]["basename"])
        shard_col += [base] * shard["samples"]
        idx_col += list(range(shard["samples"]))
    if len(shard_col) != len(id_list):
        raise ExportError(
            f"{bucket_dir}/{part}: index has {len(shard_col)} samples, wrote {len(id_list)}"
        )
    table = pa.table(
        {
            "shard": pa.array(shard_col, pa.string()),
            "index": pa.array(idx_col, pa.int32()),
            "id": pa.array(id_list, pa.string()),
        }
    )
    buf = io.BytesIO()
    pq.write_table(table, buf, compression="zstd")
    storage.write_bytes_atomic(storage.join(bucket_dir, part, MANIFEST_NAME), buf.getvalue())
    return nbytes


def merge_bucket(
    bucket_dir: str,
    parts: list[str],
    expected: Mapping[str, int] | None = None,
    check: Callable[[], None] = lambda: None,
) -> int:
    """Write the bucket's index.json from its parts' indexes, atomically.

    ``expected`` ({part: samples}, from the work units' results) is checked
    before anything is written: a part whose index disagrees (another run
    rewrote it) fails the merge and leaves no index behind. ``check`` runs
    right before the write (the export lease: reading the parts can take long).
    """
    shards = []
    ordered = sorted(parts)
    paths = [storage.join(bucket_dir, part, INDEX_NAME) for part in ordered]
    read = functools.partial(load_index, in_part=True)
    # Reads run in parallel (bounded); entries are joined in part order, so the bytes are the same.
    for part, path, entries in zip(
        ordered, paths, imap_bounded(read, paths, io_workers(bucket_dir)), strict=True
    ):
        if expected is not None:
            n = sum(int(s["samples"]) for s in entries)
            if n != expected.get(part):
                raise ExportError(
                    f"{path}: the part's index holds {n} samples but its work unit wrote "
                    f"{expected.get(part)}; another run changed this export. Start again with "
                    "--overwrite."
                )
        for shard in entries:
            for key in _FILE_KEYS:
                if shard.get(key):
                    shard[key]["basename"] = posixpath.join(part, shard[key]["basename"])
            shards.append(shard)
    body = json.dumps({"version": 2, "shards": shards}, sort_keys=True)
    check()
    storage.write_bytes_atomic(storage.join(bucket_dir, "index.json"), body.encode())
    return sum(s["samples"] for s in shards)


def is_complete(out: str) -> bool:
    return storage.exists(storage.join(out, REPORT_NAME))


def content_digest(out: str) -> str:
    """Digest of every shard, index and manifest (not reports, progress, lists or the id index,
    whose Lance files name random uuids): equal for identical exports."""
    h = hashlib.sha256()
    for rel in storage.list_files(out):
        if (
            rel.startswith((PROGRESS_DIR, LISTS_DIR, IDS_INDEX_NAME))
            or rel in (REPORT_NAME, "report.txt", DROPPED_NAME, LOCK_NAME, LEASE_NAME)
            or rel.endswith(SIDECAR_SUFFIX)
        ):
            continue
        h.update(rel.encode())
        h.update(hashlib.sha256(storage.read_bytes(storage.join(out, rel))).digest())
    return h.hexdigest()


INDEX_NAME = "index.json"


#: Tier directories are integers; bucket directories are aspect labels like ``1.000``.
_TIER_RE = re.compile(r"[0-9]+")


_AR_RE = re.compile(r"[0-9]+\.[0-9]{3}")


#: Parallel small-file requests against object storage.
IO_THREADS = 16


@dataclass(frozen=True)
class ShardInfo:
    """What the merged index says about one shard (what a sidecar is bound to)."""

    basename: str
    bytes: int
    samples: int
    hashes: dict[str, str] = field(default_factory=dict, hash=False, compare=False)

    @classmethod
    def from_index_entry(cls, entry: Mapping) -> ShardInfo:
        raw = entry["raw_data"]
        return cls(
            raw["basename"], int(raw["bytes"]), int(entry["samples"]), dict(raw.get("hashes") or {})
        )


class Tree(str):
    """An export root with its layout resolved once: the root's path, and its tier layout.

    A ``str``, so it passes through every function that takes a root, and
    :func:`rel_join` reads the layout from it: no process-wide state decides
    where a path resolves. ``flat_tier`` is None for the exporter's
    ``<tier>/<ar>/`` layout, else the tier of a tree with one folder per
    aspect ratio (``<ar>/index.json``). Resolve it where a root comes in
    (:func:`tree`) and pass it on; a plain string is a ``<tier>/<ar>/`` tree,
    and a path built from a Tree (``os.path.abspath``, ``rstrip``) is plain.
    """

    flat_tier: int | None

    def __new__(cls, root: str, flat_tier: int | None = None) -> Tree:
        obj = super().__new__(cls, root)
        object.__setattr__(obj, "flat_tier", None if flat_tier is None else int(flat_tier))
        return obj

    def __setattr__(self, name: str, value: object) -> None:
        raise AttributeError(f"a Tree is frozen: cannot set {name!r}")

    def __reduce__(self):  # pickles (Ray, process pools) as a Tree, layout included
        return (Tree, (str(self), self.flat_tier))

    def __repr__(self) -> str:
        return f"Tree({str.__repr__(self)}, flat_tier={self.flat_tier})"

    @property
    def remote(self) -> bool:
        return storage.is_remote(self)


def tree(root: str, tier: int | None = None) -> Tree:
    """``root`` resolved: its adoption record's layout, or ``tier`` for a flat tree not adopted.

    ``tier`` says that ``root`` holds one folder per aspect ratio of that tier
    (``DatasetSpec(tier=...)``, the planner's ``--tier``); it must agree with
    the adoption record when there is one. One small read (the record) per
    call: resolve once per root and pass the Tree on.
    """
    if isinstance(root, Tree) and (tier is None or root.flat_tier == int(tier)):
        return root
    recorded = _recorded_flat_tier(str(root))
    if tier is not None and recorded is not None and recorded != int(tier):
        raise ForeignTreeError(
            f"{root}: its adoption record says tier {recorded}, not {tier}; declare {recorded} "
            "or adopt the tree again with python -m prx_data.adopt --tier"
        )
    return Tree(str(root), recorded if tier is None else tier)


def flat_tier(root: str) -> int | None:
    """The tier of a flat tree as resolved in ``root`` (:class:`Tree`); None otherwise."""
    return getattr(root, "flat_tier", None)


def rel_join(root: str, rel: str) -> str:
    """``root/rel``; in a flat tree (:func:`flat_tier`) ``<tier>/<ar>/...`` is ``root/<ar>/...``."""
    bits = rel.split("/")
    if len(bits) > 1 and _TIER_RE.fullmatch(bits[0]) and flat_tier(root) == int(bits[0]):
        bits = bits[1:]
    return storage.join(root, *bits)


# --- MDS trees not written by the exporter (prx_data.export.adopt) ---------------------------

#: Where an adopted tree keeps what prx-data adds to it (never a shard or an index.json).
ADOPT_DIR = "_prx"
#: The adoption record: JSON text (not *.json: streaming's merge_index would take it).
ADOPTION_NAME = "_prx/adoption"
#: Per adopted bucket, ``_prx/<tier>/<ar>/shards``: sha256 of its index.json, shard hashes.
ADOPTED_SHARDS_NAME = "shards"


class ForeignTreeError(PrxDataError, ValueError):
    """An MDS tree not written by the exporter that cannot be used as asked (say what to do)."""


def adopted_manifest(root: str, bucket: str) -> str:
    """Where ``python -m prx_data.adopt`` keeps a bucket's manifest (shard, index, id)."""
    return storage.join(root, ADOPT_DIR, *check_bucket(bucket).split("/"), MANIFEST_NAME)


def _recorded_flat_tier(root: str) -> int | None:
    """The tier an adoption record gives a flat tree (read now: records change on adoption)."""
    try:
        path = storage.join(root, *ADOPTION_NAME.split("/"))
        obj = json.loads(confined.read(root, path, confined.SMALL_MAX_BYTES))
    except (FileNotFoundError, OSError, ValueError):
        return None
    if isinstance(obj, dict) and obj.get("layout") == "flat" and isinstance(obj.get("tier"), int):
        return obj["tier"]
    return None


def list_buckets(root: str, tiers: Iterable[int] | None = None) -> list[str]:
    """Bucket names (``"512/1.000"``) under an export root that have a merged index.

    Lists two directory levels (tiers, then ratios) rather than the whole tree,
    so it stays cheap on object storage with many shards. A flat tree
    (:func:`flat_tier`) lists one level: its ratio folders.
    """
    want = None if tiers is None else {int(t) for t in tiers}
    out = []
    flat = flat_tier(root)
    if flat is not None:
        if want is not None and flat not in want:
            return []
        return sorted(
            f"{flat}/{ar}"
            for ar in storage.list_dirs(root)
            if _AR_RE.fullmatch(ar) and storage.exists(storage.join(root, ar, INDEX_NAME))
        )
    for tier in storage.list_dirs(root):
        if not _TIER_RE.fullmatch(tier):
            continue
        if want is not None and int(tier) not in want:
            continue
        for ar in storage.list_dirs(storage.join(root, tier)):
            if _AR_RE.fullmatch(ar):
                bucket = f"{tier}/{ar}"
                if storage.exists(rel_join(root, f"{bucket}/{INDEX_NAME}")):
                    out.append(bucket)
    if not out and not isinstance(root, Tree) and _recorded_flat_tier(root) is not None:
        # A caller that skipped tree(): never read an adopted flat tree as an empty one.
        raise ForeignTreeError(
            f"{root}: an adopted tree with one folder per aspect ratio; resolve its layout "
            "first (prx_data.export.layout.tree(root)) and pass that on"
        )
    return sorted(out, key=lambda b: (int(b.split("/")[0]), b))


def read_index_entries(root: str, bucket: str, *, export_columns: bool = False) -> list[dict]:
    """The raw shard entries of one bucket's merged index (checked by :func:`load_index`)."""
    path = rel_join(root, f"{check_bucket(bucket)}/{INDEX_NAME}")
    try:
        # Our own checks (rewrite, verify) need our layout; readers take any confined name.
        entries = load_index(
            path, export_columns=export_columns, plain=not export_columns, root=root
        )
    except FileNotFoundError:
        raise NotFound(f"{path}: no merged index; is {root!r} an export root?") from None
    if not storage.is_remote(root):
        # No name may reach through a link out of the bucket (a linked part directory would
        # take sidecar writes and rewrite reads elsewhere), nor name a FIFO or device.
        names = [e[k]["basename"] for e in entries for k in _FILE_KEYS if e.get(k)]
        check_stream_basenames(path, rel_join(root, bucket), names)
    return entries


def read_index(root: str, bucket: str, *, export_columns: bool = False) -> list[ShardInfo]:
    """The shards of one bucket, in merged-index order (checked by :func:`load_index`)."""
    entries = read_index_entries(root, bucket, export_columns=export_columns)
    return [ShardInfo.from_index_entry(e) for e in entries]


def list_suffix(base: str, suffix: str) -> list[str]:
    """Relative ``/``-separated paths of files ending in ``suffix`` under ``base``."""
    if storage.is_remote(base):
        return [r.replace("\\", "/") for r in storage.list_files(base, suffix)]
    out = []
    cut = len(base.rstrip(os.sep)) + 1
    for dirpath, _dirs, files in os.walk(base):
        rel_dir = dirpath[cut:].replace(os.sep, "/")
        for f in files:
            if f.endswith(suffix):
                out.append(f"{rel_dir}/{f}" if rel_dir else f)
    return sorted(out)


def map_io(fn, items: Sequence, remote: bool) -> list:
    return map_bounded(fn, items, IO_THREADS if remote else 1)


#: Threads for the driver's many small reads (part indexes, unit markers, manifests,
#: sidecars): object storage is latency-bound, so many requests in flight; a local disk
#: gains from a few (parquet decoding and file opens release the GIL).
REMOTE_IO_WORKERS = 32
LOCAL_IO_WORKERS = 4


def io_workers(path: str) -> int:
    """How many small reads to keep in flight against ``path``'s storage."""
    return REMOTE_IO_WORKERS if storage.is_remote(path) else LOCAL_IO_WORKERS


def imap_bounded(fn: Callable[[T], R], items: Iterable[T], workers: int) -> Iterator[R]:
    """``fn`` over ``items`` on at most ``workers`` threads, yielded in ``items``' order.

    At most ``2 * workers`` calls are in flight or waiting to be yielded, so a
    million parts cost a bounded number of futures, and results (and the first
    error, in input order) are deterministic whatever the thread timing.
    """
    if workers <= 1:
        yield from map(fn, items)
        return
    window = 2 * workers
    pending: deque = deque()
    with ThreadPoolExecutor(workers) as ex:
        try:
            for x in items:
                pending.append(ex.submit(fn, x))
                if len(pending) >= window:
                    yield pending.popleft().result()
            while pending:
                yield pending.popleft().result()
        finally:
            for f in pending:  # an error or an abandoned generator: start nothing new
                f.cancel()


def map_bounded(fn: Callable[[T], R], items: Iterable[T], workers: int) -> list[R]:
    """:func:`imap_bounded` as a list (results in input order)."""
    return list(imap_bounded(fn, items, workers))


def check_manifest_shards(path: str, part: str, shards) -> None:
    """Shard names in a manifest are data too: each must be a shard of the manifest's own part."""
    import pyarrow.compute as pc

    for name in pc.unique(shards).to_pylist():  # a handful per part, whatever the row count
        check_shard_basename(path, name)
        if name.split("/")[0] != part:
            raise UnsafeIndexError(
                f"{path}: shard {name!r} is not in this manifest's part {part!r}"
            )


def read_adopted_manifest(root: str, bucket: str, shards: set[str], batch_rows: int | None = None):
    """An adopted bucket's manifest, its shard names checked against the bucket's index.

    Refused when the bucket's ``index.json`` is not the one adopted (its sha256
    in ``_prx/<bucket>/shards``): a rewritten bucket's manifest would name the
    wrong samples. ``batch_rows`` yields it a bounded batch at a time instead
    (an iterator of tables).
    """
    import pyarrow.compute as pc

    path = adopted_manifest(root, bucket)
    record = storage.join(root, ADOPT_DIR, *bucket.split("/"), ADOPTED_SHARDS_NAME)
    index = rel_join(root, f"{bucket}/{INDEX_NAME}")
    try:
        want = json.loads(confined.read(root, record, confined.SMALL_MAX_BYTES)).get("index_sha256")
    except (FileNotFoundError, ValueError, AttributeError):
        want = None
    if want != hashlib.sha256(confined.read(root, index, confined.INDEX_MAX_BYTES)).hexdigest():
        raise ForeignTreeError(
            f"{index}: not the index adopted (or {record} is missing), so the manifest may name "
            f"the wrong samples; run python -m prx_data.adopt {root} again"
        )

    def checked(t: pa.Table) -> pa.Table:
        bad = set(pc.unique(t["shard"]).to_pylist()) - shards
        if bad:
            raise UnsafeIndexError(
                f"{path}: shard(s) {sorted(bad)[:3]} are not in the bucket's index.json; the "
                "tree changed since it was adopted: run python -m prx_data.adopt again"
            )
        return t

    src = io.BytesIO(confined.read(root, path, confined.MANIFEST_MAX_BYTES))
    if batch_rows is None:
        return checked(pq.read_table(src, columns=["shard", "index", "id"]))
    pf = pq.ParquetFile(src)
    return (
        checked(pa.Table.from_batches([b]))
        for b in pf.iter_batches(batch_size=batch_rows, columns=["shard", "index", "id"])
    )


def read_manifests(export_root: str, buckets: Sequence[str] | None = None):
    """All ``ids.parquet`` rows of the chosen buckets as one Arrow table (+ ``bucket``)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    tables = []
    for bucket in buckets if buckets is not None else list_buckets(export_root):
        check_bucket(bucket)
        adopted = adopted_manifest(export_root, bucket)
        if storage.exists(adopted):  # an adopted tree: one manifest per bucket
            names = {e["raw_data"]["basename"] for e in read_index_entries(export_root, bucket)}
            t = read_adopted_manifest(export_root, bucket, names)
            tables.append(t.append_column("bucket", pa.array([bucket] * len(t), pa.string())))
            continue
        rels = [r for r in storage.list_files(rel_join(export_root, bucket), MANIFEST_NAME)]

        def read(rel, bucket=bucket):
            path = rel_join(export_root, f"{bucket}/{rel.replace(chr(92), '/')}")
            src = io.BytesIO(confined.read(export_root, path, confined.MANIFEST_MAX_BYTES))
            t = pq.read_table(src, columns=["shard", "index", "id"])  # one part's: small
            check_manifest_shards(path, posixpath.dirname(rel.replace(chr(92), "/")), t["shard"])
            return t.append_column("bucket", pa.array([bucket] * len(t), pa.string()))

        tables += map_bounded(read, rels, io_workers(export_root))
    if not tables:
        return pa.table({"shard": [], "index": pa.array([], pa.int32()), "id": [], "bucket": []})
    return pa.concat_tables(tables)


# --- completeness (what the loader and verify check) -----------------------------------------


class IncompleteExport(ExportError):
    """An export that did not finish, or whose indexes disagree with its report."""


_OVERRIDE_HINT = "pass DatasetSpec(allow_incomplete=True) to stream it anyway"


def read_report(root: str) -> dict | None:
    """The export's ``report.json`` (None when there is none: the export did not finish)."""
    try:
        return json.loads(
            confined.read(root, storage.join(root, REPORT_NAME), confined.SMALL_MAX_BYTES)
        )
    except FileNotFoundError:
        return None
    except confined.UnsafeFileError:
        raise
    except ValueError as e:
        raise IncompleteExport(
            f"{storage.join(root, REPORT_NAME)}: unreadable report ({e})"
        ) from None


def check_export_complete(root: str, report: dict | None, *, count_markers: bool = True) -> None:
    """Refuse an export without a report, or with fewer unit markers than it reports.

    Counting markers lists ``_progress`` once (local roots). A remote root's
    cache holds no ``_progress``: there the loader checks the report and the
    per-bucket counts, and ``python -m prx_data.verify`` checks the markers.
    """
    if report is None:
        raise IncompleteExport(
            f"{root}: no {REPORT_NAME}, so the export did not finish (finish it with "
            f"`python -m prx_data.write_mds ... --resume`, check it with `python -m prx_data.verify "
            f"{root}`); {_OVERRIDE_HINT}"
        )
    units = report.get("units")
    if units is None or not count_markers:  # e.g. a rewritten export: no work units
        return
    markers = len(list_markers(root))
    if markers != units:
        raise IncompleteExport(
            f"{root}: {REPORT_NAME} reports {units} work units but {PROGRESS_DIR}/ holds "
            f"{markers} markers; {_OVERRIDE_HINT}"
        )


def check_bucket_complete(
    root: str, bucket: str, shards: Sequence[ShardInfo], report: dict
) -> None:
    """The bucket's merged index holds exactly the samples the report counted."""
    expected = (report.get("buckets") or {}).get(bucket)
    got = sum(s.samples for s in shards)
    if expected != got:
        raise IncompleteExport(
            f"{rel_join(root, f'{bucket}/{INDEX_NAME}')}: index holds {got} samples but "
            f"{REPORT_NAME} counted {expected}; the export was changed after it finished or did "
            f"not finish. Check it with `python -m prx_data.verify {root}`; {_OVERRIDE_HINT}"
        )
