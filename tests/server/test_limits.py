"""What a public endpoint needs: API keys, body and queue limits, clean 400s for bad fields, a
client that disconnects mid-stream freeing its KV, and a drain on SIGTERM. No case may log a
traceback or show one to the client."""
import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest

ROOT = Path(__file__).resolve().parents[2]

CHAT = "/v1/chat/completions"
# generous: a 2-core CI machine answers in seconds, slower while other tests run
HTTP = httpx.Client(timeout=120)


def body(**over):
    b = {"model": "smollm2", "messages": [{"role": "user", "content": "Name a colour."}], "max_tokens": 4,
         "temperature": 0}
    b.update(over)
    return b


def assert_error(r, status, param=None):
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert err["message"] and "Traceback" not in err["message"] and 'File "' not in err["message"]
    if param is not None:
        assert err["param"] == param, err
    return err


# The HTTP-layer cases run the engine in the test's process (no engine process to start); the
# queue, disconnect and drain cases run it in its own process, as `lazy-rag serve` does.
def test_api_key(start_server, smollm2, no_server_errors):
    s = start_server(smollm2, api_key="s3cret", engine_process=False)
    url = s.base_url
    assert_error(HTTP.post(url + CHAT, json=body()), 401)
    r = HTTP.post(url + CHAT, json=body(), headers={"Authorization": "Bearer wrong"})
    assert_error(r, 401)
    assert r.headers["www-authenticate"] == "Bearer"
    assert_error(HTTP.get(url + "/v1/models"), 401)
    assert HTTP.post(url + CHAT, json=body(), headers={"Authorization": "Bearer s3cret"}).status_code == 200
    assert HTTP.get(url + "/health").status_code == 200  # probes need no key


def test_body_size_limit(start_server, smollm2, no_server_errors):
    s = start_server(smollm2, max_body_bytes=4096, engine_process=False)
    big = body(documents=["x " * 5000])
    err = assert_error(HTTP.post(s.base_url + CHAT, json=big), 413)
    assert "4096" in err["message"]

    def chunked():  # no Content-Length: counted while it streams in
        data = json.dumps(big).encode()
        for i in range(0, len(data), 1000):
            yield data[i:i + 1000]

    assert_error(HTTP.post(s.base_url + CHAT, content=chunked(), headers={"Content-Type": "application/json"}), 413)
    assert HTTP.post(s.base_url + CHAT, json=body()).status_code == 200


BAD = [
    ({"messages": []}, "messages"),
    ({"messages": [{"role": "function", "content": "x"}]}, "messages"),
    ({"messages": [{"role": "assistant", "tool_calls": [{"function": {"name": "f"}}]}]}, "messages"),
    ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]}, "messages"),
    ({"model": "gpt-4o"}, "model"),
    ({"n": 0}, "n"),
    ({"tool_choice": "auto"}, "tool_choice"),  # no tools
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": []}}]}, "tools"),
    ({"logprobs": 1}, "logprobs"),  # chat's is a boolean (top_logprobs counts the alternatives)
    ({"temperature": -1}, "temperature"),
    ({"temperature": "hot"}, "temperature"),
    ({"top_p": 0}, "top_p"),
    ({"max_tokens": 0}, "max_tokens"),
    ({"max_completion_tokens": 1.5}, "max_completion_tokens"),
    ({"max_tokens": 10 ** 6}, None),          # over the context window: the sizes are named
    ({"stop": [""]}, "stop"),
    ({"seed": "x"}, "seed"),
    ({"stream": "yes"}, "stream"),
    ({"mode": "fast"}, "mode"),
    ({"recovery": "magic9"}, None),
    ({"documents": [{"title": "t"}]}, "documents"),
    ({"documents": "text"}, "documents"),
    ({"rag": {"top_k": 0}}, "rag"),
    ({"rag": {"top_k": 2}}, "rag"),           # this server has no index
    ({"response_format": {"type": "xml"}}, "response_format"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}}, "response_format"),
    ({"presence_penalty": 2.5}, "presence_penalty"),
    ({"frequency_penalty": "high"}, "frequency_penalty"),
]


@pytest.mark.parametrize("engine_process", [False, True], ids=["in_process", "engine_process"])
def test_bad_fields_are_400s(start_server, smollm2, engine_process, no_server_errors):
    """The engine's refusals (a prompt over the context window, a bad recovery) are 400s from
    either driver: the engine process sends its exceptions back."""
    s = start_server(smollm2, engine_process=engine_process)
    for over, param in BAD:
        b = body(**over)
        r = HTTP.post(s.base_url + CHAT, json=b)
        status = 404 if param == "model" else 400
        err = assert_error(r, status, param)
        if over.get("max_tokens") == 10 ** 6:
            assert "context window is 8192" in err["message"]
    assert_error(HTTP.post(s.base_url + CHAT, content=b"{not json", headers={"Content-Type": "application/json"}),
                 400)
    assert_error(HTTP.post(s.base_url + CHAT, json=[1, 2]), 400)
    assert_error(HTTP.post(s.base_url + "/v1/completions", json={"model": "smollm2", "prompt": ["a", "b"]}),
                 400, "prompt")
    assert_error(HTTP.get(s.base_url + "/v1/nothing"), 404)
    s.wait_idle()


