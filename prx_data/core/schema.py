"""Column contracts shared by every stage: the Lance table and the MDS samples.

Kept in one place so that ingest, export, streaming and the column jobs
agree on names and types without importing each other.
"""

from __future__ import annotations

import pyarrow as pa

__all__ = [
    "CAPTION",
    "EMBEDDING",
    "FORMAT",
    "HEIGHT",
    "ID",
    "IMAGE",
    "MANIFEST_NAME",
    "MDS_COLUMNS",
    "PHASH",
    "PROBE_ERROR",
    "REPORT_NAME",
    "SHA256",
    "SOURCE",
    "TABLE_SCHEMA",
    "WIDTH",
    "error_column",
    "is_job_column",
    "mds_sample",
    "status_column",
]

# --- Lance table -------------------------------------------------------------
#: Stable unique key of a row ("the row id"): derived from the source and the
#: item's key, so re-ingesting the same item yields the same id.
ID = "id"
IMAGE = "image"  # encoded bytes exactly as found in the source
WIDTH = "width"  # after EXIF orientation, read from the header
HEIGHT = "height"
FORMAT = "format"  # lower-case Pillow format name, e.g. "jpeg", "png", "webp"
SOURCE = "source"  # where the row came from (folder name, tar path, table uri)
CAPTION = "caption"  # the original caption; more caption columns may exist
PROBE_ERROR = "probe_error"  # null when the header could be read, else a reason
EMBEDDING = "embedding"  # optional fixed-size float32 vector
#: Hex sha256 of ``image`` as ingested or downloaded: the key an opt-out follows to every
#: byte-identical copy (:mod:`prx_data.core.keys`). Null for a URL row not fetched yet.
SHA256 = "sha256"
#: 64-bit perceptual hash (uint64), filled by the dedup job: the key an opt-out follows to
#: re-encoded copies.
PHASH = "phash"

#: Suffixes of the bookkeeping columns a column job writes next to its value
#: column (``caption_vlm_status``, ``caption_vlm_error``, ``phash_error``):
#: statuses and failure reasons, never captions or features.
JOB_COLUMN_SUFFIXES = ("_status", "_error")


def status_column(column: str) -> str:
    """``caption_vlm`` -> ``caption_vlm_status``: the job's per-row outcome."""
    return column + JOB_COLUMN_SUFFIXES[0]


def error_column(column: str) -> str:
    """``caption_vlm`` -> ``caption_vlm_error``: why the job failed on a row (null when not)."""
    return column + JOB_COLUMN_SUFFIXES[1]


def is_job_column(name: str) -> bool:
    """True for a column job's status or failure-reason column."""
    return name.endswith(JOB_COLUMN_SUFFIXES)


TABLE_SCHEMA = pa.schema(
    [
        pa.field(ID, pa.string(), nullable=False),
        pa.field(IMAGE, pa.large_binary()),
        pa.field(WIDTH, pa.int32()),
        pa.field(HEIGHT, pa.int32()),
        pa.field(FORMAT, pa.string()),
        pa.field(SOURCE, pa.string()),
        pa.field(CAPTION, pa.string()),
        pa.field(PROBE_ERROR, pa.string()),
        pa.field(SHA256, pa.string()),
    ]
)

# --- MDS samples -------------------------------------------------------------
#: Columns of every exported sample. Caption columns are added per export
#: (each as ``str``); everything else is fixed.
MDS_COLUMNS: dict[str, str] = {
    "image": "bytes",  # JPEG (q92 default) or PNG, exactly the bucket shape
    "id": "str",  # the Lance row id, for skip lists and opt-outs
    "width": "int32",  # original (oriented) size
    "height": "int32",
    "crop_left": "float32",  # crop box in original pixels
    "crop_top": "float32",
    "crop_right": "float32",
    "crop_bottom": "float32",
    "tier": "int32",
    "bucket": "str",  # e.g. "1024/1.000"
}


def mds_sample(
    *,
    image: bytes,
    id: str,
    width: int,
    height: int,
    crop_box: tuple[float, float, float, float],
    tier: int,
    bucket: str,
) -> dict[str, object]:
    """One exported sample keyed as :data:`MDS_COLUMNS` (the one place that spells the keys)."""
    left, top, right, bottom = crop_box
    return {
        "image": image,
        "id": id,
        "width": int(width),
        "height": int(height),
        "crop_left": float(left),
        "crop_top": float(top),
        "crop_right": float(right),
        "crop_bottom": float(bottom),
        "tier": int(tier),
        "bucket": bucket,
    }


#: Per-part manifest next to the shards: (shard basename, index in shard, id).
#: Lets skip lists be built from row ids without reading any image bytes.
MANIFEST_NAME = "ids.parquet"
REPORT_NAME = "report.json"
