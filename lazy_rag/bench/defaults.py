"""Default settings of ``lazy-rag bench`` per device: the paper's workload on CUDA, and a small
variant that finishes in a few minutes on a 2-core CPU with the bundled SmolLM2; and the named
workloads of ``--preset``, per device too."""
from __future__ import annotations

from ..errors import LazyRagError
from ..requests import MODES

# what `lazy-rag bench` can run: the engine in each mode, and plain transformers (``driver``)
SYSTEMS = MODES + ("transformers",)

# options whose default is the same on every device (listed here so that a preset can set them and
# an explicit option can still override a preset: the command line leaves them at None)
_EVERY_DEVICE = dict(popularity="zipf", zipf_a=2.1, systems=",".join(SYSTEMS), shared_chunks="auto")

GPU_DEFAULTS = dict(model=None, random_weights="llama-3.1-8b", docs=100, doc_tokens=2048, k=5, question_tokens=32,
                    output_tokens=16, requests=120, hf_requests=20, rates="offline,0.5,1,2,4",
                    budgets="1.0,0.5,0.25,0.1", max_num_seqs=32, out="serving_gpu", **_EVERY_DEVICE)
# On the CPU the engine runs its kernels' plain torch references (fp32 attention, a loop over the
# sequences of a batch): a full prefill is ~3-4x slower than transformers' SDPA and a decode step
# takes ~0.1-0.2 s. 128-token documents, 4 per request, 8 output tokens and 12 requests keep the
# whole sweep (4 engine modes x 2 budgets x 3 rates, transformers x 3 rates) to ~4.5 min on 2 cores
# (BENCHMARKS.md, "Serving the paper's workload", "On a CPU"). 1.5 req/s is below lazy's CPU
# saturation (~2.3 req/s) and above full's (~1.2); 3 is above both.
CPU_DEFAULTS = dict(model="smollm2", random_weights=None, docs=20, doc_tokens=128, k=4, question_tokens=32,
                    output_tokens=8, requests=12, hf_requests=6, rates="offline,1.5,3", budgets="1.0,0.2",
                    max_num_seqs=8, out="serving_cpu", **_EVERY_DEVICE)

# decode-shared (issue 16): a decode-heavy variant of the paper's workload for shared-chunk
# attention. Offline at one tight budget with many output tokens, so that decode steps over chunks
# held by many running sequences dominate; lazy runs with grouping (shared_chunks auto) and without
# (off) beside block (private chunk copies: nothing to group) in the same process. Target: lazy's
# output tokens/s with grouping >= 2x without.
_DECODE_SHARED_GPU = dict(model=None, random_weights="llama-3.1-8b", docs=100, doc_tokens=2048, k=5,
                          output_tokens=256, requests=256, popularity="zipf", zipf_a=2.1, rates="offline",
                          budgets="0.25", systems="lazy,block", shared_chunks="auto,off", max_num_seqs=128,
                          out="decode_shared_gpu")
# The CPU variant keeps the shape (offline, budget 0.25, output a large share of each request,
# every running sequence in one batch) at a size SmolLM2 serves in a couple of minutes on 2 cores.
_DECODE_SHARED_CPU = _DECODE_SHARED_GPU | dict(model="smollm2", random_weights=None, docs=20, doc_tokens=128, k=4,
                                               output_tokens=32, requests=16, max_num_seqs=16,
                                               out="decode_shared_cpu")
# the same under uniform popularity: sharing is rarer, so grouping must not cost throughput
_UNIFORM = dict(popularity="uniform")
PRESETS = {
    "decode-shared": {"cuda": _DECODE_SHARED_GPU, "cpu": _DECODE_SHARED_CPU},
    "decode-shared-uniform": {"cuda": _DECODE_SHARED_GPU | _UNIFORM | dict(out="decode_shared_uniform_gpu"),
                              "cpu": _DECODE_SHARED_CPU | _UNIFORM | dict(out="decode_shared_uniform_cpu")},
}


def _kind(device) -> str:
    return "cuda" if getattr(device, "type", str(device)) == "cuda" else "cpu"


def defaults_for(device) -> dict:
    """The defaults for a torch.device (or its type name)."""
    return dict(GPU_DEFAULTS if _kind(device) == "cuda" else CPU_DEFAULTS)


def preset_values(name: str | None, device) -> dict:
    """The options preset ``name`` sets on ``device`` ({} for no preset)."""
    if name is None:
        return {}
    if name not in PRESETS:
        raise LazyRagError(f"Unknown --preset {name!r}; choose one of {', '.join(PRESETS)} "
                           "(or leave --preset out for the default sweep).")
    return dict(PRESETS[name][_kind(device)])


def both(name: str) -> str:
    """'GPU x, CPU y' (or the one value when they agree), for option help."""
    g, c = GPU_DEFAULTS[name], CPU_DEFAULTS[name]
    return str(g) if g == c else f"GPU {g}; CPU {c}"
