"""Test-only helper: build a Lance table straight from (bytes, caption) items.

The product path is ``python -m prx_data.ingest``; export tests use this
shortcut so they exercise the exporter alone, with exactly the rows they
need (including rows ingest would never produce).
"""

from __future__ import annotations

import lance
import pyarrow as pa

from prx_data.core.imaging import ImageError, probe
from prx_data.core.keys import sha256_hex
from prx_data.core.schema import TABLE_SCHEMA


def make_table(
    uri: str,
    items: list[tuple[str, bytes, str | None]],
    max_rows_per_file: int = 1024,
    mode: str = "create",
):
    """items: (id, image bytes, caption). Header probing mirrors ingest. ``mode="append"``
    adds the rows to an existing table (new fragments, as an ingest of more images does)."""
    rows = {n: [] for n in TABLE_SCHEMA.names}
    for item_id, data, caption in items:
        try:
            info = probe(data)
            w, h, fmt, err = info.width, info.height, info.format, None
        except ImageError as e:
            w = h = fmt = None
            err = e.reason
        rows["id"].append(item_id)
        rows["image"].append(data)
        rows["width"].append(w)
        rows["height"].append(h)
        rows["format"].append(fmt)
        rows["source"].append("test")
        rows["caption"].append(caption)
        rows["probe_error"].append(err)
        rows["sha256"].append(sha256_hex(data) if data else None)
    table = pa.table(rows, schema=TABLE_SCHEMA)
    return lance.write_dataset(table, uri, mode=mode, max_rows_per_file=max_rows_per_file)


def folder_items(items) -> list[tuple[str, bytes, str | None]]:
    out = []
    for it in items:
        with open(it.path, "rb") as f:
            out.append(
                (f"sample/{it.path.rsplit('/', 1)[-1].rsplit('.', 1)[0]}", f.read(), it.caption)
            )
    return out
