"""The S3 export lease under faults: stalled and conflicting heartbeats, skewed clocks, and
a finalize that stops on a lost lease before it writes (loopback proxies in front of moto)."""

from __future__ import annotations

import json
import os
import threading
import time

import boto3
import pytest

from prx_data.core import storage
from prx_data.core.runtime import RunOptions
from prx_data.export import layout, naming
from prx_data.export import lock as lock_mod
from prx_data.export.lock import ExportLock, ExportLocked
from prx_data.export.merge import done_parts, finalize
from prx_data.export.spec import ExportConfig
from tests.exportkit import make_export
from tests.s3proxy import RuleProxy

LEASE = naming.LEASE_NAME


def _port(url: str) -> int:
    return int(url.rsplit(":", 1)[1])


def _wait_for(cond, what: str, bound_s: float = 30.0) -> None:
    """Poll ``cond`` (a hang guard, not a timing assertion)."""
    end = time.monotonic() + bound_s
    while not cond():
        assert time.monotonic() < end, f"gave up waiting for {what}"
        time.sleep(0.02)


def _beats_after(proxy: RuleProxy, fault) -> int:
    """Lease PUTs relayed after the last one that met ``fault`` (0 before it)."""
    with proxy.lock:
        puts = [f for m, p, f in proxy.log if m == "PUT" and p.endswith(LEASE)]
    if fault not in puts:
        return 0
    last = len(puts) - 1 - puts[::-1].index(fault)
    return sum(1 for f in puts[last + 1 :] if f is None)


def _lease_body(s3_bucket: str, prefix: str) -> dict:
    c = boto3.client("s3", endpoint_url=os.environ["S3_ENDPOINT_URL"])
    return json.loads(c.get_object(Bucket=s3_bucket, Key=f"{prefix}/{LEASE}")["Body"].read())


@pytest.mark.faults
@pytest.mark.remote
def test_stalled_heartbeat_fails_check_before_another_run_can_take_over(
    s3_bucket, moto_server, monkeypatch
):
    ttl = 3.0
    out = f"s3://{s3_bucket}/stall"
    stalled = threading.Event()
    rule = lambda m, p: "stall" if stalled.is_set() and m == "PUT" and p.endswith(LEASE) else None  # noqa: E731
    with RuleProxy(_port(moto_server), rule) as proxy:
        monkeypatch.setenv("S3_ENDPOINT_URL", proxy.url)
        holder = ExportLock(out, ttl_s=ttl)
        holder.acquire()
        holder.check()
        stalled.set()  # from now on every heartbeat PUT hangs, longer than the lease lasts
        # Once one hangs, no earlier heartbeat is still on its way (they go one at a time).
        _wait_for(lambda: proxy.seen("PUT", LEASE, "stall") >= 1, "a stalled heartbeat")
        monkeypatch.setenv("S3_ENDPOINT_URL", moto_server)  # the second run reaches the store
        at_takeover: dict = {}
        put = lock_mod.S3LeaseStore.put

        def spying_put(store, body, **kw):
            if "IfMatch" in kw and not kw.get("beat"):  # the second run's takeover
                at_takeover["waited"] = time.monotonic() - t0
                try:
                    holder.check()
                    at_takeover["holder"] = "still passing"
                except ExportLocked as e:
                    at_takeover["holder"] = str(e)
            return put(store, body, **kw)

        monkeypatch.setattr(lock_mod.S3LeaseStore, "put", spying_put)
        t0 = time.monotonic()
        with ExportLock(out, ttl_s=ttl) as second:
            assert "stopped refreshing" in second.took_over
            # The holder's own check had failed before the takeover was even attempted ...
            assert "lost the lease" in at_takeover["holder"]
            assert "no heartbeat has landed" in at_takeover["holder"]
            # ... which came only after a full TTL of the same ETag on this host's clock.
            assert at_takeover["waited"] >= ttl
            with pytest.raises(ExportLocked, match="lost the lease"):
                holder.check()
            second.check()
            holder.release()  # a run that lost its lease leaves the new holder's alone
            assert _lease_body(s3_bucket, "stall")["owner"] == second._lease.owner
        assert not storage.exists(f"{out}/{LEASE}")


