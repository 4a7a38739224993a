"""The GPU's measured bf16 matmul rate: the compute roofline the build benchmarks divide by."""
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
