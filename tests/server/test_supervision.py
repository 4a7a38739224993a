"""A dead engine process is replaced: killed mid-stream under load, every request in flight ends
with a clean 503 (an error event in a stream), /ready says the engine is restarting, a new
process loads the model and the server answers again, with the same greedy answers; a crash loop
spends the bounded attempts and leaves the server unavailable (503), never half-up."""
import os
import signal
import threading
import time

import httpx
import pytest

from lazy_rag.errors import LazyRagError
from lazy_rag.server import EngineSpec, engine_process
from lazy_rag.server.engine_process import RestartPolicy
from tests.server.word_model import WORDS, word_tokenizer

HTTP = httpx.Client(timeout=120)
COMPLETIONS = "/v1/completions"


def wait_ready(url: str, timeout: float = 120) -> list[str]:
    """The /ready statuses seen until it answers 200."""
    seen, deadline = [], time.time() + timeout
    while True:
        r = HTTP.get(url + "/ready")
        seen.append(r.json()["status"])
        if r.status_code == 200:
            return seen
        assert time.time() < deadline, f"not ready after {timeout} s: {seen[-3:]}"
        time.sleep(0.1)


def test_engine_process_killed_mid_stream_is_restarted(start_server, tmp_path, caplog, monkeypatch):
    folder = tmp_path / "tokenizer"
    word_tokenizer().save_pretrained(folder)
    spec = EngineSpec(random="tiny-llama", tokenizer=str(folder), device="cpu")
    # two starts in a row at most; a child that served less than a minute counts against them
    s = start_server(spec, model_name="m", engine_restart=RestartPolicy(attempts=2, backoff_s=0.05, stable_s=60))
    url = s.base_url
    prompt = {"model": "m", "prompt": " ".join(WORDS[:20]), "temperature": 0}
    before = HTTP.post(url + COMPLETIONS, json={**prompt, "max_tokens": 12}).json()["choices"][0]["text"]
    first_pid = s.state.driver.engine_pid

    streams, started = [], threading.Barrier(7)

    def stream(i):
        events = []
        with httpx.Client(timeout=120) as c:
            with c.stream("POST", url + COMPLETIONS, json={**prompt, "max_tokens": 4000, "stream": True,
                                                           "prompt": f"{WORDS[i]} {prompt['prompt']}"}) as r:
                lines = r.iter_lines()
                events.append(r.status_code)
                for line in lines:
                    if not line:
                        continue
                    events.append(line)
                    if len(events) == 4:  # three events in: wait for the others, then the kill
                        started.wait(60)
        streams.append(events)

    threads = [threading.Thread(target=stream, args=(i,)) for i in range(6)]
    for t in threads:
        t.start()
    started.wait(60)  # six streams under way, each has had a few tokens
    os.kill(first_pid, signal.SIGKILL)
    for t in threads:
        t.join(60)
    assert len(streams) == 6
    for events in streams:
        assert events[0] == 200 and events[-1] == "data: [DONE]", events[-3:]
        assert '"code": "engine_unavailable"' in events[-2] and "Traceback" not in "".join(events[1:])
    seen = wait_ready(url)
    assert seen[0] == "engine_restarting" and seen[-1] == "ready", seen
    assert s.state.driver.engine_pid != first_pid and s.state.driver.in_flight == 0
    again = HTTP.post(url + COMPLETIONS, json={**prompt, "max_tokens": 12}).json()["choices"][0]["text"]
    assert again == before  # the same weights (seeded) in the new process
    assert "lazy_rag_engine_restarts_total 1.0" in HTTP.get(url + "/metrics").text

    # a crash loop: the new child dies within a minute and the next one cannot load the model
    def cannot_load(spec):
        raise LazyRagError("the model cannot be loaded (a test's)")

    monkeypatch.setattr(engine_process, "EngineChild", cannot_load)
    os.kill(s.state.driver.engine_pid, signal.SIGKILL)
    deadline = time.time() + 120
    while s.state.driver.restarting or s.state.driver.alive:
        assert time.time() < deadline, "the supervisor did not give up"
        time.sleep(0.1)
    r = HTTP.get(url + "/ready")
    assert r.status_code == 503 and r.json() == {"status": "engine_unavailable"}
    r = HTTP.post(url + COMPLETIONS, json={**prompt, "max_tokens": 2})
    assert r.status_code == 503 and r.json()["error"]["code"] == "engine_unavailable" and "retry-after" in r.headers
    logged = [rec.getMessage() for rec in caplog.records]
    assert any("could not be restarted (2 attempts)" in m for m in logged), logged
    assert any("a test's" in m for m in logged)


def test_restart_policy_waits_grow_and_are_bounded():
    p = RestartPolicy(attempts=4, backoff_s=0.5, max_backoff_s=3)
    assert [p.delay(i) for i in range(5)] == [0.5, 1.0, 2.0, 3, 3]
    with pytest.raises(Exception, match="restart policy"):
        RestartPolicy(backoff_s=5, max_backoff_s=1)
