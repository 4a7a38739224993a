"""The web page at / in a real headless browser (Debian's chromium, driven by playwright; the
README's test command installs both): ask over the served index, the answer streams in, then the
sources with scores and the TTFT and cached/computed tokens."""
import json
import os
import shutil

import httpx
import pytest

QUESTION = "In what year was the Marrow Point Lighthouse completed?"


def chromium_path() -> str:
    path = os.environ.get("LAZY_RAG_CHROMIUM") or shutil.which("chromium") or shutil.which("chromium-browser")
    if not path:
        pytest.fail("No chromium found: install it (`apt-get install chromium`; the README's test command, "
                    "install.sh --browser, does) or set LAZY_RAG_CHROMIUM to a Chromium binary.")
    return path


def test_page_asks_streams_and_shows_sources(served, no_server_errors):
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
            # the page shows what the server answers to the same request (the server's answers
            # against in-process generation are tests/server/test_openai_api.py's; an in-process
            # answer here could run with other CPU threads than the engine process, and a near
            # tie between two tokens can then go the other way)
            body = {"model": "smollm2", "temperature": 0, "max_tokens": 32, "mode": "lazy", "rag": {"top_k": 3},
                    "messages": [{"role": "user", "content": QUESTION}]}
            want = httpx.post(served.base_url + "/v1/chat/completions", json=body, timeout=120).json()
            assert answer.strip() == want["choices"][0]["message"]["content"].strip()
            rows = page.locator("#sources tbody tr")
            assert rows.count() == 3
            assert "lighthouse.md" in rows.nth(0).inner_text()
            stats = page.inner_text("#stats")
            assert "from cached KV" in stats and "computed" in stats
            assert page.is_hidden("#error") and not errors
        finally:
            browser.close()


HOSTILE = '<img src=x onerror="window.pwned=1"><script>window.pwned=2</script><b>bold</b>'


def test_page_renders_answers_sources_and_errors_as_text(start_server, no_server_errors):
    """A document (or an answer quoting one) holding HTML or script is shown as its text: nothing
    in it runs or becomes an element. The server's answers are replaced (a browser route) by
    ones carrying such text in every field the page shows."""
    from playwright.sync_api import sync_playwright

    from tests.server.word_model import word_llm

    s = start_server(word_llm(), model_name="m", engine_process=False)
    chunk = {"id": "x", "object": "chat.completion.chunk", "created": 0, "model": "m"}
    events = [
        {**chunk, "choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}, "finish_reason": None}]},
        {**chunk, "choices": [{"index": 0, "delta": {"content": HOSTILE[:20]}, "finish_reason": None}]},
        {**chunk, "choices": [{"index": 0, "delta": {"content": HOSTILE[20:]}, "finish_reason": None}]},
        {**chunk, "choices": [{"index": 0, "delta": {}, "finish_reason": "stop"}],
         "sources": [{"chunk_id": HOSTILE, "source": HOSTILE, "score": 0.5, "text": HOSTILE}],
         "lazy_rag": {"mode": HOSTILE, "recovery": "", "ttft_ms": 1.0, "cached_tokens": 1, "encoded_tokens": 0,
                      "computed_tokens": 1}}]
    sse = "".join(f"data: {json.dumps(e)}\n\n" for e in events) + "data: [DONE]\n\n"
    info = {"model": "m", "modes": ["lazy"], "default_mode": "lazy", "device": HOSTILE,
            "index": {"path": HOSTILE, "chunks": 3}}
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=chromium_path(), headless=True,
                                    args=["--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage"])
        try:
            page = browser.new_page()
            errors = []
            page.on("pageerror", lambda e: errors.append(str(e)))
            page.route("**/info", lambda route: route.fulfill(json=info))
            answers = iter([
                dict(status=200, body=sse, headers={"Content-Type": "text/event-stream"}),
                dict(status=400, json={"error": {"message": HOSTILE, "type": "invalid_request_error"}})])
            page.route("**/v1/chat/completions", lambda route: route.fulfill(**next(answers)))
            page.goto(s.base_url + "/")
            page.wait_for_function("document.getElementById('served').textContent.includes('indexed chunks')")
            page.fill("#question", "Q ?")
            page.click("#send")
            page.wait_for_function("document.getElementById('stats').textContent.startsWith('TTFT')")
            assert page.inner_text("#answer") == HOSTILE
            cells = page.locator("#sources tbody td")
            assert cells.nth(2).inner_text() == HOSTILE and cells.nth(3).inner_text() == HOSTILE
            assert HOSTILE in page.inner_text("#served") and HOSTILE in page.inner_text("#stats")
            page.click("#send")  # the second answer: an error whose message holds the markup
            page.wait_for_function("!document.getElementById('error').hidden")
            assert page.inner_text("#error") == "400: " + HOSTILE
            assert page.evaluate("document.querySelectorAll('main img, main script, main b').length") == 0
            assert page.evaluate("window.pwned") is None and not errors
        finally:
            browser.close()
