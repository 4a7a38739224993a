"""The engine in its own process: the HTTP process holds no weights, answers equal the in-process
``LazyLLM.generate``, and a dead engine process gives clean 503s (never a traceback) and a 503
/ready. (Disconnects freeing the child's pages: test_limits; every OpenAI route: test_openai_api,
whose server runs the engine in its own process.)"""
import logging
import os
import signal
import threading
import time

import httpx
import pytest

from lazy_rag.chat import render_messages
from lazy_rag.server.prompts import Document, chat_with_documents

HTTP = httpx.Client(timeout=120)
CHAT = "/v1/chat/completions"


def test_http_process_holds_no_weights(served):
    from lazy_rag.server.remote_model import RemoteModel

    state = served.state
    assert isinstance(state.llm, RemoteModel) and not hasattr(state.llm, "model")
    assert state.index.llm is state.llm  # the index's metadata and embedder, over the tokenizer only
    assert state.driver.engine_pid not in (None, os.getpid())
    info = HTTP.get(served.base_url + "/info").json()
    assert info["engine_process"] == state.driver.engine_pid and info["context_window"] == 8192


@pytest.mark.parametrize("engine_process", [True, False], ids=["engine_process", "in_process"])
def test_answers_equal_in_process_generate(start_server, smollm2, engine_process, no_server_errors):
    """Greedy answers through either driver equal ``LazyLLM.generate`` on the same prompt: the
    server tokenizes (documents through its cache) exactly as the engine would."""
    s = start_server(smollm2, engine_process=engine_process)
    question = [("user", "Which colour is the ferry?")]
    docs = [Document("The ferry to Port Sallow is painted a deep green.", "Ferry"),
            Document("The Marrow Point Lighthouse was completed in 1871.")]
    want = smollm2.generate(chat_with_documents(smollm2.tokenizer, question, docs), max_new_tokens=10).text
    body = {"model": s.model, "max_tokens": 10, "temperature": 0,
            "messages": [{"role": r, "content": c} for r, c in question],
            "documents": [{"title": "Ferry", "text": docs[0].text}, docs[1].text]}
    for _ in range(2):  # the second time the documents' ids come from the cache, their KV from the pool
        r = HTTP.post(s.base_url + CHAT, json=body).json()
        assert r["choices"][0]["message"]["content"] == want
    assert r["lazy_rag"]["encoded_tokens"] == 0 and s.state.builder.documents.hits >= 2
    plain = smollm2.generate([render_messages(smollm2.tokenizer, question)], max_new_tokens=10).text
    r = HTTP.post(s.base_url + "/v1/completions", json={"model": s.model, "max_tokens": 10, "temperature": 0,
                                                         "prompt": render_messages(smollm2.tokenizer, question)})
    assert r.json()["choices"][0]["text"] == plain


def assert_clean_503(r):
    assert r.status_code == 503, r.text
    err = r.json()["error"]
    assert err["code"] == "engine_unavailable" and "Traceback" not in err["message"] and 'File "' not in err["message"]


def test_engine_process_death_gives_503_without_traceback(start_server, smollm2, caplog):
    """With restarts off (restarts: test_supervision)."""
    from lazy_rag.server.engine_process import RestartPolicy

    caplog.set_level(logging.WARNING)
    s = start_server(smollm2, engine_process=True, engine_restart=RestartPolicy(attempts=0))
    assert HTTP.get(s.base_url + "/ready").status_code == 200
    long = {"model": s.model, "prompt": "1, 2, 3, 4, 5, 6, 7,", "max_tokens": 400, "temperature": 0}
    whole = []  # a non-streamed request in flight when the engine dies
    waiter = threading.Thread(target=lambda: whole.append(HTTP.post(s.base_url + "/v1/completions", json=long)))
    with httpx.Client(timeout=60) as c:
        with c.stream("POST", s.base_url + "/v1/completions", json={**long, "stream": True}) as r:
            assert r.status_code == 200
            lines = r.iter_lines()
            assert any(next(lines).startswith("data: ") for _ in range(4))
            waiter.start()
            time.sleep(0.5)
            os.kill(s.state.driver.engine_pid, signal.SIGKILL)
            events = [line for line in lines if line]
    waiter.join(60)
    # the stream had sent its headers (200): it ends with an OpenAI error event, then [DONE]
    assert events[-1] == "data: [DONE]"
    assert '"code": "engine_unavailable"' in events[-2] and "Traceback" not in "".join(events)
    assert_clean_503(whole[0])
    assert HTTP.get(s.base_url + "/ready").status_code == 503
    assert HTTP.get(s.base_url + "/ready").json() == {"status": "engine_unavailable"}
    assert_clean_503(HTTP.post(s.base_url + CHAT, json={"model": s.model, "max_tokens": 2,
                                                          "messages": [{"role": "user", "content": "Hi"}]}))
    assert HTTP.get(s.base_url + "/health").status_code == 200  # the process is alive; the engine is not
    assert "lazy_rag_engine_up 0.0" in HTTP.get(s.base_url + "/metrics").text
    assert s.state.driver.in_flight == 0
    errors = [r for r in caplog.records if r.levelno >= logging.ERROR]
    assert [r.getMessage() for r in errors if "engine process died" in r.getMessage()]
    assert not [r for r in errors if r.exc_info], "a traceback was logged"
