"""The web page at / in a real headless browser (Debian's chromium, driven by playwright; the
README's test command installs both): ask over the served index, the answer streams in, then the
sources with scores and the TTFT and cached/computed tokens."""
import os
import shutil

import pytest

QUESTION = "In what year was the Marrow Point Lighthouse completed?"


def chromium_path() -> str:
    path = os.environ.get("LAZY_RAG_CHROMIUM") or shutil.which("chromium") or shutil.which("chromium-browser")
    if not path:
        pytest.fail("No chromium found: install it (`apt-get install chromium`; the README's test command, "
                    "install.sh --browser, does) or set LAZY_RAG_CHROMIUM to a Chromium binary.")
    return path


def test_page_asks_streams_and_shows_sources(served, corpus_index, no_server_errors):
    from playwright.sync_api import sync_playwright

    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=chromium_path(), headless=True,
                                    args=["--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage"])
        try:
            page = browser.new_page()
            errors = []
            page.on("pageerror", lambda e: errors.append(str(e)))
            page.goto(served.base_url + "/")
            page.wait_for_function("document.getElementById('served').textContent.includes('indexed chunks')")
            assert page.locator("#mode option").count() == 4
            page.fill("#question", QUESTION)
            page.fill("#top-k", "3")
            page.fill("#max-tokens", "32")
            page.click("#send")
            page.wait_for_function("document.getElementById('stats').textContent.startsWith('TTFT')", timeout=120_000)
            answer = page.inner_text("#answer")
            want = corpus_index.query(QUESTION, top_k=3, max_new_tokens=32).answer
            assert answer.strip() == want.strip()
            rows = page.locator("#sources tbody tr")
            assert rows.count() == 3
            assert "lighthouse.md" in rows.nth(0).inner_text()
            stats = page.inner_text("#stats")
            assert "from cached KV" in stats and "computed" in stats
            assert page.is_hidden("#error") and not errors
        finally:
            browser.close()
