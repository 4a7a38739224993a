"""Where the engine's host (Python) time goes: cProfile of one paper request through
``LazyLLM.generate`` and of one batched prefill step, on the GPU (the kernels' path).

Llama-3.1-8B shape with random bf16 weights (``--layers`` of them), 5 chunks of 2048 tokens
resident in the pool, a 32-token question. Prints the functions with the most cumulative and own
time; the GPU work is whatever the host waits for at the step's end (``argmax().tolist()``).

    python benchmarks/host_profile.py [--layers 32] [--batch 32] [--mode lazy] [--top 30]
"""
from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import time

import torch

from lazy_rag.bench.paper_request import PaperRequests
from lazy_rag.random_models import IdTokenizer, random_llama31_8b


def show(prof: cProfile.Profile, title: str, top: int) -> None:
    for key in ("cumulative", "tottime"):
        out = io.StringIO()
        pstats.Stats(prof, stream=out).sort_stats(key).print_stats(top)
        print(f"\n===== {title}: by {key} =====")
        print("\n".join(line for line in out.getvalue().splitlines() if line.strip())[:12000])


def graph_stats(eng) -> dict:
    st = eng.stats()
    return {k: st[k] for k in ("steps", "graph_replays", "graphs", "append_graph_replays", "append_graphs")}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--mode", default="lazy")
    ap.add_argument("--top", type=int, default=30)
    args = ap.parse_args()
    from lazy_rag import LazyLLM

    llm = LazyLLM(random_llama31_8b(args.layers), IdTokenizer(), kv_bytes=24 << 30)
    prompt = PaperRequests().prompt

    for _ in range(3):  # every chunk placed, kernels compiled, graphs captured
        llm.generate(prompt(), max_new_tokens=1, mode=args.mode)
        llm.engine.generate([dict(segments=prompt(), mode=args.mode, max_new_tokens=1) for _ in range(args.batch)])
    torch.cuda.synchronize()
    print(f"after warm-up: engine {graph_stats(llm.engine)}")
    for _ in range(3):
        t = time.perf_counter()
        r = llm.generate(prompt(), max_new_tokens=1, mode=args.mode)
        print(f"one request: wall {1e3 * (time.perf_counter() - t):.1f} ms, TTFT {r.stats.ttft_ms:.1f} ms; "
              f"engine {graph_stats(llm.engine)}")
    t = time.perf_counter()
    for _ in range(10):
        llm.engine.host.prepare(prompt(), llm.default_source, 0, args.mode)
    print(f"prepare (segments to layout) alone: {(time.perf_counter() - t) * 100:.2f} ms")
    prof = cProfile.Profile()
    t = time.perf_counter()
    prof.enable()
    r = llm.generate(prompt(), max_new_tokens=1, mode=args.mode)
    prof.disable()
    print(f"one request: wall {1e3 * (time.perf_counter() - t):.1f} ms, TTFT {r.stats.ttft_ms:.1f} ms; "
          f"engine {graph_stats(llm.engine)}")
    show(prof, "one request (LazyLLM.generate)", args.top)
    eng = llm.engine
    handles = [eng.submit(prompt(), mode=args.mode, max_new_tokens=1) for _ in range(args.batch)]
    torch.cuda.synchronize()
    prof = cProfile.Profile()
    t = time.perf_counter()
    prof.enable()
    eng.run_until_done()
    prof.disable()
    print(f"batch {args.batch}: wall {1e3 * (time.perf_counter() - t):.1f} ms, "
          f"TTFT p50 {sorted(h.ttft_ms for h in handles)[len(handles) // 2]:.1f} ms; engine {graph_stats(eng)}")
    show(prof, f"batch {args.batch} (Engine.run_until_done)", args.top)
    graphs = llm.engine.runner.append_graphs
    # last, since a replay rewrites the KV slots of a finished request: the GPU time of the last
    # captured step alone
    if graphs is not None and graphs.graphs:
        cap = next(reversed(graphs.graphs.values()))
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        for _ in range(3):
            start.record()
            for _ in range(10):
                cap.graph.replay()
            end.record()
            torch.cuda.synchronize()
            print(f"graph replay alone: {start.elapsed_time(end) / 10:.2f} ms GPU per step "
                  f"({next(reversed(graphs.graphs))})")
        from torch.profiler import ProfilerActivity, profile
        with profile(activities=[ProfilerActivity.CUDA]) as gp:
            for _ in range(5):
                cap.graph.replay()
            torch.cuda.synchronize()
        print(gp.key_averages().table(sort_by="cuda_time_total", row_limit=18, max_name_column_width=60))


if __name__ == "__main__":
    main()
