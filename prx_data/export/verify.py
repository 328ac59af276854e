"""Check an export end to end: report <-> markers <-> indexes <-> shards <-> manifests <-> sidecars.

Every problem is collected with the path it concerns, instead of stopping at
the first, so one run tells a user everything that is wrong:

* ``report.json`` exists and its unit count matches the ``_progress`` markers;
* every bucket the report counts has a merged index with that many samples,
  and no bucket exists that the report does not count;
* every shard's columns are the exporter's (``MDS_COLUMNS`` plus ``str``
  caption columns), so no encoding can run code when the export is read;
* every shard basename is confined to the bucket (``<part>/shard.NNNNN.mds[.ext]``,
  no ``..``, absolute paths or backslashes);
* every shard exists with the size its index records; ``deep`` rehashes each
  shard with the hashes its index records (streaming's ``xxh64`` by default);
* every part's ``ids.parquet`` has as many rows per shard as the index;
* no part directory or file sits in a bucket without being in its index;
* every sidecar belongs to a shard of the index, and its content is checked by
  ``check_sidecar`` (the skip-list parser lives a layer above: the CLI passes it in);
* precomputed latents (``_latents/``, when there are any): every shard of a
  tier with latents has a ``.npy`` made from its current data with the size the
  record names (``deep``: its xxh64 too), and nothing else lies there;
* attached columns (``_columns/<name>/``): the same, per column, for its Arrow files;
* the list store ``_lists/`` holds only list files (``<name>.parquet`` with
  sorted, unique string ids), its registry reference and its lock;
* nothing in a local tree is a symbolic link, FIFO, device or socket, and every
  file is read through :mod:`prx_data.core.confined` (regular files inside the
  root, capped at what the index declares), so a crafted tree is reported,
  never followed, blocked on or read without bound.

This reads every index, manifest and sidecar (and with ``deep`` every shard)
and lists each bucket once: an audit, not a hot path.
"""

from __future__ import annotations

import io
import json
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass

from prx_data.core import confined, storage
from prx_data.core.errors import PrxDataError
from prx_data.core.schema import MANIFEST_NAME, REPORT_NAME
from prx_data.export.bounded import imap_bounded, io_workers, map_io
from prx_data.export.layout import ShardInfo, list_markers, read_report, rel_join
from prx_data.export.naming import (
    AR_RE,
    INDEX_NAME,
    LATENTS_DIR,
    LIST_NAME_RE,
    LISTS_DIR,
    LISTS_FILE_RE,
    PART_RE,
    PART_SHARD_RE,
    PROGRESS_DIR,
    SIDECAR_SUFFIX,
    TIER_RE,
)
from prx_data.export.safety import columns_problem, folded_columns

#: ``check_sidecar(path, data, shard, name) -> problems`` (messages, empty when fine).
SidecarCheck = Callable[[str, bytes, ShardInfo, str], list[str]]


@dataclass(frozen=True)
class Problem:
    path: str
    message: str

    def __str__(self) -> str:
        return f"{self.path}: {self.message}"


@dataclass
class VerifyResult:
    root: str
    buckets: int = 0
    shards: int = 0
    sidecars: int = 0
    rehashed: int = 0
    problems: list[Problem] = None  # type: ignore[assignment]
    #: The attached columns found beside the shards (``img_latent`` when it has latents).
    columns: list[str] = None  # type: ignore[assignment]
    #: Paths (and the trees below them) already reported as not a regular file inside the root.
    unsafe: set[str] = None  # type: ignore[assignment]

    def __post_init__(self):
        if self.problems is None:
            self.problems = []
        if self.unsafe is None:
            self.unsafe = set()
        if self.columns is None:
            self.columns = []

    def under_unsafe(self, path: str) -> bool:
        """Whether ``path`` is, or lies below, an entry already reported as unsafe."""
        p = path.replace("\\", "/")
        return any(p == u or p.startswith(u + "/") for u in self.unsafe)

    def unreadable(self, path: str, message: str) -> None:
        """Report a refused read once (the tree walk may have named the same entry already)."""
        if not self.under_unsafe(path):
            self.problems.append(Problem(path, message))
            self.unsafe.add(path.replace("\\", "/"))

    @property
    def ok(self) -> bool:
        return not self.problems


def _walk_tree(root: str, res: VerifyResult) -> list[str]:
    """Every regular file under ``root`` (relative, ``/``-separated); the rest are problems.

    A symbolic link, FIFO, device or socket anywhere in a local tree is one
    problem line naming it; none is followed or opened, and nothing below a
    linked directory is looked at.
    """
    files = []
    for e in confined.walk(root, (SIDECAR_SUFFIX,)):
        if e.problem is None:
            files.append(e.rel)
            continue
        path = storage.join(root, *e.rel.split("/"))
        res.problems.append(Problem(path, e.problem))
        res.unsafe.add(path.replace("\\", "/"))
    return files


