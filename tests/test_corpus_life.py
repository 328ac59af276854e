"""Months of one corpus, scripted the way a user lives them, on the S3 test server and local disk.

One table is exported twice (to ``s3://`` and to a local folder), then: three rounds of
opt-outs (one with concurrent adds from several processes), an id opted out before it was
ingested, a re-caption, re-exports with ``--overwrite`` (the local one killed and resumed),
dedup of a planted copy, a rewrite once more than 10% is skipped, and training-style
streaming with a cache limit over the remote export and a local one, stopped mid-epoch
and resumed. After every step: every export tree passes ``verify --deep``, every tree
streams exactly its live samples and never an opted-out id, and streaming deleted no
file outside its cache directory.
"""

from __future__ import annotations

import io
import logging
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import uuid

import pytest

from prx_data.cli import dedup as dedup_cli
from prx_data.cli import optout as optout_cli
from prx_data.cli import skips as skips_cli
from prx_data.cli import verify as verify_cli
from prx_data.export import layout
from prx_data.skips.export_state import read_store_list
from prx_data.stream.dataset import DatasetSpec
from tests import exportkit
from tests.exportkit import run_rank
from tests.tablekit import make_table

pytestmark = [pytest.mark.remote, pytest.mark.slow]
logging.getLogger("streaming").setLevel(logging.ERROR)
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
N_ROWS = 20
#: About two 512-tier samples per shard, so a cache limit has shards to evict.
SHARD_BYTES = 60_000


def _jpeg(i: int) -> bytes:
    """A 600x600 photo-like image (smooth random structure): its own pHash, 512-tier."""
    import numpy as np
    from PIL import Image

    rng = np.random.default_rng(1000 + i)
    small = Image.fromarray(rng.integers(0, 256, (8, 8, 3), dtype=np.uint8))
    buf = io.BytesIO()
    small.resize((600, 600), Image.Resampling.BICUBIC).save(buf, "JPEG", quality=90)
    return buf.getvalue()


@pytest.fixture()
def ray_tmp():
    """A private TMPDIR for the CLI runs' own Ray runtimes (short: Ray puts sockets there)."""
    d = tempfile.mkdtemp(prefix="life")
    yield d
    shutil.rmtree(d, ignore_errors=True)


def _cli_env(ray_tmp: str) -> dict:
    """Subprocess env: this checkout first, the moto endpoint inherited, a private Ray TMPDIR."""
    path = REPO + os.pathsep + os.environ.get("PYTHONPATH", "")
    return {**os.environ, "PYTHONPATH": path, "TMPDIR": ray_tmp}


def _export_args(table: str, out: str, *extra: str) -> list[str]:
    return [
        *(sys.executable, "-m", "prx_data.write_mds", "--table", table, "--out", out),
        *("--tiers", "512", "--size-limit", str(SHARD_BYTES), "--rows-per-task", "2"),
        *("--min-units", "1", "--num-cpus", "1", "--no-progress", *extra),
    ]


def _write_mds(env: dict, table: str, out: str, *extra: str) -> None:
    r = subprocess.run(_export_args(table, out, *extra), env=env, capture_output=True)
    assert r.returncode == 0, r.stderr.decode()[-3000:]


def _ids_file(tmp_path, ids) -> str:
    p = tmp_path / f"ids-{uuid.uuid4().hex[:8]}.txt"
    p.write_text("".join(f"{i}\n" for i in sorted(ids)))
    return str(p)


def _files(root: str) -> set[str]:
    return {os.path.relpath(os.path.join(d, f), root) for d, _, fs in os.walk(root) for f in fs}


def _with_captions(samples: list[dict]) -> dict:
    """run_rank's collate, keeping each sample's caption next to its id."""
    return {
        "id": [(s["id"], s["caption"]) for s in samples],
        "shapes": {tuple(s["image"].shape) for s in samples},
    }


