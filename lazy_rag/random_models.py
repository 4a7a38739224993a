"""Named architectures with random weights, built in place on the device (one module at a time,
each from its own seed: ``engine/shard_loading.RandomSource``).

The benchmark machine has no model hub, so a serving benchmark there runs a real architecture's
shape (what decides speed and KV size) with random weights; the kernel compile (``kernel_compile``)
and the server's engine specification (``server.engine_spec``) build them too. ``IdTokenizer``
stands in for a tokenizer when prompts are token ids only.
"""
from __future__ import annotations

from .errors import LazyRagError

LLAMA3_ROPE = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}

# LlamaConfig arguments per name. "tiny-llama" keeps head_dim 32 (the Triton kernels need a multiple
# of 32) so that the same tests run on CPU and GPU.
ARCHITECTURES: dict[str, dict] = {
    "llama-3.1-8b": dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
                         num_key_value_heads=8, vocab_size=128256, max_position_embeddings=131072,
                         rope_parameters=LLAMA3_ROPE),
    # Llama-3.1-70B's shape (its config.json): 80 layers, 64 query / 8 KV heads of 128; 141 GB of
    # bf16 weights, more than one H200 holds: served split over GPUs (tensor_parallel, issue 63)
    "llama-3.1-70b": dict(hidden_size=8192, intermediate_size=28672, num_hidden_layers=80, num_attention_heads=64,
                          num_key_value_heads=8, vocab_size=128256, max_position_embeddings=131072,
                          rope_parameters=LLAMA3_ROPE),
    # Qwen2.5-0.5B(-Instruct)'s shape: 24 layers, 14 query / 2 KV heads of 64, q/k/v biases, tied
    # embeddings (the bundled qwen2.5-0.5b's architecture, for speed runs on machines without its weights)
    "qwen2.5-0.5b": dict(model_type="qwen2", hidden_size=896, intermediate_size=4864, num_hidden_layers=24,
                         num_attention_heads=14, num_key_value_heads=2, vocab_size=151936,
                         max_position_embeddings=32768, tie_word_embeddings=True,
                         rope_parameters={"rope_type": "default", "rope_theta": 1000000.0}),
    # Qwen3-30B-A3B's shape: 48 layers, 32 query / 4 KV heads of 128, q/k normed per head, 128 experts
    # of width 768, 8 routed per token (~3.3B active parameters); and the dense Qwen3 model with the
    # same active parameters (its MLP the width of 8 experts), the MoE decode's yardstick
    "qwen3-30b-a3b": dict(model_type="qwen3_moe", hidden_size=2048, intermediate_size=6144, moe_intermediate_size=768,
                          num_experts=128, num_experts_per_tok=8, norm_topk_prob=True, num_hidden_layers=48,
                          num_attention_heads=32, num_key_value_heads=4, head_dim=128, vocab_size=151936,
                          max_position_embeddings=40960, rope_parameters={"rope_type": "default", "rope_theta": 1000000.0}),
    "qwen3-a3b-dense": dict(model_type="qwen3", hidden_size=2048, intermediate_size=6144, num_hidden_layers=48,
                            num_attention_heads=32, num_key_value_heads=4, head_dim=128, vocab_size=151936,
                            max_position_embeddings=40960,
                            rope_parameters={"rope_type": "default", "rope_theta": 1000000.0}),
    # Gemma-3-12B's shape: 48 layers, five sliding-window layers (window 1024, local RoPE base 1e4)
    # to one global layer (base 1e6, linear scaling 8), 16 query / 8 KV heads of 256, vocabulary 262k
    "gemma-3-12b": dict(model_type="gemma3_text", hidden_size=3840, intermediate_size=15360, num_hidden_layers=48,
                        num_attention_heads=16, num_key_value_heads=8, head_dim=256, query_pre_attn_scalar=256,
                        vocab_size=262208, sliding_window=1024, max_position_embeddings=131072,
                        layer_types=[("full_attention" if (i + 1) % 6 == 0 else "sliding_attention") for i in range(48)],
                        rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                                         "full_attention": {"rope_type": "linear", "rope_theta": 1000000.0,
                                                            "factor": 8.0}}),
    "tiny-llama": dict(hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
                       num_key_value_heads=2, vocab_size=4096, max_position_embeddings=32768,
                       rope_parameters={**LLAMA3_ROPE, "original_max_position_embeddings": 256}),
    # the engine tests' model (head_dim 32) over SmolLM2's vocabulary: the soak's (reliability_soak.py)
    "tiny-smollm2": dict(hidden_size=128, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, vocab_size=49152, max_position_embeddings=8192,
                         initializer_range=0.08,
                         rope_parameters={**LLAMA3_ROPE, "original_max_position_embeddings": 256}),
}


