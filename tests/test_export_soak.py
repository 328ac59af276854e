"""Fault soak: one export to S3 (moto on loopback) while Ray workers die at random points
and the store answers 5xx, stalls, times out and loses answers to writes it applied, with
rival exporters started on the same ``--out`` at the start and mid-run.

It must end with exactly one writer, a finished export that ``verify --deep`` passes, and
bytes identical to an undisturbed run of the same unit plan. Every fault is drawn from one
seed (``PRX_SOAK_SEED`` overrides it; it is printed and named in every failure), per
request key, so a seed reproduces the same fault map whatever order the requests come in.
"""

from __future__ import annotations

import json
import os
import random
import re
import threading
import time
from collections import Counter
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
from prx_data.pipelines.write_mds import run_export

from prx_data.cli import verify as verify_cli
from prx_data.core import storage
from prx_data.core.runtime import RunOptions
from prx_data.export import naming
from prx_data.export.layout import content_digest, is_complete
from prx_data.export.naming import ExportError
from prx_data.export.prepare import plan_units, prepare_output
from prx_data.export.spec import ExportConfig
from prx_data.export.unit import export_unit
from prx_data.pipelines import write_mds
from tests.exportkit import finalize_reference
from tests.s3proxy import relay

pytestmark = [pytest.mark.faults, pytest.mark.remote, pytest.mark.ray]

#: The seed when ``PRX_SOAK_SEED`` is not set; its faults include an answer lost after the
#: store created the lease (a run that missed it refused itself and left the lease behind).
DEFAULT_SEED = 12
#: Seconds a botocore request may wait for an answer here; a long stall outlasts it.
READ_TIMEOUT_S = 2.0
#: Hard bound on the exporters (joined against it): a hang guard, generous for a loaded host.
DEADLINE_S = 300.0
#: Long stalls cost READ_TIMEOUT_S each, so a run gets at most this many.
MAX_LONG_STALLS = 3
#: Worker deaths per run (each costs a worker start-up).
KILLS = 2
#: Where a unit's worker dies: a function of prx_data.export.unit that dies at its n-th call
#: (the n-th image: before its sample is written; the manifest: after the shards and part
#: index are uploaded; the marker path: after the manifest), or "after": once the marker is
#: written, before Ray has the unit's result.
KILL_POINTS = ("prepare_with", "write_manifest", "marker_path", "after")
ROWS_PER_TASK = 2
#: A part-level index.json (streaming's upload) as opposed to a bucket's merged one (ours).
_PART_INDEX = re.compile(r"/f\d{6}-\d{9}/index\.json$")


def _jpeg(size: tuple[int, int], shade: int) -> bytes:
    import io

    from PIL import Image

    buf = io.BytesIO()
    Image.new("RGB", size, (shade, 90, 160)).save(buf, "JPEG")
    return buf.getvalue()


@pytest.fixture(scope="module")
def soak_table(tmp_path_factory) -> str:
    """Eight small images over two fragments: four units across several buckets."""
    from tests.tablekit import make_table

    sizes = [(600, 600), (1200, 600), (600, 1200), (800, 600)] * 2
    uri = str(tmp_path_factory.mktemp("soak") / "t.lance")
    items = [(f"s/{i}", _jpeg(s, 10 * i), f"caption {i}") for i, s in enumerate(sizes)]
    make_table(uri, items, max_rows_per_file=4)
    return uri


class SoakProxy(ThreadingHTTPServer):
    """Relays to moto; the first request for each key (method + path) may meet one fault.

    Faults: a 5xx answer, a short stall (answered late, within the timeout), or a long
    stall past the client's read timeout, either before the request reaches the store or
    after the store applied it (the answer is lost; the client retries a write that landed).
    Long stalls go only to requests of our own botocore client, whose read timeout the test
    sets (pyarrow's and streaming's clients would wait far longer). Every key meets at most
    one fault, so each retry loop ends. ``events`` records lease writes, lease deletes and
    shard uploads that landed, in order, for the one-writer check.
    """

    daemon_threads = True

    def __init__(self, upstream: int, seed: int):
        self.upstream = upstream
        self.seed = seed
        self.lock = threading.Lock()
        self.seen: set[tuple[str, str]] = set()
        self.injected: Counter = Counter()
        self.log: list[str] = []
        self.long_left = MAX_LONG_STALLS
        self.events: list[tuple[str, str]] = []
        self.first_shard = threading.Event()
        super().__init__(("127.0.0.1", 0), _SoakHandler)

    def fault_for(self, method: str, target: str, agent: str) -> str | None:
        """The fault for this request (``target``: path and query), drawn per key."""
        key = (method, target)
        # Drawn without the bucket's name (a fresh one per test), so a seed is reproducible.
        rng = random.Random(f"{self.seed}:{method}:{target.split('/', 2)[-1]}")
        r = rng.random()
        path = target.split("?", 1)[0]
        ours = "Botocore" in agent and not path.endswith(".mds") and not _PART_INDEX.search(path)
        if r < 0.15:
            fault = rng.choice(("500", "503"))
        elif r < 0.30:
            fault = "stall"
        elif r < 0.38 and ours and method in ("GET", "PUT", "DELETE"):
            fault = rng.choice(("timeout", "lost-answer")) if method != "GET" else "timeout"
        else:
            return None
        with self.lock:
            if key in self.seen:
                return None
            self.seen.add(key)
            if fault in ("timeout", "lost-answer"):
                if self.long_left == 0:
                    return None
                self.long_left -= 1
            self.injected[fault] += 1
            self.log.append(f"{fault} {method} {target}")
        return fault

    def record(self, method: str, path: str, status: int, body: bytes | None) -> None:
        if not 200 <= status < 300:
            return
        event = None
        if path.endswith(naming.LEASE_NAME) and method == "PUT" and body:
            event = ("lease", json.loads(body).get("owner", "?"))
        elif path.endswith(naming.LEASE_NAME) and method == "DELETE":
            event = ("free", "")
        elif path.endswith(".mds") and method == "PUT":
            event = ("shard", path)
        if event:
            with self.lock:
                self.events.append(event)
            if event[0] == "shard":
                self.first_shard.set()


