"""Default settings of ``lazy-rag bench`` per device: the paper's workload on CUDA, and a small
variant that finishes in a few minutes on a 2-core CPU with the bundled SmolLM2."""
from __future__ import annotations

GPU_DEFAULTS = dict(model=None, random_weights="llama-3.1-8b", docs=100, doc_tokens=2048, k=5, question_tokens=32,
                    output_tokens=16, requests=120, hf_requests=20, rates="offline,0.5,1,2,4",
                    budgets="1.0,0.5,0.25,0.1", max_num_seqs=32, out="serving_gpu")
# On the CPU the engine runs its kernels' plain torch references (fp32 attention, a loop over the
# sequences of a batch): a full prefill is ~3-4x slower than transformers' SDPA and a decode step
# takes ~0.1-0.2 s. 128-token documents, 4 per request, 8 output tokens and 12 requests keep the
# whole sweep (4 engine modes x 2 budgets x 3 rates, transformers x 3 rates) to ~4.5 min on 2 cores
# (BENCHMARKS.md). 1.5 req/s is below lazy's CPU saturation (~2.3 req/s) and above full's (~1.2);
# 3 is above both.
CPU_DEFAULTS = dict(model="smollm2", random_weights=None, docs=20, doc_tokens=128, k=4, question_tokens=32,
                    output_tokens=8, requests=12, hf_requests=6, rates="offline,1.5,3", budgets="1.0,0.2",
                    max_num_seqs=8, out="serving_cpu")


def defaults_for(device) -> dict:
    """The defaults for a torch.device (or its type name)."""
    kind = getattr(device, "type", str(device))
    return dict(GPU_DEFAULTS if kind == "cuda" else CPU_DEFAULTS)


def both(name: str) -> str:
    """'GPU x, CPU y' (or the one value when they agree), for option help."""
    g, c = GPU_DEFAULTS[name], CPU_DEFAULTS[name]
    return str(g) if g == c else f"GPU {g}; CPU {c}"
