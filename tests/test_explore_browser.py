"""The explorer end to end in headless Chromium: search, click, neighbours, no XSS, no rebinding.

Needs Debian's chromium at /usr/bin/chromium (``apt-get install -y chromium``)
and the PyPI ``playwright`` package; no browser download. The screenshot is
kept as artifacts/explore.png.
"""

from __future__ import annotations

import os
import shutil
from urllib.parse import parse_qs, urlparse

import pytest

from tests.explore_kit import (
    XSS_CAPTION,
    make_enriched_table,
    make_explore_table,
    make_scored_table,
    running_server,
)

CHROMIUM = "/usr/bin/chromium"
#: A foreign name the browser resolves to loopback, as a DNS-rebinding attack makes it do.
REBIND_HOST = "rebind.test"
ARTIFACTS = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "artifacts")

pytestmark = [
    pytest.mark.browser,
    pytest.mark.skipif(
        not (os.path.exists(CHROMIUM) or shutil.which("chromium")),
        reason="Debian chromium is not installed (apt-get install -y chromium)",
    ),
]


def _launch(p):
    return p.chromium.launch(
        executable_path=CHROMIUM if os.path.exists(CHROMIUM) else shutil.which("chromium"),
        headless=True,
        args=[
            "--no-sandbox",
            "--disable-gpu",
            "--disable-background-networking",
            "--disable-component-update",
            "--disable-sync",
            "--no-first-run",
            "--no-proxy-server",
            f"--host-resolver-rules=MAP {REBIND_HOST} 127.0.0.1",
        ],
    )


def test_search_click_neighbours_and_no_xss(tmp_path):
    sync_api = pytest.importorskip("playwright.sync_api")
    uri = str(tmp_path / "t.lance")
    make_explore_table(uri)
    with running_server(uri, build_indexes=True) as (url, _), sync_api.sync_playwright() as p:
        browser = _launch(p)
        try:
            # The page's CSP forbids eval, so this part sticks to selectors and attributes.
            page = browser.new_page(viewport={"width": 1200, "height": 900})
            errors: list[str] = []
            thumbs: dict[str, tuple[int, str]] = {}
            page.on("pageerror", lambda e: errors.append(str(e)))

            def on_response(r) -> None:
                if "/api/thumb" in r.url:
                    row_id = parse_qs(urlparse(r.url).query).get("id", [""])[0]
                    thumbs[row_id] = (r.status, r.headers.get("content-type", ""))

            page.on("response", on_response)
            inflight = {"now": 0, "max": 0}

            def started(r) -> None:
                if "/api/thumb" in r.url:
                    inflight["now"] += 1
                    inflight["max"] = max(inflight["max"], inflight["now"])

            def ended(r) -> None:
                if "/api/thumb" in r.url:
                    inflight["now"] -= 1

            page.on("request", started)
            page.on("requestfinished", ended)
            page.on("requestfailed", ended)
            page.goto(url + "/")
            page.wait_for_selector("body[data-ready='1']")

            # Type a query: the grid shows exactly the matching thumbnails.
            page.fill("#q", "green")
            page.wait_for_selector("#results[data-query='green']")
            assert _ids(page, "#results") == [f"t/green{i}" for i in range(4)]
            page.wait_for_load_state("networkidle")
            assert all(thumbs.get(f"t/green{i}") == (200, "image/jpeg") for i in range(4))
            # Thumbnails never take all six connections: a search always has one free.
            assert 1 <= inflight["max"] <= 4

            # Click one: its neighbours are the other green squares.
            page.click("#results figure.card[data-id='t/green2']")
            page.wait_for_selector("#neighbours[data-for='t/green2']")
            neigh = _ids(page, "#neighbours", sort=False)
            assert set(neigh[:3]) == {"t/green0", "t/green1", "t/green3"}
            assert page.text_content("#selected-id") == "t/green2"

            # A caption full of markup is shown as text and runs nothing.
            page.fill("#q", "evil")
            page.wait_for_selector("#results[data-query='evil']")
            assert page.text_content("#results figure.card .caption") == XSS_CAPTION
            assert page.locator("#results script").count() == 0
            assert page.title() != "pwned"

            # Filters: the tier drop-down narrows the grid.
            page.fill("#q", "")
            page.select_option("#tier", "512")
            page.wait_for_selector("#status:has-text('0 images')")

            # The screenshot: a search with a clicked image and its neighbours.
            page.select_option("#tier", "")
            page.fill("#q", "square")
            page.wait_for_selector("#results[data-query='square']")
            page.click("#results figure.card[data-id='t/blue1']")
            page.wait_for_selector("#neighbours[data-for='t/blue1']")
            page.wait_for_load_state("networkidle")
            os.makedirs(ARTIFACTS, exist_ok=True)
            shot = os.path.join(ARTIFACTS, "explore.png")
            page.screenshot(path=shot, full_page=True)
            assert os.path.getsize(shot) > 10_000
            assert errors == []

            # Escaping does not rely on the CSP: with the CSP bypassed, still nothing runs.
            loose = browser.new_page(bypass_csp=True)
            loose.goto(url + "/")
            loose.wait_for_selector("body[data-ready='1']")
            loose.fill("#q", "evil")
            loose.wait_for_selector("#results[data-query='evil']")
            loose.wait_for_load_state("networkidle")
            assert loose.evaluate("window.__xss") is None
            assert loose.title() != "pwned"

            # DNS rebinding: a foreign name that resolves to 127.0.0.1 gets a 421, never data.
            port = urlparse(url).port
            evil = browser.new_page()
            for path in ("/", "/api/search?q=green", "/api/thumb?id=t%2Fgreen0"):
                resp = evil.goto(f"http://{REBIND_HOST}:{port}{path}")
                assert resp is not None and resp.status == 421, path
                body = resp.text()
                assert "not served here" in body and "t/green" not in body
            # The same browser on a loopback name is served.
            resp = evil.goto(f"http://localhost:{port}/api/search?q=green")
            assert resp is not None and resp.status == 200 and "t/green0" in resp.text()
        finally:
            browser.close()


