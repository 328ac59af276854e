"""Names and paths of the export tree: part and pack names, the patterns that recognise
them, and where each file of an export lives (the tree is drawn in
:mod:`prx_data.export.layout`). No I/O here, so every other export module can name a path.

Every pattern is used with ``fullmatch`` (``$`` would accept a trailing newline) and
spells digits ``[0-9]`` (``\\d`` also matches other scripts' digits, e.g. ``٥١٢``).
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Iterable

from prx_data.core import storage
from prx_data.core.errors import PrxDataError


def part_name(fragment_id: int, start: int) -> str:
    """A work unit's key, ``f<fragment>-<start>``: its progress marker, its dropped rows and
    its staging folder, all bookkeeping of one table version's unit plan. Exports written
    before parts were named by content (:func:`content_part_name`) also name their part
    folders so; such trees stay readable."""
    return f"f{fragment_id:06d}-{start:09d}"


def pack_name(ordinal: int, first_part: str) -> str:
    """The pack name of exports written before packs were named by content
    (:func:`content_pack_name`): its place in the bucket and its first unit part."""
    return f"p{ordinal:06d}-{first_part}"


#: 64-bit additive set digest of row ids (see :func:`ids_digest`).
_DIGEST_MASK = (1 << 64) - 1
_DIGEST_PERSON = b"prx-part-ids"


def ids_digest(ids: Iterable[str]) -> int:
    """A digest of a set of row ids that does not depend on their order or on the table.

    The sum, modulo 2**64, of a 64-bit BLAKE2b of each id: a part's digest is
    that of the ids it holds, and a pack's is the sum of its parts' digests
    (their id sets are disjoint), so a pack is named by content without
    reading one id. What a compaction, a re-ingest or a rewrite of the table
    changes (fragment ids, row addresses, the order of fragments) never
    reaches it: an identical re-export gives identical names, so whatever is
    bound to a shard's path (latents, checkpoints' fingerprints) still holds.
    """
    import numpy as np

    def one(i: str) -> bytes:
        return hashlib.blake2b(i.encode(), digest_size=8, person=_DIGEST_PERSON).digest()

    words = np.frombuffer(b"".join(map(one, ids)), dtype="<u8")
    return int(words.sum(dtype=np.uint64)) & _DIGEST_MASK if len(words) else 0


def content_part_name(digest: int) -> str:
    """A work unit's part in one bucket, named by the ids it holds (:func:`ids_digest`)."""
    return f"u{digest & _DIGEST_MASK:016x}"


def content_pack_name(digest: int) -> str:
    """A pack, named by the ids it holds: the sum of its parts' digests (:func:`ids_digest`)."""
    return f"p{digest & _DIGEST_MASK:016x}"


def name_digest(name: str) -> int | None:
    """The id digest a content-named part or pack carries; None for a legacy name."""
    if CONTENT_PART_RE.fullmatch(name) or CONTENT_PACK_RE.fullmatch(name):
        return int(name[1:], 16)
    return None


def combine_digests(digests: Iterable[int]) -> int:
    """The digest of the union of disjoint id sets, from theirs."""
    return sum(digests) & _DIGEST_MASK


_HEX64 = r"[0-9a-f]{16}"
#: A part named by its unit's fragment range, as older versions wrote (widths are minimums).
LEGACY_UNIT_PART_PATTERN = r"f[0-9]{6,}-[0-9]{9,}"
#: What :func:`content_part_name` and :func:`content_pack_name` produce.
CONTENT_PART_PATTERN = rf"u{_HEX64}"
CONTENT_PACK_PATTERN = rf"p{_HEX64}"
#: A work unit's part: named by content, or by fragment range (older exports).
UNIT_PART_PATTERN = rf"(?:{CONTENT_PART_PATTERN}|{LEGACY_UNIT_PART_PATTERN})"
#: A pack of unit parts (``prx_data.export.pack``): by content, or :func:`pack_name` (older).
PACK_PATTERN = rf"(?:{CONTENT_PACK_PATTERN}|p[0-9]{{6,}}-{LEGACY_UNIT_PART_PATTERN})"
#: A part directory of a bucket: a work unit's part, or a pack of them.
PART_PATTERN = rf"(?:{UNIT_PART_PATTERN}|{PACK_PATTERN})"
#: A shard file as MDSWriter names it, raw or compressed (streaming's compression extensions).
SHARD_FILE_PATTERN = r"shard\.[0-9]{5,}\.mds(?:\.(?:br|bz2|gz|snappy|zstd))?"
CONTENT_PART_RE = re.compile(CONTENT_PART_PATTERN)
CONTENT_PACK_RE = re.compile(CONTENT_PACK_PATTERN)
#: Compiled patterns; a merged index names ``<part>/shard.NNNNN.mds[.ext]`` (PART_SHARD_RE).
PART_RE = re.compile(PART_PATTERN)
SHARD_FILE_RE = re.compile(SHARD_FILE_PATTERN)
PART_SHARD_RE = re.compile(rf"{PART_PATTERN}/{SHARD_FILE_PATTERN}")
#: Index entry keys that name a file (streaming joins each to the dataset directory).
FILE_KEYS = ("raw_data", "zip_data", "raw_meta", "zip_meta")


def marker_path(out: str, part: str) -> str:
    """Where a finished work unit leaves its marker (the unit's counts, JSON text)."""
    return storage.join(out, PROGRESS_DIR, f"{part}.done")


PROGRESS_DIR = "_progress"
#: Precomputed VAE latents beside the shards (:mod:`prx_data.export.latents`).
LATENTS_DIR = "_latents"
#: Columns attached beside the shards, one folder per column (:mod:`prx_data.export.attached`).
COLUMNS_DIR = "_columns"
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
#: The export's skip lists as row ids (:mod:`prx_data.skips.export_state`): one parquet per list
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


class ExportError(PrxDataError):
    """A problem with the export's configuration or output location."""


INDEX_NAME = "index.json"
#: Tier directories are integers; bucket directories are aspect labels like ``1.000``.
TIER_RE = re.compile(r"[0-9]+")
AR_RE = re.compile(r"[0-9]+\.[0-9]{3}")
#: Where an adopted tree keeps what prx-data adds to it (never a shard or an index.json).
ADOPT_DIR = "_prx"
#: The adoption record: JSON text (not *.json: streaming's merge_index would take it).
ADOPTION_NAME = "_prx/adoption"
#: Per adopted bucket, ``_prx/<tier>/<ar>/shards``: sha256 of its index.json, shard hashes.
ADOPTED_SHARDS_NAME = "shards"