class _SoakHandler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"

    def log_message(self, *args):
        pass

    def _answer(self, status: int, code: str) -> None:
        err = b"" if self.command == "HEAD" else f"<Error><Code>{code}</Code></Error>".encode()
        self.send_response(status)
        self.send_header("Content-Length", str(len(err)))
        self.end_headers()
        self.wfile.write(err)

    def _stall_and_drop(self) -> None:
        time.sleep(READ_TIMEOUT_S + 0.5)  # the client has given up by now
        self.close_connection = True

    def _forward(self):
        srv: SoakProxy = self.server  # type: ignore[assignment]
        path = self.path.split("?", 1)[0]
        n = int(self.headers.get("Content-Length") or 0)
        body = self.rfile.read(n) if n else None
        fault = srv.fault_for(self.command, self.path, self.headers.get("User-Agent", ""))
        if fault in ("500", "503"):
            self._answer(int(fault), "InternalError" if fault == "500" else "SlowDown")
            return
        if fault == "timeout":
            self._stall_and_drop()
            return
        if fault == "stall":
            time.sleep(random.Random(f"{srv.seed}:{self.path.split('/', 2)[-1]}").uniform(0.1, 0.6))
        if fault == "lost-answer":  # the store applies it; the answer never arrives
            status = _apply(srv.upstream, self, body)
            srv.record(self.command, path, status, body)
            self._stall_and_drop()
            return
        status = relay_status(self, srv.upstream, body)
        srv.record(self.command, path, status, body)

    do_GET = do_PUT = do_POST = do_HEAD = do_DELETE = _forward


def _apply(upstream: int, handler: BaseHTTPRequestHandler, body: bytes | None) -> int:
    """Send the request to the store and throw the answer away; its status."""
    import http.client

    conn = http.client.HTTPConnection("127.0.0.1", upstream, timeout=30)
    try:
        headers = {k: v for k, v in handler.headers.items() if k.lower() != "connection"}
        conn.request(handler.command, handler.path, body=body, headers=headers)
        resp = conn.getresponse()
        resp.read()
        return resp.status
    finally:
        conn.close()


def relay_status(handler: BaseHTTPRequestHandler, upstream: int, body: bytes | None) -> int:
    """:func:`tests.s3proxy.relay`, returning the status it relayed."""
    sent: list[int] = []
    original = handler.send_response

    def send_response(code, message=None):
        sent.append(code)
        original(code, message)

    handler.send_response = send_response  # type: ignore[method-assign]
    try:
        relay(handler, upstream, body)
    finally:
        handler.send_response = original  # type: ignore[method-assign]
    return sent[0] if sent else 0


def _check_one_writer(events: list[tuple[str, str]], why: str) -> list[str]:
    """Holders of the lease in order; fails if two held it at once or a shard landed outside
    the first holder's tenure (the only run with units to write)."""
    holders: list[str] = []
    current = None
    for kind, what in events:
        if kind == "lease":
            assert current in (None, what), f"two runs held the lease at once; {why}"
            if current is None:
                holders.append(what)
            current = what
        elif kind == "free":
            current = None
        else:
            assert current is not None and current == holders[0], (
                f"{what} uploaded outside the first lease holder's tenure; {why}"
            )
    assert current is None, f"the lease was left behind; {why}"
    return holders


