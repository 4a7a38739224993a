"""Kernel tests: on a machine without CUDA, run the Triton kernels in the CPU interpreter.

TRITON_INTERPRET must be set before any kernel module is imported (Triton reads it when a kernel
is decorated). On the GPU (tests/kernels/run_gpu.sh) the same tests run in bf16 and fp16.
"""
import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