class Life:
    """The corpus, its exports, and what must hold after every step."""

    def __init__(self, tmp_path, monkeypatch, capsys, table: str):
        self.tmp, self.capsys, self.table = tmp_path, capsys, table
        monkeypatch.setattr(exportkit, "_collate", _with_captions)
        self.opted: set[str] = set()  # every id ever opted out (none removed in this life)
        #: Those opted out through `optout` (consent): no later export writes them. A list
        #: added with `skips add` only hides its samples.
        self.consented: set[str] = set()
        self.dups: dict[str, set[str]] = {}  # per export root: its dedup list
        self.roots: dict[str, str | None] = {}  # export root -> its cache dir (remote) or None
        self.captions = "cap"

    def verify(self, root: str) -> int:
        rc = verify_cli.main([root, "--deep", "--no-progress"])
        self.last_verify = self.capsys.readouterr().out
        return rc

    def live(self, root: str) -> set[str]:
        ids = set(layout.read_manifests(root)["id"].to_pylist())
        return ids - self.opted - self.dups.get(root, set())

    def stream(self, specs, **kw) -> list[tuple[str, str]]:
        """Stream like a rank does; no file outside a cache directory may disappear."""
        local = [r for r, c in self.roots.items() if c is None]
        before = {r: _files(r) for r in local}
        run = run_rank(specs, rank=0, world_size=1, batch_size=1, tier=512, **kw)
        self.last_state = run.state
        for r in local:
            assert _files(r) >= before[r], f"streaming deleted files of {r}"
        seen = [s for b in run.batches for s in b]
        assert not {i for i, _ in seen} & self.opted, "an opted-out id was streamed"
        return seen

    def check(self, step: str) -> None:
        """After every step: deep-verify and stream each export tree, exactly its live ids."""
        for root, cache in self.roots.items():
            assert self.verify(root) == 0, f"{step}: verify --deep {root}\n{self.last_verify}"
            seen = self.stream(DatasetSpec(root, local=cache), shuffle=False)
            ids = [i for i, _ in seen]
            assert len(ids) == len(set(ids)) and set(ids) == self.live(root), step
            assert {c.split(" ")[0] for _, c in seen} == {self.captions}, step

    def optout(self, export: str, ids: set[str], tool: str = "optout", **kw) -> None:
        f = _ids_file(self.tmp, ids)
        if tool == "optout":
            args = ["--export", export, "--name", "optout", "--ids", f]
            assert optout_cli.main([*args, "--unmatched", f + ".unmatched", *kw.get("x", [])]) == 0
            self.consented |= ids
        else:
            assert skips_cli.main(["add", export, "optout", "--ids", f, *kw.get("x", [])]) == 0
        self.capsys.readouterr()
        self.opted |= ids

    def sync(self, export: str) -> None:
        assert skips_cli.main(["sync", export]) == 0
        self.capsys.readouterr()


