"""Per-host limits across fetch processes: every fetcher leases slots from one HostSlots."""

from __future__ import annotations

import threading
import time

import pytest

from prx_data.download import fetch as F
from tests.downloadkit import ImageServer


def test_slots_never_exceed_per_host_across_holders_and_expire():
    slots = F.HostSlots(3, ttl=0.2)
    assert slots.acquire("a", {"h": 5, "g": 1}) == {"h": 3, "g": 1}
    assert slots.acquire("b", {"h": 5, "g": 4}) == {"g": 2}
    assert slots.acquire("a", {"h": 5}) == {}  # no more than per_host
    assert slots.in_use() == {"h": 3, "g": 3}
    slots.give_back("a", "h")
    assert slots.acquire("b", {"h": 5}) == {"h": 1}
    slots.release("a")
    assert slots.acquire("b", {"h": 2}) == {"h": 2}
    assert slots.in_use() == {"h": 3, "g": 2}
    time.sleep(0.3)  # b stopped renewing: a killed task does not hold a host forever
    assert slots.in_use() == {}
    assert slots.acquire("c", {"h": 9}) == {"h": 3}
    slots.renew("c")
    slots.release("c")
    assert slots.in_use() == {}


def _two_fetchers(srv: ImageServer, slots) -> list[list[F.FetchResult]]:
    """Two fetchers (as two fetch tasks would have), each per_host=2, fetching at once."""
    cfg = F.FetchConfig(allow=srv.allow, per_host=2, threads=8, retries=0)
    urls = [srv.url(f"/slow/{i}") for i in range(12)]
    out: list = [None, None]

    def run(k: int) -> None:
        fetcher = F.Fetcher(cfg)
        try:
            out[k] = (
                fetcher.fetch_many(urls)
                if slots is None
                else F.fetch_with_slots(fetcher, urls, slots, poll=0.01)
            )
        finally:
            fetcher.close()

    threads = [threading.Thread(target=run, args=(k,)) for k in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    return out


@pytest.mark.parametrize("shared", [False, True])
def test_per_host_holds_across_fetchers_only_with_shared_slots(shared):
    with ImageServer() as srv:
        results = _two_fetchers(srv, F.HostSlots(2) if shared else None)
        peak = srv.max_inflight
    assert all(r.status == F.OK for rs in results for r in rs)
    if shared:
        assert peak <= 2
    else:  # each fetcher holds its own limit: together they pass it
        assert peak > 2


def test_a_holder_keeps_to_the_slots_it_was_granted():
    """Another task holds 3 of the host's 4 slots: this one fetches one row at a time."""
    with ImageServer() as srv:
        slots = F.HostSlots(4)
        assert slots.acquire("other task", {"127.0.0.1": 3}) == {"127.0.0.1": 3}
        fetcher = F.Fetcher(F.FetchConfig(allow=srv.allow, per_host=4, threads=8, retries=0))
        try:
            urls = [srv.url(f"/slow/{i}") for i in range(6)]
            got = F.fetch_with_slots(fetcher, urls, slots, poll=0.01)
        finally:
            fetcher.close()
        assert all(r.status == F.OK for r in got) and srv.max_inflight == 1
        assert slots.in_use() == {"127.0.0.1": 3}  # its own slot went back, the others' stay