def _buckets_on_disk(files: list[str]) -> tuple[list[str], list[str]]:
    """(bucket names with any file, top-level-ish paths that are not part of the layout)."""
    buckets, stray = set(), []
    for rel in files:
        bits = rel.replace("\\", "/").split("/")
        if not TIER_RE.fullmatch(bits[0]):
            continue
        if len(bits) < 3 or not AR_RE.fullmatch(bits[1]):
            stray.append(rel)
            continue
        buckets.add(f"{bits[0]}/{bits[1]}")
    return sorted(buckets), stray


def verify_export(
    root: str,
    *,
    deep: bool = False,
    check_sidecar: SidecarCheck | None = None,
    progress: bool = False,
) -> VerifyResult:
    """Check the export at ``root``; the result lists every problem found.

    ``progress`` shows a bar over buckets (useful with ``deep`` on large exports).
    """
    res = VerifyResult(root)
    add = res.problems.append
    if not storage.exists(root):
        add(Problem(root, "does not exist"))
        return res
    files = _walk_tree(root, res)  # first: what follows skips what it reported
    report_path = storage.join(root, REPORT_NAME)
    try:
        report = read_report(root)
    except confined.UnsafeFileError as e:
        res.unreadable(report_path, str(e).removeprefix(f"{report_path}: "))
        report = {}
    except Exception as e:  # noqa: BLE001 - an unreadable report is a finding, not a crash
        add(Problem(report_path, str(e)))
        report = {}
    if report is None:
        add(Problem(report_path, "missing: the export did not finish (resume it)"))
        report = {}
    units = report.get("units")
    if units is not None:
        markers = list_markers(root)
        if len(markers) != units:
            add(
                Problem(
                    storage.join(root, PROGRESS_DIR),
                    f"{len(markers)} unit markers, the report counts {units} units",
                )
            )
    _verify_lists(root, res)
    reported = dict(report.get("buckets") or {})
    on_disk, stray = _buckets_on_disk(files)
    for rel in stray:
        add(Problem(rel_join(root, rel), "not inside a <tier>/<ratio>/ bucket"))
    from tqdm.auto import tqdm

    names = sorted(set(on_disk) | set(reported), key=lambda b: (int(b.split("/")[0]), b))
    for bucket in tqdm(names, desc="verify", unit="bucket", disable=not progress):
        res.buckets += 1
        folded = folded_columns(report) or True
        _verify_bucket(
            root, bucket, reported.get(bucket), bool(report), deep, check_sidecar, res, folded
        )
    _verify_latents(root, files, sorted(on_disk), deep, res)
    _verify_columns(root, files, sorted(on_disk), deep, res)
    from prx_data.export.attached import all_columns

    res.columns = all_columns(root)
    return res


def _verify_latents(
    root: str, files: list[str], buckets: list[str], deep: bool, res: VerifyResult
) -> None:
    """``_latents/``: the record, one ``.npy`` per shard bound to its data, nothing else."""
    from prx_data.export import latents as L

    here = {f for f in files if f.split("/", 1)[0] == LATENTS_DIR and ".tmp-" not in f}
    if not here - {L.LOCK_NAME}:
        return
    _verify_bound(
        root,
        here,
        buckets,
        deep,
        res,
        folder=LATENTS_DIR,
        record_rel=L.RECORD_NAME,
        read=lambda: L.read_record(root),
        file_rel=L.npy_rel,
        size_key="npy_bytes",
        fixed={L.RECORD_NAME, L.LOCK_NAME},
        what="latents",
        redo="python -m prx_data.latents",
    )


