"""Named skip lists stored as per-shard sidecars next to the MDS shards.

Mosaic Streaming cannot leave samples out without rewriting shards. A skip
list records, per shard, the sample indices to leave out; the loader
(:mod:`prx_data.stream.dataset`) removes them from the *sample space*, so
partitioning, shuffling and resumption see the filtered dataset.

Sidecar ``<bucket>/<part>/shard.NNNNN.mds.<name>.skip`` (never ``*.json``:
streaming's ``merge_index`` would take it for an index)::

    magic   8 bytes  b"PRXSKIP1"
    hlen    uint32 LE, length of the header
    header  UTF-8 JSON, sorted keys: name, shard (basename as in the merged
            index), bytes + samples (raw shard size and sample count),
            hashes (the shard's hashes from the index, may be empty),
            count (number of indices), crc32 (of the index payload)
    indices count x uint32 LE, sorted and unique

The header binds the sidecar to its shard's content and to its own name: a
sidecar whose shard was rewritten (different bytes, samples or hash; when
the index records hashes the sidecar must carry the same ones) or that was
renamed (header name != file name) is refused on load. Stray ``*.skip``
files (a name that is not a valid list name, a shard the index does not
have) are reported by :func:`scan_sidecars` instead of being ignored. The
same list written twice gives identical bytes.
"""

from __future__ import annotations

import json
import os
import re
import struct
import zlib
from collections.abc import Iterable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field

import numpy as np

from prx_data.core import confined, storage
from prx_data.core.errors import (
    OutOfRange,
    PrxDataError,
    UnknownName,
    UsageError,
    read_user_text,
)
from prx_data.export.bounded import map_io  # noqa: F401
from prx_data.export.layout import (  # noqa: F401
    ShardInfo,
    list_buckets,
    list_suffix,
    read_index,
    read_manifests,
    rel_join,
)
from prx_data.export.naming import (  # noqa: F401
    LIST_NAME_RE,
    LISTS_DIR,
    LISTS_REF_NAME,
    SIDECAR_SUFFIX,
)
from prx_data.table.lance_ops import query_ids

MAGIC = b"PRXSKIP1"
#: The naming contract lives with the export tree (:mod:`prx_data.export.layout`).
SUFFIX = SIDECAR_SUFFIX
NAME_RE = LIST_NAME_RE
#: The export-only list log in ``_lists/`` (written by :mod:`prx_data.skips.lists`).
LOCAL_LOG_NAME = "_local.parquet"
#: How long a list writer waits for the export's lease (held by a run or another update).
LOCK_TIMEOUT_S = 900.0


class SkipListError(PrxDataError, ValueError):
    """A sidecar that is corrupt, or that does not belong to the shard next to it."""


def validate_name(name: str) -> str:
    """Skip-list names become file-name parts: lower-case ``[a-z0-9._-]``, at most 64 chars."""
    if not isinstance(name, str) or not NAME_RE.fullmatch(name) or name.endswith(".json"):
        raise UsageError(
            f"invalid skip-list name {name!r}: use 1-64 characters from [a-z0-9._-], "
            "starting with a letter or digit (e.g. 'dedup', 'optout-2026-11')"
        )
    return name