def test_cards_id_search_duplicates_and_paging(tmp_path):
    sync_api = pytest.importorskip("playwright.sync_api")
    uri = make_enriched_table(str(tmp_path / "rich.lance"))
    with (
        running_server(uri, page_size=6, build_indexes=True) as (url, _),
        sync_api.sync_playwright() as p,
    ):
        browser = _launch(p)
        try:
            page = browser.new_page(viewport={"width": 1280, "height": 1000})
            errors: list[str] = []
            page.on("pageerror", lambda e: errors.append(str(e)))
            page.goto(url + "/")
            page.wait_for_selector("body[data-ready='1']")
            page.wait_for_selector("#results figure.card")

            # Paging: six per page, the next page holds six others, the last one the rest.
            first = _ids(page, "#results")
            assert len(first) == 6 and page.is_disabled("#prev")
            page.click("#next")
            page.wait_for_selector("#results[data-offset='6']")
            second = _ids(page, "#results")
            assert len(second) == 6 and not set(first) & set(second)
            page.click("#next")
            page.wait_for_selector("#results[data-offset='12']")
            assert len(_ids(page, "#results")) == 3 and page.is_disabled("#next")
            # The transparent overlay is flagged blank on its card.
            overlay = page.locator("#results figure.card[data-id='t/overlay']")
            assert overlay.locator(".badge.blank").is_visible()
            page.wait_for_load_state("networkidle")
            os.makedirs(ARTIFACTS, exist_ok=True)
            page.screenshot(path=os.path.join(ARTIFACTS, "explore_last_page.png"), full_page=True)
            page.click("#prev")
            page.wait_for_selector("#results[data-offset='6']")

            # An id typed into the search box finds that row; its card shows the id as text.
            page.fill("#q", "t/red2")
            page.wait_for_selector("#results[data-query='t/red2']")
            card = page.locator("#results figure.card").first
            assert card.get_attribute("data-id") == "t/red2"
            assert card.locator(".rid").text_content() == "t/red2"
            assert card.locator(".rid").is_visible()
            # Labels, the duplicate state with a link to its keeper, and every caption column.
            chips = card.locator(".chip").all_text_contents()
            assert "label: visual" in chips
            assert not [c for c in chips if c.startswith(("source:", "caption_vlm_status:"))]
            assert card.locator(".dup a.keeper").text_content() == "t/red0"
            tabs = card.locator(".tab")
            assert [tabs.nth(i).text_content() for i in range(tabs.count())] == [
                "caption",
                "caption_vlm",
            ]
            assert card.locator(".caption").text_content() == "a red square 2"
            card.locator(".tab[data-column='caption_vlm']").click()
            assert card.locator(".caption").text_content() == "vlm says t/red2 crimson"
            assert page.locator("#similar-panel").is_hidden()  # a tab is not a card click
            page.screenshot(path=os.path.join(ARTIFACTS, "explore_cards.png"), full_page=True)

            # Following the keeper link shows the keeper.
            card.locator(".dup a.keeper").click()
            page.wait_for_selector("#results[data-query='t/red0']")
            assert page.locator("#results figure.card").first.get_attribute("data-id") == "t/red0"

            # The typed dup_of field (not a drop-down) lists a keeper's duplicates.
            page.fill("#q", "")
            page.fill("#field-dup_of", "t/red0")
            page.wait_for_selector("#status:has-text('2 images (browse)')")
            assert _ids(page, "#results") == ["t/red1", "t/red2"]
            assert page.locator("select#label-dup_of").count() == 0
            assert errors == []
        finally:
            browser.close()


