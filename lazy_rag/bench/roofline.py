"""The GPU's measured bf16 matmul rate (the compute roofline the build benchmarks divide by) and
the profile benchmarks' split of kernel time by class."""
from __future__ import annotations

import time


def matmul_tflops(device) -> float:
    """TFLOP/s of a bf16 8192 x 8192 matmul on ``device`` (a CUDA device; NaN elsewhere), timed
    over 20 products after 3 warm-up ones."""
    import torch

    device = torch.device(device)
    if device.type != "cuda":
        return float("nan")
    a = torch.randn(8192, 8192, device=device, dtype=torch.bfloat16)
    for _ in range(3):
        a @ a
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(20):
        a @ a
    torch.cuda.synchronize()
    return 20 * 2 * 8192 ** 3 / (time.perf_counter() - t0) / 1e12


def kernel_class(name: str, copies: bool = False, all_reduces: bool = False) -> str:
    """The record field a profiled CUDA kernel's time goes to (the profile benchmarks' split):
    ``attention_ms`` (lazy-rag's Triton attention kernels), ``matmul_ms`` (cuBLAS GEMMs),
    ``d2h_ms`` (device-to-host copies, with ``copies``), ``all_reduce_ms`` (NCCL's all-reduce
    kernels, with ``all_reduces``: a tensor-parallel rank's), else ``other_kernels_ms``."""
    n = name.lower()
    if copies and "memcpy" in n and ("dtoh" in n or "device -> pageable" in n or "device -> pinned" in n):
        return "d2h_ms"
    if all_reduces and "nccl" in n and "allreduce" in n:
        return "all_reduce_ms"
    if "paged_attn" in n or "shared_chunk" in n or "merge" in n or "prefill_runs" in n:
        return "attention_ms"
    if "gemm" in n or "nvjet" in n or "cutlass" in n or "sm90_xmma" in n:
        return "matmul_ms"
    return "other_kernels_ms"