@dataclass
class SkipList:
    """One named skip list for one shard."""

    name: str
    shard: ShardInfo
    indices: np.ndarray  # sorted unique uint32

    def to_bytes(self) -> bytes:
        payload = np.ascontiguousarray(self.indices, dtype="<u4").tobytes()
        header = {
            "name": self.name,
            "shard": self.shard.basename,
            "bytes": self.shard.bytes,
            "samples": self.shard.samples,
            "hashes": dict(sorted(self.shard.hashes.items())),
            "count": int(len(self.indices)),
            "crc32": zlib.crc32(payload),
        }
        hb = json.dumps(header, sort_keys=True, separators=(",", ":")).encode()
        return MAGIC + struct.pack("<I", len(hb)) + hb + payload

    @classmethod
    def from_bytes(
        cls,
        data: bytes,
        source: str,
        expected: ShardInfo | None = None,
        expected_name: str | None = None,
    ) -> SkipList:
        """Parse and validate; ``source`` names the file in errors.

        ``expected`` is the shard it sits next to and ``expected_name`` the
        list its file name says: a copied or renamed sidecar is refused.
        """
        if len(data) < len(MAGIC) + 4 or data[: len(MAGIC)] != MAGIC:
            raise SkipListError(f"{source}: not a skip-list sidecar (bad magic)")
        (hlen,) = struct.unpack_from("<I", data, len(MAGIC))
        start = len(MAGIC) + 4
        if start + hlen > len(data):
            raise SkipListError(f"{source}: truncated header")
        try:
            header = json.loads(data[start : start + hlen])
            name, shard = header["name"], header["shard"]
            nbytes, samples = int(header["bytes"]), int(header["samples"])
            count, crc, hashes = int(header["count"]), int(header["crc32"]), dict(header["hashes"])
        except (ValueError, KeyError, TypeError) as e:
            raise SkipListError(f"{source}: corrupt header ({e})") from None
        payload = data[start + hlen :]
        if len(payload) != 4 * count:
            raise SkipListError(
                f"{source}: truncated or padded payload ({len(payload)} bytes for {count} indices)"
            )
        if zlib.crc32(payload) != crc:
            raise SkipListError(f"{source}: checksum mismatch, the index payload is corrupt")
        idx = np.frombuffer(payload, dtype="<u4")  # read-only view, no copy
        if count and ((idx[1:] <= idx[:-1]).any() or int(idx[-1]) >= samples):
            raise SkipListError(f"{source}: indices are not sorted, unique and < samples={samples}")
        if expected_name is not None and name != expected_name:
            raise SkipListError(
                f"{source}: the file is named for list {expected_name!r} but holds list {name!r} "
                "(a renamed or copied sidecar); rebuild it with python -m prx_data.skips add, or "
                "delete it"
            )
        if expected is not None:
            # Fast path for the common case; the slow one explains the mismatch.
            if (shard, nbytes, samples) != (
                expected.basename,
                expected.bytes,
                expected.samples,
            ) or hashes != expected.hashes:
                _check_binding(source, ShardInfo(shard, nbytes, samples, hashes), expected)
            info = expected
        else:
            info = ShardInfo(shard, nbytes, samples, hashes)
        return cls(name, info, idx)


def _check_binding(source: str, got: ShardInfo, expected: ShardInfo) -> None:
    problems = []
    if got.basename != expected.basename:
        problems.append(f"shard {got.basename!r} != {expected.basename!r}")
    if got.bytes != expected.bytes:
        problems.append(f"shard bytes {got.bytes} != {expected.bytes} in the index")
    if got.samples != expected.samples:
        problems.append(f"shard samples {got.samples} != {expected.samples} in the index")
    common = sorted(set(got.hashes) & set(expected.hashes))
    for algo in common:
        if got.hashes[algo] != expected.hashes[algo]:
            problems.append(f"shard {algo} {got.hashes[algo]} != {expected.hashes[algo]}")
    # Same size is no proof of same bytes: when either side has hashes, they must meet.
    if expected.hashes and not common:
        problems.append(
            f"the index records shard hashes ({', '.join(sorted(expected.hashes))}) and the "
            f"sidecar {'records ' + ', '.join(sorted(got.hashes)) if got.hashes else 'none'}"
        )
    elif got.hashes and not expected.hashes:
        problems.append(
            f"the sidecar was bound to shard hashes ({', '.join(sorted(got.hashes))}) that the "
            "index no longer records"
        )
    if problems:
        raise SkipListError(
            f"{source}: sidecar does not match its shard ({'; '.join(problems)}). The shard was "
            "rewritten after the list was made: rebuild the list (python -m prx_data.skips add ...) "
            "or remove it (python -m prx_data.skips remove)."
        )


