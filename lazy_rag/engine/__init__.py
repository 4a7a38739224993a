"""The paged serving engine: the one runtime of every request, on CUDA and on the CPU.

Files, one job each (nano-vllm's split): ``config`` (every knob), ``page_pool`` (KV memory),
``page_manager`` (page ownership, ref counts, eviction, prefix hashes), ``chunk_tiers`` (host
tier and disk store below the pool, one key scheme), ``sequence`` (a request, a chunk encode,
runs of KV), ``kv_planner`` (where a request's KV lives, per mode), ``scheduler`` (queues,
budget, preemption), ``page_table`` (runs -> the kernels' page table), ``model_runner`` (the one
forward and its attention paths), ``cuda_graphs`` (captured decode steps), ``engine`` (submit /
step / generate / stream / encode), ``recovery`` (what a quality recovery is, and which chunk
tokens a request recomputes); tensor parallelism: ``tensor_parallel`` (a rank's share of the
model and of chunk KV, the collectives), ``rank_pool`` (the worker processes), ``rank_worker`` (a rank's engine and commands), ``tp_engine``
(the engine over N ranks in lockstep).
"""
from importlib import import_module

# Exported lazily: ``engine.recovery`` (a request's Recovery) is imported by light front ends that
# never run the engine, which pulls in torch and the kernels
_EXPORTS = {"Engine": "engine", "RequestHandle": "engine", "EngineConfig": "config", "PageManager": "page_manager",
            "OutOfPages": "page_pool", "PagePool": "page_pool", "RequestTooLarge": "scheduler",
            "Scheduler": "scheduler", "Sequence": "sequence", "engine_for": "tp_engine"}

__all__ = ["Engine", "EngineConfig", "RequestHandle", "PagePool", "PageManager", "Scheduler", "Sequence",
           "OutOfPages", "RequestTooLarge", "engine_for"]


def __getattr__(name):
    if name in _EXPORTS:
        return getattr(import_module(f".{_EXPORTS[name]}", __name__), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
