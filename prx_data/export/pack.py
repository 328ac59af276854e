"""The pack stage: a bucket's unit parts, concatenated into shards of about ``shard_size``.

A work unit writes one part per bucket it touches (named by the ids it holds), so a large table gives
millions of small shards (a unit of 1,000 rows over 25 buckets: 40 samples,
a few MB, per part), against Mosaic's 50-100 MB. After every unit is done
and before the buckets are merged, consecutive parts of a bucket (in name
order) are grouped into packs of at most ``shard_size`` bytes
(:func:`plan_packs`), and each pack is written (:func:`write_pack`) by
feeding the parts' MDS samples, as encoded bytes, to streaming's
``MDSWriter``: the JPEG is never decoded or re-encoded, ``size_limit``,
compression and hashes are the export's, and the pack gets its manifest and
index like a part. The plan is a function of the units' counts (their
markers), so a rerun, a ``--resume`` and a cluster of any size write the same
packs with the same bytes.

Durability follows the units: on a local ``--out`` a pack is staged under
``_progress/writing``, fsynced and renamed into its bucket; on object storage
its objects are PUT (each durable) after clearing an earlier attempt's. Then
its marker ``_progress/packed/<tier>/<ar>/<pack>`` is written, and only then
are the unit parts it holds deleted. A kill at any point leaves a tree
without a report: ``--resume`` keeps packs with a marker, removes those
without (:func:`safety.remove_stale_parts`), and packs again from the parts,
which are still there.
"""

from __future__ import annotations

import functools
import io
import json
import os
import re
import threading
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass

import numpy as np

from prx_data.core import storage
from prx_data.core.schema import MANIFEST_NAME
from prx_data.export.bounded import imap_bounded, io_workers
from prx_data.export.durable import (
    create_only_uploads,
    fsync,
    publish_parts,
    refused_upload,
    stage_dir,
    write_manifest,
)
from prx_data.export.naming import (
    INDEX_NAME,
    PACK_PATTERN,
    PROGRESS_DIR,
    ExportError,
    combine_digests,
    content_pack_name,
    name_digest,
    pack_name,
)
from prx_data.export.safety import check_manifest_shards, load_index, remove_tree
from prx_data.export.spec import ExportConfig, UnitResult, published_parts

#: Where a written pack leaves its marker: ``_progress/packed/<tier>/<ar>/<pack>``.
PACKED_DIR = f"{PROGRESS_DIR}/packed"
_MARKER_RE = re.compile(rf"[0-9]+/[0-9]+\.[0-9]{{3}}/{PACK_PATTERN}")


@dataclass(frozen=True)
class Pack:
    """Consecutive unit parts of one bucket, written as one pack directory."""

    bucket: str
    name: str
    parts: tuple[str, ...]
    samples: int
    #: The parts' shard bytes (uncompressed): what the plan groups by.
    nbytes: int

    def to_json(self) -> str:
        return json.dumps(asdict(self), sort_keys=True)

    @classmethod
    def from_json(cls, text: str | bytes) -> Pack:
        d = json.loads(text)
        return cls(**{**d, "parts": tuple(d["parts"])})

    @property
    def key(self) -> str:
        """``<tier>/<ar>/<pack>``: the pack's path under the export (unique, unlike its name)."""
        return f"{self.bucket}/{self.name}"


def marker_path(out: str, pack: Pack) -> str:
    return storage.join(out, *PACKED_DIR.split("/"), *pack.key.split("/"))


def done_packs(out: str) -> set[str]:
    """``<tier>/<ar>/<pack>`` of every pack with a marker (one listing of ``_progress/packed``)."""
    root = storage.join(out, *PACKED_DIR.split("/"))
    return {
        r
        for r in (x.replace("\\", "/") for x in storage.list_files(root))
        if _MARKER_RE.fullmatch(r)
    }