def test_a_corpus_life_never_streams_an_opt_out_nor_deletes_data(
    moto_server, s3_bucket, tmp_path, monkeypatch, capsys, ray_tmp
):
    import lance

    from prx_data.table.lance_ops import update_column

    env = _cli_env(ray_tmp)
    table = str(tmp_path / "photos.lance")
    items = [(f"c/{i:02d}", _jpeg(i), f"cap {i}") for i in range(N_ROWS)]
    items.append(("c/dup", items[3][1], "cap copy"))  # a planted copy: c/03's exact bytes
    make_table(table, items, max_rows_per_file=8)
    life = Life(tmp_path, monkeypatch, capsys, table)
    remote = f"s3://{s3_bucket}/exports/photos"
    local = str(tmp_path / "exports" / "photos")

    # Month 0: export to object storage and to local disk.
    _write_mds(env, table, remote)
    _write_mds(env, table, local)
    life.roots = {remote: str(tmp_path / "node-cache" / "photos"), local: None}
    life.check("export")

    # Opt-out round 1 on the local export; the remote one gets it from the registry.
    life.optout(local, {"c/01", "c/02"}, tool="skips", x=["--reason", "ticket 1"])
    life.sync(remote)
    life.check("opt-out round 1")

    # Round 2: several processes opt out at once on the remote export (skips add and optout).
    procs = []
    for k, sid in enumerate(["c/05", "c/07", "c/09", "c/11"]):
        f = _ids_file(tmp_path, [sid])
        if k % 2:
            cmd = ["-m", "prx_data.skips", "add", remote, "optout", "--ids", f]
        else:
            cmd = ["-m", "prx_data.optout", "--export", remote, "--name", "optout", "--ids", f]
            life.consented.add(sid)
        procs.append(subprocess.Popen([sys.executable, *cmd], cwd=str(tmp_path), env=env))
        life.opted.add(sid)
    assert [p.wait(timeout=300) for p in procs] == [0] * 4
    assert set(read_store_list(remote, "optout")["id"].to_pylist()) == life.opted
    life.sync(local)
    life.check("opt-out round 2 (concurrent)")

    # Round 3 includes an id that is not ingested yet.
    life.optout(remote, {"c/13", "c/new"})
    life.sync(local)
    life.check("opt-out round 3")

    # Re-caption, and the new row arrives.
    staged = str(tmp_path / "new.lance")
    make_table(staged, [("c/new", _jpeg(99), "cap new")])
    lance.write_dataset(lance.dataset(staged).to_table(), table, mode="append")
    import pyarrow as pa

    ids = lance.dataset(table).to_table(columns=["id"])["id"].to_pylist()
    update_column(table, "caption", pa.table({"id": ids, "caption": [f"recap {i}" for i in ids]}))
    life.captions = "recap"

    # Re-export both with --overwrite; the local one is killed part way and resumed.
    _write_mds(env, table, remote, "--overwrite")
    args = _export_args(table, local, "--overwrite")
    started = time.time() - 1
    proc = subprocess.Popen(args, env=env, start_new_session=True)

    def new_units() -> list[str]:  # markers of the re-export's own finished units
        return [m for m in layout.list_markers(local) if os.path.getmtime(m) >= started]

    try:
        deadline = time.time() + 240
        # The overwrite removes the old report first, then writes the new units' markers.
        while layout.is_complete(local) or not new_units():
            assert proc.poll() is None and time.time() < deadline, "the re-export did not start"
            time.sleep(0.02)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    # An interrupted overwrite never looks complete.
    assert not layout.is_complete(local)
    assert life.verify(local) != 0
    r = subprocess.run(_export_args(table, local, "--resume"), env=env, capture_output=True)
    assert r.returncode == 0, r.stderr.decode()[-3000:]
    # c/new was opted out (round 3) before it was ingested: the ledger keeps it, and every
    # id opted out through `optout`, out of every later export (never written), while the
    # samples of lists added with `skips add` are written and hidden by their sidecars.
    written = set(layout.read_manifests(local)["id"].to_pylist())
    assert "c/new" in life.consented and not written & life.consented
    assert written == set(lance.dataset(table).to_table(columns=["id"])["id"].to_pylist()) - (
        life.consented
    )
    life.check("re-caption, re-export --overwrite, kill and --resume")

    # Dedup: the planted copy is listed on both exports.
    for root in (local, remote):
        args = ["--table", table, "--export", root, "--engine", "local", "--report", ""]
        assert dedup_cli.main([*args, "--no-progress"]) == 0
        capsys.readouterr()
        life.dups[root] = {"c/dup"}
        assert set(read_store_list(root, "dedup")["id"].to_pylist()) == {"c/dup"}
    life.check("dedup")

    # More than 10% is skipped now: rewrite without every skipped sample.
    exported = layout.read_manifests(local).num_rows
    assert len(life.opted | {"c/dup"}) > 0.10 * exported
    rewritten = str(tmp_path / "exports" / "photos-clean")
    assert skips_cli.main(["rewrite", local, rewritten]) == 0
    capsys.readouterr()
    assert not set(layout.read_manifests(rewritten)["id"].to_pylist()) & (life.opted | {"c/dup"})
    life.roots[rewritten] = None
    life.check("rewrite")

    # Training: the remote export and the rewritten local one, with a cache limit, stopped
    # mid-epoch and resumed from the loader's state.
    shard = max(s.bytes for b in layout.list_buckets(remote) for s in layout.read_index(remote, b))
    cache = str(tmp_path / "train-cache")
    specs = [DatasetSpec(remote, local=cache), DatasetSpec(rewritten)]
    # predownload: streaming's ready thread waits for its shard without fetching it again, so
    # a look-ahead over more shards than the cache holds can evict that shard under it and
    # hang the epoch (upstream streaming; seen here with the default 8 samples ahead).
    kw = {"cache_limit": 5 * shard + 4096, "shuffle": True, "predownload": 2}
    want = sorted([*life.live(remote), *life.live(rewritten)])  # one table, two exports
    first = life.stream(specs, stop_after=6, **kw)
    rest = life.stream(specs, state=life.last_state, **kw)
    got = sorted(i for i, _ in first + rest)
    assert got == want  # exactly once across the stop and the resume
    cached = [f for f in _files(cache) if f.endswith(".mds")]
    assert len(cached) < len(layout.read_index(remote, layout.list_buckets(remote)[0]))
    life.check("training with a cache limit, stop and resume")
