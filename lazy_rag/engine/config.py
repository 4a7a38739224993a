"""``EngineConfig``: every knob of the serving engine in one object (sizes, pages, batching,
eviction), with the defaults for the device it runs on."""
from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from ..errors import LazyRagError
from ..kernels import FP8
from .page_manager import POLICIES

# EngineConfig.kv_dtype -> the pool's storage dtype (None: the model's)
KV_DTYPES = {None: None, "auto": None, "fp8": FP8, "float8_e4m3fn": FP8}
# EngineConfig.shared_chunks: when decode attention reads a shared chunk once for every sequence
SHARED_CHUNKS = ("auto", "on", "off")


def default_kv_bytes(device: torch.device) -> int:
    """KV pool budget when none is given: a fifth of the GPU's memory (the paper's 5 x 2048-token
    request is 1.25 GiB of KV for an 8B model), 2 GiB on the CPU."""
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).total_memory // 5
    return 2 << 30


@dataclass(frozen=True)
class EngineConfig:
    """KV pool size: ``num_pages``, else ``kv_bytes``, else ``gpu_memory_fraction`` of the free
    GPU memory, else ``default_kv_bytes``. ``page_size`` None: 64 on CUDA (the kernels' tile), 16
    on the CPU (small pages waste less of a short chunk). ``host_bytes``: the host-memory tier of
    chunk KV below the pool. ``policy``: eviction of unreferenced cached pages; ``gdsf`` by
    default: in the paper's Zipf workload it keeps 0.1-0.4 points more chunk hits than LRU (as
    LFU does) and ties it under uniform popularity (benchmarks/eviction_policy.py), and unlike
    plain LFU it ages. ``cuda_graphs``: replay decode steps, and prefill / append steps of up to
    ``append_graph_tokens`` new tokens whose attention is the Triton kernels' (lazy, block, short
    prefix-hit tails), from captured graphs (CUDA only; ``append_graph_tokens=0``: decode only).
    Each captured append shape holds its activations in the graphs' shared memory pool. A cold
    lazy request's step, which encodes its missing chunks, replays one too when it has at most
    2,048 new tokens; their K/V is captured into one static buffer of that many tokens
    (``cuda_graphs.AppendGraphs.run_encoding``).
    ``kv_dtype``: how the pool, the host tier and the KV an engine encodes store keys and values:
    None or "auto" in the model's dtype; "fp8": float8_e4m3fn with one fp16 scale per (layer,
    token, KV head) for K and for V (``kernels/kv_quant.py``), 50.8% of bf16's bytes at head_dim
    128, so a budget holds about twice the chunks; the kernels dequantise in registers and the
    model still computes in its dtype. ``shared_chunks``: decode attention over a chunk that several
    sequences of a step hold reads its KV once for all of them (``kernels/shared_chunks.py``);
    "auto" groups when the step's sharing pays (``engine/shared_chunks.py``), "on" groups every chunk
    held by two or more sequences, "off" never groups. ``tensor_parallel``: the number of ranks
    (processes) the model's layers are split over, Megatron-style (``engine/tensor_parallel.py``;
    CPU and gloo in this version); each rank's pool holds its KV heads of every chunk within the
    KV budget above, which is per rank."""

    kv_bytes: int | None = None
    gpu_memory_fraction: float | None = None
    num_pages: int | None = None
    page_size: int | None = None
    host_bytes: int = 4 << 30
    max_num_seqs: int = 64
    max_batched_tokens: int = 16384
    policy: str = "gdsf"
    cuda_graphs: bool = True
    append_graph_tokens: int = 4096
    kv_dtype: str | None = None
    shared_chunks: str = "auto"
    tensor_parallel: int = 1

    def __post_init__(self):
        if self.kv_dtype not in KV_DTYPES:
            raise LazyRagError(f"Unknown kv_dtype {self.kv_dtype!r}; choose one of "
                               f"{', '.join(str(k) for k in KV_DTYPES)}.")
        if self.shared_chunks not in SHARED_CHUNKS:
            raise LazyRagError(f"Unknown shared_chunks {self.shared_chunks!r}; choose one of "
                               f"{', '.join(SHARED_CHUNKS)}.")
        if self.policy not in POLICIES:
            raise LazyRagError(f"Unknown eviction policy {self.policy!r}; choose one of {', '.join(POLICIES)}.")
        if self.append_graph_tokens < 0:
            raise LazyRagError(f"EngineConfig.append_graph_tokens must be >= 0 (0: no append graphs), got "
                               f"{self.append_graph_tokens}.")
        for name in ("max_num_seqs", "max_batched_tokens", "tensor_parallel"):
            if getattr(self, name) < 1:
                raise LazyRagError(f"EngineConfig.{name} must be at least 1, got {getattr(self, name)}.")
        if self.page_size is not None and not (self.page_size >= 1 and self.page_size & (self.page_size - 1) == 0):
            # the block-mode copy kernel addresses slots within a page with a power-of-two tile
            raise LazyRagError(f"page_size must be a power of two, got {self.page_size}.")

    def with_options(self, **options) -> "EngineConfig":
        unknown = set(options) - set(self.__dataclass_fields__)
        if unknown:
            raise LazyRagError(f"Unknown engine option(s) {', '.join(sorted(unknown))}; the options are "
                               f"{', '.join(self.__dataclass_fields__)}.")
        return replace(self, **options)

    def resolved_kv_dtype(self, model_dtype: torch.dtype) -> torch.dtype:
        """The pool's storage dtype for a model computing in ``model_dtype``."""
        return KV_DTYPES[self.kv_dtype] or model_dtype

    def resolved_page_size(self, device: torch.device) -> int:
        return self.page_size or (64 if device.type == "cuda" else 16)

    def pool_bytes(self, device: torch.device) -> int:
        if self.kv_bytes is not None:
            return int(self.kv_bytes)
        if self.gpu_memory_fraction is not None and device.type == "cuda":
            return int(torch.cuda.mem_get_info(device)[0] * self.gpu_memory_fraction)
        return default_kv_bytes(device)
