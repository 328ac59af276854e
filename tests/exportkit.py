"""Small export trees and simulated ranks for the streaming tests.

The trees come from :func:`prx_data.export.sample.make_sample_export`
(solid-colour JPEGs written with ``streaming.MDSWriter`` in the tree that
:mod:`prx_data.export.layout` defines), so the streaming tests run in
milliseconds; ``make_export`` is its name here. :func:`run_rank` runs one
rank of a multi-rank job in this process; :func:`skip_samples` (a test double) gives a
tree sidecars that no list log knows.
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

from prx_data.export.sample import SampleExport, make_sample_export

#: The fabricated tree is the package's sample export (prx_data.export.sample).
FakeExport = SampleExport
make_export = make_sample_export


def finalize_reference(cfg, results: dict):
    """Pack and merge units run in this process, as ``run_export`` does (an undisturbed run)."""
    from prx_data.pipelines.write_mds import run_packs

    from prx_data.export.merge import finalize
    from prx_data.export.pack import plan_packs

    ordered = {p: results[p] for p in sorted(results)}
    packs = run_packs(cfg, plan_packs(cfg.out, ordered, cfg.shard_size)) if cfg.shard_size else None
    return finalize(cfg, ordered, 0.0, packs=packs)


def upload_tree(local_root: str, remote_root: str) -> None:
    """Copy a local export tree to an ``s3://`` URI (for the remote tests)."""
    from prx_data.core import storage

    for rel in storage.list_files(local_root):
        with open(os.path.join(local_root, rel), "rb") as f:
            storage.write_bytes_atomic(
                storage.join(remote_root, rel.replace(os.sep, "/")), f.read()
            )


# --- sidecars without a log (a test double) ---------------------------------------------------


@dataclass
class Skipped:
    """What :func:`skip_samples` wrote (or removed)."""

    shards_written: int = 0
    samples_listed: int = 0
    #: Requested row ids in no manifest of the export (``ids=``).
    missing_ids: list[str] = field(default_factory=list)
    #: Sidecars deleted (``remove=True``).
    removed: int = 0

    @property
    def ids_not_found(self) -> int:
        return len(self.missing_ids)


def skip_samples(
    root: str,
    name: str,
    skips: Mapping[tuple[str, str], Iterable[int]] | None = None,
    *,
    ids: Iterable[str] | None = None,
    replace: bool = False,
    remove: bool = False,
) -> Skipped:
    """TEST DOUBLE: write list ``name``'s ``.skip`` sidecars directly, with no log entry.

    The library writes sidecars only by materialising the log
    (:mod:`prx_data.skips.materialise`); exports with a table get their lists through
    :func:`prx_data.skips.ops.update_list`. This stands in for a tree whose sidecars no log
    knows (written before lists had one, or fabricated with no table) and for the loader's
    tests, which need skipped samples and nothing else. It calls the private writer the
    materialisation uses, so the sidecars are byte for byte what the library writes.

    ``skips``: ``{(bucket, shard basename): sample indices}`` (merged with the list's
    sidecars unless ``replace``); ``ids``: row ids, found through the export's id index or
    its manifests; ``remove``: delete every sidecar of the list.
    """
    import pyarrow as pa

    from prx_data.export import layout
    from prx_data.export.idindex import lookup_or_manifests
    from prx_data.skips import sidecar
    from prx_data.skips.materialise import _write_positions

    out = Skipped()
    if remove:
        skips, replace = {}, True
        for bucket in layout.list_buckets(root):
            shards = layout.read_index(root, bucket)
            for shard in sidecar.list_sidecars(root, bucket, shards).get(name, []):
                skips[(bucket, shard)] = []
        out.removed = len(skips)
    elif ids is not None:
        wanted = pa.array(sorted(set(ids)), pa.string())
        skips, found = {}, set()
        for hit in lookup_or_manifests(root, wanted):
            for b, s, i in zip(
                hit["bucket"].to_pylist(),
                hit["shard"].to_pylist(),
                hit["index"].to_pylist(),
                strict=True,
            ):
                skips.setdefault((b, s), []).append(i)
            found.update(hit["id"].to_pylist())
        out.missing_ids = sorted(set(wanted.to_pylist()) - found)
    w = _write_positions(root, name, skips or {}, replace=replace)
    out.shards_written, out.samples_listed = w.shards_written, w.samples_listed
    return out


# --- rank simulation ---------------------------------------------------------------------------


