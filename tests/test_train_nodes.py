"""Training across nodes as users run it: two nodes, autoresume, resumes on other node counts.

The fast tests pin the Composer internals that ``prx_data.train.composer_compat``
relies on (the per-node signal-file names). The slow tests run the real entry
point on simulated nodes on this machine::

    composer -n 1 --world_size 2 --node_rank 0|1 --master_addr 127.0.0.1 --master_port P \
        -m prx_data.train CONFIG.yaml key=value ...

Each node runs in its own mount namespace (``unshare --mount``) with its own
``/dev/shm`` (streaming's shared memory is per node) and its own ``TMPDIR``;
the working directory is the same for all nodes, like a shared file system.
Both nodes are killed (SIGKILL) mid-epoch after a checkpoint; the run is then
resumed on other node and process counts, and ``SampleIdLogger`` proves that
every training sample of the epoch was trained exactly once.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

import pytest

from tests.trainkit import save_tiny_t5, tiny_overrides

REPO = Path(__file__).resolve().parents[1]
CONFIGS = REPO / "configs" / "train"
GLOBAL_BATCH = 8
#: Two buckets; the hold-out salt is chosen so that each bucket's training side is a whole
#: number of global batches (the planner's unit here), so the epoch is every training sample.
BUCKETS = {"512/1.000": 56, "512/0.778": 40}
HOLDOUT_FRACTION = 0.2  # the smoke configs' value
#: Fixed so that a 2-node checkpoint resumes on 1 node (docs/TRAINING.md, "Multi-node").
CANONICAL_NODES = 2
KILL_AFTER_BATCH = 5  # rank 0 logged batch 5: the checkpoint at 4 exists, the epoch is not done
SAVE_INTERVAL = 2
#: Where the nodes' TMPDIRs go (pytest's tmp paths are too long for AF_UNIX sockets).
SHORT_TMP = "/tmp"


# --- Composer contract (fast) ------------------------------------------------------------------


def test_composer_is_a_version_the_signal_file_fix_knows():
    from prx_data.train import composer_compat

    assert composer_compat.supported(), (
        "Composer was upgraded: check the contracts below and the slow two-node tests, "
        "then add the version to prx_data.train.composer_compat.SUPPORTED"
    )
    assert not composer_compat.supported("0.33.0")


def test_composer_still_names_signal_files_through_the_patched_function():
    """Autoresume and the checkpoint download look the name up on the module at call time."""
    import inspect

    from composer import Trainer
    from composer.utils import checkpoint
    from composer.utils import dist as cdist

    lookup = Trainer._get_autoresume_checkpoint
    assert "dist.get_node_signal_file_name()" in inspect.getsource(lookup)
    assert "dist.get_node_signal_file_name()" in inspect.getsource(checkpoint.download_checkpoint)
    # The name broadcast from global rank 0: node 0's, whatever node calls it.
    src = inspect.getsource(cdist.get_node_signal_file_name)
    assert "broadcast_object_list(file_name_list, src=0)" in src


def test_each_node_gets_its_own_signal_file_name(monkeypatch):
    from composer.utils import dist as cdist

    from prx_data.train.composer_compat import node_signal_file_name, per_node_signal_files

    assert node_signal_file_name("._signal_file_node0_Ab3xYz", 3) == "._signal_file_node3_Ab3xYz"
    assert node_signal_file_name("._signal_file_node0_Ab3xYz", 0) == "._signal_file_node0_Ab3xYz"
    assert node_signal_file_name("other-name", 2) == "other-name.node2"

    original = cdist.get_node_signal_file_name
    monkeypatch.setenv("NODE_RANK", "1")  # what Composer's launcher sets on the second node
    unpatched = original()
    assert unpatched.startswith("._signal_file_node1_")  # one process: it is its own rank 0
    with per_node_signal_files():
        assert cdist.get_node_signal_file_name is not original
        name = cdist.get_node_signal_file_name()
        assert name.startswith("._signal_file_node1_") and len(name) == len(unpatched)
        monkeypatch.setenv("NODE_RANK", "0")
        assert cdist.get_node_signal_file_name().startswith("._signal_file_node0_")
    assert cdist.get_node_signal_file_name is original


def test_the_patch_is_undone_when_building_the_trainer_fails():
    from composer.utils import dist as cdist

    from prx_data.train.composer_compat import multinode_safe

    original = cdist.get_node_signal_file_name
    seen = []

    def failing(**kwargs):
        seen.append(cdist.get_node_signal_file_name is original)
        raise ValueError("bad config")

    with pytest.raises(ValueError, match="bad config"):
        multinode_safe(failing)(model=None)
    assert seen == [False] and cdist.get_node_signal_file_name is original


def test_a_checkpoint_missing_on_a_node_is_one_line_that_says_what_to_do():
    import inspect

    from composer import Trainer

    from prx_data.core.errors import PrxDataError
    from prx_data.train.composer_compat import MISSING_ON_A_NODE, multinode_safe

    assert MISSING_ON_A_NODE in inspect.getsource(Trainer._get_autoresume_checkpoint)

    def composer_refuses(**kwargs):
        raise RuntimeError(MISSING_ON_A_NODE)

    with pytest.raises(PrxDataError, match="node-local disk.*s3://") as info:
        multinode_safe(composer_refuses)(save_folder="/disk/ckpt")
    assert "'/disk/ckpt'" in str(info.value) and "\n" not in str(info.value)

    def other_failure(**kwargs):
        raise RuntimeError("something else")

    with pytest.raises(RuntimeError, match="something else"):
        multinode_safe(other_failure)(save_folder="/disk/ckpt")


def test_composer_mirrors_a_remote_save_folder_where_the_trainer_looks():
    """The autoresume lookup still abspath-joins the URI and downloads only when absent."""
    import inspect

    from composer import Trainer

    from prx_data.train.composer_compat import LATEST_FILENAME, remote_autoresume_copy

    src = inspect.getsource(Trainer._get_autoresume_checkpoint)
    assert "latest_checkpoint_path = os.path.join(save_folder, save_latest_filename)" in src
    assert "[os.path.abspath(latest_checkpoint_path)]" in src
    assert "not os.path.exists(latest_checkpoint_path)" in src  # an old copy is never refreshed
    init = inspect.signature(Trainer.__init__).parameters
    assert init["save_latest_filename"].default == LATEST_FILENAME
    got = remote_autoresume_copy("s3://bkt/runs/{run_name}/checkpoints", "r1", cwd="/work/dir")
    assert got == "/work/dir/s3:/bkt/runs/r1/checkpoints/latest-rank0.pt"
    assert remote_autoresume_copy("/shared/runs/{run_name}/checkpoints", "r1") is None


def test_a_resume_drops_only_the_earlier_download_of_a_remote_checkpoint(tmp_path, monkeypatch):
    from prx_data.train.composer_compat import drop_stale_autoresume_copy

    monkeypatch.chdir(tmp_path)
    mirror = tmp_path / "s3:" / "bkt" / "runs" / "r1" / "ckpt"
    mirror.mkdir(parents=True)
    (mirror / "latest-rank0.pt").write_bytes(b"old")
    (mirror / "ep0-ba2-rank0.pt").write_bytes(b"keep")
    removed = drop_stale_autoresume_copy("s3://bkt/runs/{run_name}/ckpt", "r1")
    assert removed == str(mirror / "latest-rank0.pt")
    assert sorted(p.name for p in mirror.iterdir()) == ["ep0-ba2-rank0.pt"]
    assert drop_stale_autoresume_copy("s3://bkt/runs/{run_name}/ckpt", "r1") is None
    local = tmp_path / "local"
    local.mkdir()
    (local / "latest-rank0.pt").write_bytes(b"the real checkpoint")
    assert drop_stale_autoresume_copy(str(local), "r1") is None
    assert (local / "latest-rank0.pt").exists()


# --- the simulated cluster (slow) ------------------------------------------------------------


def _can_unshare() -> bool:
    if shutil.which("unshare") is None or os.geteuid() != 0:
        return False
    probe = subprocess.run(
        ["unshare", "--mount", "--propagation", "private", "mount", "-t", "tmpfs", "x", "/dev/shm"],
        capture_output=True,
    )
    return probe.returncode == 0


needs_namespaces = pytest.mark.skipif(
    sys.platform != "linux" or not _can_unshare(),
    reason="simulated nodes need root and `unshare --mount` (own /dev/shm per node)",
)


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def pick_salt(export, fraction: float, unit: int, min_held: int = 2) -> tuple[str, set[str]]:
    """A hold-out salt whose training side is whole units in every bucket; (salt, held ids).

    Then the planner trims nothing and "every training sample of the epoch" is
    exactly every id outside the hold-out.
    """
    from prx_data.stream.holdout import Holdout

    for i in range(20000):
        salt = f"nodes-{i}"
        hold = Holdout(fraction, salt)
        held: set[str] = set()
        ok = True
        for ids in export.ids.values():
            mask = hold.held_out(ids)
            n = int(mask.sum())
            if (len(ids) - n) % unit or n < min_held:
                ok = False
                break
            held |= {i for i, m in zip(ids, mask, strict=True) if m}
        if ok:
            return salt, held
    raise AssertionError("no salt found")


class Cluster:
    """Simulated nodes sharing one working directory (the run folder)."""

    def __init__(self, run: Path, config: Path, overrides: list[str], env: dict[str, str]):
        self.run = run
        self.config = config
        self.overrides = overrides
        self.env = env
        self._tmp: dict[int, Path] = {}
        (run / "logs").mkdir(parents=True, exist_ok=True)

    def node_tmp(self, node_rank: int) -> Path:
        """The node's TMPDIR: short, since multiprocessing puts AF_UNIX sockets in it."""
        if node_rank not in self._tmp:
            self._tmp[node_rank] = Path(tempfile.mkdtemp(prefix=f"n{node_rank}.", dir=SHORT_TMP))
        return self._tmp[node_rank]

    def node_dir(self, node_rank: int) -> Path:
        """What is local to one node (its TMPDIR, its disk): outside the shared folder."""
        return self.run.parent / f"{self.run.name}.node{node_rank}"

    def node_command(
        self, node_rank: int, nodes: int, nproc: int, port: int, binds: dict[str, Path]
    ) -> list[str]:
        logs = self.run / "logs"
        tag = f"{nodes}x{nproc}-node{node_rank}"
        launcher = [
            sys.executable,
            "-m",
            "composer.cli.launcher",
            "-n",
            str(nproc),
            "--world_size",
            str(nodes * nproc),
            "--node_rank",
            str(node_rank),
            "--master_addr",
            "127.0.0.1",
            "--master_port",
            str(port),
            "--stdout",
            str(logs / f"{tag}-rank{{rank}}.stdout"),
            "--stderr",
            str(logs / f"{tag}-rank{{rank}}.stderr"),
            "-m",
            "prx_data.cli.train",
            str(self.config),
            *self.overrides,
        ]
        # A node of its own: private /dev/shm, and optionally node-local disks bound over
        # shared paths (``binds``: path seen by the job -> this node's directory).
        script = ["mount -t tmpfs tmpfs /dev/shm"]
        for target, source in binds.items():
            script.append(f'mkdir -p "{target}" && mount --bind "{source}" "{target}"')
        script.append('exec "$@"')
        return ["unshare", "--mount", "--propagation", "private", "sh", "-c",
                " && ".join(script), "node", *launcher]  # fmt: skip

    def start(
        self, nodes: int, nproc: int, node_binds: list[dict[str, Path]] | None = None
    ) -> list[subprocess.Popen]:
        port = _free_port()
        procs = []
        for n in range(nodes):
            tmp = self.node_tmp(n)
            binds = node_binds[n] if node_binds else {}
            for source in binds.values():
                source.mkdir(parents=True, exist_ok=True)
            env = {**self.env, "TMPDIR": str(tmp)}
            out = (self.run / "logs" / f"{nodes}x{nproc}-node{n}.launcher").open("w")
            procs.append(
                subprocess.Popen(
                    self.node_command(n, nodes, nproc, port, binds),
                    cwd=self.run,
                    env=env,
                    stdout=out,
                    stderr=subprocess.STDOUT,
                    start_new_session=True,
                )
            )
        return procs

    def logs(self) -> str:
        return "\n".join(
            f"--- {p.name}\n{p.read_text()[-2500:]}" for p in sorted((self.run / "logs").glob("*"))
        )

    def run_to_end(self, nodes: int, nproc: int, timeout: float = 1200, **kw) -> None:
        procs = self.start(nodes, nproc, **kw)
        try:
            codes = [p.wait(timeout=timeout) for p in procs]
        finally:
            _kill(procs)
        assert codes == [0] * nodes, f"exit codes {codes}\n{self.logs()}"

    def run_expecting_failure(self, nodes: int, nproc: int, timeout: float = 600, **kw) -> str:
        procs = self.start(nodes, nproc, **kw)
        try:
            codes = [p.wait(timeout=timeout) for p in procs]
        finally:
            _kill(procs)
        assert any(codes), f"expected a failure\n{self.logs()}"
        return self.logs()

    def kill_after(self, nodes: int, nproc: int, batch: int, **kw) -> set[int]:
        """Start, SIGKILL every node once global rank 0 logged ``batch``; the batches logged."""
        procs = self.start(nodes, nproc, **kw)
        try:
            deadline = time.monotonic() + 1200
            while time.monotonic() < deadline and all(p.poll() is None for p in procs):
                if max(logged_batches(self.run / "ids"), default=-1) >= batch:
                    break
                time.sleep(0.1)
        finally:
            ended = [p.poll() for p in procs]
            _kill(procs)
        assert ended == [None] * nodes, f"a node ended on its own: {ended}\n{self.logs()}"
        return logged_batches(self.run / "ids")


