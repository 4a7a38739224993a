"""Where each tensor-parallel rank runs, and over which backend its collectives travel.

Rank ``r`` of an engine whose model is on ``cuda:i`` runs on ``cuda:(i + r)``, one GPU per rank;
on the CPU every rank shares the CPU. The activations' all-reduces and the gathers of device
tensors go over NCCL on CUDA (GPU to GPU, no host copy), over gloo on the CPU; the small
control-plane collectives (lockstep checks, agreements on sizes) are CPU tensors over gloo
everywhere (``rank_group.RankGroup``).
"""
from __future__ import annotations

import torch

from ..errors import LazyRagError

def rank_device(base: torch.device, rank: int) -> torch.device:
    """The device of rank ``rank`` when rank 0's model is on ``base``."""
    base = torch.device(base)
    if base.type != "cuda":
        return base
    return torch.device("cuda", (base.index or 0) + rank)


def check_rank_devices(base: torch.device, size: int) -> None:
    """Refuse ``size`` ranks for a model on ``base`` where they cannot run: any device but the CPU
    or CUDA, or fewer GPUs from ``base`` on than ranks."""
    base = torch.device(base)
    if base.type == "cpu":
        return
    if base.type != "cuda":
        raise LazyRagError(f"tensor_parallel={size} runs on the CPU (gloo) or on CUDA GPUs (NCCL), not on "
                           f"{base.type}. Load the model with device='cpu', or use tensor_parallel=1.")
    first = base.index or 0
    have = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if first + size > have:
        raise LazyRagError(
            f"tensor_parallel={size} with the model on cuda:{first} needs {first + size} visible GPUs (ranks on "
            f"cuda:{first}..cuda:{first + size - 1}, one each); {have} are visible. Make more visible "
            f"(CUDA_VISIBLE_DEVICES), load the model on cuda:0, or use tensor_parallel=1.")
