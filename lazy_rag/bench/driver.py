"""Run one system over one list of requests with their arrival times; time every request.

Engine modes (lazy, block, prefix, full) go through one ``lazy_rag.engine.Engine``: an event loop
submits each request once its arrival time has passed and steps the engine while it has work,
sleeping until the next arrival when idle. ``transformers`` is what a user would otherwise run:
``model.generate`` on the whole re-encoded prompt, one request at a time in arrival order.

Times are taken from one ``time.perf_counter`` clock started just before the first arrival, so
TTFT and end-to-end latency are counted from each request's *arrival* (queueing included), not
from the moment the system got round to it.
"""
from __future__ import annotations

import copy
import time
from dataclasses import dataclass, field

import numpy as np
import torch
from transformers.generation import BaseStreamer


@dataclass
class RequestTiming:
    arrival_s: float
    first_token_s: float
    finish_s: float
    prompt_tokens: int
    output_tokens: int

    @property
    def ttft_ms(self) -> float:
        return (self.first_token_s - self.arrival_s) * 1e3

    @property
    def e2e_ms(self) -> float:
        return (self.finish_s - self.arrival_s) * 1e3


@dataclass
class RunResult:
    system: str
    timings: list[RequestTiming]
    wall_s: float                                   # first arrival (t=0) to last completion
    engine_stats: dict = field(default_factory=dict)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def run_engine(engine, mode: str, requests, arrivals, max_new_tokens: int) -> RunResult:
    """Drive ``engine`` through ``requests`` (lazy_rag.bench.workload.Request) arriving at
    ``arrivals`` seconds (sorted)."""
    handles = []
    submit_at = []
    n = len(requests)
    _sync(engine.host.device)
    t0 = time.perf_counter()
    i = 0
    while i < n or engine.scheduler.has_work:
        now = time.perf_counter() - t0
        while i < n and arrivals[i] <= now:
            handles.append(engine.submit(segments=requests[i].segments, mode=mode, max_new_tokens=max_new_tokens))
            submit_at.append(now)
            i += 1
        if engine.scheduler.has_work:
            if not engine.step():
                time.sleep(0)  # only chunk transfers in flight
        elif i < n:
            time.sleep(max(0.0, arrivals[i] - (time.perf_counter() - t0)))
    _sync(engine.host.device)
    wall = time.perf_counter() - t0
    timings = []
    for h, arr in zip(handles, arrivals):
        st = h.result.stats
        start = h.t0 - t0  # when submit() ran: arrival + the wait for the step in progress
        timings.append(RequestTiming(float(arr), start + st.ttft_ms / 1e3, start + st.total_ms / 1e3,
                                     st.prompt_tokens, len(h.result.token_ids)))
    return RunResult(mode, timings, wall, engine.stats())


class FirstTokenClock(BaseStreamer):
    """A transformers streamer that only notes when the first new token arrives: ``generate``
    calls ``put`` once with the prompt, then once per new token (after it was sampled on the host)."""

    def __init__(self):
        self.puts = 0
        self.first_token_at: float | None = None

    def put(self, value) -> None:
        self.puts += 1
        if self.puts == 2:
            self.first_token_at = time.perf_counter()

    def end(self) -> None:
        pass


def greedy_generation_config(model, eos_ids, max_new_tokens: int):
    """Greedy decoding of exactly the engine's rule: stop at one of ``eos_ids`` (none: never) or
    after max_new_tokens; sampling options of the checkpoint's own config are cleared."""
    gc = copy.deepcopy(model.generation_config)
    eos = sorted(eos_ids)
    gc.eos_token_id = eos or None
    gc.pad_token_id = gc.pad_token_id if gc.pad_token_id is not None else (eos[0] if eos else 0)
    gc.do_sample, gc.num_beams = False, 1
    gc.temperature = gc.top_p = gc.top_k = None
    gc.max_new_tokens, gc.min_new_tokens, gc.max_length = max_new_tokens, None, None
    return gc


@torch.inference_mode()
def run_transformers(llm, requests, arrivals, max_new_tokens: int) -> RunResult:
    """Plain ``model.generate`` with full re-encoding, sequentially in arrival order (a request
    waits for the previous one, and for its own arrival)."""
    model, dev = llm.model, llm.device
    gc = greedy_generation_config(model, llm.eos_ids, max_new_tokens)
    prompts = [torch.tensor([llm.prepare(r.segments).token_ids], device=dev) for r in requests]
    eos = set(llm.eos_ids)
    timings = []
    _sync(dev)
    t0 = time.perf_counter()
    for ids, arr in zip(prompts, arrivals):
        wait = float(arr) - (time.perf_counter() - t0)
        if wait > 0:
            time.sleep(wait)
        clock = FirstTokenClock()
        out = model.generate(ids, attention_mask=torch.ones_like(ids), generation_config=gc, streamer=clock)
        _sync(dev)
        done = time.perf_counter() - t0
        new = out[0, ids.shape[1]:].tolist()
        if new and new[-1] in eos:
            new = new[:-1]  # the engine does not count the EOS it stops at either
        first = (clock.first_token_at - t0) if clock.first_token_at is not None else done
        timings.append(RequestTiming(float(arr), first, done, int(ids.shape[1]), len(new)))
    return RunResult("transformers", timings, time.perf_counter() - t0)


def summarize_timings(timings: list[RequestTiming]) -> tuple[np.ndarray, np.ndarray, int, int]:
    """TTFT and end-to-end latencies (ms), total output tokens, total prompt tokens."""
    return (np.array([t.ttft_ms for t in timings]), np.array([t.e2e_ms for t in timings]),
            sum(t.output_tokens for t in timings), sum(t.prompt_tokens for t in timings))