def _part_bytes(out: str, bucket: str, part: str) -> int:
    """Shard bytes of a part from its index (a marker written before units recorded them)."""
    index = storage.join(out, *bucket.split("/"), part, INDEX_NAME)
    return sum(int(e["raw_data"]["bytes"]) for e in load_index(index, in_part=True))


def plan_packs(out: str, results: Mapping[str, UnitResult], shard_size: int) -> list[Pack]:
    """Per bucket, its parts in name order, cut greedily into runs of at most ``shard_size`` bytes.

    A part larger than ``shard_size`` is a pack of its own; a bucket with one
    part is one pack. Only the units' results are read (plus the index of a
    part whose marker predates ``bucket_bytes``): arithmetic over the parts,
    the same on every cluster and every rerun. Parts are named by the ids they
    hold, so their order, the cut and each pack's name
    (:func:`~prx_data.export.naming.content_pack_name`, the sum of its parts'
    digests) depend on the content alone: a table compacted or ingested again
    gives the same packs.
    """
    per_bucket: dict[str, list[tuple[str, int, int]]] = {}
    unknown: list[tuple[str, str]] = []
    for bucket, parts in published_parts(results).items():
        for part in sorted(parts):
            r = parts[part]
            n, b = r.buckets[bucket], r.bucket_bytes.get(bucket)
            if b is None:
                unknown.append((bucket, part))
            per_bucket.setdefault(bucket, []).append((part, n, -1 if b is None else b))
    if unknown:
        looked_up = dict(
            zip(
                unknown,
                imap_bounded(lambda bp: _part_bytes(out, *bp), unknown, io_workers(out)),
                strict=True,
            )
        )
        per_bucket = {
            bucket: [(p, n, looked_up.get((bucket, p), b)) for p, n, b in parts]
            for bucket, parts in per_bucket.items()
        }
    packs = []
    for bucket in sorted(per_bucket):
        runs: list[list[tuple[str, int, int]]] = []
        size = 0
        for item in per_bucket[bucket]:
            if runs and runs[-1] and size + item[2] <= shard_size:
                runs[-1].append(item)
                size += item[2]
            else:
                runs.append([item])
                size = item[2]
        for k, run in enumerate(runs):
            packs.append(
                Pack(
                    bucket=bucket,
                    name=_pack_name(k, [p for p, _, _ in run]),
                    parts=tuple(p for p, _, _ in run),
                    samples=sum(n for _, n, _ in run),
                    nbytes=sum(b for _, _, b in run),
                )
            )
    return packs


def _pack_name(ordinal: int, parts: Sequence[str]) -> str:
    """By content when every part is named by content; as older versions named it otherwise
    (a resume of units an older version finished)."""
    digests = [name_digest(p) for p in parts]
    if all(d is not None for d in digests):
        return content_pack_name(combine_digests(digests))
    return pack_name(ordinal, parts[0])


# --- writing one pack -----------------------------------------------------------------------


class _Encoded(bytes):
    """One sample exactly as MDS encoded it in a part's shard."""


@functools.cache
def _encoded_writer() -> type:
    """``MDSWriter`` taking already-encoded samples: its shards, sizes, hashes, compression."""
    from prx_data.core.streaming_compat import mds_writer

    class EncodedMDSWriter(mds_writer()):
        #: Called with (shard entry, samples) once each shard is on disk (``open_writer``).
        on_shard = None

        def encode_sample(self, sample) -> bytes:
            if not isinstance(sample, _Encoded):
                raise TypeError("the pack writer takes encoded samples only")
            return bytes(sample)

        def flush_shard(self) -> None:
            n = len(self.new_samples)
            super().flush_shard()
            if self.on_shard is not None:
                self.on_shard(self.shards[-1], n)

    return EncodedMDSWriter


