"""``prx-data JOB [args]``: the same jobs as ``python -m prx_data.JOB``."""

from __future__ import annotations

import importlib
import sys

JOBS = {
    "ingest": "load sources (folders, parquet, WebDataset, twin tars, Lance) into a Lance table",
    "download": "fetch the images of URL-only rows (LAION-style parquet) into the table",
    "table": "table maintenance: stats (rows, fragments), compact, the tags that pin versions in use",
    "search": "full-text, vector and hybrid search over a table; builds the indexes",
    "stats": "resolution / aspect-ratio / tier distribution of a table, with plots",
    "explore": "small web explorer over a table (loopback by default)",
    "quality": "measure blank / near-blank images into an image_quality column",
    "caption": "re-caption images with a VLM and write the column back",
    "classify": "label captions visual / text / nsfw and write the column back",
    "score": "CLIP embeddings and score, aesthetic, watermark, NSFW scores into columns",
    "dedup": "perceptual-hash dedup: dup_of column and a 'dedup' skip list",
    "semdedup": "embedding-cluster dedup: a 'semdedup' skip list, share removed per threshold",
    "optout": "add an opt-out skip list to an export",
    "write_mds": "export a table to resolution/aspect-ratio bucketed MDS",
    "adopt": "id manifests and shard hashes for an MDS tree another writer made (skip lists)",
    "verify": "check an export: report, indexes, shards (--deep: hashes), manifests, sidecars",
    "skips": "manage sidecar skip lists of an export (add, list, stats, remove, rewrite)",
    "planner": "preflight: batches per bucket, tail drops, fatal configurations",
    "jpeg_fidelity": "measure JPEG re-encode fidelity; estimate JPEG quality",
    "train": "Composer training run from a YAML config",
    "demo": "the export path end to end on an embedded sample",
}


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help") or argv[0] not in JOBS:
        print("usage: prx-data JOB [options]   (same as: python -m prx_data.JOB)\n\njobs:")
        for name, what in JOBS.items():
            print(f"  {name:<14} {what}")
        return 0 if argv[:1] in ([], ["-h"], ["--help"]) else 2
    module = importlib.import_module(f"prx_data.cli.{argv[0]}")
    return int(module.main(argv[1:]) or 0)


if __name__ == "__main__":
    sys.exit(main())
