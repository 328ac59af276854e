"""Multi-process soak of the skip-list log: 4 processes add, remove and sync at once on two
exports of one table, on local disk and on the S3 test server (moto, on loopback), all
recording into the table's corpus ledger. Every acknowledged change is in the ledger at the
commit it was given, once (nothing doubled), the ledger's state is the replay of those
changes in commit order (nothing lost, nothing resurrected), its opt-out key set is the replay's opt-outs with their content keys,
every export materialises it, and no process fails."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from prx_data.core.keys import KeySet
from prx_data.skips.ledger import Ledger
from prx_data.skips.ops import sync
from tests.exportkit import make_export, upload_tree
from tests.listsoak import content_keys
from tests.tablekit import make_table
from tests.test_list_model import skipped

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
B = "512/1.000"


def _soak(tmp_path, procs: int, ops: int, bucket: str | None = None) -> int:
    table = str(tmp_path / "t.lance")
    make_table(table, [("s/0", b"\xff\xd8x", "c")])
    exports = [make_export(str(tmp_path / e), {B: 8}, samples_per_part=4) for e in "ab"]
    if bucket is not None:  # the exports and the table (so its registry) on the S3 server
        remote = f"s3://{bucket}/t.lance"
        upload_tree(table, remote)
        table = remote
        for ex in exports:
            root = f"s3://{bucket}/exports/{os.path.basename(ex.root)}"
            upload_tree(ex.root, root)
            ex.root = root
    for ex in exports:
        sync(ex.root, table)
    env = {**os.environ, "PYTHONPATH": REPO + os.pathsep + os.environ.get("PYTHONPATH", "")}
    logs = [str(tmp_path / f"w{k}.jsonl") for k in range(procs)]
    running = [
        subprocess.Popen(
            [sys.executable, "-m", "tests.listsoak", str(k), str(ops), table, logs[k]]
            + [ex.root for ex in exports],
            env=env,
            cwd=REPO,
            stderr=subprocess.PIPE,
        )
        for k in range(procs)
    ]
    errs = [p.communicate(timeout=1200)[1].decode() for p in running]
    assert [p.returncode for p in running] == [0] * procs, "\n".join(errs)
    assert not any("Traceback" in e for e in errs), "\n".join(errs)
    print(f"soak: {procs} processes, {procs * ops} operations, {len(acked_of(logs))} acknowledged")
    acked = acked_of(logs)
    reg = Ledger.for_table(table)
    entries = reg.entries()
    by_seq: dict[int, set] = {}
    for s, n, i, op in zip(
        entries["seq"].to_pylist(),
        entries["list"].to_pylist(),
        entries["id"].to_pylist(),
        entries["op"].to_pylist(),
        strict=True,
    ):
        by_seq.setdefault(s, set()).add((n, i, op))
    want: dict[str, set[str]] = {}
    for a in sorted(acked, key=lambda a: a["seq"]):
        # Nothing lost: the change is in the registry, at its own commit.
        assert by_seq[a["seq"]] == {(a["list"], i, a["op"]) for i in a["ids"]}
        ids = want.setdefault(a["list"], set())
        ids.update(a["ids"]) if a["op"] == "add" else ids.difference_update(a["ids"])
    want = {n: v for n, v in want.items() if v}
    # Nothing doubled: every entry is one acknowledged change's, once.
    assert sorted(by_seq) == sorted({a["seq"] for a in acked})
    assert len(entries) == sum(len(a["ids"]) for a in acked)
    # Nothing resurrected: the state is the replay in commit order.
    assert {n: set(t["id"].to_pylist()) for n, t in reg.state().items()} == want
    # The opt-outs every later export leaves out are the replay's, with their content keys.
    out = sorted(want.get("optout", set()))
    keys = reg.optout_keys()
    expect = KeySet.of(out, content_keys(out)["sha256"])
    assert keys.id.tolist() == expect.id.tolist()
    assert keys.sha256.tolist() == expect.sha256.tolist()
    for ex in exports:
        sync(ex.root)
        held = ex.all_ids()
        assert skipped(ex) == {n: v & held for n, v in want.items() if v & held}
    return len(acked)


def acked_of(logs: list[str]) -> list[dict]:
    return [json.loads(line) for path in logs for line in open(path)]


@pytest.mark.slow
@pytest.mark.timeout(1200)
def test_four_processes_at_once_lose_and_resurrect_nothing(tmp_path):
    assert _soak(tmp_path, 4, 5) > 0


@pytest.mark.slow
@pytest.mark.timeout(1800)
def test_four_processes_at_once_on_s3_lose_and_resurrect_nothing(tmp_path, s3_bucket):
    assert _soak(tmp_path, 4, 5, s3_bucket) > 0


@pytest.mark.slow
@pytest.mark.timeout(3600)
def test_soak_long(tmp_path):
    assert _soak(tmp_path, 4, 25) > 0
