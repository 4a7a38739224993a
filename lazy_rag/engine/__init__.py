"""The serving engine: a shared paged KV pool with tiers, continuous batching, four modes.

Files, one job each (nano-vllm's split): ``page_pool`` (KV memory), ``block_manager`` (page
ownership, ref counts, eviction, prefix hashes), ``tiers`` (host / disk / encode below the pool),
``sequence`` (a request), ``kv_planner`` (where a request's KV lives, per mode), ``scheduler``
(queues, budget, preemption), ``model_runner`` (batched forward through the kernels),
``engine`` (submit / step / generate / stream).
"""
from .block_manager import BlockManager
from .engine import Engine, RequestHandle
from .page_pool import OutOfPages, PagePool
from .scheduler import RequestTooLarge, Scheduler
from .sequence import SamplingParams, Sequence

__all__ = ["Engine", "RequestHandle", "PagePool", "BlockManager", "Scheduler", "Sequence", "SamplingParams",
           "OutOfPages", "RequestTooLarge"]