def open_writer(dest: str, entry: Mapping, *, on_shard=None):
    """The pack writer at local ``dest`` with ``entry``'s columns, compression, hashes and size limit.

    ``on_shard(entry, samples)`` sees each shard as soon as it is closed (a
    rewrite checks it, then moves it to object storage, one shard on disk at a time).
    """
    writer = _encoded_writer()(
        out=dest,
        columns=dict(zip(entry["column_names"], entry["column_encodings"], strict=True)),
        compression=entry.get("compression"),
        hashes=list((entry["raw_data"].get("hashes") or {}).keys()) or None,
        size_limit=entry.get("size_limit") or (1 << 26),
    )
    writer.on_shard = on_shard
    return writer


def preload_writer() -> threading.Thread:
    """Load the pack writer on a daemon thread; returns the thread.

    Importing streaming's writer (torch) takes seconds: a job that packs on its own
    threads starts it while its units run elsewhere. A failure is left to the packs'
    own call, which raises it where it is reported.
    """

    def run() -> None:
        try:
            _encoded_writer()
        except Exception:  # noqa: BLE001 (the packs' call raises it again)
            pass

    thread = threading.Thread(target=run, name="prx-pack-writer", daemon=True)
    thread.start()
    return thread


def shard_raw(part_dir: str, entry: Mapping, read=None) -> bytes:
    """One part shard's uncompressed bytes, checked against the part's index (size, hashes, count).

    ``read(path, max_bytes)`` fetches the file (default: :func:`storage.read_bytes`;
    a rewrite reads confined to the export it was handed).
    """
    from prx_data.core.streaming_compat import decompress, get_hash

    info = entry.get("zip_data") or entry["raw_data"]
    path = storage.join(part_dir, info["basename"])
    data = storage.read_bytes(path) if read is None else read(path, int(info["bytes"]))
    bad = len(data) != int(info["bytes"]) or any(
        get_hash(algo, data) != want for algo, want in sorted((info.get("hashes") or {}).items())
    )
    if bad:
        raise ExportError(
            f"{path}: the shard's bytes differ from what its index records (size or hash); "
            "the part was changed after its unit wrote it. Start again with --overwrite."
        )
    if entry.get("zip_data"):
        data = decompress(entry["compression"], data)
    n = int(np.frombuffer(data, np.uint32, 1, 0)[0]) if len(data) >= 4 else -1
    if n != int(entry["samples"]) or len(data) < 4 * (n + 2):
        raise ExportError(f"{path}: holds {n} samples, its index records {entry['samples']}")
    return data


def split_samples(data: bytes, skip: Sequence[int] = ()) -> list[_Encoded]:
    """The encoded samples of an uncompressed shard (:func:`shard_raw`), in order, but ``skip``."""
    n = int(np.frombuffer(data, np.uint32, 1, 0)[0])
    offsets = np.frombuffer(data, np.uint32, n + 1, 4).tolist()
    dead = set(int(i) for i in skip)
    return [_Encoded(data[offsets[i] : offsets[i + 1]]) for i in range(n) if i not in dead]


def _shard_samples(part_dir: str, entry: dict) -> list[_Encoded]:
    """The encoded samples of one part shard, its bytes checked against the part's index."""
    return split_samples(shard_raw(part_dir, entry))


def part_ids(part_dir: str, part: str, entries: Sequence[dict], read=None) -> list[str]:
    """:func:`_part_ids` (the rewrite's stage takes a part's ids as the pack stage does)."""
    return _part_ids(part_dir, part, entries, read)


def _part_ids(part_dir: str, part: str, entries: Sequence[dict], read=None) -> list[str]:
    """The part's row ids in sample order, its manifest checked against its index.

    ``read(path, max_bytes)``: as for :func:`shard_raw` (the cap is generous: 4 KiB an id).
    """
    import pyarrow.parquet as pq

    path = storage.join(part_dir, MANIFEST_NAME)
    cap = (1 << 20) + 4096 * sum(int(e["samples"]) for e in entries)
    data = storage.read_bytes(path) if read is None else read(path, cap)
    t = pq.read_table(io.BytesIO(data), columns=["shard", "index", "id"])
    check_manifest_shards(path, part, t["shard"])
    want_shards, want_index = [], []
    for e in entries:
        want_shards += [f"{part}/{e['raw_data']['basename']}"] * int(e["samples"])
        want_index += range(int(e["samples"]))
    if t["shard"].to_pylist() != want_shards or t["index"].to_pylist() != want_index:
        raise ExportError(f"{path}: the manifest's rows do not match the part's index")
    return t["id"].to_pylist()


