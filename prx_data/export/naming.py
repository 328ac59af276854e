"""Names and paths of the export tree: part and pack names, the patterns that recognise
them, and where each file of an export lives (the tree is drawn in
:mod:`prx_data.export.layout`). No I/O here, so every other export module can name a path.

Every pattern is used with ``fullmatch`` (``$`` would accept a trailing newline) and
spells digits ``[0-9]`` (``\\d`` also matches other scripts' digits, e.g. ``٥١٢``).
"""

from __future__ import annotations

import re

from prx_data.core import storage
from prx_data.core.errors import PrxDataError


def part_name(fragment_id: int, start: int) -> str:
    """The part (work unit) directory name: stable for a table version and unit plan."""
    return f"f{fragment_id:06d}-{start:09d}"


def pack_name(ordinal: int, first_part: str) -> str:
    """A pack's directory name: its place in the bucket and the first unit part it holds."""
    return f"p{ordinal:06d}-{first_part}"


#: What :func:`part_name` produces (widths are minimums: more fragments widen them).
UNIT_PART_PATTERN = r"f[0-9]{6,}-[0-9]{9,}"
#: What :func:`pack_name` produces: a pack of consecutive unit parts (``prx_data.export.pack``).
PACK_PATTERN = rf"p[0-9]{{6,}}-{UNIT_PART_PATTERN}"
#: A part directory of a bucket: a work unit's part, or a pack of them.
PART_PATTERN = rf"(?:{UNIT_PART_PATTERN}|{PACK_PATTERN})"
#: A shard file as MDSWriter names it, raw or compressed (streaming's compression extensions).
SHARD_FILE_PATTERN = r"shard\.[0-9]{5,}\.mds(?:\.(?:br|bz2|gz|snappy|zstd))?"
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