def _verify_columns(
    root: str, files: list[str], buckets: list[str], deep: bool, res: VerifyResult
) -> None:
    """``_columns/``: per attached column its record and one file per shard (of the record's
    kind: ``.arrow`` or ``.npy``) bound to its data (:mod:`prx_data.export.attached`);
    nothing else."""
    from prx_data.export import attached as A

    here = {f for f in files if f.split("/", 1)[0] == A.COLUMNS_DIR and ".tmp-" not in f}
    names = sorted({f.split("/")[1] for f in here if f.count("/") >= 2})
    for rel in sorted(f for f in here if f.count("/") < 2 and f != A.LOCK_NAME):
        res.problems.append(Problem(rel_join(root, rel), "not an attached column file"))
    for name in names:
        mine = {f for f in here if f.split("/")[1] == name}
        if not A.NAME_RE.fullmatch(name):
            for rel in sorted(mine):
                res.problems.append(Problem(rel_join(root, rel), "not an attached column file"))
            continue
        kinds: dict[str, str] = {}  # the record's kind, once read: its files' extension

        def read(n: str = name, kinds: dict = kinds) -> dict | None:
            record = A.read_record(root, n)
            if record is not None:
                kinds["kind"] = A.kind_of(record)
            return record

        _verify_bound(
            root,
            mine,
            buckets,
            deep,
            res,
            folder=f"{A.COLUMNS_DIR}/{name}",
            record_rel=A.record_rel(name),
            read=read,
            file_rel=lambda key, n=name, kinds=kinds: A.file_rel(n, key, kinds["kind"]),
            size_key="bytes",
            fixed={A.record_rel(name)},
            what=f"attached column {name!r}",
            redo=f"{A.JOB} {root} --table TABLE --columns {name}",
        )


def _verify_bound(
    root: str,
    here: set[str],
    buckets: list[str],
    deep: bool,
    res: VerifyResult,
    *,
    folder: str,
    record_rel: str,
    read: Callable[[], dict | None],
    file_rel: Callable[[str], str],
    size_key: str,
    fixed: set[str],
    what: str,
    redo: str,
) -> None:
    """Files bound to shards (:mod:`prx_data.export.bound`) under ``folder``: the record, one
    file per shard of each tier it covers, made from the shard's current data, with the size
    (``deep``: the xxh64) the record names; nothing else."""
    from prx_data.export import bound
    from prx_data.export.layout import read_index

    sizes = {f"{folder}/{rel}": n for rel, n in storage.file_sizes(rel_join(root, folder)).items()}
    record_path = storage.join(root, *record_rel.split("/"))
    try:
        record = read()
    except Exception as e:  # noqa: BLE001 - an unreadable record is a finding
        res.problems.append(Problem(record_path, str(e).removeprefix(f"{record_path}: ")))
        return
    if record is None:
        res.problems.append(Problem(record_path, f"missing: rerun {redo}"))
        return
    shards = record.get("shards") or {}
    expected = set(fixed)
    done = {key.split("/", 1)[0] for key in shards}  # tiers the job was asked for
    for bucket in buckets:
        if bucket.split("/", 1)[0] not in done:  # another tier: its runs come in step
            continue
        try:
            index = read_index(root, bucket)
        except Exception:  # noqa: BLE001 - the bucket check above reported it
            continue
        for key in bound.stale_shards(shards, bucket, index, PrxDataError):
            res.problems.append(
                Problem(
                    storage.join(root, *file_rel(key).split("/")),
                    f"no {what} made from this shard's current data: rerun {redo}",
                )
            )
        for s in index:
            key = f"{bucket}/{s.basename}"
            rec = shards.get(key)
            if rec is None:
                continue
            rel = file_rel(key)
            expected.add(rel)
            path = storage.join(root, *rel.split("/"))
            want_bytes = int(rec.get(size_key, -1))
            if rel not in here:
                res.problems.append(Problem(path, "missing"))
            elif sizes.get(rel) != want_bytes:
                res.problems.append(Problem(path, f"size differs from the {what} record"))
            elif deep and bound.file_digest(root, path, want_bytes) != rec.get("xxh64"):
                res.problems.append(Problem(path, f"xxh64 differs from the {what} record"))
    for rel in sorted(here - expected):
        res.problems.append(
            Problem(rel_join(root, rel), f"not a file of the {what} of this export")
        )


def _verify_lists(root: str, res: VerifyResult) -> None:
    """``_lists/``: list files that parse, with sorted unique ids; nothing else."""
    import io

    import pyarrow as pa
    import pyarrow.compute as pc
    import pyarrow.parquet as pq

    base = storage.join(root, LISTS_DIR)
    for rel in storage.list_files(base):
        path = storage.join(base, rel)
        name = rel.replace("\\", "/")
        if "/" in name or not LISTS_FILE_RE.fullmatch(name):
            res.problems.append(Problem(path, "not a file of the skip-list store"))
            continue
        if (
            not name.endswith(".parquet")
            or ".tmp-" in name
            or name
            == "_local.parquet"  # the export-only log is not a list (prx_data.skips.export_state)
            or res.under_unsafe(path)
        ):
            continue
        try:
            data = confined.read(root, path, confined.MANIFEST_MAX_BYTES)
            ids = pq.read_table(io.BytesIO(data), columns=["id"])["id"]
            ids = ids.combine_chunks()
            if not pa.types.is_string(ids.type) or ids.null_count:
                raise ValueError("ids are not non-null strings")
            if (
                len(ids) > 1
                and not pc.all(pc.less(ids.slice(0, len(ids) - 1), ids.slice(1))).as_py()
            ):
                raise ValueError("ids are not sorted and unique")
        except Exception as e:  # noqa: BLE001 - an unreadable list is a finding
            res.problems.append(Problem(path, f"unreadable skip list ({e})"))


