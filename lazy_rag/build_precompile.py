"""A new index's encode kernel compiled from the model's config while the build loads the weights.

A machine's first build compiles its encode kernel (``kernels.prefill_runs``: ~2.5 s of Triton
compile and ~1 s of Triton's one-time setup on an H100) in its first batch while the disk waits;
on the 8B shape that kept most first builds under 70% of the disk's write bandwidth, against
74-106% for a machine's second build (BENCHMARKS.md, sessions 28-29). ``EncodeWarmup`` can only
start once the model is loaded.

A Triton kernel's compiled variant depends on the attention's shape and dtypes (heads, KV heads,
head dim, the KV dtype, the page size), never on the number of layers, the MLP or the weights.
So before the load, ``warm_from_config`` builds a one-layer model of the same config with random
weights (tens of MB) and starts the build's own ``EncodeWarmup`` on it, on a thread, beside the
load; the build's warm-up then waits for it (``EncodeWarmup(after=...)``) and finds the kernel
compiled. A child process instead (session 30, commit eab5ee8) was too slow to start beside a
checkpoint's load to help. The model is built on the caller's thread: transformers' model
construction patches process-wide state (the default dtype, ``torch.nn.init``) that the load
beside it must not see changed.

CUDA only; ``LAZY_RAG_PRECOMPILE=off`` turns it off. A warm-up that fails is logged and changes
nothing: the build compiles as it did without it.
"""
from __future__ import annotations

import logging
import os

import torch

from .build_pipeline import EncodeWarmup

log = logging.getLogger(__name__)

ENV = "LAZY_RAG_PRECOMPILE"
THREAD = "lazy-rag-precompile"
# the one-layer model: a vocabulary this small (the warm-up's token ids are 1s) and a narrow MLP
# (its matmuls are cuBLAS's, compiled for no one), so that its weights are tens of MB
VOCAB, INTERMEDIATE = 256, 256
# its engine's KV pool (the default is a fifth of the GPU); the pool's size is no kernel argument
POOL_BYTES = 256 << 20


def one_layer_config(config):
    """A copy of ``config`` with one decoder layer, a small vocabulary and a narrow MLP: the same
    attention (heads, KV heads, head dim, RoPE) as the model's, so the same kernel variants."""
    cfg = config.__class__.from_dict(config.to_dict())
    cfg.num_hidden_layers = 1
    if getattr(cfg, "layer_types", None):
        cfg.layer_types = list(cfg.layer_types[:1])
    cfg.vocab_size, cfg.intermediate_size = VOCAB, INTERMEDIATE
    cfg.pad_token_id = None  # an embedding's padding row must lie inside the smaller vocabulary
    return cfg


def wanted(device) -> bool:
    return (os.environ.get(ENV, "").lower() not in ("0", "off", "false", "no")
            and torch.device(device).type == "cuda" and torch.cuda.is_available())


def warm_from_config(config, *, dtype, kv_dtype, device, prefix_tokens: int = 0) -> EncodeWarmup | None:
    """The build's encode warm-up on a one-layer model of ``config``, started on its thread; None
    where it would not help (not CUDA, ``LAZY_RAG_PRECOMPILE=off``) or where the model cannot
    be built (logged: the build compiles as it would have)."""
    from transformers import AutoModelForCausalLM

    from .bench.random_models import IdTokenizer
    from .llm import LazyLLM

    if not wanted(device):
        return None
    try:
        # created in fp32 on the host, then moved: never under a default dtype or device
        # that a load on another thread could be changing
        model = AutoModelForCausalLM.from_config(one_layer_config(config)).to(device=device, dtype=dtype).eval()
        llm = LazyLLM(model, IdTokenizer(), kv_bytes=POOL_BYTES)
        return EncodeWarmup(llm, [1] * prefix_tokens, None, kv_dtype, thread_name=THREAD)
    except Exception as e:  # noqa: BLE001 - an optional head start
        log.warning("Could not start compiling the build's kernels from the model's config (%s: %s); the build "
                    "compiles them itself.", type(e).__name__, e)
        return None


def warm_for_pretrained(name_or_path: str, *, device="auto", kv_dtype="auto", prefix_ids=None) -> EncodeWarmup | None:
    """``warm_from_config`` for the model ``LazyLLM.from_pretrained(name_or_path, device)`` is
    about to load; ``kv_dtype``: a store's name for it (``store.KV_DTYPE_NAMES``' values, or
    auto); ``prefix_ids(tokenizer)``: the shared prefix's token ids, if the build has one. None
    if the config cannot be read here: the load that follows says why."""
    from transformers import AutoConfig

    from .architecture import check_supported
    from .models import load_tokenizer, resolve_device, resolve_dtype, resolve_model_path

    try:
        dev = resolve_device(device)
        if not wanted(dev):
            return None
        path = str(resolve_model_path(name_or_path))
        config = AutoConfig.from_pretrained(path)
        check_supported(config)
        dtype = resolve_dtype("auto", dev)
        prefix = len(prefix_ids(load_tokenizer(path))) if prefix_ids is not None else 0
    except Exception as e:  # noqa: BLE001 - the model's own load reports it
        log.debug("No kernel warm-up from the config of %s: %s", name_or_path, e)
        return None
    kv = dtype if kv_dtype == "auto" else getattr(torch, kv_dtype)
    return warm_from_config(config, dtype=dtype, kv_dtype=kv, device=dev, prefix_tokens=prefix)