@dataclass
class RankRun:
    """What one simulated rank saw: per batch its ids and the one image shape."""

    batches: list[list[str]]
    shapes: list[tuple[int, ...]]
    state: dict | None = None


def _collate(samples: list[dict]) -> dict:
    shapes = {tuple(s["image"].shape) for s in samples}
    return {"id": [s["id"] for s in samples], "shapes": shapes}


@contextlib.contextmanager
def one_rank():
    """This process as the only rank of a one-node world, torch.distributed not started
    (streaming reads the world from the environment)."""
    from unittest import mock

    import streaming.base.dataset as sd
    from streaming.base.util import clean_stale_shared_memory

    from prx_data.stream import dataset as ps

    env = {"RANK": "0", "WORLD_SIZE": "1", "LOCAL_WORLD_SIZE": "1", "LOCAL_RANK": "0"}
    clean_stale_shared_memory()
    try:
        with (
            mock.patch.dict(os.environ, env),
            mock.patch.object(sd, "maybe_init_dist", lambda: False),
            mock.patch.object(ps, "maybe_init_dist", lambda: False),
        ):
            yield
    finally:
        import gc

        gc.collect()
        clean_stale_shared_memory()


def rank_items(spec, **kwargs) -> list[dict]:
    """Every item of ``spec`` at tier 512, unshuffled, as one single-process rank sees them
    (a remote root's shards fetched on demand)."""
    from prx_data.stream import dataset as ps

    with one_rank():
        ds = ps.BucketedDataset(
            spec, tier=512, batch_size=1, shuffle=False, num_workers=1, **kwargs
        )
        try:
            return [ds.get_item(i) for i in range(ds.num_samples)]
        finally:
            del ds


def run_rank(
    datasets,
    *,
    rank: int,
    world_size: int,
    batch_size: int,
    num_workers: int = 0,
    stop_after: int | None = None,
    state: dict | None = None,
    **kwargs,
) -> RankRun:
    """Run one rank of a ``world_size``-rank job in this process, one rank per node.

    Streaming reads the world from ``RANK``/``WORLD_SIZE``/``LOCAL_WORLD_SIZE``;
    torch.distributed is not started (streaming only needs it for barriers,
    and every simulated rank is its own node's leader). ``stop_after`` stops
    after that many batches and returns the loader's resumption state.
    """
    import gc
    from unittest import mock

    import streaming.base.dataset as sd
    from streaming import StreamingDataLoader
    from streaming.base.util import clean_stale_shared_memory

    from prx_data.stream import dataset as ps

    env = {
        "RANK": str(rank),
        "WORLD_SIZE": str(world_size),
        "LOCAL_WORLD_SIZE": "1",
        "LOCAL_RANK": "0",
    }
    clean_stale_shared_memory()
    with (
        mock.patch.dict(os.environ, env),
        mock.patch.object(sd, "maybe_init_dist", lambda: False),
        mock.patch.object(ps, "maybe_init_dist", lambda: False),
    ):
        ds = loader = None
        try:
            ds = ps.BucketedDataset(
                datasets, batch_size=batch_size, num_workers=num_workers, **kwargs
            )
            if state is not None:
                ds.load_state_dict(state)
            loader = StreamingDataLoader(
                ds, batch_size=batch_size, num_workers=num_workers, collate_fn=_collate
            )
            run = RankRun([], [])
            for b in loader:
                run.batches.append(b["id"])
                run.shapes.append(tuple(sorted(b["shapes"])))
                if stop_after is not None and len(run.batches) == stop_after:
                    break
            if stop_after is not None:
                run.state = loader.state_dict()
        finally:
            del loader, ds
            gc.collect()
    clean_stale_shared_memory()
    return run


def pinned_cli_args(table: str, out: str) -> list[str]:
    """``write_mds`` flags for a one-CPU run that cuts the same units as
    ``ExportConfig(rows_per_task=2, min_units=1)`` on any cluster, so its bytes can be
    compared with a reference exported in-process on another number of CPUs."""
    return [
        *("--table", table, "--out", out),
        *("--rows-per-task", "2", "--min-units", "1", "--num-cpus", "1", "--no-progress"),
    ]


def spawn_cli(argv: list[str], env: dict) -> subprocess.Popen:
    """Start a job in its own process group (so a test can SIGKILL all of it), output discarded."""
    return subprocess.Popen(
        [sys.executable, "-m", *argv],
        env=env,
        start_new_session=True,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