def sidecar_basename(shard_basename: str, name: str) -> str:
    """``f0-0/shard.00000.mds`` + ``dedup`` -> ``f0-0/shard.00000.mds.dedup.skip``."""
    return f"{shard_basename}.{validate_name(name)}{SUFFIX}"


# --- export tree ---------------------------------------------------------------------------


@dataclass(frozen=True)
class SidecarProblem:
    """A ``*.skip`` file that is not a usable sidecar: ``orphan`` or ``unparseable``."""

    path: str
    kind: str
    reason: str
    #: The list its file name claims (None when the name has no ``.mds.<list>`` part).
    claimed: str | None = None

    def text(self) -> str:
        return f"{self.kind}: {self.path}: {self.reason}"


def scan_sidecars(
    root: str,
    bucket: str,
    shards: Sequence[ShardInfo],
    files: Iterable[str] | None = None,
) -> tuple[dict[str, list[str]], list[SidecarProblem]]:
    """One listing of a bucket: ``{list: [shard basenames]}`` and the orphan ``*.skip`` files.

    An orphan is a file that cannot belong to any list of this bucket: a list
    name that is not valid (``Dedup``: names are lower-case), or a shard the
    index does not have. Such files are never applied, so they are reported.
    ``files`` (``/``-separated paths in the bucket) is a listing the caller made.
    """
    known = {s.basename for s in shards}
    out: dict[str, list[str]] = {}
    orphans: list[SidecarProblem] = []
    bucket_dir = rel_join(root, bucket)
    listed = (
        list_suffix(bucket_dir, SUFFIX)
        if files is None
        else sorted(f for f in files if f.endswith(SUFFIX))
    )
    for rel in listed:
        stem = rel[: -len(SUFFIX)]
        # The shard basename is the longest known prefix ending in ".mds".
        pos = stem.find(".mds.")
        first = pos
        while pos != -1:
            shard, name = stem[: pos + 4], stem[pos + 5 :]
            if shard in known and NAME_RE.fullmatch(name):
                out.setdefault(name, []).append(shard)
                break
            pos = stem.find(".mds.", pos + 1)
        else:
            path = rel_join(bucket_dir, rel)
            if first == -1:
                orphans.append(
                    SidecarProblem(path, "orphan", "not named <shard>.mds.<list>.skip", None)
                )
                continue
            shard, name = stem[: first + 4], stem[first + 5 :]
            if shard not in known:
                why = f"no shard {shard!r} in {bucket}/index.json"
            else:
                why = f"{name!r} is not a valid list name (lower-case [a-z0-9._-])"
            orphans.append(SidecarProblem(path, "orphan", why, name))
    return {k: sorted(v) for k, v in sorted(out.items())}, orphans


def list_sidecars(root: str, bucket: str, shards: Sequence[ShardInfo]) -> dict[str, list[str]]:
    """{list name: [shard basenames that have a sidecar]} for one bucket (one listing)."""
    return scan_sidecars(root, bucket, shards)[0]


def read_sidecar(root: str, bucket: str, shard: ShardInfo, name: str) -> SkipList:
    path = rel_join(root, f"{bucket}/{sidecar_basename(shard.basename, name)}")
    return SkipList.from_bytes(_read(root, path, shard), path, expected=shard, expected_name=name)


def _read(root: str | confined.Confined, path: str, shard: ShardInfo) -> bytes:
    """A sidecar's bytes: a regular file inside ``root``, no larger than its shard allows.

    A FIFO, a device, a link out of the export or a file past the size a list
    of ``shard.samples`` indices can have is refused (:mod:`prx_data.core.confined`),
    so a received export cannot hang or flood a reader. Locally this is one
    ``open`` + ``fstat`` (pyarrow's per-file setup would dominate for 100k tiny sidecars).
    """
    box = root if isinstance(root, confined.Confined) else confined.confined(root)
    try:
        return box.read(path, confined.sidecar_max_bytes(shard.samples))
    except confined.UnsafeFileError as e:
        raise SkipListError(str(e)) from None


