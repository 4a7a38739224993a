"""The paged serving engine: the one runtime of every request, on CUDA and on the CPU.

Files, one job each (nano-vllm's split): ``config`` (every knob), ``page_pool`` (KV memory),
``page_manager`` (page ownership, ref counts, eviction, prefix hashes), ``chunk_tiers`` (host
tier and disk store below the pool, one key scheme), ``sequence`` (a request, a chunk encode,
runs of KV), ``kv_planner`` (where a request's KV lives, per mode), ``scheduler`` (queues,
budget, preemption), ``page_table`` (runs -> the kernels' page table), ``model_runner`` (the one
forward and its attention paths), ``cuda_graphs`` (captured decode steps), ``engine`` (submit /
step / generate / stream / encode).
"""
from .config import EngineConfig
from .engine import Engine, RequestHandle
from .page_manager import PageManager
from .page_pool import OutOfPages, PagePool
from .scheduler import RequestTooLarge, Scheduler
from .sequence import Sequence

__all__ = ["Engine", "EngineConfig", "RequestHandle", "PagePool", "PageManager", "Scheduler", "Sequence",
           "OutOfPages", "RequestTooLarge"]