# With -m slow (about 45 s alone): the default suite keeps its 15-minute budget, and checks
# the same fencing deterministically (tests/test_store_fencing.py, tests/test_export_lease.py).
@pytest.mark.slow
@pytest.mark.timeout(DEADLINE_S + 120)
def test_fault_soak_ends_with_one_writer_and_identical_bytes(
    soak_table, s3_bucket, moto_server, monkeypatch, tmp_path, ray_local
):
    seed = int(os.environ.get("PRX_SOAK_SEED") or DEFAULT_SEED)
    t0 = time.monotonic()
    pinned = {"rows_per_task": ROWS_PER_TASK, "min_units": 1}
    # The undisturbed run: every unit in this process, no Ray, no store.
    ref = prepare_output(ExportConfig(table=soak_table, out=str(tmp_path / "ref"), **pinned)).cfg
    units = sorted(plan_units(ref), key=lambda u: u.part)
    finalize_reference(ref, {u.part: export_unit(ref, u) for u in units})

    rng = random.Random(seed)
    crashes = {}
    for u in rng.sample(units, KILLS):
        point = rng.choice(KILL_POINTS)
        crashes[u.part] = (point, rng.randint(1, u.count) if point == "prepare_with" else 1)
    port = int(moto_server.rsplit(":", 1)[1])
    proxy = SoakProxy(port, seed)
    why = f"seed={seed} (PRX_SOAK_SEED), kills={crashes}"
    print(f"fault soak: {why}")
    flags = str(tmp_path / "died")
    os.makedirs(flags)

    class DieOnce(write_mds._ExportTask):  # local class: cloudpickle ships it by value
        def __call__(self, row: dict) -> dict:
            from prx_data.export import unit as U

            part = naming.part_name(int(row["fragment_id"]), int(row["start"]))
            point, nth = crashes.get(part, (None, 0))
            if point:
                try:
                    os.close(os.open(os.path.join(flags, part), os.O_CREAT | os.O_EXCL))
                except FileExistsError:
                    point = None  # the retry: run as usual
            if point and point != "after":
                original, calls = getattr(U, point), [0]

                def die_at_nth(*a, **k):
                    calls[0] += 1
                    if calls[0] >= nth:
                        os._exit(1)  # the worker dies right there
                    return original(*a, **k)

                setattr(U, point, die_at_nth)
            try:
                out = super().__call__(row)
            finally:
                if point and point != "after":
                    setattr(U, point, original)
            if point == "after":
                os._exit(1)
            return out

    monkeypatch.setattr(write_mds, "_ExportTask", DieOnce)
    monkeypatch.setenv("S3_ENDPOINT_URL", f"http://127.0.0.1:{proxy.server_address[1]}")
    monkeypatch.setenv("S3_READ_TIMEOUT_S", str(READ_TIMEOUT_S))
    monkeypatch.setenv("S3_CONNECT_TIMEOUT_S", "2")
    out = f"s3://{s3_bucket}/soak"
    cfg = ExportConfig(table=soak_table, out=out, **pinned)
    outcomes: dict[str, object] = {}
    start = threading.Barrier(2)

    def exporter(name: str, wait: threading.Barrier | None) -> None:
        try:
            if wait is not None:
                wait.wait(timeout=30)
            outcomes[name] = run_export(cfg, RunOptions(progress=False, engine="ray"))
        except BaseException as e:  # noqa: BLE001 - the outcome is what the test checks
            outcomes[name] = e

    threading.Thread(target=proxy.serve_forever, daemon=True).start()
    try:
        runs = [threading.Thread(target=exporter, args=(n, start), daemon=True) for n in ("a", "b")]
        for t in runs:
            t.start()
        # A third exporter once the writer is uploading shards.
        while not proxy.first_shard.wait(0.2):
            assert time.monotonic() - t0 < DEADLINE_S, f"no shard was uploaded; {why}"
            if not any(t.is_alive() for t in runs):
                break
        runs.append(threading.Thread(target=exporter, args=("mid-run", None), daemon=True))
        runs[-1].start()
        for t in runs:
            t.join(timeout=max(1.0, DEADLINE_S - (time.monotonic() - t0)))
        assert not any(t.is_alive() for t in runs), f"still running after {DEADLINE_S} s; {why}"
    finally:
        proxy.shutdown()
        proxy.server_close()
    seconds = time.monotonic() - t0
    print(f"fault soak: {seconds:.1f} s, injected {dict(proxy.injected)}:", *proxy.log, sep="\n  ")

    finished = {n: r for n, r in outcomes.items() if not isinstance(r, BaseException)}
    refused = {n: r for n, r in outcomes.items() if isinstance(r, BaseException)}
    assert len(finished) == 1, f"{len(finished)} runs finished: {outcomes}; {why}"
    assert "mid-run" not in finished, f"{outcomes}; {why}"
    for name, err in refused.items():  # refused by the lease, or waited and found it complete
        assert isinstance(err, ExportError), f"{name}: {err!r}; {why}"
        assert re.search("holds the lease|holds a complete export", str(err)), f"{name}: {err}"
    holders = _check_one_writer(proxy.events, why)
    assert holders, f"nobody held the lease; {why}"
    assert sorted(os.listdir(flags)) == sorted(crashes), f"not every worker died; {why}"
    assert proxy.injected["500"] + proxy.injected["503"] and proxy.injected["stall"], why

    monkeypatch.setenv("S3_ENDPOINT_URL", moto_server)  # read back without faults
    assert is_complete(out), why
    assert not storage.exists(storage.join(out, naming.LEASE_NAME)), why
    assert content_digest(out) == content_digest(ref.out), f"bytes differ; {why}"
    assert verify_cli.main([out, "--deep", "--no-progress"]) == 0, why