def load_skips(
    root: str,
    bucket: str,
    shards: Sequence[ShardInfo],
    names: Sequence[str] | None = None,
    listing: Mapping[str, list[str]] | None = None,
    problems: list[SidecarProblem] | None = None,
) -> dict[str, np.ndarray]:
    """Union of the chosen lists (all if ``names`` is None) per shard basename, validated.

    Shards without any skipped sample are absent from the result. ``listing``
    reuses a :func:`list_sidecars` result instead of listing again. A bad
    sidecar raises :class:`SkipListError`, unless ``problems`` is given: then
    it is appended there and left out (for reports such as ``skips stats``).
    """
    found = list_sidecars(root, bucket, shards) if listing is None else listing
    chosen = list(found) if names is None else [validate_name(n) for n in names]
    by_base = {s.basename: s for s in shards}
    remote = storage.is_remote(root)
    bucket_dir = rel_join(root, bucket)
    sep = "/" if remote else os.sep
    box = confined.confined(root)  # once: resolving the root per sidecar would triple the cost

    def read(job: tuple[str, ShardInfo]) -> SkipList | SidecarProblem:
        name, shard = job
        path = f"{bucket_dir}{sep}{shard.basename.replace('/', sep)}.{name}{SUFFIX}"
        if problems is not None:
            try:
                return SkipList.from_bytes(_read(box, path, shard), path, shard, expected_name=name)
            except SkipListError as e:
                return SidecarProblem(path, "unparseable", str(e).removeprefix(f"{path}: "), name)
        return SkipList.from_bytes(
            _read(box, path, shard), path, expected=shard, expected_name=name
        )

    jobs = [(name, by_base[b]) for name in chosen for b in found.get(name, [])]
    lists = map_io(read, jobs, remote)
    if problems is not None:  # report bad sidecars and leave them out, instead of raising
        problems += [sl for sl in lists if isinstance(sl, SidecarProblem)]
        lists = [sl for sl in lists if isinstance(sl, SkipList)]
    per_shard: dict[str, list[np.ndarray]] = {}
    for sl in lists:
        per_shard.setdefault(sl.shard.basename, []).append(sl.indices)
    return {
        b: (arrs[0] if len(arrs) == 1 else np.unique(np.concatenate(arrs))).astype(np.uint32)
        for b, arrs in per_shard.items()
    }


def read_indices_file(path: str) -> dict[tuple[str, str], list[int]]:
    """Lines ``<bucket> <shard basename> <index>`` (whitespace separated; ``#`` comments)."""
    out: dict[tuple[str, str], list[int]] = {}
    for n, line in enumerate(read_user_text(path, "indices file").splitlines(), 1):
        line = line.split("#", 1)[0].strip()
        if not line:
            continue
        parts = line.split()
        if len(parts) != 3 or not re.fullmatch(r"[0-9]+", parts[2]):
            raise UsageError(f"{path}:{n}: expected '<bucket> <shard> <index>', got {line!r}")
        out.setdefault((parts[0], parts[1]), []).append(int(parts[2]))
    return out


def read_ids_file(path: str) -> list[str]:
    """One row id per line; blank lines ignored."""
    return [
        s for s in (line.strip() for line in read_user_text(path, "ids file").splitlines()) if s
    ]


# --- library API ---------------------------------------------------------------------------


@dataclass
class AddResult:
    """Outcome of adding to a skip list: what was written and what could not be matched."""

    name: str
    shards_written: int = 0
    samples_listed: int = 0
    #: Row ids not found in any manifest (add_skips_by_ids / add_skips_by_query).
    ids_not_found: int = 0
    #: Those ids, sorted (a request is small next to the export; a compliance report lists them).
    missing_ids: list[str] = field(default_factory=list)


