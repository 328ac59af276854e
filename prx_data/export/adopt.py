"""Adopt an MDS tree another writer made, so skip lists, opt-outs and ``verify`` work on it.

Skip lists bind row ids to (shard, index) through manifests, which only the
exporter writes. ``python -m prx_data.adopt ROOT`` writes them once for any
MDS bucket tree, without touching a shard or an ``index.json``::

    ROOT/
      <tier>/<ar>/index.json + shards   a plain tree (any MDSWriter run), or
      <ar>/index.json + shards          a flat tree of one tier (--tier N), e.g. PRX's
                                        fine-t2i-to-mds.py (w<N>/shard... via merge_index)
      _prx/adoption                     the record (JSON text): layout, tier, id column,
                                        columns, per-bucket samples
      _prx/<tier>/<ar>/ids.parquet      manifest: shard (as in the index), index, id
      _prx/<tier>/<ar>/shards           JSON text: sha256 of index.json; per shard bytes,
                                        samples and xxh64 of its raw bytes
      _prx/report.json, report.txt      what was adopted, samples per bucket

Ids come from a ``str`` column (``--id-column``, default ``id`` when there is
one) or, without one, are synthetic: ``<bucket>/<shard>:<index>``, stable as
long as the shards are. Skip-list sidecars then go next to the shards, as in
an export. Adoption reads every shard once (to hash it and read its ids);
rerun it after a bucket is rewritten.
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from prx_data.core import confined, storage
from prx_data.core.schema import MANIFEST_NAME, REPORT_NAME
from prx_data.export import bounded, layout, naming, safety
from prx_data.export.layout import ForeignTreeError

RECORD_FORMAT = "prx-data adoption"
SHARDS_NAME = naming.ADOPTED_SHARDS_NAME
#: Column names tried, in order, when no --id-column is given.
DEFAULT_ID_COLUMNS = ("id",)


@dataclass(frozen=True)
class AdoptResult:
    """What an adoption wrote."""

    root: str
    layout: str  # "tiered" (<tier>/<ar>/) or "flat" (<ar>/ of one declared tier)
    tier: int | None
    buckets: dict[str, int]
    shards: int
    id_column: str | None  # None: synthetic ids <bucket>/<shard>:<index>
    seconds: float
    columns: dict[str, str] = field(default_factory=dict)

    @property
    def samples(self) -> int:
        return sum(self.buckets.values())


def record_path(root: str) -> str:
    return storage.join(root, *naming.ADOPTION_NAME.split("/"))


def read_record(root: str) -> dict | None:
    """The adoption record of ``root`` (None when it was never adopted)."""
    try:
        obj = json.loads(confined.read(root, record_path(root), confined.SMALL_MAX_BYTES))
    except FileNotFoundError:
        return None
    except ValueError as e:
        raise ForeignTreeError(
            f"{record_path(root)}: unreadable adoption record ({e}); run python -m "
            f"prx_data.adopt {root} again"
        ) from None
    if not isinstance(obj, dict) or obj.get("format") != RECORD_FORMAT:
        raise ForeignTreeError(f"{record_path(root)}: not an adoption record of prx-data")
    return obj


def detect_layout(root: str, tier: int | None) -> tuple[str, int | None]:
    """``("tiered", None)`` or ``("flat", tier)``; refuses what is neither, saying why."""
    if not storage.exists(root) or not (storage.is_remote(root) or os.path.isdir(root)):
        raise ForeignTreeError(f"{root}: no such folder; give the root of an MDS bucket tree")
    if _ours(root) and not storage.exists(record_path(root)):
        raise ForeignTreeError(
            f"{root}: an export written by prx_data.write_mds (or skips rewrite: it has "
            f"{naming.MARKER_NAME} or {REPORT_NAME}) already has its manifests; it "
            f"needs no adoption (check it with python -m prx_data.verify {root})"
        )
    dirs = storage.list_dirs(root)
    tiered = [
        d
        for d in dirs
        if naming.TIER_RE.fullmatch(d)
        and any(
            naming.AR_RE.fullmatch(a)
            and storage.exists(storage.join(root, d, a, naming.INDEX_NAME))
            for a in storage.list_dirs(storage.join(root, d))
        )
    ]
    flat = [
        d
        for d in dirs
        if naming.AR_RE.fullmatch(d) and storage.exists(storage.join(root, d, naming.INDEX_NAME))
    ]
    if tiered and flat:
        raise ForeignTreeError(
            f"{root}: holds both tier folders ({tiered[0]}/) and ratio folders ({flat[0]}/); "
            "adopt each layout from its own root"
        )
    if flat:
        if tier is None:
            raise ForeignTreeError(
                f"{root}: one folder per aspect ratio ({flat[0]}/index.json) and no tier; "
                "declare it: python -m prx_data.adopt ROOT --tier 1024 (or DatasetSpec(tier=...))"
            )
        return "flat", int(tier)
    if tiered:
        if tier is not None:
            raise ForeignTreeError(
                f"{root}: has tier folders ({', '.join(tiered[:4])}); --tier is only for a tree "
                "with one folder per aspect ratio: leave it out"
            )
        return "tiered", None
    raise ForeignTreeError(
        f"{root}: no <tier>/<ratio>/index.json (e.g. 1024/1.000/index.json) or <ratio>/index.json"
        " under it; buckets are folders named like 1.000 (width/height, 3 decimals)"
    )


def _id_column(index_path: str, entries: Sequence[dict], wanted: str | None) -> str | None:
    cols = [dict(zip(e["column_names"], e["column_encodings"], strict=True)) for e in entries]
    if wanted == "":  # asked for synthetic ids
        return None
    if wanted is None:
        for name in DEFAULT_ID_COLUMNS:
            if all(c.get(name) == "str" for c in cols):
                return name
        return None
    for c in cols:
        if c.get(wanted) != "str":
            got = "missing" if wanted not in c else f"encoded {c[wanted]!r}"
            raise ForeignTreeError(
                f"{index_path}: id column {wanted!r} is {got}; it must be a 'str' column "
                f"(columns: {', '.join(sorted(c))}), or leave --id-column out for synthetic ids"
            )
    return wanted


def _shard_bytes(bdir: str, entry: dict) -> bytes:
    """The raw (decompressed) bytes of one shard, as its index describes them."""
    from prx_data.core.streaming_compat import decompress

    raw, zipped = entry["raw_data"], entry.get("zip_data")
    path = layout.rel_join(bdir, raw["basename"])
    # Confined to the bucket, no more than the index declares (no link out, FIFO or device).
    if storage.exists(path):
        return confined.read(bdir, path, int(raw["bytes"]))
    if zipped:
        zpath = layout.rel_join(bdir, zipped["basename"])
        return decompress(entry["compression"], confined.read(bdir, zpath, int(zipped["bytes"])))
    raise ForeignTreeError(f"{path}: shard missing (the index names it)")


def _column_values(data: bytes, entry: dict, column: str, source: str) -> list[str]:
    """One ``str`` column of every sample of a raw MDS shard, no other column decoded."""
    names, sizes = entry["column_names"], entry["column_sizes"]
    pos = names.index(column)
    n = int(np.frombuffer(data[:4], np.uint32)[0])
    if n != int(entry["samples"]):
        raise ForeignTreeError(f"{source}: holds {n} samples, its index says {entry['samples']}")
    offsets = np.frombuffer(data[4 : 4 + 4 * (n + 1)], np.uint32)
    var = [i for i, s in enumerate(sizes) if not s]
    out = []
    for i in range(n):
        begin = int(offsets[i])
        head = np.frombuffer(data[begin : begin + 4 * len(var)], np.uint32)
        lens = list(sizes)
        for j, col in enumerate(var):
            lens[col] = int(head[j])
        start = begin + 4 * len(var) + sum(lens[:pos])
        out.append(data[start : start + lens[pos]].decode("utf-8"))
    return out


def _write_parquet(path: str, tables: list[pa.Table]) -> None:
    schema = pa.schema([("shard", pa.string()), ("index", pa.int32()), ("id", pa.string())])
    buf = io.BytesIO()
    with pq.ParquetWriter(buf, schema, compression="zstd") as w:
        for t in tables:
            w.write_table(t)
    storage.write_bytes_atomic(path, buf.getvalue())


def adopt_tree(root: str, *, tier: int | None = None, id_column: str | None = None) -> AdoptResult:
    """Write the manifests, shard hashes, record and report of a foreign MDS tree.

    Refuses (:class:`ForeignTreeError`, one line) an export of ours, a tree
    with no buckets, unsafe names or encodings, an id column that is not
    ``str``, and empty or repeated ids within a bucket.
    """
    from prx_data.core.streaming_compat import get_hash

    t0 = time.monotonic()
    kind, flat = detect_layout(root, tier)
    root = layout.Tree(root, flat)
    buckets = layout.list_buckets(root)
    per_bucket: dict[str, int] = {}
    records: dict[str, dict] = {}
    columns: dict[str, str] = {}
    chosen: str | None = None
    synthetic = False
    nshards = 0
    for bucket in buckets:
        index_path = layout.rel_join(root, f"{bucket}/{naming.INDEX_NAME}")
        index_bytes = confined.read(root, index_path, confined.INDEX_MAX_BYTES)
        entries = layout.read_index_entries(root, bucket)
        if not entries:
            continue
        col = _id_column(index_path, entries, id_column)
        if col is None:
            synthetic = True
        elif chosen is None:
            chosen = col
        columns.update(zip(entries[0]["column_names"], entries[0]["column_encodings"], strict=True))
        bdir = layout.rel_join(root, bucket)

        def one(entry: dict, bucket: str = bucket, bdir: str = bdir, col: str | None = col):
            base = entry["raw_data"]["basename"]
            data = _shard_bytes(bdir, entry)
            if len(data) != int(entry["raw_data"]["bytes"]):
                raise ForeignTreeError(
                    f"{layout.rel_join(bdir, base)}: {len(data)} bytes, its index says "
                    f"{entry['raw_data']['bytes']}; the shard or its index changed"
                )
            want = entry["raw_data"].get("hashes") or {}
            for algo, h in sorted(want.items()):
                if get_hash(algo, data) != h:
                    raise ForeignTreeError(
                        f"{layout.rel_join(bdir, base)}: {algo} differs from its index.json"
                    )
            n = int(entry["samples"])
            if col is None:
                ids = [f"{bucket}/{base}:{i}" for i in range(n)]
            else:
                ids = _column_values(data, entry, col, layout.rel_join(bdir, base))
            info = {"basename": base, "bytes": len(data), "samples": n}
            info["xxh64"] = get_hash("xxh64", data)
            table = pa.table(
                {
                    "shard": pa.array([base] * n, pa.string()),
                    "index": pa.array(np.arange(n, dtype=np.int32)),
                    "id": pa.array(ids, pa.string()),
                }
            )
            return info, table

        infos, tables = [], []
        for info, table in bounded.imap_bounded(one, entries, bounded.io_workers(root)):
            infos.append(info)
            tables.append(table)
        ids = pa.chunked_array([c for t in tables for c in t["id"].chunks], pa.string())
        empty = int(pc.sum(pc.equal(pc.utf8_length(ids), 0)).as_py() or 0)
        if empty:
            raise ForeignTreeError(
                f"{index_path}: {empty} sample(s) have an empty {col!r}; pick another "
                "--id-column, or adopt with synthetic ids (--id-column '')"
            )
        if len(pc.unique(ids)) != len(ids):
            raise ForeignTreeError(
                f"{index_path}: column {col!r} repeats ids within the bucket, so a skip list "
                "could not tell samples apart; pick another --id-column, or adopt with "
                "synthetic ids (--id-column '')"
            )
        _write_parquet(layout.adopted_manifest(root, bucket), tables)
        shards_rec = {
            "index_sha256": hashlib.sha256(index_bytes).hexdigest(),
            "shards": infos,
        }
        storage.write_bytes_atomic(
            storage.join(root, naming.ADOPT_DIR, *bucket.split("/"), SHARDS_NAME),
            json.dumps(shards_rec, indent=1, sort_keys=True).encode(),
        )
        per_bucket[bucket] = sum(i["samples"] for i in infos)
        records[bucket] = {"samples": per_bucket[bucket], "shards": len(infos)}
        nshards += len(infos)
    if not per_bucket:
        raise ForeignTreeError(f"{root}: its buckets hold no shards; nothing to adopt")
    record = {
        "format": RECORD_FORMAT,
        "version": 1,
        "layout": kind,
        "tier": flat,
        "id_column": None if synthetic else chosen,
        "synthetic_ids": synthetic,
        "columns": dict(sorted(columns.items())),
        "buckets": records,
    }
    storage.write_bytes_atomic(record_path(root), json.dumps(record, indent=1).encode())
    res = AdoptResult(
        root=str(root),
        layout=kind,
        tier=flat,
        buckets=per_bucket,
        shards=nshards,
        id_column=record["id_column"],
        seconds=time.monotonic() - t0,
        columns=record["columns"],
    )
    _write_report(res)
    return res


def _write_report(res: AdoptResult) -> None:
    body = {
        "adopted": True,
        "layout": res.layout,
        "tier": res.tier,
        "buckets": dict(sorted(res.buckets.items())),
        "samples": res.samples,
        "shards": res.shards,
        "id_column": res.id_column,
        "synthetic_ids": res.id_column is None,
        "seconds": round(res.seconds, 3),
    }
    base = storage.join(res.root, naming.ADOPT_DIR)
    storage.write_bytes_atomic(storage.join(base, REPORT_NAME), json.dumps(body, indent=2).encode())
    storage.write_bytes_atomic(storage.join(base, "report.txt"), report_text(res).encode())


def report_text(res: AdoptResult) -> str:
    ids = (
        f"ids from column {res.id_column!r}"
        if res.id_column
        else "synthetic ids <bucket>/<shard>:<index> (no 'str' id column)"
    )
    lines = [
        f"adopted {res.root}: {res.samples} samples in {res.shards} shards, "
        f"{len(res.buckets)} buckets ({res.layout}"
        + (f", tier {res.tier}" if res.tier else "")
        + f"); {ids}; {res.seconds:.1f} s",
        f"{'bucket':<14} {'samples':>10}",
    ]
    lines += [f"{b:<14} {n:>10}" for b, n in sorted(res.buckets.items())]
    lines.append(
        f"shards untouched; manifests and hashes in {naming.ADOPT_DIR}/; skip lists: "
        f"python -m prx_data.skips add {res.root} NAME --ids FILE"
    )
    return "\n".join(lines) + "\n"


# --- verify ------------------------------------------------------------------------------------


def verify_adopted(root: str, *, deep: bool = False) -> tuple[list[str], int, int]:
    """Problems of an adopted tree (index changed, shard size or hash), buckets, shards checked."""
    from prx_data.core.streaming_compat import get_hash

    rec = read_record(root)
    if rec is None:
        raise ForeignTreeError(f"{root}: not adopted; run python -m prx_data.adopt {root}")
    root = layout.Tree(root, rec.get("tier") if rec.get("layout") == "flat" else None)
    problems: list[str] = []
    nshards = 0
    for bucket in sorted(rec.get("buckets") or {}):
        index_path = layout.rel_join(root, f"{bucket}/{naming.INDEX_NAME}")
        spath = storage.join(root, naming.ADOPT_DIR, *bucket.split("/"), SHARDS_NAME)
        try:
            srec = json.loads(storage.read_bytes(spath))
            index_bytes = storage.read_bytes(index_path)
        except (FileNotFoundError, ValueError) as e:
            problems.append(f"{spath}: {e}")
            continue
        if hashlib.sha256(index_bytes).hexdigest() != srec.get("index_sha256"):
            problems.append(f"{index_path}: changed since adoption; run python -m prx_data.adopt")
            continue
        entries = {e["raw_data"]["basename"]: e for e in layout.read_index_entries(root, bucket)}
        if not storage.exists(layout.adopted_manifest(root, bucket)):
            problems.append(f"{layout.adopted_manifest(root, bucket)}: missing manifest")
        bdir = layout.rel_join(root, bucket)
        for info in srec.get("shards", []):
            nshards += 1
            entry = entries.get(info["basename"])
            path = layout.rel_join(bdir, info["basename"])
            if entry is None:
                problems.append(f"{path}: not in {index_path}")
                continue
            try:
                data = _shard_bytes(bdir, entry) if deep else None
            except (ForeignTreeError, FileNotFoundError) as e:
                problems.append(str(e))
                continue
            if data is None:
                if not (storage.exists(path) or entry.get("zip_data")):
                    problems.append(f"{path}: missing")
                continue
            if get_hash("xxh64", data) != info.get("xxh64"):
                problems.append(f"{path}: xxh64 differs from the adoption: the shard changed")
    return problems, len(rec.get("buckets") or {}), nshards


def _ours(root: str) -> bool:
    """An export's marker or config, or a ``report.json`` (a rewrite writes no marker)."""
    return safety.has_proof(root) or storage.exists(storage.join(root, REPORT_NAME))