def test_bounded_queue_answers_429_under_a_flood(start_server, smollm2, no_server_errors):
    s = start_server(smollm2, max_queue=2)
    codes, lock = [], threading.Lock()

    def one():
        r = HTTP.post(s.base_url + CHAT, json=body(max_tokens=24), timeout=120)
        with lock:
            codes.append((r.status_code, r.headers.get("retry-after"), r.json()))

    threads = [threading.Thread(target=one) for _ in range(10)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    refused = [c for c in codes if c[0] == 429]
    served = [c for c in codes if c[0] == 200]
    assert len(refused) + len(served) == 10 and refused and len(served) >= 2, [c[0] for c in codes]
    assert all(c[1] == "1" and c[2]["error"]["type"] == "rate_limit_error" for c in refused)
    assert len({c[2]["choices"][0]["message"]["content"] for c in served}) == 1  # the same greedy answer
    s.wait_idle()


@pytest.mark.parametrize("engine_process", [True, False], ids=["engine_process", "in_process"])
def test_client_disconnect_frees_the_request(start_server, smollm2, engine_process, no_server_errors):
    """The engine's counters come from the driver: asked of the engine process when it runs in one."""
    s = start_server(smollm2, engine_process=engine_process)
    before = s.wait_idle()
    # a prompt the model continues for a long time (counting), so the request is still running
    # when its client goes away
    long = {"model": "smollm2", "prompt": "1, 2, 3, 4, 5, 6, 7,", "max_tokens": 400, "temperature": 0}
    with httpx.Client(timeout=60) as c:
        with c.stream("POST", s.base_url + "/v1/completions", json={**long, "stream": True}) as r:
            assert r.status_code == 200
            lines = r.iter_lines()
            got = [next(lines) for _ in range(6)]  # a few events, then hang up
            assert any(line.startswith("data: ") for line in got)
            assert s.state.driver.in_flight == 1 and s.state.driver.stats()["pages_private"] > 0
    after = s.wait_idle(timeout=30)
    assert after["pages_private"] == before["pages_private"] == 0
    assert after["requests_running"] == 0 and s.state.driver.in_flight == 0
    assert after["steps"] - before["steps"] < 200  # dropped, not run to its 400 tokens
    # a non-streamed request whose client gives up is dropped too
    with pytest.raises(httpx.ReadTimeout):
        HTTP.post(s.base_url + "/v1/completions", json=long, timeout=1.5)
    after = s.wait_idle(timeout=30)
    assert after["pages_private"] == 0 and after["steps"] - before["steps"] < 400


def test_sigterm_drains_and_exits_0(tmp_path):
    """`lazy-rag serve` in its own process: SIGTERM while a stream is in flight stops admission
    (503), lets the stream finish, and exits 0 without a traceback; its engine process exits too."""
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    proc = subprocess.Popen([sys.executable, "-m", "lazy_rag.cli", "serve", "--device", "cpu", "--port", str(port),
                             "--drain-timeout", "60"], cwd=ROOT, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.time() + 120
        while True:
            try:
                if HTTP.get(url + "/ready", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert proc.poll() is None and time.time() < deadline, "the server did not start"
            time.sleep(0.2)
        engine_pid = HTTP.get(url + "/info").json()["engine_process"]
        assert engine_pid and engine_pid != proc.pid
        events = []
        with httpx.Client(timeout=120) as c:
            with c.stream("POST", url + "/v1/completions", json={"model": "smollm2", "prompt": "1, 2, 3, 4, 5, 6,",
                                                                 "max_tokens": 48, "temperature": 0, "stream": True}) as r:
                lines = r.iter_lines()
                events.append(next(lines))
                proc.send_signal(signal.SIGTERM)
                time.sleep(0.5)
                # admission is closed: a new request on a fresh connection is refused or answered 503
                try:
                    late = HTTP.post(url + CHAT, json=body(), timeout=10)
                    assert late.status_code == 503 and late.json()["error"]["code"] == "draining"
                except httpx.ConnectError:
                    pass
                events.extend(lines)
        assert events[-1] == "data: [DONE]" or [e for e in events if e][-1] == "data: [DONE]"
        finish = [json.loads(e[6:]) for e in events if e.startswith("data: {")][-1]
        assert finish["choices"][0]["finish_reason"] == "length"
        assert proc.wait(timeout=60) == 0
        with pytest.raises(ProcessLookupError):  # gone, and reaped by the server
            os.kill(engine_pid, 0)
    finally:
        if proc.poll() is None:
            proc.kill()
        log = proc.stdout.read()
    assert "Traceback" not in log, log