def logged_lists(export_root: str) -> set[str]:
    """Lists the export's list log owns (:mod:`prx_data.skips.lists`): those its list state
    (``_lists/registry``) records as materialised, and those its export-only log
    (``_lists/_local.parquet``) has entries for. Their sidecars are derived from the log, so
    the next materialisation rewrites them: they must be changed through the log."""
    import io

    import pyarrow.parquet as pq

    base = storage.join(export_root, LISTS_DIR)
    out: set[str] = set()
    try:
        obj = json.loads(storage.read_bytes(storage.join(base, LISTS_REF_NAME)))
    except (FileNotFoundError, NotADirectoryError, ValueError):
        obj = None
    if isinstance(obj, dict) and isinstance(obj.get("lists"), dict):
        out |= {str(n) for n in obj["lists"]}
    try:
        data = storage.read_bytes(storage.join(base, LOCAL_LOG_NAME))
    except (FileNotFoundError, NotADirectoryError):
        return out
    try:
        out |= set(pq.read_table(io.BytesIO(data), columns=["list"])["list"].to_pylist())
    except Exception:  # noqa: BLE001 - an unreadable log owns whatever it may hold
        raise SkipListError(
            f"{storage.join(base, LOCAL_LOG_NAME)}: unreadable export-only list log; the "
            "sidecars cannot be changed outside it: run python -m prx_data.skips sync "
            f"{export_root} to see why"
        ) from None
    return out


@contextmanager
def _low_level(export_root: str, name: str, what: str) -> Iterator[None]:
    """Hold the export's lease (a materialisation cannot run meanwhile), refusing a list the
    log owns: a sidecar written here would be silently undone by the next ``sync``."""
    from prx_data.export.lock import ExportLock

    validate_name(name)
    with ExportLock(export_root, wait_s=LOCK_TIMEOUT_S, what="skip-list update"):
        if name in logged_lists(export_root):
            raise UsageError(
                f"{export_root}: list {name!r} is kept by the export's list log, so {what} "
                "here would be undone at the next sync; change it with python -m "
                f"prx_data.skips add/remove {export_root} {name} (prx_data.skips.lists."
                "update_list), --export-only to change only this export"
            )
        yield


def add_skips(
    export_root: str,
    name: str,
    skips: Mapping[tuple[str, str], Iterable[int]],
    *,
    replace: bool = False,
) -> AddResult:
    """Add sample indices ``{(bucket, shard basename): indices}`` to the list ``name``.

    Indices are merged with an existing sidecar of the same name, so adding the
    same indices again rewrites identical bytes. ``replace=True`` overwrites the
    given shards' sidecars instead (an empty set removes the shard from the list).
    Everything is validated before anything is written. Holds the export's lease;
    a list the export's list log owns is refused (:func:`logged_lists`): change it
    through :mod:`prx_data.skips.lists`, which records the change first.
    """
    with _low_level(export_root, name, "writing its sidecars"):
        return write_skips(export_root, name, skips, replace=replace)