def _write_samples(cfg: ExportConfig, pack: Pack, bucket_dir: str, dest: str) -> list[str]:
    """Feed every sample of the pack's parts, in part order, to one writer at ``dest``."""
    writer = None
    ids: list[str] = []
    try:
        for part in pack.parts:
            part_dir = storage.join(bucket_dir, part)
            entries = load_index(storage.join(part_dir, INDEX_NAME), in_part=True)
            for entry in entries:
                columns = dict(zip(entry["column_names"], entry["column_encodings"], strict=True))
                if writer is None:
                    writer = _encoded_writer()(
                        out=dest,
                        columns=columns,
                        compression=cfg.compression,
                        hashes=list(cfg.hashes) or None,
                        size_limit=cfg.size_limit,
                    )
                    create_only_uploads(writer)
                elif columns != writer.columns:
                    raise ExportError(
                        f"{part_dir}: columns {sorted(columns)} differ from the pack's "
                        f"{sorted(writer.columns)}; start again with --overwrite"
                    )
                for sample in _shard_samples(part_dir, entry):
                    writer.write(sample)
            ids += _part_ids(part_dir, part, entries)
    except Exception:
        refused = refused_upload([writer])
        if refused is not None:
            raise refused from None
        raise
    finally:
        if writer is not None:
            try:
                writer.finish()
            except Exception:
                refused = refused_upload([writer])
                if refused is not None:
                    raise refused from None
                raise
    if len(ids) != pack.samples:
        raise ExportError(
            f"{bucket_dir}: pack {pack.name} holds {len(ids)} samples, its units wrote {pack.samples}"
        )
    return ids


def write_pack(cfg: ExportConfig, pack: Pack) -> Pack:
    """Write one pack (unless its marker says it is written), then delete the parts it holds.

    Idempotent: a retried or resumed pack either finds its marker (and only
    finishes deleting its parts) or writes the pack again from the parts.
    """
    local = not storage.is_remote(cfg.out)
    tier, ar = pack.bucket.split("/")
    bucket_dir = storage.join(cfg.out, tier, ar)
    marker = marker_path(cfg.out, pack)
    try:
        done = Pack.from_json(storage.read_bytes(marker))
    except FileNotFoundError:
        done = None
    if done is not None and done != pack:
        raise ExportError(
            f"{marker}: the pack was written from other parts ({done.parts[:3]}...) than "
            "this run plans; another run changed this export. Start again with --overwrite."
        )
    if done is None:
        if local:
            stage = stage_dir(cfg.out, f"{tier}-{ar}-{pack.name}")
            dest_bucket = os.path.join(stage, tier, ar)
        else:
            storage.delete(storage.join(bucket_dir, pack.name))  # an earlier attempt's objects
            dest_bucket = bucket_dir
        ids = _write_samples(cfg, pack, bucket_dir, storage.join(dest_bucket, pack.name))
        write_manifest(dest_bucket, pack.name, ids)
        if local:
            publish_parts(cfg.out, stage, {pack.bucket: pack.name})
        storage.write_bytes_atomic(marker, pack.to_json().encode())
        if local:
            fsync(os.path.dirname(marker))
    # The pack is durable: the unit parts it holds (written by this export's units) go.
    for part in pack.parts:
        if local:
            remove_tree(os.path.join(bucket_dir, part))
        else:
            storage.delete(storage.join(bucket_dir, part))
    if local:
        fsync(bucket_dir)
    return pack
