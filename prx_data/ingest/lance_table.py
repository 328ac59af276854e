"""Another Lance table as a source (e.g. a table made elsewhere, or a subset to merge).

Column roles are detected as for parquet (:mod:`prx_data.ingest.parquet`):
image bytes, caption, key (default: the ``id`` column, else
``<fragment>/<row>``) and embedding. Width, height, format and probe errors
are read again from the image headers; every other column is kept. Work
units are row ranges of the source's fragments.
"""

from __future__ import annotations

import os
import posixpath
from dataclasses import asdict

import pyarrow as pa

from prx_data.core import schema as S
from prx_data.ingest.common import Counts, Plan, RowBuilder, WorkUnit, strip_ext
from prx_data.ingest.parquet import (
    Roles,
    detect_roles,
    embedding_dim,
    extra_fields,
    rows_from_batch,
)
from prx_data.table.lance_ops import open_table

KIND = "lance"
DEFAULT_ITEMS_PER_UNIT = 4096
#: Columns recomputed from the image rather than copied.
RECOMPUTED = {S.WIDTH, S.HEIGHT, S.FORMAT, S.SOURCE, S.PROBE_ERROR}


def detect(path: str) -> bool:
    p = path.rstrip("/")
    return p.endswith(".lance") or (os.path.isdir(os.path.join(p, "_versions")))


def plan(
    path: str,
    source: str | None = None,
    *,
    image_column: str | None = None,
    caption_column: str | None = None,
    key_column: str | None = None,
    embedding_column: str | None = None,
    items_per_unit: int = DEFAULT_ITEMS_PER_UNIT,
    storage_options: dict | None = None,
) -> Plan:
    ds = open_table(path, storage_options)
    roles = detect_roles(
        ds.schema,
        image_column=image_column,
        caption_column=caption_column,
        key_column=key_column,
        embedding_column=embedding_column,
    )
    roles.keep = tuple(c for c in roles.keep if c not in RECOMPUTED)
    if roles.embedding is not None and roles.embedding_dim is None:
        roles.embedding_dim = embedding_dim(
            ds.to_table(
                columns=[roles.embedding], filter=f"`{roles.embedding}` IS NOT NULL", limit=1
            )[roles.embedding]
        )
    source = source or posixpath.basename(strip_ext(path.rstrip("/"))) or "lance"
    units = []
    total_rows = total_bytes = 0
    for frag in ds.get_fragments():
        n = frag.count_rows()
        total_rows += n
        total_bytes += sum((f.file_size_bytes or 0) for f in frag.metadata.files)
        for off in range(0, n, items_per_unit):
            units.append(
                WorkUnit(
                    KIND,
                    source,
                    {
                        "uri": path,
                        "fragment": frag.fragment_id,
                        "offset": off,
                        "limit": min(items_per_unit, n - off),
                        "version": ds.version,
                        "roles": asdict(roles),
                        "storage_options": storage_options,
                    },
                )
            )
    approx = total_bytes / total_rows if total_rows else None
    fields = [f for f in extra_fields(ds.schema, roles)]
    return Plan(units, fields, Counts(), approx)


def load(unit: WorkUnit, counts: Counts) -> pa.Table:
    a = unit.args
    roles = Roles(**{**a["roles"], "keep": tuple(a["roles"]["keep"])})
    ds = open_table(a["uri"], a.get("storage_options"), a["version"])
    columns = [c for c in (roles.image, roles.caption, roles.key, roles.embedding) if c] + list(
        roles.keep
    )
    frag = ds.get_fragment(a["fragment"])
    table = frag.to_table(columns=columns, offset=a["offset"], limit=a["limit"])
    rows = RowBuilder(unit.source, counts)
    rows_from_batch(
        table,
        roles,
        rows,
        counts,
        key_prefix=str(a["fragment"]),
        start=a["offset"],
        base_dir=None,
    )
    return rows.table(extra_fields(ds.schema, roles))