def write_skips(
    export_root: str,
    name: str,
    skips: Mapping[tuple[str, str], Iterable[int]],
    *,
    replace: bool = False,
    existing: set[tuple[str, str]] | None = None,
) -> AddResult:
    """:func:`add_skips` without the lease or the log check: for the list materialisation
    (:mod:`prx_data.skips.lists`), which holds the export's lease and is the log's writer.
    ``existing``: the given shards that have a sidecar of the list, when the caller knows
    (saves listing their buckets)."""
    validate_name(name)
    result = AddResult(name)
    by_bucket: dict[str, dict[str, list]] = {}
    for (bucket, shard), idx in skips.items():
        by_bucket.setdefault(bucket, {}).setdefault(shard, []).append(
            np.asarray(idx if isinstance(idx, np.ndarray) else list(idx), np.int64)
        )
    remote = storage.is_remote(export_root)
    box = confined.confined(export_root)
    # Validate everything first, so bad input writes nothing.
    jobs = []
    for bucket, per_shard in sorted(by_bucket.items()):
        shards = {s.basename: s for s in read_index(export_root, bucket)}
        if existing is None:
            have = set(list_sidecars(export_root, bucket, list(shards.values())).get(name, []))
        else:
            have = {s for b, s in existing if b == bucket}
        for base, arrs in sorted(per_shard.items()):
            if base not in shards:
                raise UnknownName(
                    f"shard {base!r} is not in the index of bucket {bucket!r} under {export_root}"
                )
            info = shards[base]
            target = rel_join(export_root, f"{bucket}/{sidecar_basename(base, name)}")
            if not remote and os.path.isdir(target):  # one stat: never a traceback mid-write
                raise SkipListError(
                    f"{target}: a directory where the sidecar file belongs; remove or rename it"
                )
            idx = np.unique(np.concatenate(arrs)) if arrs else np.zeros(0, np.int64)
            if len(idx) and (idx[0] < 0 or idx[-1] >= info.samples):
                bad = int(idx[-1] if idx[-1] >= info.samples else idx[0])
                raise OutOfRange(
                    f"{bucket}/{base}: sample index {bad} is outside 0..{info.samples - 1}"
                )
            jobs.append((bucket, info, idx, base in have))

    def write(job) -> int:
        bucket, info, idx, has_old = job
        path = rel_join(export_root, f"{bucket}/{sidecar_basename(info.basename, name)}")
        if has_old and not replace:
            old = read_sidecar(export_root, bucket, info, name).indices.astype(np.int64)
            idx = np.union1d(old, idx)
        # Writes are confined to the export like reads: never through a link out of it.
        if not len(idx):
            if has_old:  # replace with nothing: the shard leaves the list
                box.delete(path)
            return 0
        box.write_atomic(path, SkipList(name, info, idx.astype(np.uint32)).to_bytes())
        return len(idx)

    for n in map_io(write, jobs, remote):
        result.shards_written += bool(n)
        result.samples_listed += n
    return result


def add_skips_by_ids(export_root: str, name: str, ids: Iterable[str]) -> AddResult:
    """Skip the samples whose row id (Lance ``id``) is in ``ids``, via the export's id index
    (or its manifests, for an export without one).

    The low-level path: sidecars only, under the export's lease, for a list the export's
    list log does not own (:func:`logged_lists`; the log imports such a list exactly, id by
    id, at its next change). A list the log owns is refused with the command to use.
    """
    with _low_level(export_root, name, "adding ids to its sidecars"):
        return _add_by_ids(export_root, name, ids)


def _add_by_ids(export_root: str, name: str, ids: Iterable[str]) -> AddResult:
    import pyarrow as pa

    from prx_data.export.idindex import lookup_or_manifests

    wanted = pa.array(sorted(set(ids)), pa.string())
    skips: dict[tuple[str, str], list[int]] = {}
    found: set[str] = set()
    for hit in lookup_or_manifests(export_root, wanted):
        for b, s, i in zip(
            hit["bucket"].to_pylist(),
            hit["shard"].to_pylist(),
            hit["index"].to_pylist(),
            strict=True,
        ):
            skips.setdefault((b, s), []).append(i)
        found.update(hit["id"].to_pylist())
    result = write_skips(export_root, name, skips)
    result.missing_ids = sorted(set(wanted.to_pylist()) - found)
    result.ids_not_found = len(result.missing_ids)
    return result


def add_skips_by_query(export_root: str, name: str, table_uri: str, where: str) -> AddResult:
    """Skip the samples whose rows match ``where`` in the Lance table ``table_uri``."""
    return add_skips_by_ids(export_root, name, query_ids(table_uri, where))