@pytest.mark.faults
@pytest.mark.remote
def test_one_stalled_heartbeat_is_cut_short_and_the_lease_kept(s3_bucket, moto_server, monkeypatch):
    ttl = 4.0
    out = f"s3://{s3_bucket}/short"
    state = {"armed": False, "stalls": 0}

    def rule(method, path):
        if state["armed"] and method == "PUT" and path.endswith(LEASE) and not state["stalls"]:
            state["stalls"] += 1
            return "stall"  # held far longer than the lease; only the client's timeout ends it
        return None

    with RuleProxy(_port(moto_server), rule) as proxy:
        monkeypatch.setenv("S3_ENDPOINT_URL", proxy.url)
        with ExportLock(out, ttl_s=ttl) as holder:
            state["armed"] = True
            _wait_for(lambda: _beats_after(proxy, "stall") >= 2, "heartbeats after the stalled one")
            holder.check()
            monkeypatch.setenv("S3_ENDPOINT_URL", moto_server)
            with pytest.raises(ExportLocked, match="holds the lease"):
                ExportLock(out, ttl_s=ttl).acquire()  # the lease is live: refused
            holder.check()
    assert state["stalls"] == 1


@pytest.mark.faults
@pytest.mark.remote
@pytest.mark.parametrize("fault", ["409", "lost-answer"])
def test_conflicting_heartbeat_answers_do_not_stop_a_healthy_run(
    fault, s3_bucket, moto_server, monkeypatch
):
    """409 ConditionalRequestConflict, or a heartbeat that landed but whose answer was lost,
    so that botocore's retry meets our own new ETag (412): the lease is still ours."""
    ttl = 4.0
    out = f"s3://{s3_bucket}/conflict-{fault}"
    faults = [(409, "ConditionalRequestConflict")] * 2 if fault == "409" else ["lost-answer"]
    state = {"armed": False, "left": len(faults)}

    def rule(method, path):
        if state["armed"] and method == "PUT" and path.endswith(LEASE) and state["left"]:
            state["left"] -= 1
            return faults[-state["left"] - 1]
        return None

    with RuleProxy(_port(moto_server), rule) as proxy:
        monkeypatch.setenv("S3_ENDPOINT_URL", proxy.url)
        with ExportLock(out, ttl_s=ttl) as holder:
            state["armed"] = True
            _wait_for(
                lambda: _beats_after(proxy, faults[-1]) >= 2 or holder._lease.lost,
                "heartbeats after the faults",
            )
            holder.check()
            assert state["left"] == 0
            assert holder._lease.lost is None
            body = _lease_body(s3_bucket, f"conflict-{fault}")
            assert body["owner"] == holder._lease.owner
            monkeypatch.setenv("S3_ENDPOINT_URL", moto_server)
            with pytest.raises(ExportLocked, match="holds the lease"):
                ExportLock(out, ttl_s=ttl).acquire()


def _put_lease(client, bucket: str, key: str, expires: float, ttl: float, **cond) -> str:
    body = {"owner": "elsewhere", "pid": 1, "host": "skewed", "started": 0.0}
    body.update(expires=expires, ttl_s=ttl, written=time.time())
    return client.put_object(Bucket=bucket, Key=key, Body=json.dumps(body).encode(), **cond)["ETag"]


@pytest.mark.faults
@pytest.mark.remote
def test_takeover_ignores_the_wall_clocks_of_other_hosts(s3_bucket, moto_server):
    ttl = 2.0
    client = boto3.client("s3", endpoint_url=moto_server)
    # A dead run on a host whose clock is an hour ahead: its "expires" is in the future.
    key = f"ahead/{LEASE}"
    _put_lease(client, s3_bucket, key, time.time() + 3600, ttl)
    t0 = time.monotonic()
    with ExportLock(f"s3://{s3_bucket}/ahead", ttl_s=ttl) as lock:
        assert "stopped refreshing" in lock.took_over
        assert time.monotonic() - t0 >= ttl  # a full TTL of the same ETag, on this clock
    # A live run on a host whose clock is an hour behind: its lease always looks expired.
    key = f"behind/{LEASE}"
    stop = threading.Event()
    etag = _put_lease(client, s3_bucket, key, time.time() - 3600, ttl)

    def beat(etag=etag):
        while not stop.wait(ttl / 8):
            etag = _put_lease(client, s3_bucket, key, time.time() - 3600, ttl, IfMatch=etag)

    t = threading.Thread(target=beat, daemon=True)
    t.start()
    try:
        with pytest.raises(ExportLocked, match="holds the lease"):
            ExportLock(f"s3://{s3_bucket}/behind", ttl_s=ttl).acquire()
    finally:
        stop.set()
        t.join()
    assert json.loads(client.get_object(Bucket=s3_bucket, Key=key)["Body"].read())["owner"] == (
        "elsewhere"
    )


