"""Abuse at the HTTP edge: malformed and hostile bodies get clean 4xx answers (never a 500 or a
traceback), slow clients get 408 and lose their connection, and a well-behaved client is served
all the while. A real server (uvicorn in a thread, with `lazy-rag serve`'s protocol) over the
word model, the engine in this process."""
import json
import socket
import threading
import time

import httpx
import pytest
import torch

from tests.server.word_model import word_llm

CHAT = "/v1/chat/completions"


@pytest.fixture(scope="module")
def llm():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield word_llm()
    torch.set_num_threads(threads)


def ok_body(**over):
    return {"model": "m", "max_tokens": 2, "temperature": 0, "messages": [{"role": "user", "content": "Q ?"}],
            **over}


def error_of(r, status):
    assert r.status_code == status, (r.status_code, r.text[:300])
    err = r.json()["error"]
    assert err["message"] and "Traceback" not in r.text and 'File "' not in r.text
    return err


def test_hostile_bodies_get_clean_4xx(start_server, llm, no_server_errors):
    s = start_server(llm, model_name="m", engine_process=False, max_body_bytes=8 << 20)
    url = s.base_url + CHAT
    with httpx.Client(timeout=120) as c:
        def post(content=None, **kw):
            return c.post(url, content=content, headers={"Content-Type": "application/json"}, **kw)

        error_of(post(b'{"model": "m", "messages": [}'), 400)                           # malformed JSON
        error_of(post(b'{"model": "m", "messages": "\xff\xfe"}'), 400)                    # invalid UTF-8
        error_of(post(b"[" * 200_000 + b"]" * 200_000), 400)                              # nesting bomb
        error_of(c.post(url, json=ok_body(messages={"role": "user"})), 400)              # wrong types
        error_of(c.post(url, json=ok_body(max_tokens="10")), 400)
        error_of(c.post(url, json=ok_body(temperature=[1])), 400)
        err = error_of(c.post(url, json=ok_body(max_tokens=10 ** 12)), 400)              # huge max_tokens
        assert "context window" in err["message"]
        err = error_of(c.post(url, json=ok_body(documents=["w1"] * 5000)), 400)          # thousands of documents
        assert "5000 documents" in err["message"] and "--max-documents" in err["message"]
        # a document of a million tokens: under this server's 8 MiB body limit, over the context window
        err = error_of(c.post(url, json=ok_body(documents=["w1 " * 1_000_000])), 400)
        assert "context window" in err["message"]
        # ... and over the default 4 MiB limit: refused before it is read
        small = start_server(llm, model_name="m", engine_process=False)
        err = error_of(c.post(small.base_url + CHAT, json=ok_body(documents=["w123 " * 1_000_000])), 413)
        assert "--max-body-bytes" in err["message"]
        r = c.post(url, json=ok_body())
        assert r.status_code == 200 and r.json()["choices"][0]["message"]["content"]


def raw(port: int) -> socket.socket:
    sock = socket.create_connection(("127.0.0.1", port), timeout=10)
    return sock


def read_all(sock: socket.socket) -> bytes:
    out = b""
    while True:
        try:
            data = sock.recv(65536)
        except (ConnectionResetError, socket.timeout):
            return out
        if not data:
            return out
        out += data


def test_slow_clients_get_408_and_others_are_served(start_server, llm, no_server_errors):
    """Slow-loris: connections that dribble their headers, or send headers and then too little
    body, are answered 408 and closed after the client timeout; meanwhile ordinary requests are
    answered at once (the 26 slow connections cost nothing but their sockets)."""
    s = start_server(llm, model_name="m", engine_process=False, client_timeout_s=2.0)
    slow_headers, slow_bodies = [raw(s.port) for _ in range(20)], [raw(s.port) for _ in range(5)]
    t0 = time.monotonic()
    for sock in slow_headers:
        sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\n")  # ... and never the rest
    for sock in slow_bodies:
        sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     b"Content-Length: 1000\r\n\r\n{\"model\": ")
    served = []

    def dribble():  # one more slow client that keeps sending a header byte now and then
        sock = raw(s.port)
        try:
            for byte in b"GET /health HTTP/1.1\r\nHost: x\r\nX-Slow: " + b"a" * 100:
                sock.sendall(bytes([byte]))
                time.sleep(0.05)
        except OSError:  # closed on us: what the deadline does
            served.append("dribbler closed")

    t = threading.Thread(target=dribble)
    t.start()
    with httpx.Client(timeout=30) as c:
        for _ in range(3):
            r = c.post(s.base_url + CHAT, json=ok_body())
            assert r.status_code == 200
            served.append(time.monotonic() - t0)
    assert served[-1] < 2.0  # answered while every slow connection was still open
    for sock in slow_headers + slow_bodies:
        answer = read_all(sock)
        assert answer.startswith(b"HTTP/1.1 408"), answer[:100]
        body = json.loads(answer.split(b"\r\n\r\n", 1)[1])
        assert body["error"]["code"] == "request_timeout" and "--client-timeout" in body["error"]["message"]
        sock.close()
    t.join(30)
    assert "dribbler closed" in served
    assert time.monotonic() - t0 < 15
    assert httpx.get(s.base_url + "/ready").status_code == 200
