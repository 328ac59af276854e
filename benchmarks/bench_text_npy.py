"""Stored text embeddings at a real encoder's shape: bytes a sample, and the loader, npy against Arrow.

  write    ``run_attach --text-encoder`` with the encoder replaced by synthetic values
           (normal floats, no model download) at T5Gemma 2B's shape (``--length`` 256 x
           ``--hidden`` 2304), through the job's own writer: one ``.npy`` a shard in
           bfloat16 (``--text-dtype``), masks ``uint8``. Wall seconds and bytes a sample.
  loader   one process serving every sample with ``get_item`` (images left encoded) and
           both text columns as ``extra_columns``, from the local export: samples/s in
           shard order, and the time to serve the first sample of a shard not opened yet
           (the per-process caches cleared: what a shuffled epoch pays on most samples).
  arrow    embeddings of the same shape as the previous version stored them (float32
           Arrow fixed-size lists, zstd, one IPC file a shard, read whole, digest-checked
           and decoded once per process per shard), served by the same loader. Its values
           are fresh float32 draws (full mantissas, as an encoder's output: bfloat16
           values widened to float32 would let zstd halve them).

Files are in the page cache in both cases (just written): the figures are CPU and
memory traffic, not disk reads.

    python benchmarks/bench_text_npy.py [--samples 1024] [--shard 256] [--json OUT.json]
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import sys
import tempfile
import time
from pathlib import Path
from unittest import mock

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

BUCKETS = ("512/1.000", "512/0.500")
NAMES = ("latent_caption_synthetic", "attention_mask_caption_synthetic")


def _make_export(root: str, samples: int, shard: int):
    from prx_data.export import sample

    real = sample._jpeg
    one = functools.lru_cache(maxsize=None)(lambda w, h: real(8, 8, (1, 2, 3)))
    with mock.patch.object(sample, "_jpeg", lambda w, h, colour: one(w, h)):
        per = samples // len(BUCKETS)
        return sample.make_sample_export(
            root, dict.fromkeys(BUCKETS, per), samples_per_part=per, samples_per_shard=shard
        )


def _make_table(uri: str, ids: list[str]) -> None:
    import lance
    import pyarrow as pa

    ds = lance.write_dataset(
        pa.table({"id": ids, "caption": [f"a caption for {i}" for i in ids]}), uri
    )
    ds.create_scalar_index("id", "BTREE", replace=True)


def _synthetic_embedder(length: int, hidden: int, dtype: str):
    """A stand-in for :class:`prx_data.pipelines.attach.TextEmbedder`: same outputs (stored
    embeddings, uint8 masks) and record fields, values drawn at random."""
    import numpy as np

    from prx_data.export import attached as A
    from prx_data.export import npyfile
    from prx_data.pipelines import attach as job

    class Synthetic(job.TextEmbedder):
        def __init__(self, cfg) -> None:
            self.batch, self.dtype = cfg.text_batch, dtype
            self.shapes = ((length, hidden), (length,))
            self.stores = (A.npy_body(dtype, self.shapes[0]), A.npy_body("uint8", (length,)))
            self.identity = {
                "name_or_path": "synthetic",
                "weights": "0" * 64,
                "max_length": length,
                "layer": -1,
                "hidden_size": hidden,
            }
            self.rng = np.random.default_rng(0)
            self.empty = self._encode([""])

        def _encode(self, texts):
            n = len(texts)
            feats, feats_file = npyfile.allocate((n, length, hidden), dtype)
            for i in range(0, n, self.batch):
                f = self.rng.standard_normal((min(self.batch, n - i), length, hidden), np.float32)
                feats[i : i + len(f)] = npyfile.to_stored(f, dtype, A.AttachedError)
            masks, masks_file = npyfile.allocate((n, length), "uint8")
            masks[:] = 0
            masks[:, : length // 4] = 1
            return (feats, feats_file), (masks, masks_file)

    return Synthetic


def _to_arrow(root: str) -> int:
    """Rewrite the text columns as the previous version stored them (float32 Arrow
    fixed-size lists, a record without ``kind``); returns the bytes written."""
    import numpy as np
    import pyarrow as pa

    from prx_data.export import attached as A
    from prx_data.export import bound

    rng, total = np.random.default_rng(1), 0
    for name in NAMES:
        rec = A.read_record(root, name)
        dtype, shape = A.npy_spec(rec)
        t = pa.float32() if dtype != "uint8" else pa.uint8()
        for s in reversed(shape):
            t = pa.list_(t, s)
        for key, entry in rec["shards"].items():
            npy = A.file_path(root, name, key, A.NPY)
            arr = np.load(npy, mmap_mode="r")
            if dtype != "uint8":  # the encoder's float32 output: full mantissas, as zstd sees them
                arr = rng.standard_normal(arr.shape, np.float32)
            os.remove(npy)
            flat = pa.array(arr.reshape(-1))
            del arr
            for s in reversed(shape):
                flat = pa.FixedSizeListArray.from_arrays(flat, s)
            data = A.encode(name, flat)
            del flat
            with open(A.file_path(root, name, key), "wb") as f:
                f.write(data)
            entry.update(bytes=len(data), xxh64=bound.xxh64(data))
            total += len(data)
            del data
        body = {k: v for k, v in rec.items() if k not in ("kind", "dtype", "shape", "shards")}
        body["type"] = A.type_text(t)
        A.write_record(root, name, body, rec["shards"])
    return total


def _serve(root: str, shard: int) -> dict:
    from prx_data.stream import attached as served
    from prx_data.stream.spec import DatasetSpec
    from prx_data.train.data import EncodedBucketedDataset
    from tests.exportkit import one_rank

    def clear() -> None:
        served._npy_file.cache_clear()
        served._column_file.cache_clear()

    clear()
    with one_rank():
        ds = EncodedBucketedDataset(
            DatasetSpec(root), tier=512, batch_size=8, shuffle=False, num_workers=1,
            extra_columns=NAMES,
        )  # fmt: skip
        try:
            n = ds.num_samples
            t0 = time.perf_counter()
            for i in range(n):
                item = ds.get_item(i)
            wall = time.perf_counter() - t0
            assert item[NAMES[0]].dtype.name == "float32"
            cold = []
            for i in range(0, n, shard):  # the first sample of each shard, caches cleared
                clear()
                t0 = time.perf_counter()
                ds.get_item(i)
                cold.append(time.perf_counter() - t0)
        finally:
            del ds
    clear()
    return {
        "samples": n,
        "samples_per_s": round(n / wall, 1),
        "first_sample_of_a_shard_ms": round(1000 * sorted(cold)[len(cold) // 2], 2),
    }


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--samples", type=int, default=1024)
    ap.add_argument("--shard", type=int, default=256, help="samples a shard")
    ap.add_argument("--length", type=int, default=256)
    ap.add_argument("--hidden", type=int, default=2304)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    from prx_data.pipelines import attach as job

    out: dict = {k: getattr(args, k) for k in ("samples", "shard", "length", "hidden", "dtype")}
    with tempfile.TemporaryDirectory(prefix="bench-text-npy-", dir=os.environ.get("TMPDIR")) as tmp:
        root = os.path.join(tmp, "ex")
        ex = _make_export(root, args.samples, args.shard)
        table = os.path.join(tmp, "t.lance")
        _make_table(table, sorted(ex.all_ids()))
        fake = _synthetic_embedder(args.length, args.hidden, args.dtype)
        with mock.patch.object(job, "TextEmbedder", fake):
            cfg = job.AttachConfig(
                out=root, table=table, columns=("caption",), text_encoder="synthetic",
                max_length=args.length, text_dtype=args.dtype,
            )  # fmt: skip
            t0 = time.perf_counter()
            r = job.run_attach(cfg)
            out["write_s"] = round(time.perf_counter() - t0, 2)
        out["npy_bytes_per_sample"] = round(r.bytes_written / r.samples)
        print(json.dumps(out, indent=1), flush=True)
        out["loader_npy"] = _serve(root, args.shard)
        print(json.dumps(out["loader_npy"], indent=1), flush=True)
        out["arrow_bytes_per_sample"] = round(_to_arrow(root) / r.samples)
        out["loader_arrow"] = _serve(root, args.shard)
    print(json.dumps(out, indent=1))
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=1) + "\n")


if __name__ == "__main__":
    main()