# --- the export's end checks the lease before every write ------------------------------------------

B1, B2 = "512/1.000", "512/0.500"
FINAL = {naming.INDEX_NAME, naming.DROPPED_NAME, "report.txt", layout.REPORT_NAME}


class _Lease:
    """A stand-in for the run's lease: ``check`` does what the test says."""

    def __init__(self, check):
        self.check = check


def _unfinalized(tmp_path):
    root = str(tmp_path / "exp")
    make_export(root, {B1: 40, B2: 24}, samples_per_part=16)
    for b in (B1, B2):
        os.remove(os.path.join(root, b, naming.INDEX_NAME))
    for name in (layout.REPORT_NAME, "report.txt", naming.DROPPED_NAME):
        if os.path.exists(os.path.join(root, name)):
            os.remove(os.path.join(root, name))
    return root, done_parts(root), ExportConfig(table="t", out=root, caption_columns=("caption",))


def test_finalize_checks_the_lease_right_before_every_write(tmp_path, monkeypatch):
    root, results, cfg = _unfinalized(tmp_path)
    events: list[str] = []
    write = storage.write_bytes_atomic

    def recording_write(path, data):
        events.append(os.path.relpath(path, root))
        write(path, data)

    monkeypatch.setattr(storage, "write_bytes_atomic", recording_write)
    finalize(cfg, results, 0.0, lease=_Lease(lambda: events.append("check")))
    written = [e for e in events if e != "check"]
    assert {os.path.basename(w) for w in written} == FINAL
    for i, e in enumerate(events):
        if e != "check":
            assert events[i - 1] == "check", events  # each write right after a check


def test_finalize_stops_on_a_lost_lease_before_it_writes(tmp_path):
    root, results, cfg = _unfinalized(tmp_path)

    def lost() -> None:
        raise ExportLocked("lost the lease on s3://b/x/.prx-export.lease: test")

    with pytest.raises(ExportLocked, match="lost the lease"):
        finalize(cfg, results, 0.0, lease=_Lease(lost))
    for b in (B1, B2):
        assert not os.path.exists(os.path.join(root, b, naming.INDEX_NAME))
    for name in (layout.REPORT_NAME, "report.txt", naming.DROPPED_NAME):
        assert not os.path.exists(os.path.join(root, name))


@pytest.mark.ray
@pytest.mark.slow  # a real Ray run; the finalize tests above cover the default suite
def test_an_export_whose_lease_is_lost_after_its_units_writes_no_index_or_report(
    tmp_path, monkeypatch, ray_local
):
    import sys

    from prx_data.pipelines import write_mds
    from tests import badinputs
    from tests.tablekit import make_table

    uri = str(tmp_path / "t.lance")
    make_table(uri, [(f"i{k}", badinputs.good_jpeg(seed=k), "c") for k in range(4)])
    out = str(tmp_path / "o")

    def check(self) -> None:  # the lease runs out once every unit has finished
        steps = ("on_write_complete", "merge", "merge_bucket", "merge_dropped")
        if sys._getframe(1).f_code.co_name in steps:
            raise ExportLocked("lost the lease on s3://b/o/.prx-export.lease: test")

    monkeypatch.setattr(write_mds.ExportLock, "check", check)
    cfg = ExportConfig(table=uri, out=out, rows_per_task=2, min_units=1)
    with pytest.raises(ExportLocked, match="lost the lease"):
        write_mds.run_export(cfg, RunOptions(progress=False))
    assert len(layout.list_markers(out)) == 2  # the units finished ...
    assert layout.list_buckets(out) == []  # ... but no merged index
    for name in (layout.REPORT_NAME, "report.txt", naming.DROPPED_NAME):
        assert not os.path.exists(os.path.join(out, name))
