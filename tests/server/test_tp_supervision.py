"""A tensor-parallel engine process whose worker rank dies is replaced like a dead engine process
(``engine_process.RestartPolicy``): the request in flight ends with an error naming the rank (no
hang), the engine process exits, /ready reports the restart (503) and then ready once a new engine
process and new ranks are up, and the same greedy answer comes back."""
import os
import signal
import threading
import time
from pathlib import Path

import httpx

from lazy_rag.engine import EngineConfig
from lazy_rag.server import EngineSpec
from lazy_rag.server.engine_process import RestartPolicy
from tests.server.test_supervision import wait_ready
from tests.server.word_model import WORDS, word_tokenizer

HTTP = httpx.Client(timeout=120)
COMPLETIONS = "/v1/completions"


def _rank_workers(pid: int) -> list[int]:
    """The spawned children of ``pid`` that are TP ranks (not multiprocessing's resource tracker)."""
    out = []
    for entry in Path("/proc").iterdir():
        try:
            ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            cmd = (entry / "cmdline").read_bytes()
        except (OSError, ValueError, IndexError):
            continue
        if ppid == pid and b"spawn_main" in cmd and b"resource_tracker" not in cmd:
            out.append(int(entry.name))
    return out


def test_a_dead_rank_fails_its_request_and_the_engine_process_is_restarted(start_server, tmp_path):
    folder = tmp_path / "tokenizer"
    word_tokenizer().save_pretrained(folder)
    spec = EngineSpec(random="tiny-llama", tokenizer=str(folder), device="cpu",
                      engine_config=EngineConfig(tensor_parallel=2))   # 2 KV heads: one per rank
    s = start_server(spec, model_name="m", engine_restart=RestartPolicy(attempts=2, backoff_s=0.05, stable_s=60))
    url = s.base_url
    prompt = {"model": "m", "prompt": " ".join(WORDS[:20]), "temperature": 0}
    before = HTTP.post(url + COMPLETIONS, json={**prompt, "max_tokens": 12}).json()["choices"][0]["text"]
    first_pid = s.state.driver.engine_pid
    (rank,) = _rank_workers(first_pid)

    events, started = [], threading.Event()

    def stream():
        with httpx.Client(timeout=120) as c:
            with c.stream("POST", url + COMPLETIONS, json={**prompt, "max_tokens": 4000, "stream": True}) as r:
                for line in r.iter_lines():
                    if line:
                        events.append(line)
                        if len(events) == 3:
                            started.set()

    t = threading.Thread(target=stream)
    t.start()
    assert started.wait(60)
    os.kill(rank, signal.SIGKILL)
    t0 = time.time()
    t.join(60)
    assert not t.is_alive() and time.time() - t0 < 30   # the closed connection, not the collective timeout
    assert events[-1] == "data: [DONE]" and "rank 1" in events[-2] and "Traceback" not in "".join(events), events[-2:]
    seen = []
    while not seen or seen[-1] == "ready":   # the dead engine process is noticed...
        seen.append(HTTP.get(url + "/ready").json()["status"])
        assert time.time() - t0 < 30, seen
        time.sleep(0.05)
    seen += wait_ready(url)   # ...and replaced
    assert "engine_restarting" in seen and seen[-1] == "ready", seen
    assert s.state.driver.engine_pid != first_pid and s.state.driver.restarts == 1
    again = HTTP.post(url + COMPLETIONS, json={**prompt, "max_tokens": 12}).json()["choices"][0]["text"]
    assert again == before
    # the engine process exits when asked, its ranks with it (not killed after the 10 s timeout:
    # a process started by multiprocessing runs no atexit handler, and joins its ranks at exit)
    engine = s.state.driver._child.process
    t1 = time.time()
    s.stop()
    assert time.time() - t1 < 8 and engine.exitcode == 0, (time.time() - t1, engine.exitcode)