def test_score_filter_sort_and_cluster_strip(tmp_path):
    sync_api = pytest.importorskip("playwright.sync_api")
    uri = str(tmp_path / "scored.lance")
    scores = make_scored_table(uri)
    ranked = [k for v, k in sorted((v, k) for k, v in scores.items() if v is not None)]
    with running_server(uri, page_size=5) as (url, _), sync_api.sync_playwright() as p:
        browser = _launch(p)
        try:
            page = browser.new_page(viewport={"width": 1280, "height": 1000})
            errors: list[str] = []
            page.on("pageerror", lambda e: errors.append(str(e)))
            page.goto(url + "/")
            page.wait_for_selector("body[data-ready='1']")
            # Sort by a score, high first: the cards come in score order and show the value.
            page.select_option("#score", "clip_score")
            page.select_option("#sort", "desc")
            page.wait_for_selector(f"#results figure.card[data-id='{ranked[-1]}']:first-child")
            assert _ids(page, "#results", sort=False) == ranked[::-1][:5]
            first = page.locator("#results figure.card").first
            assert first.locator(".chip.score").text_content() == "clip_score: 1.10"
            # A minimum narrows the grid; low first reverses it.
            page.fill("#score-min", "0.8")
            page.select_option("#sort", "asc")
            page.wait_for_selector("#status:has-text('4 images (browse)')")
            assert _ids(page, "#results", sort=False) == ranked[-4:]
            assert "min.clip_score=0.8" in page.url and "sort=clip_score" in page.url
            # A card's near duplicates side by side, the one semantic dedup keeps marked.
            page.fill("#score-min", "")
            page.select_option("#score", "")
            page.fill("#q", "t/red0")
            page.wait_for_selector("#results[data-query='t/red0']")
            page.click("#results figure.card[data-id='t/red0']")
            page.click("#show-cluster")
            page.wait_for_selector("#cluster[data-for='t/red0']")
            assert _ids(page, "#cluster", sort=False) == ["t/red1", "t/red0", "t/red2"]
            kept = page.locator("#cluster figure.card[data-id='t/red1'] .badge.kept")
            assert kept.is_visible()
            assert "semantic dedup keeps t/red1" in page.text_content("#cluster-head")
            page.wait_for_load_state("networkidle")
            os.makedirs(ARTIFACTS, exist_ok=True)
            page.screenshot(path=os.path.join(ARTIFACTS, "explore_cluster.png"), full_page=True)
            assert errors == []
        finally:
            browser.close()


def _ids(page, container: str, sort: bool = True) -> list[str]:
    ids = [
        el.get_attribute("data-id") for el in page.query_selector_all(f"{container} figure.card")
    ]
    return sorted(ids) if sort else ids