def _verify_bucket(
    root: str,
    bucket: str,
    expected: int | None,
    have_report: bool,
    deep: bool,
    check_sidecar: SidecarCheck | None,
    res: VerifyResult,
    folded: bool | frozenset = True,
) -> None:
    add = res.problems.append
    bdir = rel_join(root, bucket)
    index_path = storage.join(bdir, INDEX_NAME)
    if have_report and expected is None:
        add(Problem(bdir, "bucket is not in report.json (left by another run?)"))
    try:
        index = json.loads(confined.read(root, index_path, confined.INDEX_MAX_BYTES))
        entries = list(index["shards"])
    except FileNotFoundError:
        add(Problem(index_path, "missing: no merged index for this bucket"))
        return
    except confined.UnsafeFileError as e:
        res.unreadable(index_path, str(e).removeprefix(f"{index_path}: "))
        return
    except (ValueError, KeyError, TypeError) as e:
        add(Problem(index_path, f"unreadable index ({e})"))
        return
    shards: dict[str, ShardInfo] = {}
    on_disk: dict[str, tuple[str, int, dict]] = {}  # basename -> (file basename, bytes, hashes)
    total = 0
    column_problems: dict[str, None] = {}  # one problem per distinct finding, in index order
    for i, entry in enumerate(entries):
        if isinstance(entry, dict) and (found := columns_problem(entry, export_columns=folded)):
            column_problems.setdefault(found)
        try:
            info = ShardInfo.from_index_entry(entry)
            stored = entry.get("zip_data") or entry["raw_data"]
            file_base, nbytes = stored["basename"], int(stored["bytes"])
        except (KeyError, TypeError, ValueError) as e:
            add(Problem(index_path, f"shard entry {i} is malformed ({e})"))
            continue
        bad = [b for b in {info.basename, file_base} if not PART_SHARD_RE.fullmatch(str(b))]
        if bad:
            add(
                Problem(
                    index_path,
                    f"shard {bad[0]!r} is not a <part>/shard.NNNNN.mds path inside the bucket; "
                    "refusing to follow it",
                )
            )
            continue
        shards[info.basename] = info
        on_disk[info.basename] = (file_base, nbytes, dict(stored.get("hashes") or {}))
        total += info.samples
    res.shards += len(shards)
    for found in column_problems:
        add(Problem(index_path, found))
    if expected is not None and total != expected:
        add(Problem(index_path, f"index holds {total} samples, report.json counts {expected}"))
    sizes = _sizes(bdir)  # one listing of the bucket: relative path -> bytes
    files = sizes
    for file_base, nbytes, _hashes in sorted(on_disk.values()):
        path = rel_join(bdir, file_base)
        if file_base not in files:
            if not res.under_unsafe(path):  # a linked part: reported once, above
                add(Problem(path, "shard listed in the index is missing"))
            continue
        if sizes.get(file_base) != nbytes:
            add(Problem(path, f"{sizes.get(file_base)} bytes, the index records {nbytes}"))
    if deep:
        _rehash(root, bdir, on_disk, files, sizes, res)
    # manifests: rows per shard == index samples
    parts = sorted({b.split("/")[0] for b in shards})
    # Manifests are read in parallel (bounded) and checked in part order: the same findings.
    for part, (mpath, col) in zip(
        parts,
        imap_bounded(_manifest_reader(root, bdir, files), parts, io_workers(bdir)),
        strict=True,
    ):
        if col is None:
            if not res.under_unsafe(mpath):
                add(Problem(mpath, "manifest missing"))
            continue
        if isinstance(col, Exception):
            add(Problem(mpath, f"unreadable manifest ({col})"))
            continue
        got = Counter(col)
        for base in sorted(b for b in shards if b.startswith(f"{part}/")):
            rows = got.pop(base, 0)
            if rows != shards[base].samples:
                add(
                    Problem(
                        mpath,
                        f"{rows} rows for {base}, the index records {shards[base].samples} samples",
                    )
                )
        for base in sorted(got):
            add(Problem(mpath, f"{got[base]} rows for {base!r}, which the index does not list"))
    # files that the index does not account for
    known_parts = set(parts)
    listed = {v[0] for v in on_disk.values()}  # once, not per file: buckets hold 10^5 shards
    sidecars = []
    for rel in sorted(files):
        bits = rel.split("/")
        if rel == INDEX_NAME:
            continue
        if len(bits) != 2 or not PART_RE.fullmatch(bits[0]):
            add(Problem(rel_join(bdir, rel), "not part of the export layout"))
            continue
        if bits[0] not in known_parts:
            add(Problem(rel_join(bdir, rel), "part is not in the merged index (unfinished unit?)"))
            continue
        if rel.endswith(SIDECAR_SUFFIX):
            sidecars.append(rel)
        elif bits[1] not in (INDEX_NAME, MANIFEST_NAME) and rel not in listed:
            add(Problem(rel_join(bdir, rel), "file is not listed in the merged index"))
    _verify_sidecars(root, bdir, sidecars, shards, check_sidecar, res)