class IdTokenizer:
    """Prompts of token ids only: this stands in for a tokenizer (decode, EOS, vocab)."""

    bos_token_id = eos_token_id = unk_token_id = None
    all_special_tokens: list = []
    all_special_ids: list = []
    chat_template = None

    def get_vocab(self):
        return {}

    def decode(self, ids, skip_special_tokens=True):
        return " ".join(map(str, ids))


def random_config(name: str, layers: int | None = None):
    """The config of a named architecture (``layers`` overrides its depth)."""
    from transformers import Gemma3TextConfig, LlamaConfig, Qwen2Config, Qwen3Config, Qwen3MoeConfig

    if name not in ARCHITECTURES:
        raise LazyRagError(f"Unknown random architecture {name!r}; choose one of {', '.join(ARCHITECTURES)}.")
    kwargs = dict(ARCHITECTURES[name])
    if layers is not None:
        kwargs["num_hidden_layers"] = layers
        if "layer_types" in kwargs:
            kwargs["layer_types"] = kwargs["layer_types"][:layers]
    config_class = {"llama": LlamaConfig, "qwen2": Qwen2Config, "qwen3": Qwen3Config,
                    "qwen3_moe": Qwen3MoeConfig, "gemma3_text": Gemma3TextConfig}[kwargs.pop("model_type", "llama")]
    return config_class(**kwargs)


def random_source(name: str, dtype=None, layers: int | None = None, seed: int = 0, device="cpu"):
    """The ``shard_loading.RandomSource`` of a named architecture: what every process that builds
    it (a tensor-parallel rank, an engine process) needs to draw the same weights."""
    from .engine.shard_loading import RandomSource
    from .models import resolve_device, resolve_dtype

    return RandomSource(random_config(name, layers), seed, resolve_dtype(dtype or "auto", resolve_device(device)))


def random_model(name: str, device="cpu", dtype=None, layers: int | None = None, seed: int = 0,
                 tensor_parallel: int = 1, experts: str | None = None):
    """A causal LM of the named architecture with random weights, created directly on ``device``
    in ``dtype`` (default: bf16 on CUDA, fp32 on CPU): an 8B model is never built on the host.
    Each module is drawn from its own seed (``shard_loading.RandomSource``), so that
    ``tensor_parallel=N`` builds rank 0's share alone, with the values the whole model holds.
    ``experts``: what runs a mixture-of-experts shape's routed experts (``lazy_rag.experts.EXPERTS``;
    None: its default; a dense shape ignores it)."""
    from .experts import use_experts
    from .kernels import compiler_setup
    from .models import resolve_device

    dev = resolve_device(device)
    compiler_setup.start(dev)   # Triton's once-per-process set-up beside the weights' creation
    model = random_source(name, dtype, layers, seed, dev).load_share(0, tensor_parallel, dev)
    return use_experts(model, experts)


def random_llm(name: str, device="cpu", dtype=None, layers: int | None = None, seed: int = 0, **engine_options):
    """``LazyLLM`` over a random model of the named architecture, prompts as token ids
    (``engine_options``: ``EngineConfig``'s; with ``tensor_parallel`` each rank builds its share)."""
    from .engine import EngineConfig
    from .llm import LazyLLM

    config = (engine_options.pop("engine_config", None) or EngineConfig()).with_options(**engine_options)
    model = random_model(name, device, dtype, layers, seed, config.tensor_parallel)
    llm = LazyLLM(model, IdTokenizer(), engine_config=config)
    llm.model_name = f"random:{name}"
    return llm


def random_llama31_8b(layers: int = 32, device: str = "cuda"):
    """Llama-3.1-8B's shape (llama3 RoPE) with random bf16 weights (the GPU benchmark scripts' model)."""
    import torch

    return random_model("llama-3.1-8b", device, torch.bfloat16, layers)