def list_skip_lists(
    export_root: str, tiers: Iterable[int] | None = None
) -> dict[str, dict[str, int]]:
    """{list name: {bucket: number of shards with a sidecar}}."""
    out: dict[str, dict[str, int]] = {}
    for bucket in list_buckets(export_root, tiers):
        for name, shards in list_sidecars(
            export_root, bucket, read_index(export_root, bucket)
        ).items():
            out.setdefault(name, {})[bucket] = len(shards)
    return dict(sorted(out.items()))


def sidecar_problems(
    export_root: str, tiers: Iterable[int] | None = None, *, read: bool = True
) -> list[SidecarProblem]:
    """Every orphan and unparseable sidecar of an export.

    ``read`` checks every sidecar's bytes (about 0.1 ms each locally); without
    it only orphans, which the listing alone reveals, are found.
    """
    problems: list[SidecarProblem] = []
    for bucket in list_buckets(export_root, tiers):
        shards = read_index(export_root, bucket)
        listing, orphans = scan_sidecars(export_root, bucket, shards)
        problems += orphans
        if read:
            load_skips(export_root, bucket, shards, None, listing=listing, problems=problems)
    return problems


@dataclass
class BucketStats:
    bucket: str
    samples: int
    skipped: int

    @property
    def percent(self) -> float:
        return 100.0 * self.skipped / self.samples if self.samples else 0.0


def skip_stats(
    export_root: str,
    names: Sequence[str] | None = None,
    tiers: Iterable[int] | None = None,
    problems: list[SidecarProblem] | None = None,
) -> dict[str, list[BucketStats]]:
    """Per list (and ``"*"`` for the union of the chosen lists), per bucket: samples skipped.

    Every bucket appears under every list, with 0 where the list has no sidecar.
    With ``problems``, orphan and unparseable sidecars are appended there (and
    left out of the counts) instead of an unparseable one raising.
    """
    out: dict[str, list[BucketStats]] = {}
    per_bucket = []
    all_names: set[str] = set()
    for bucket in list_buckets(export_root, tiers):
        shards = read_index(export_root, bucket)
        found, orphans = scan_sidecars(export_root, bucket, shards)
        if problems is not None:
            problems += orphans
        all_names |= set(found)
        per_bucket.append((bucket, shards, found))
    chosen = sorted(all_names) if names is None else [validate_name(n) for n in names]
    for bucket, shards, found in per_bucket:
        total = sum(s.samples for s in shards)
        union: dict[str, np.ndarray] = {}
        for name in chosen:
            lists = load_skips(export_root, bucket, shards, [name], found, problems)
            out.setdefault(name, []).append(
                BucketStats(bucket, total, sum(len(v) for v in lists.values()))
            )
            for b, v in lists.items():
                union[b] = np.union1d(union[b], v) if b in union else v
        out.setdefault("*", []).append(
            BucketStats(bucket, total, sum(len(v) for v in union.values()))
        )
    return out


def remove_skip_list(export_root: str, name: str, tiers: Iterable[int] | None = None) -> int:
    """Delete every sidecar of list ``name``; returns how many files were removed.

    Under the export's lease; a list the export's list log owns is refused (a sidecar
    deleted here would come back at the next sync): ``python -m prx_data.skips remove``.
    """
    with _low_level(export_root, name, "deleting its sidecars"):
        return _remove_sidecars(export_root, name, tiers)


def _remove_sidecars(export_root: str, name: str, tiers: Iterable[int] | None) -> int:
    paths = []
    for bucket in list_buckets(export_root, tiers):
        for shard in list_sidecars(export_root, bucket, read_index(export_root, bucket)).get(
            name, []
        ):
            paths.append(rel_join(export_root, f"{bucket}/{sidecar_basename(shard, name)}"))
    map_io(confined.confined(export_root).delete, paths, storage.is_remote(export_root))
    return len(paths)