def _manifest_reader(root: str, bdir: str, files: dict[str, int]):
    """``part -> (path, shard column | None if absent | the error if unreadable)``."""
    import pyarrow.parquet as pq

    def read(part: str) -> tuple[str, list | Exception | None]:
        mpath = rel_join(bdir, f"{part}/{MANIFEST_NAME}")
        if f"{part}/{MANIFEST_NAME}" not in files:
            return mpath, None
        try:
            src = io.BytesIO(confined.read(root, mpath, confined.MANIFEST_MAX_BYTES))
            return mpath, pq.read_table(src, columns=["shard"])["shard"].to_pylist()
        except Exception as e:  # noqa: BLE001 - a corrupt manifest is a finding
            return mpath, e

    return read


def _sizes(bdir: str) -> dict[str, int]:
    """Regular files of a bucket (links, FIFOs and devices were reported by the tree walk)."""
    return {e.rel: e.size for e in confined.walk(bdir) if e.problem is None}


def _rehash(
    root: str, bdir: str, on_disk: dict, files: dict, sizes: dict, res: VerifyResult
) -> None:
    from prx_data.core.streaming_compat import get_hash

    jobs = [(b, v) for b, v in sorted(on_disk.items()) if v[0] in files]

    def one(job):
        base, (file_base, _nbytes, hashes) = job
        path = rel_join(bdir, file_base)
        if not hashes:
            return [Problem(path, "the index records no hash for this shard; cannot rehash")]
        try:  # no more than the index declares (a size mismatch was reported above)
            data = confined.read(root, path, _nbytes)
        except confined.UnsafeFileError as e:
            return [Problem(path, str(e).removeprefix(f"{path}: "))]
        return [
            Problem(path, f"{algo} is {got}, the index records {want}: the shard's bytes changed")
            for algo, want in sorted(hashes.items())
            if (got := get_hash(algo, data)) != want
        ]

    for found in map_io(one, jobs, storage.is_remote(bdir)):
        res.problems.extend(found)
        res.rehashed += 1


def _verify_sidecars(
    root: str,
    bdir: str,
    rels: list[str],
    shards: dict[str, ShardInfo],
    check_sidecar: SidecarCheck | None,
    res: VerifyResult,
) -> None:
    found: list[list[Problem] | tuple[str, str, str]] = []  # per sidecar: problems, or a read job
    for rel in rels:
        path = rel_join(bdir, rel)
        stem = rel[: -len(SIDECAR_SUFFIX)]
        match = None
        cut = len(stem)  # the longest shard name that the stem extends with ".<list name>"
        while (cut := stem.rfind(".", 0, cut)) > 0:
            if stem[:cut] in shards:
                match = (stem[:cut], stem[cut + 1 :])
                break
        if match is None:
            found.append([Problem(path, "orphan sidecar: no shard of the index has this name")])
            continue
        res.sidecars += 1
        base, name = match
        if not LIST_NAME_RE.fullmatch(name):
            found.append([Problem(path, f"sidecar name {name!r} is not a valid skip-list name")])
        elif check_sidecar is not None:
            found.append((path, base, name))

    box = confined.confined(root)

    def check(job: list[Problem] | tuple[str, str, str]) -> list[Problem]:
        if isinstance(job, list):
            return job
        path, base, name = job
        try:
            data = box.read(path, confined.sidecar_max_bytes(shards[base].samples))
        except confined.UnsafeFileError as e:
            return [Problem(path, str(e).removeprefix(f"{path}: "))]
        return [Problem(path, m) for m in check_sidecar(path, data, shards[base], name)]

    # Sidecars are read in parallel (bounded); findings keep the listing's order.
    for problems in imap_bounded(check, found, io_workers(bdir)):
        res.problems.extend(problems)
