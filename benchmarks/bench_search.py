"""Exploration latency on a large synthetic table: full-text p50, ANN p50, fragment count.

Builds (once per run, in a temp folder unless --dir is given) a Lance table
with N synthetic captions and N random 128-d unit vectors, indexes it with
:func:`prx_data.table.search.build_indexes` (INVERTED + IVF_PQ), and times:

- ``fts``: :func:`prx_data.table.search.text_search` for 2-word queries, k=50
  (target p50 <= 50 ms at 1M rows);
- ``ann``: :func:`prx_data.table.search.vector_search`, k=50, nprobes=20,
  refine_factor=5 (target p50 <= 20 ms at 1M), plus recall@10 against an
  exact scan of a few queries;
- ``anchor``: a plain full scan of the ``id`` column with a filter, in the
  same run, so latencies can be read relative to this machine's speed.

Usage::

    python benchmarks/bench_search.py --rows 1000000 --queries 200
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import lance
import numpy as np
import pyarrow as pa

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from prx_data.table import lance_ops as T  # noqa: E402
from prx_data.table import search  # noqa: E402

WORDS = [
    "red",
    "green",
    "blue",
    "yellow",
    "black",
    "white",
    "dog",
    "cat",
    "horse",
    "bird",
    "tree",
    "house",
    "car",
    "boat",
    "street",
    "beach",
    "mountain",
    "river",
    "city",
    "night",
    "sunset",
    "portrait",
    "woman",
    "man",
    "child",
    "old",
    "young",
    "small",
    "large",
    "wooden",
    "glass",
    "stone",
    "painting",
    "photo",
    "drawing",
    "sketch",
    "close",
    "view",
    "aerial",
    "snow",
    "rain",
    "forest",
    "field",
    "flower",
    "garden",
    "kitchen",
    "table",
    "chair",
    "window",
    "door",
    "bridge",
    "road",
    "train",
    "plane",
    "sky",
    "cloud",
    "sea",
    "lake",
    "island",
]


def build(uri: str, rows: int, dim: int, seed: int = 0, chunk: int = 200_000) -> None:
    rng = np.random.default_rng(seed)
    vocab = np.array(WORDS)

    def batches():
        for start in range(0, rows, chunk):
            n = min(chunk, rows - start)
            lens = rng.integers(6, 16, n)
            words = vocab[rng.zipf(1.3, lens.sum()) % len(vocab)]
            caps, o = [], 0
            for L in lens:
                caps.append(" ".join(words[o : o + L]))
                o += L
            v = rng.standard_normal((n, dim)).astype(np.float32)
            v /= np.linalg.norm(v, axis=1, keepdims=True)
            yield pa.record_batch(
                {
                    "id": pa.array([f"b/{i}" for i in range(start, start + n)]),
                    "caption": pa.array(caps),
                    "width": pa.array(rng.integers(256, 4096, n).astype(np.int32)),
                    "height": pa.array(rng.integers(256, 4096, n).astype(np.int32)),
                    "embedding": pa.FixedSizeListArray.from_arrays(pa.array(v.ravel()), dim),
                }
            )

    schema = next(iter(batches())).schema
    lance.write_dataset(pa.RecordBatchReader.from_batches(schema, batches()), uri, mode="overwrite")


def p50_ms(fn, queries) -> tuple[float, float]:
    fn(queries[0])  # warm caches
    times = []
    for q in queries:
        t0 = time.perf_counter()
        fn(q)
        times.append((time.perf_counter() - t0) * 1000)
    times.sort()
    return statistics.median(times), times[int(0.95 * (len(times) - 1))]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument(
        "--rows", type=int, default=1_000_000, help="rows in the table (default: %(default)s)"
    )
    p.add_argument("--dim", type=int, default=128, help="vector size (default: %(default)s)")
    p.add_argument(
        "--queries", type=int, default=200, help="queries per kind (default: %(default)s)"
    )
    p.add_argument(
        "--index",
        default=search.DEFAULT_VECTOR_INDEX,
        help="vector index type (default: %(default)s)",
    )
    p.add_argument(
        "--nprobes", type=int, default=20, help="IVF partitions probed (default: %(default)s)"
    )
    p.add_argument(
        "--reuse-index", action="store_true", help="keep the indexes already on the table (--dir)"
    )
    p.add_argument("--dir", default=None, help="keep the table here (reused if it exists)")
    args = p.parse_args(argv)

    work = args.dir or tempfile.mkdtemp(prefix="bench_search_")
    uri = str(Path(work) / f"search_{args.rows}.lance")
    t0 = time.perf_counter()
    if not T.table_exists(uri) or T.open_table(uri).count_rows() != args.rows:
        build(uri, args.rows, args.dim)
    t_build = time.perf_counter() - t0
    t0 = time.perf_counter()
    made = (
        {i["fields"][0]: i["type"] for i in T.open_table(uri).list_indices()}
        if args.reuse_index
        else None
    ) or search.build_indexes(
        uri, min_rows_for_ann=min(search.MIN_ROWS_FOR_ANN, args.rows), vector_index=args.index
    )
    t_index = time.perf_counter() - t0
    ds = T.open_table(uri)
    stats = T.table_stats(uri)

    rng = np.random.default_rng(1)
    text_q = [" ".join(rng.choice(WORDS[:40], 2, replace=False)) for _ in range(args.queries)]
    vec_q = rng.standard_normal((args.queries, args.dim)).astype(np.float32)
    vec_q /= np.linalg.norm(vec_q, axis=1, keepdims=True)

    fts50, fts95 = p50_ms(lambda q: search.text_search(ds, q, k=50, columns=["id"]), text_q)
    ann50, ann95 = p50_ms(
        lambda q: search.vector_search(
            ds, q, k=50, column="embedding", columns=["id"], nprobes=args.nprobes
        ),
        list(vec_q),
    )
    anchor50, _ = p50_ms(
        lambda i: ds.to_table(columns=["id"], filter=f"width = {int(i)}"),
        list(range(300, 300 + 20)),
    )
    # Recall@10 (top 10 of the same k=50 query) against an exact scan, on a few queries.
    recalls = []
    for q in vec_q[:10]:
        approx = set(
            search.vector_search(
                ds, q, k=50, column="embedding", columns=["id"], nprobes=args.nprobes
            )["id"].to_pylist()[:10]
        )
        exact = ds.to_table(
            columns=["id"],
            nearest={
                "column": "embedding",
                "q": q,
                "k": 10,
                "metric": "cosine",
                "use_index": False,
            },
        )["id"].to_pylist()
        recalls.append(len(approx & set(exact)) / 10)

    result = {
        "rows": args.rows,
        "nprobes": args.nprobes,
        "build_s": round(t_build, 1),
        "index_s": round(t_index, 1),
        "indexes": made,
        "fragments": stats["fragments"],
        "fts_p50_ms": round(fts50, 2),
        "fts_p95_ms": round(fts95, 2),
        "ann_p50_ms": round(ann50, 2),
        "ann_p95_ms": round(ann95, 2),
        "ann_recall_at_10": round(float(np.mean(recalls)), 3),
        "anchor_full_scan_filter_p50_ms": round(anchor50, 2),
        "fts_vs_scan": round(fts50 / anchor50, 3),
        "ann_vs_scan": round(ann50 / anchor50, 3),
    }
    print(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
