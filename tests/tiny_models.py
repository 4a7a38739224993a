"""Tiny random checkpoints of every supported family (and a few unsupported ones)."""
import torch
from transformers import (Gemma2Config, Gemma2ForCausalLM, Gemma3ForCausalLM, Gemma3TextConfig, GraniteConfig, GraniteForCausalLM,
                          GraniteMoeConfig, GraniteMoeForCausalLM, GraniteMoeSharedConfig, GraniteMoeSharedForCausalLM, LlamaConfig, LlamaForCausalLM, MistralConfig,
                          MistralForCausalLM, MixtralConfig, MixtralForCausalLM, Olmo2Config, Olmo2ForCausalLM, OlmoeConfig,
                          OlmoeForCausalLM, Phi3Config, Phi3ForCausalLM, Qwen2Config, Qwen2ForCausalLM, Qwen2MoeConfig,
                          Qwen2MoeForCausalLM, Qwen3Config, Qwen3ForCausalLM, Qwen3MoeConfig, Qwen3MoeForCausalLM)

COMMON = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=8192, initializer_range=0.08)

ROPES = {
    "default": {"rope_type": "default", "rope_theta": 10000.0},
    "linear": {"rope_type": "linear", "rope_theta": 10000.0, "factor": 4.0},
    "llama3": {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 256},
    "yarn": {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 256},
}

FAMILIES = {
    "llama": (LlamaConfig, LlamaForCausalLM, {}),
    "qwen2": (Qwen2Config, Qwen2ForCausalLM, {}),  # q/k/v bias
    "qwen3": (Qwen3Config, Qwen3ForCausalLM, {"head_dim": 16}),  # per-head q/k norm
    "mistral": (MistralConfig, MistralForCausalLM, {"sliding_window": None}),
    # multipliers far from neutral (1, and 1/sqrt(head_dim) for the softmax scale), so a forward
    # that missed any of them would miss the oracle by far more than the tests' tolerance
    "granite": (GraniteConfig, GraniteForCausalLM, {"embedding_multiplier": 6.0, "residual_multiplier": 0.4,
                                                     "attention_multiplier": 0.6, "logits_scaling": 3.0}),
    "phi3": (Phi3Config, Phi3ForCausalLM, {"sliding_window": None, "pad_token_id": 0}),  # fused qkv, gate/up
    "olmo2": (Olmo2Config, Olmo2ForCausalLM, {"pad_token_id": 0, "eos_token_id": 2}),  # whole-q/k norms, post-norms
    # sliding (window 8) and global layers interleaved, each kind with its own RoPE (the global one
    # scaled), softmax scale query_pre_attn_scalar ** -0.5 far from 1/sqrt(head_dim), four norms
    "gemma3_text": (Gemma3TextConfig, Gemma3ForCausalLM, {
        "head_dim": 32, "query_pre_attn_scalar": 12, "sliding_window": 8, "pad_token_id": 0, "eos_token_id": 2,
        "bos_token_id": 1, "layer_types": ["sliding_attention", "full_attention", "sliding_attention",
                                           "sliding_attention"], "num_hidden_layers": 4}),
    # gemma3_text's layer without q/k norms, sliding (window 8) and global layers alternating under
    # one RoPE; small soft-caps (scores 5, logits 3) so that capping changes the logits (the
    # families' tests show it does); eager attention, the only one of transformers' CPU attentions
    # that soft-caps (the oracle's reference). Layer 0 global (Gemma 2's own start sliding): after a
    # sliding first layer, CacheBlend's layer-1 KV deviation is exactly 0 for every chunk token
    # past the window, ties that tensor parallelism's summation order breaks differently
    # (tests/engine/test_tensor_parallel.py)
    "gemma2": (Gemma2Config, Gemma2ForCausalLM, {
        "head_dim": 32, "query_pre_attn_scalar": 12, "sliding_window": 8, "pad_token_id": 0, "eos_token_id": 2,
        "bos_token_id": 1, "num_hidden_layers": 4, "attn_logit_softcapping": 5.0, "final_logit_softcapping": 3.0,
        "attn_implementation": "eager",
        "layer_types": ["full_attention", "sliding_attention", "full_attention", "sliding_attention"]}),
}
# mixture-of-experts families: 4 experts, each token mixing 2, so tokens differ in their experts
# (tests/test_families.py shows they do, and that the mixing matters). Apart from FAMILIES, which
# tests/engine/test_tensor_parallel.py runs over 2 ranks: tensor parallelism refuses MoE MLPs.
MOE_FAMILIES = {
    "mixtral": (MixtralConfig, MixtralForCausalLM, {"num_local_experts": 4, "num_experts_per_tok": 2,
                                                    "sliding_window": None}),
    # routed experts plus the gated shared expert; layer 1 a dense MLP (mlp_only_layers)
    "qwen2_moe": (Qwen2MoeConfig, Qwen2MoeForCausalLM, {
        "num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 64, "shared_expert_intermediate_size": 96,
        "mlp_only_layers": [1]}),
    "qwen3_moe": (Qwen3MoeConfig, Qwen3MoeForCausalLM, {"num_experts": 4, "num_experts_per_tok": 2, "head_dim": 16,
                                                        "moe_intermediate_size": 64, "norm_topk_prob": True}),
    "olmoe": (OlmoeConfig, OlmoeForCausalLM, {"num_experts": 4, "num_experts_per_tok": 2, "pad_token_id": 0,
                                              "eos_token_id": 2}),
    # granite's multipliers far from neutral (as for granite) around the experts; the shared one
    # with a shared MLP beside them
    "granitemoe": (GraniteMoeConfig, GraniteMoeForCausalLM, {
        "num_local_experts": 4, "num_experts_per_tok": 2, "embedding_multiplier": 6.0, "residual_multiplier": 0.4,
        "attention_multiplier": 0.6, "logits_scaling": 3.0}),
    "granitemoeshared": (GraniteMoeSharedConfig, GraniteMoeSharedForCausalLM, {
        "num_local_experts": 4, "num_experts_per_tok": 2, "shared_intermediate_size": 96,
        "embedding_multiplier": 6.0, "residual_multiplier": 0.4, "attention_multiplier": 0.6, "logits_scaling": 3.0}),
}
# gemma3_text's RoPE per layer kind: the sliding layers' local base, the global layers' own (scaled)
GEMMA3_ROPES = {"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                "full_attention": {"rope_type": "linear", "rope_theta": 1000000.0, "factor": 8.0}}


def tiny_model(family: str = "llama", rope: str = "default", vocab_size: int = 49152, seed: int = 0, **over):
    cfg_cls, model_cls, extra = {**FAMILIES, **MOE_FAMILIES}[family]
    ropes = {k: dict(v) for k, v in GEMMA3_ROPES.items()} if family == "gemma3_text" else dict(ROPES[rope])
    cfg = cfg_cls(vocab_size=vocab_size, rope_parameters=ropes, **{**COMMON, **extra, **over})
    torch.manual_seed(seed)
    model = model_cls(cfg).eval()
    if family in ("gemma3_text", "gemma2"):   # their (1 + weight) norms start at weight 0: make them count
        with torch.no_grad():
            for name, param in model.named_parameters():
                if "norm" in name:
                    param.normal_(0.0, 0.3)
    return model
