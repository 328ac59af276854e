"""Multi-process exactly-once: 2 ranks (gloo) killed mid-epoch, autoresumed on 1 and on 2 ranks.

Runs the real entry point (``composer -n N -m prx_data.train CONFIG.yaml k=v``)
on a small bucketed export. ``SampleIdLogger`` records the ids each rank
trained on; :func:`consumed_ids` drops batches replayed after a resume. The
union over the killed run and its resumption must be every sample once.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

import pytest

from tests.trainkit import save_tiny_t5, tiny_overrides

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[1]
CONFIG = REPO / "configs" / "train" / "smoke_cpu.yaml"
GLOBAL_BATCH = 8
#: Two buckets, each a multiple of the planner's unit (global batch x 1 worker) for both
#: world sizes, so the epoch is the whole export and no bucket tail is trimmed.
BUCKETS = {"512/1.000": 56, "512/0.778": 40}
BATCHES_PER_EPOCH = sum(BUCKETS.values()) // GLOBAL_BATCH  # 12
KILL_AFTER_BATCH = 5  # kill once batch index 5 is logged: checkpoint at 4 exists, epoch not done


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _command(
    nproc: int, run: Path, encoder: str, export: str, extra: tuple[str, ...] = ()
) -> list[str]:
    overrides = [
        *tiny_overrides(encoder),
        f"variables.data_root={export}",
        "data.plan.include_higher_tiers=false",
        "data.plan.small_buckets=error",
        f"data.global_batch_size={GLOBAL_BATCH}",
        "data.num_workers=1",
        "data.persistent_workers=false",
        "data.caption_dropout=0.2",
        "trainer.max_duration=1ep",
        "trainer.run_name=resume-test",
        f"trainer.save_folder={run / 'ckpt'}",
        "trainer.save_interval=2ba",
        "trainer.autoresume=true",
        f"logging.sample_ids_dir={run / 'ids'}",
        "logging.console_log_interval=1ba",
        # Exactly-once over the whole export: no eval hold-out, no sample grids.
        "eval.enabled=false",
        "sampling.enabled=false",
        *extra,
    ]
    launcher = [
        sys.executable,
        "-m",
        "composer.cli.launcher",
        "-n",
        str(nproc),
        "--master_port",
        str(_free_port()),
        "--stdout",
        str(run / "logs" / "rank{rank}.stdout"),
        "--stderr",
        str(run / "logs" / "rank{rank}.stderr"),
        "-m",
        "prx_data.cli.train",
    ]
    return [*launcher, str(CONFIG), *overrides]


def _env() -> dict[str, str]:
    env = dict(os.environ)
    env.update(HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", OMP_NUM_THREADS="1")
    env["PYTHONPATH"] = str(REPO) + os.pathsep + env.get("PYTHONPATH", "")
    return env


def _logged_batches(ids_dir: Path) -> set[int]:
    out: set[int] = set()
    for p in ids_dir.glob("attempt-*-rank0.jsonl"):
        for line in p.read_text().splitlines()[1:]:
            try:
                out.add(json.loads(line)["batch"])
            except (json.JSONDecodeError, KeyError):
                pass
    return out


def _run_to_end(cmd: list[str], run: Path, timeout: float = 900) -> str:
    """Run to completion; returns rank 0's output (the launcher's own stdout and stderr)."""
    (run / "logs").mkdir(parents=True, exist_ok=True)
    proc = subprocess.run(
        cmd, cwd=REPO, env=_env(), capture_output=True, text=True, timeout=timeout
    )
    if proc.returncode != 0:
        logs = "\n".join(p.read_text()[-3000:] for p in sorted((run / "logs").glob("*")))
        raise AssertionError(
            f"exit {proc.returncode}\n{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}\n{logs}"
        )
    return proc.stdout + proc.stderr


def _clean_shm() -> None:
    from streaming.base.util import clean_stale_shared_memory

    clean_stale_shared_memory()


def test_killed_two_rank_run_resumes_exactly_once_on_one_and_two_ranks(tmp_path):
    from prx_data.train.callbacks import attempts_summary, consumed_ids
    from tests.exportkit import make_export

    encoder = save_tiny_t5(tmp_path / "t5")
    export = make_export(str(tmp_path / "export"), BUCKETS)
    expected = sorted(export.all_ids())
    assert len(expected) == BATCHES_PER_EPOCH * GLOBAL_BATCH

    # 1) Two ranks, killed (SIGKILL, no clean shutdown) mid-epoch after a checkpoint.
    first = tmp_path / "first"
    done = _kill_after(
        _command(2, first, encoder, str(tmp_path / "export")), first, KILL_AFTER_BATCH
    )
    assert KILL_AFTER_BATCH <= max(done) < BATCHES_PER_EPOCH - 1, done
    assert (first / "ckpt" / "latest-rank0.pt").exists()
    _clean_shm()  # the killed ranks could not release streaming's shared memory

    # 2) Resume the same state twice: on 1 rank and on 2 ranks (same global batch).
    for nproc in (1, 2):
        run = tmp_path / f"resume{nproc}"
        shutil.copytree(first, run, symlinks=True)
        _run_to_end(_command(nproc, run, encoder, str(tmp_path / "export")), run)
        _clean_shm()
        attempts = attempts_summary(run / "ids")
        assert len(attempts) == 2
        resumed_from = attempts[1]["start_batch"]
        # The last checkpoint may be the one written right after the last logged batch.
        assert 2 <= resumed_from <= max(done) + 1 and resumed_from % 2 == 0, attempts
        ids = consumed_ids(run / "ids")
        dupes = {k: v for k, v in Counter(ids).items() if v > 1}
        assert not dupes, f"{nproc} rank(s): seen twice: {sorted(dupes)[:5]}"
        assert sorted(ids) == expected, f"{nproc} rank(s): missing {set(expected) - set(ids)}"


def _kill_after(cmd: list[str], run: Path, batch: int) -> set[int]:
    """Start ``cmd``, SIGKILL its process group once rank 0 logged ``batch``; the batches logged."""
    (run / "logs").mkdir(parents=True)
    proc = subprocess.Popen(
        cmd,
        cwd=REPO,
        env=_env(),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )
    try:
        deadline = time.monotonic() + 900
        while time.monotonic() < deadline and proc.poll() is None:
            if max(_logged_batches(run / "ids"), default=-1) >= batch:
                break
            time.sleep(0.1)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=60)
    if proc.returncode != -signal.SIGKILL:
        logs = "\n".join(p.read_text()[-4000:] for p in sorted((run / "logs").glob("*")))
        raise AssertionError(f"the run ended on its own (exit {proc.returncode}):\n{logs}")
    return _logged_batches(run / "ids")


def _rank_ids(ids_dir: Path, rank: int) -> dict[tuple[str, int], list[str]]:
    out = {}
    for p in ids_dir.glob(f"attempt-*-rank{rank}.jsonl"):
        token = p.name.split("-")[1]
        for line in p.read_text().splitlines()[1:]:
            try:
                rec = json.loads(line)
            except json.JSONDecodeError:
                continue
            out[(token, rec["batch"])] = rec["ids"]
    return out


def test_replicated_run_counts_unique_samples_and_resumes_exactly_once(tmp_path):
    """replication=2 on 2 ranks: both ranks train the same batch; one copy is counted."""
    import torch

    from prx_data.train.callbacks import consumed_ids
    from tests.exportkit import make_export

    encoder = save_tiny_t5(tmp_path / "t5")
    export = make_export(str(tmp_path / "export"), BUCKETS)
    expected = sorted(export.all_ids())
    unique_per_step = GLOBAL_BATCH // 2
    steps = len(expected) // unique_per_step  # 24
    extra = ("data.plan.replication=2", "trainer.save_interval=4ba")
    first = tmp_path / "first"
    done = _kill_after(_command(2, first, encoder, str(tmp_path / "export"), extra), first, 9)
    assert max(done) < steps - 1, done
    ckpt = torch.load(first / "ckpt" / "latest-rank0.pt", weights_only=False)
    state = ckpt["state"]
    stamp = state["timestamp"]["Timestamp"]  # Composer keys serialized objects by class
    batches = int(stamp["batch"])
    assert batches % 4 == 0 and batches >= 4
    # The resume position counts each replicated batch once.
    assert state["dataset_state"]["train"]["sample_in_epoch"] == batches * unique_per_step
    assert int(stamp["sample"]) == batches * unique_per_step
    _clean_shm()

    run = tmp_path / "resume"
    shutil.copytree(first, run, symlinks=True)
    out = _run_to_end(_command(2, run, encoder, str(tmp_path / "export"), extra), run)
    _clean_shm()
    # Replicas got identical batches.
    r0, r1 = _rank_ids(run / "ids", 0), _rank_ids(run / "ids", 1)
    assert r0 == r1 and all(len(v) == unique_per_step for v in r0.values())
    only0 = tmp_path / "ids0"
    only0.mkdir()
    for p in (run / "ids").glob("attempt-*-rank0.jsonl"):
        shutil.copy(p, only0 / p.name)
    ids = consumed_ids(only0)
    dupes = {k: v for k, v in Counter(ids).items() if v > 1}
    assert not dupes, f"seen twice after the resume: {sorted(dupes)[:5]}"
    assert sorted(ids) == expected, f"missing {set(expected) - set(ids)}"
    assert "4 unique per step, replication 2" in out and "bucket plan:" in out, out[-3000:]
