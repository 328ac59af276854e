"""End to end: caption labels -> ``skips add --table --where`` -> skip lists on an export.

The export is fabricated with tests/exportkit.py (real MDS shards, manifests
and merged indexes); the labels come from the real classify pipeline
(rules only, so no model is needed).
"""

from __future__ import annotations

import lance
import pyarrow as pa
import pytest

from prx_data.export.layout import read_index
from prx_data.skips.sidecar import list_sidecars, load_skips
from tests.exportkit import make_export

CAPTIONS = {
    0: "A screenshot of a spreadsheet with quarterly totals.",
    3: "A nude figure study drawn in charcoal.",
    5: "A scanned page of a handwritten letter.",
}


@pytest.mark.ray
def test_labels_become_named_skip_lists(tmp_path, ray_local):
    from prx_data.cli.classify import main as classify_main
    from prx_data.cli.skips import main as skips_main

    bucket = "512/1.000"
    export = make_export(str(tmp_path / "export"), {bucket: 10}, samples_per_part=4)
    ids = export.ids[bucket]
    uri = str(tmp_path / "t.lance")
    captions = [
        CAPTIONS.get(i, f"A photograph of a quiet lake number {i} at dawn.")
        for i in range(len(ids))
    ]
    lance.write_dataset(
        pa.table(
            {
                "id": ids,
                "image": pa.array([b""] * len(ids), pa.large_binary()),
                "caption_vlm": captions,
            }
        ),
        uri,
    )
    assert classify_main(["--table", uri, "--rules-only", "--no-progress"]) == 0
    where = "label IN ('text','nsfw')"
    assert (
        skips_main(["add", str(tmp_path / "export"), "captions", "--table", uri, "--where", where])
        == 0
    )

    root = str(tmp_path / "export")
    shards = read_index(root, bucket)
    skipped = load_skips(root, bucket, shards, ["captions"], list_sidecars(root, bucket, shards))
    got = {(base, int(i)) for base, idx in skipped.items() for i in idx}
    want = {export.where[ids[i]][1:] for i in CAPTIONS}
    assert got == want