def is_foreign_tree(root: str) -> bool:
    """An MDS tree another writer made, adopted or not."""
    return storage.exists(record_path(root)) or not _ours(root)


def _has_buckets(root: str) -> bool:
    """Some ``<tier>/<ar>/index.json`` or ``<ar>/index.json`` under ``root``."""
    if not storage.is_remote(root) and not os.path.isdir(root):
        return False
    for d in storage.list_dirs(root):
        if naming.AR_RE.fullmatch(d) and storage.exists(storage.join(root, d, naming.INDEX_NAME)):
            return True
        if naming.TIER_RE.fullmatch(d) and any(
            naming.AR_RE.fullmatch(a)
            and storage.exists(storage.join(root, d, a, naming.INDEX_NAME))
            for a in storage.list_dirs(storage.join(root, d))
        ):
            return True
    return False


def is_plain_tree(root: str) -> bool:
    """An MDS tree another writer made that was not adopted (no id manifests)."""
    return not storage.exists(record_path(root)) and not _ours(root) and _has_buckets(root)


__all__ = [
    "MANIFEST_NAME",
    "AdoptResult",
    "ForeignTreeError",
    "adopt_tree",
    "detect_layout",
    "is_plain_tree",
    "read_record",
    "report_text",
    "verify_adopted",
]


def resolve_tree(root: str, tier: int) -> layout.Tree:
    """``root`` resolved, taking ``tier`` as its tier when it is a flat tree with no recorded tier."""
    resolved = layout.tree(root)
    if resolved.flat_tier is not None or (storage.is_remote(root) and not storage.exists(root)):
        return resolved
    if _ours(root):
        return resolved
    try:
        dirs = storage.list_dirs(root)
    except (FileNotFoundError, NotADirectoryError):
        return resolved
    if any(
        naming.AR_RE.fullmatch(d) and storage.exists(storage.join(root, d, naming.INDEX_NAME))
        for d in dirs
    ):
        return layout.Tree(root, tier)
    return resolved


def refuse_plain_tree(root: str) -> None:
    """Skip lists on a tree another writer made need its id manifests: refuse until adopted."""
    if storage.exists(root) and is_plain_tree(root):
        raise ForeignTreeError(
            f"{root}: not an export of prx_data.write_mds nor an adopted tree, so it has no id "
            f"manifests; run python -m prx_data.adopt {root} once (shards are not touched)"
        )