def _kill(procs: list[subprocess.Popen]) -> None:
    for p in procs:
        if p.poll() is None:
            try:
                os.killpg(p.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
    for p in procs:
        p.wait(timeout=60)


def logged_batches(ids_dir: Path) -> set[int]:
    out: set[int] = set()
    for p in ids_dir.glob("attempt-*-rank0.jsonl"):
        for line in p.read_text().splitlines()[1:]:
            try:
                out.add(json.loads(line)["batch"])
            except (json.JSONDecodeError, KeyError):
                pass
    return out


def _env(extra: dict[str, str] | None = None) -> dict[str, str]:
    env = dict(os.environ)
    env.update(HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", OMP_NUM_THREADS="1")
    env["PYTHONPATH"] = str(REPO) + os.pathsep + env.get("PYTHONPATH", "")
    env.update(extra or {})
    return env


def overrides(
    encoder: str, export_root: str, run: Path, salt: str, save_folder: str, extra=()
) -> list[str]:
    return [
        *tiny_overrides(encoder),
        f"variables.data_root={export_root}",
        "data.plan.include_higher_tiers=false",
        "data.plan.small_buckets=error",
        f"data.global_batch_size={GLOBAL_BATCH}",
        "data.num_workers=1",
        "data.persistent_workers=false",
        f"data.plan.num_canonical_nodes={CANONICAL_NODES}",
        "trainer.max_duration=1ep",
        "trainer.run_name=nodes",
        f"trainer.save_folder={save_folder}",
        f"trainer.save_interval={SAVE_INTERVAL}ba",
        "trainer.autoresume=true",
        f"logging.sample_ids_dir={run / 'ids'}",
        "logging.console_log_interval=1ba",
        # The smoke configs' eval hold-out and sample grids stay on.
        "eval.enabled=true",
        f"eval.holdout_salt={salt}",
        "eval.interval=1ep",
        f"sampling.folder={run / 'samples'}",
        "sampling.interval=6ba",
        "metrics.enabled=false",  # the latent config's FID etc.: tests/test_train_metrics.py
        f"metrics.folder={run / 'metrics'}",  # eval JSON, also with a remote save_folder
        *extra,
    ]


def check_exactly_once(ids_dir: Path, expected: list[str], what: str, attempts: int) -> None:
    from prx_data.train.callbacks import attempts_summary, consumed_ids

    summary = attempts_summary(ids_dir)
    assert len(summary) == attempts, summary
    starts = [a["start_batch"] for a in summary[1:]]
    assert all(s > 0 and s % SAVE_INTERVAL == 0 for s in starts), f"{what}: not resumed {summary}"
    ids = consumed_ids(ids_dir)
    dupes = {k: v for k, v in Counter(ids).items() if v > 1}
    assert not dupes, f"{what}: seen twice: {sorted(dupes)[:5]}"
    assert sorted(ids) == expected, f"{what}: missing {sorted(set(expected) - set(ids))[:5]}"


def check_eval_and_grids(run: Path) -> None:
    evals = sorted((run / "metrics").glob("eval-ba*.json"))
    assert evals, "no eval record"
    record = json.loads(evals[-1].read_text())
    assert record["metrics"], record
    assert list((run / "samples").glob("ba*.png")), "no sample grid"


@pytest.fixture(autouse=True)
def _short_tmp(monkeypatch):
    """A short parent for the nodes' TMPDIRs, removed after each test."""
    short = tempfile.mkdtemp(prefix="prx-nodes.")
    monkeypatch.setattr(sys.modules[__name__], "SHORT_TMP", short)
    yield
    shutil.rmtree(short, ignore_errors=True)


@pytest.fixture(scope="module")
def cluster_data(tmp_path_factory):
    """A tiny encoder, the export, a hold-out salt that trims nothing, the training ids."""
    from tests.exportkit import make_export

    base = tmp_path_factory.mktemp("nodes")
    encoder = save_tiny_t5(base / "t5")
    export = make_export(str(base / "export"), BUCKETS)
    salt, held = pick_salt(export, HOLDOUT_FRACTION, GLOBAL_BATCH)
    expected = sorted(export.all_ids() - held)
    return encoder, export.root, salt, expected


def _resume_copy(first: Path, run: Path) -> None:
    """The killed run's shared folder as another cluster finds it (its own copy per resume)."""
    shutil.copytree(first, run, symlinks=True)


@needs_namespaces
@pytest.mark.slow
@pytest.mark.timeout(3600)
@pytest.mark.parametrize("config", ["smoke_cpu.yaml", "smoke_latent_cpu.yaml"])
def test_two_nodes_on_a_shared_folder_killed_resume_exactly_once_on_one_node(
    tmp_path, cluster_data, config, request
):
    """2 nodes x 1 process, SIGKILLed mid-epoch; resumed on 1 node x 1 and 1 node x 2.

    The save folder and the sample-id logs are in the shared working directory.
    With Composer's own signal-file names this failed at start-up with
    ``FileNotFoundError: .../._signal_file_node0_*``.
    """
    encoder, export_root, salt, expected = cluster_data
    extra: tuple[str, ...] = ()
    resumes = [(1, 1), (1, 2)]
    if "latent" in config:
        from prx_data.train.vae import save_tiny_autoencoder

        vae = save_tiny_autoencoder(str(tmp_path / "vae"), "AutoencoderKL")
        extra = (f"vae.name_or_path={vae}", "model.patch_size=4")
        resumes = [(1, 2)]  # the pixel case covers 1 x 1 too

    def cluster(run: Path) -> Cluster:
        ov = overrides(encoder, export_root, run, salt, str(run / "ckpt"), extra)
        return Cluster(run, CONFIGS / config, ov, _env())

    first = tmp_path / "first"
    done = cluster(first).kill_after(2, 1, KILL_AFTER_BATCH)
    batches = len(expected) // GLOBAL_BATCH
    assert KILL_AFTER_BATCH <= max(done) < batches - 1, done
    assert (first / "ckpt" / "latest-rank0.pt").exists()
    assert not list((first / "ckpt").glob("._signal_file*")), "signal files left behind"
    import torch

    ckpt = torch.load(first / "ckpt" / "latest-rank0.pt", weights_only=False, map_location="cpu")
    data_state = ckpt["state"]["dataset_state"]["train"]
    # The order is fixed by the canonical node count, not by the 2 physical nodes it ran on.
    assert data_state["num_canonical_nodes"] == CANONICAL_NODES, data_state
    assert data_state["initial_physical_nodes"] == 2, data_state
    for nodes, nproc in resumes:
        run = tmp_path / f"resume-{nodes}x{nproc}"
        _resume_copy(first, run)
        cluster(run).run_to_end(nodes, nproc)
        check_exactly_once(run / "ids", expected, f"{config} {nodes}x{nproc}", attempts=2)
        check_eval_and_grids(run)


def _latest_batch(bucket: str, run_name: str) -> int:
    """The batch of the checkpoint the bucket's ``latest-rank0.pt`` symlink names (-1: none)."""
    import re

    import boto3

    s3 = boto3.client("s3", endpoint_url=os.environ["S3_ENDPOINT_URL"])
    key = f"runs/{run_name}/checkpoints/latest-rank0.pt.symlink"
    try:
        target = s3.get_object(Bucket=bucket, Key=key)["Body"].read().decode()
    except s3.exceptions.NoSuchKey:
        return -1
    m = re.search(r"-ba(\d+)-", target)
    assert m, target
    return int(m.group(1))


@needs_namespaces
@pytest.mark.slow
@pytest.mark.timeout(3600)
def test_two_nodes_with_an_s3_save_folder_resume_from_the_newest_checkpoint(
    tmp_path, cluster_data, s3_bucket
):
    """save_folder on S3 (moto on loopback), one shared working directory, three attempts.

    2 nodes x 1 to batch 4, 1 node x 2 to batch 8, 2 nodes x 1 to the end of
    the epoch. Each attempt stops at its ``max_duration``: rank 0 uploads
    checkpoints in the background, and a finished fit waits for the uploads,
    so what is in the bucket does not depend on the machine's speed (the kill
    cases are covered above). The third attempt must start from batch 8, the
    newest checkpoint in the bucket, not from the copy of batch 4 that Composer
    downloaded into ``./s3:/...`` at the second.
    """
    encoder, export_root, salt, expected = cluster_data
    run = tmp_path / "work"
    save = f"s3://{s3_bucket}/runs/{{run_name}}/checkpoints"

    def cluster(duration: str) -> Cluster:
        extra = (f"trainer.max_duration={duration}", "sampling.enabled=false")
        ov = overrides(encoder, export_root, run, salt, save, extra)
        return Cluster(run, CONFIGS / "smoke_cpu.yaml", ov, _env())

    cluster("4ba").run_to_end(2, 1)
    assert _latest_batch(s3_bucket, "nodes") == 4
    cluster("8ba").run_to_end(1, 2)
    assert _latest_batch(s3_bucket, "nodes") == 8
    mirror = run / "s3:" / s3_bucket / "runs" / "nodes" / "checkpoints" / "latest-rank0.pt"
    assert mirror.exists()  # Composer's download at the second attempt (batch 4)
    cluster("1ep").run_to_end(2, 1)
    from prx_data.train.callbacks import attempts_summary

    starts = [a["start_batch"] for a in attempts_summary(run / "ids")]
    assert starts == [0, 4, 8], starts
    check_exactly_once(run / "ids", expected, "s3 save folder", attempts=3)
    assert list((run / "metrics").glob("eval-ba*.json")), "no eval record"


@needs_namespaces
@pytest.mark.slow
@pytest.mark.timeout(3600)
def test_node_local_save_folders_resume_on_the_node_that_holds_the_checkpoint(
    tmp_path, cluster_data
):
    """The same save_folder path on each node, a different disk behind it (a bind mount).

    Only node 0 holds rank 0's checkpoint: a 2-node resume is refused with one
    line saying what to do; a resume on node 0 alone (2 processes) is exact.
    """
    encoder, export_root, salt, expected = cluster_data
    run = tmp_path / "work"
    disk = run / "ckpt"
    extra = ("sampling.enabled=false",)
    ov = overrides(encoder, export_root, run, salt, str(disk), extra)
    cluster = Cluster(run, CONFIGS / "smoke_cpu.yaml", ov, _env())
    binds = [{str(disk): cluster.node_dir(n) / "disk"} for n in range(2)]
    cluster.kill_after(2, 1, KILL_AFTER_BATCH, node_binds=binds)
    assert (cluster.node_dir(0) / "disk" / "latest-rank0.pt").exists()
    assert not (cluster.node_dir(1) / "disk" / "latest-rank0.pt").exists()
    assert not list(disk.iterdir()), "the shared path itself got files"
    out = cluster.run_expecting_failure(2, 1, node_binds=binds)
    assert "is on global rank 0's node only" in out, out[-3000:]
    cluster.run_to_end(1, 2, node_binds=binds[:1])
    check_exactly_once(run / "ids", expected, "node-local disks", attempts=2)
