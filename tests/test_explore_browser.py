"""The explorer end to end in headless Chromium: search, click, neighbours, no XSS.

Needs Debian's chromium at /usr/bin/chromium (``apt-get install -y chromium``)
and the PyPI ``playwright`` package; no browser download. The screenshot is
kept as artifacts/explore.png.
"""

from __future__ import annotations

import os
import shutil
from urllib.parse import parse_qs, urlparse

import pytest

from tests.explore_kit import XSS_CAPTION, make_explore_table, running_server

CHROMIUM = "/usr/bin/chromium"
ARTIFACTS = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "artifacts")

pytestmark = [
    pytest.mark.browser,
    pytest.mark.skipif(
        not (os.path.exists(CHROMIUM) or shutil.which("chromium")),
        reason="Debian chromium is not installed (apt-get install -y chromium)",
    ),
]


def test_search_click_neighbours_and_no_xss(tmp_path):
    sync_api = pytest.importorskip("playwright.sync_api")
    uri = str(tmp_path / "t.lance")
    make_explore_table(uri)
    with running_server(uri) as (url, _), sync_api.sync_playwright() as p:
        browser = p.chromium.launch(
            executable_path=CHROMIUM if os.path.exists(CHROMIUM) else shutil.which("chromium"),
            headless=True,
            args=[
                "--no-sandbox",
                "--disable-gpu",
                "--disable-background-networking",
                "--disable-component-update",
                "--disable-sync",
                "--no-first-run",
            ],
        )
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
            page.goto(url + "/")
            page.wait_for_selector("body[data-ready='1']")

            # Type a query: the grid shows exactly the matching thumbnails.
            page.fill("#q", "green")
            page.wait_for_selector("#results[data-query='green']")
            assert _ids(page, "#results") == [f"t/green{i}" for i in range(4)]
            page.wait_for_load_state("networkidle")
            assert all(thumbs.get(f"t/green{i}") == (200, "image/jpeg") for i in range(4))

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
        finally:
            browser.close()


def _ids(page, container: str, sort: bool = True) -> list[str]:
    ids = [
        el.get_attribute("data-id") for el in page.query_selector_all(f"{container} figure.card")
    ]
    return sorted(ids) if sort else ids
