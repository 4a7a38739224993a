"""Which transformers checkpoints lazy-rag can run, and the parts of them our forward uses.

We reuse the checkpoint's own modules (projections, norms, MLP, embeddings) and replace only
attention, which is where cached chunk KV and lazy RoPE come in. A family is supported when its
attention is plain softmax attention over RoPE'd q/k (RoPE tables whose frequencies do not
depend on the sequence length; global, or gemma3_text's and gemma2's sliding windows below; no
score soft-capping but gemma2's) and its decoder layer is one of the shapes ``LayerFamily`` describes:

- llama, mistral, qwen2, qwen3: pre-norm -> q/k/v proj (optional bias; qwen3 norms q and k per
  head before RoPE) -> RoPE -> attention -> o_proj -> residual -> pre-norm -> MLP -> residual;
- granite: llama's layer with scalar multipliers: embeddings times ``embedding_multiplier``,
  each residual branch times ``residual_multiplier``, softmax scale ``attention_multiplier``
  (instead of 1/sqrt(head_dim)) and logits divided by ``logits_scaling``;
- phi3: llama's layer with one fused ``qkv_proj`` (q, k, v in that order, split by head counts)
  and a fused gate/up MLP (the checkpoint's own MLP module runs it);
- olmo2: no input pre-norms; q and k normed over all heads at once (``q_norm``/``k_norm`` of
  width heads * head_dim) before RoPE; attention's and the MLP's outputs normed
  (``post_attention_layernorm``, ``post_feedforward_layernorm``) before their residual adds;
- gemma3_text (Gemma 3): four norms per layer ("sandwich": pre- and post-norms around attention
  and the MLP), q/k normed per head, Gemma's (1 + weight) RMSNorm (the checkpoint's module), the
  embeddings scaled by sqrt(hidden) (its embedding module does it), softmax scale
  ``query_pre_attn_scalar ** -0.5``, and two layer kinds (``config.layer_types``): sliding-window
  layers with their own RoPE base (``rope_local_base_freq``) and global layers with the global
  RoPE (and its scaling);
- gemma2 (Gemma 2): gemma3_text's sandwich norms, (1 + weight) RMSNorm, embedding scale and
  softmax scale, without q/k norms; sliding and global layers alternate under one RoPE table;
  attention scores are soft-capped, ``tanh(s / attn_logit_softcapping) * attn_logit_softcapping``
  before the mask and softmax, and the logits likewise by ``final_logit_softcapping``. torch's
  SDPA cannot soft-cap, so its torch attention computes explicit scores
  (``model_runner.capped_attention``); the Triton kernels cap (and window) in registers;
- mixtral, qwen2_moe, qwen3_moe, olmoe: mistral's, qwen2's, qwen3's layer (olmoe: llama's
  pre-norms with olmo2's whole-q/k norms) whose MLP is a sparse mixture-of-experts block: a
  router picks each token's top-k experts and mixes their outputs (qwen2_moe adds a gated shared
  expert). The checkpoint's own block runs it (``LayerFamily.moe``);
- granitemoe, granitemoeshared: granite's layer (its multipliers) with the experts in
  ``block_sparse_moe`` (granitemoeshared adds a shared MLP beside them, on for every token).

Mixture-of-experts and packing: the engine packs the tokens of many sequences into one
[n_tokens, hidden] batch, which the block takes as one sequence; its router scores and picks
experts per token (softmax and top-k over each row of its logits, no capacity limit or batch
statistics), so a token's output does not depend on what it is packed with. On CUDA the experts
run decode-sized batches through lazy-rag's Triton experts kernel (lazy_rag/experts.py,
kernels/moe.py: each hit expert's weights read once per step, the routed pairs sorted on the
device with no host sync, so the step graphs capture it) and larger batches as transformers'
``grouped_mm`` experts implementation (each projection one grouped GEMM over all experts); the
choice is made where the model is loaded (``experts=``, default "auto").

Sliding windows and position-free reuse: a window is a mask over *logical* positions (a query at
p sees keys at p - W + 1 .. p), which lazy-rag assigns at query time exactly like RoPE; a chunk
encoded alone sees its own tokens within the window, and in a sliding layer the question sees the
last W logical positions, as in a full forward. ``LayerKind`` holds each kind's RoPE table and
window. Stored chunk KV is unrotated; the pool keeps each layer's keys rotated by that layer's
own table (``ModelParts.layer_rope``: gemma3_text's sliding layers by their local one, every other
layer by the global one), so every attention path, the Triton kernels' (which rotate only the
query) included, takes a layer's keys as stored and rotates its query by the same table. What
rotates a chunk's keys in every layer at once (placing it in the pool, block mode's copy) takes
``ModelParts.pool_rope``.
"""
from __future__ import annotations

import json
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from .errors import UnsupportedModelError
from .kernels.rope import LayerRopes, RopeTable


@dataclass(frozen=True)
class LayerFamily:
    """How one family's decoder layer differs from llama's (see the module docstring)."""
    qkv: str = "separate"        # "fused": one qkv_proj, split into q, k, v by head counts (phi3)
    qk_norm: str | None = None   # "head": per head (qwen3); "whole": over all heads at once (olmo2)
    norms: str = "pre"           # "pre": input_layernorm / post_attention_layernorm before the branches;
                                 # "post": post_attention_layernorm / post_feedforward_layernorm after (olmo2);
                                 # "sandwich": input/pre_feedforward before, post_attention/post_feedforward
                                 # after (gemma3_text)
    multipliers: bool = False    # granite's embedding / residual / attention multipliers and logits_scaling
    fused_norm: bool = True      # its RMSNorm rounds to x's dtype before the weight multiply (olmo2's after)
    moe: bool = False            # the MLP is a sparse mixture-of-experts block (see the module docstring)
    windows: bool = False        # sliding-window and global layer kinds (config.layer_types)
    softcap: bool = False        # attention scores and logits soft-capped (gemma2)
    layer: str = ""              # the layer in words (`lazy-rag models`, docs/models.md)
    tested: str = ""             # what tests/test_parity.py / test_families.py hold it to


_PARITY = "lazy, block, full, prefix and greedy tokens equal to the HF oracle (fp32, tiny random models)"
_MOE_PARITY = _PARITY + "; 4 experts, top-2, the routing shown to matter"
FAMILIES: dict[str, LayerFamily] = {
    "llama": LayerFamily(layer="pre-norm llama layer (SmolLM included)",
                         tested=_PARITY + "; default, linear, llama3 and yarn RoPE; SmolLM2 bundled"),
    "mistral": LayerFamily(layer="llama's layer; no sliding window", tested=_PARITY),
    "qwen2": LayerFamily(layer="llama's layer with q/k/v biases", tested=_PARITY + "; Qwen2.5 bundled"),
    "qwen3": LayerFamily(qk_norm="head", layer="llama's layer, q/k normed per head before RoPE", tested=_PARITY),
    "granite": LayerFamily(multipliers=True, layer="llama's layer with embedding/residual/attention multipliers "
                           "and logits_scaling", tested=_PARITY + ", non-neutral multipliers"),
    "phi3": LayerFamily(qkv="fused", layer="fused qkv_proj and gate_up_proj (Phi-3, Phi-4); default RoPE, "
                        "full rotary", tested=_PARITY),
    "olmo2": LayerFamily(qk_norm="whole", norms="post", fused_norm=False,
                         layer="q/k normed over all heads, post-norms instead of pre-norms", tested=_PARITY),
    "gemma3_text": LayerFamily(qk_norm="head", norms="sandwich", fused_norm=False, windows=True,
                               layer="Gemma 3: pre- and post-norms, (1 + w) RMSNorm, sliding-window and global "
                               "layers with their own RoPE",
                               tested=_PARITY + "; windows 8 and 16 under chunks longer than the window; on CUDA "
                               "the Triton kernels' windows with each layer's own RoPE"),
    "gemma2": LayerFamily(norms="sandwich", fused_norm=False, windows=True, softcap=True,
                          layer="Gemma 2: pre- and post-norms, (1 + w) RMSNorm, alternating sliding-window and "
                          "global layers under one RoPE, attention scores and logits soft-capped (tanh)",
                          tested=_PARITY + "; window 8 under chunks longer than the window; soft-caps 5 and 3 "
                          "shown to matter; on CUDA the Triton kernels' windows and caps"),
    "mixtral": LayerFamily(moe=True, layer="mistral's layer, a mixture-of-experts MLP (top-k routed experts)",
                           tested=_MOE_PARITY),
    "qwen2_moe": LayerFamily(moe=True, layer="qwen2's layer, routed experts plus a gated shared expert",
                             tested=_MOE_PARITY + ", a shared expert and a dense layer"),
    "qwen3_moe": LayerFamily(qk_norm="head", moe=True, layer="qwen3's layer (q/k normed per head), routed "
                             "experts", tested=_MOE_PARITY),
    "olmoe": LayerFamily(qk_norm="whole", moe=True, layer="llama's pre-norms, q/k normed over all heads, routed "
                         "experts", tested=_MOE_PARITY),
    "granitemoe": LayerFamily(multipliers=True, moe=True, layer="granite's layer (multipliers), routed experts "
                              "(block_sparse_moe)", tested=_MOE_PARITY + ", non-neutral multipliers"),
    "granitemoeshared": LayerFamily(multipliers=True, moe=True, layer="granitemoe's layer plus a shared MLP beside "
                                    "the experts",
                                    tested=_MOE_PARITY + ", a shared MLP, non-neutral multipliers"),
}
SUPPORTED_MODEL_TYPES = tuple(FAMILIES)
# default, linear, llama3 and yarn give fixed frequencies; `dynamic` (and longrope) change with the
# sequence length, so a chunk's KV could not be computed once and reused
SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3", "yarn")
# families we know and do not run: what they need that lazy-rag lacks, and the nearest supported one
KNOWN_UNSUPPORTED = {
    "gemma3": ("a vision tower (the multimodal checkpoint); its text model, model type gemma3_text, runs",
               "gemma3_text"),
    "gemma": ("its embedding normaliser and (1 + weight) norms, not wired into lazy-rag's layer", "llama"),
    # mixture-of-experts layers lazy-rag has not wired in (mixtral, qwen2_moe, qwen3_moe, olmoe and
    # the granite ones run)
    "granitemoehybrid": ("a mixture-of-experts MLP and Mamba layers", "granite"),
    "phimoe": ("LayerNorm norms and a sparsemixer-routed mixture-of-experts MLP, not wired into lazy-rag's layer",
               "phi3"),
    "deepseek_v2": ("multi-head latent attention (MLA) and a mixture-of-experts MLP", "llama"),
    "deepseek_v3": ("multi-head latent attention (MLA) and a mixture-of-experts MLP", "llama"),
    "phi": ("a parallel attention/MLP block with LayerNorm and partial rotary", "phi3"),
    "olmo": ("non-parametric LayerNorm and q/k/v clipping", "olmo2"),
}
SOFTCAP_KEYS = ("attn_logit_softcapping", "final_logit_softcapping")
_MOE_KEYS = ("num_experts", "num_local_experts", "n_routed_experts", "moe_num_experts")


def lm_logits(model, hidden: torch.Tensor) -> torch.Tensor:
    """fp32 logits of a transformers causal LM's final hidden states (normed): its LM head, divided
    by Granite's ``logits_scaling`` or soft-capped by Gemma 2's ``final_logit_softcapping``
    where the config has one, as its own forward does."""
    out = model.lm_head(hidden)
    scaling = getattr(model.config, "logits_scaling", None)
    out = out if scaling is None else out / scaling
    return softcap(out, getattr(model.config, "final_logit_softcapping", None)).float()


def softcap(x: torch.Tensor, cap: float | None) -> torch.Tensor:
    """Gemma 2's soft-capping: ``tanh(x / cap) * cap`` (None: x as it is)."""
    return x if cap is None else torch.tanh(x / cap) * cap


@dataclass
class ModelShape:
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    hidden_size: int
    vocab_size: int
    max_positions: int

    @property
    def kv_bytes_per_token(self) -> int:
        """Bytes of K+V per token per dtype byte (multiply by element size)."""
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim


def _families_line() -> str:
    return ("lazy-rag runs Llama (incl. SmolLM, llama3 RoPE scaling), Mistral (no sliding window), Qwen2, Qwen3, "
            "Granite, Phi-3 (incl. Phi-4; default RoPE), OLMo 2, Gemma 2, Gemma 3 (text) and the "
            "mixture-of-experts Mixtral, Qwen2-MoE, Qwen3-MoE, OLMoE and Granite MoE checkpoints (model types "
            f"{', '.join(SUPPORTED_MODEL_TYPES)}).")


def num_experts(config) -> int:
    """How many experts a mixture-of-experts config routes between (0: a dense MLP)."""
    return next((getattr(config, k) for k in _MOE_KEYS if isinstance(getattr(config, k, None), int)
                 and getattr(config, k) > 0), 0)


def _family(config) -> LayerFamily:
    """``config``'s family; a plain one (no flag set) for a model type lazy-rag does not run."""
    return FAMILIES.get(getattr(config, "model_type", None), LayerFamily())


def _unsupported_feature(config) -> str | None:
    """What in ``config`` lazy-rag cannot run, whatever the model type, or None."""
    capped = any(getattr(config, k, None) is not None for k in SOFTCAP_KEYS)
    if capped and not _family(config).softcap:
        return "soft-capping of attention scores or logits"
    if num_experts(config) and not _family(config).moe:
        return "a mixture-of-experts MLP"
    if getattr(config, "clip_qkv", None) is not None:   # olmoe's (and olmo's) option, off in released checkpoints
        return f"q/k/v clipping (clip_qkv {config.clip_qkv})"
    if getattr(config, "kv_lora_rank", None) is not None:
        return "multi-head latent attention (MLA)"
    return None


def _sliding_window(config) -> bool:
    layer_types = getattr(config, "layer_types", None) or []
    if "sliding_attention" in layer_types:
        return True
    if layer_types:   # every layer named and none slides (qwen2/qwen3's use_sliding_window=False)
        return False
    return getattr(config, "sliding_window", None) is not None and getattr(config, "use_sliding_window", True)


def check_supported(config) -> None:
    """Refuse checkpoints whose attention is not plain global RoPE attention, or whose layer is
    none of ``FAMILIES``, naming the feature and the nearest supported family."""
    mt = getattr(config, "model_type", None)
    feature = _unsupported_feature(config)
    if mt not in FAMILIES:
        known, nearest = KNOWN_UNSUPPORTED.get(mt, (None, "llama"))
        why = known or feature or ("sliding-window attention" if _sliding_window(config) else None)
        raise UnsupportedModelError(
            f"Model type {mt!r} is not supported" + (f": it uses {why}" if why else "")
            + f". {_families_line()} The nearest supported family is {nearest}."
        )
    if feature is not None:
        raise UnsupportedModelError(f"This {mt} checkpoint uses {feature}, which lazy-rag does not run; "
                                    f"use a plain {mt} checkpoint.")
    if windowed(config) and getattr(config, "use_bidirectional_attention", False):
        raise UnsupportedModelError(
            f"This {mt} checkpoint uses bidirectional attention (an embedding model), which lazy-rag does not run; "
            f"use a causal {mt} checkpoint."
        )
    if _sliding_window(config) and not windowed(config):
        raise UnsupportedModelError(
            f"This {mt} checkpoint uses sliding-window attention (window {getattr(config, 'sliding_window', None)}); "
            "lazy-rag needs global attention so cached chunks stay visible at any position. Use a "
            f"{mt} checkpoint (or config) without a sliding window."
        )
    params = getattr(config, "rope_parameters", None) or {}
    if isinstance(params, dict) and params and "rope_type" not in params:
        if not windowed(config):
            raise UnsupportedModelError(
                "Per-layer-type RoPE parameters are not supported (one RoPE table per model expected)."
            )
        kinds = [params[t] or {} for t in sorted(set(config.layer_types))]   # gemma3_text: one per layer kind
    else:
        kinds = [params if isinstance(params, dict) else {}]
    for params in kinds:
        rope_type = params.get("rope_type", "default")
        if rope_type not in SUPPORTED_ROPE_TYPES:
            raise _rope_refusal(rope_type, mt)
        partial = params.get("partial_rotary_factor", getattr(config, "partial_rotary_factor", 1.0))
        if partial is not None and float(partial) != 1.0:
            raise UnsupportedModelError(
                f"This {mt} checkpoint rotates only part of each head (partial_rotary_factor {partial}); lazy-rag's "
                f"lazy RoPE rotates whole heads. Use a {mt} checkpoint with full rotary (partial_rotary_factor 1)."
            )


def windowed(config) -> bool:
    """Whether ``config`` is of a family whose sliding-window layers lazy-rag runs (gemma3_text, gemma2)."""
    return _family(config).windows


def _rope_refusal(rope_type: str, mt) -> UnsupportedModelError:
    return UnsupportedModelError(
        f"RoPE type {rope_type!r} is not supported: its frequencies change with sequence length (or per "
        "token), so chunk KV cannot be computed once and reused. Supported: "
        f"{', '.join(SUPPORTED_ROPE_TYPES)}; use a {mt} checkpoint (or config) with one of those."
    )


def layer_fingerprint(config) -> str | None:
    """The config values outside the weights that change a family's KV or logits (granite's
    multipliers; gemma3_text's and gemma2's window, layer kinds, RoPE and softmax scale, and
    gemma2's soft-caps; a
    mixture-of-experts router's top-k), as a canonical string; None for families whose layer is
    fixed by its weights."""
    fam = FAMILIES.get(getattr(config, "model_type", None))
    if fam is None:
        return None
    if fam.moe:
        # the weights' shapes carry the expert count (and which layers are sparse), but how many
        # experts each token mixes, and whether their weights are renormalised over those
        # (qwen/olmoe's norm_topk_prob; mixtral always does: null), are config values
        moe = {"num_experts": num_experts(config), "num_experts_per_tok": int(config.num_experts_per_tok),
               "norm_topk_prob": getattr(config, "norm_topk_prob", None)}
        return json.dumps({**moe, **(multipliers_of(config) if fam.multipliers else {})}, sort_keys=True)
    if windowed(config):
        # the model fingerprint's "rope" is the global table only: the sliding layers' RoPE, which
        # layers slide and how far change every layer after the first sliding one
        # (the soft-caps only where set: gemma3_text's fingerprints stay as they were)
        caps = {k: float(getattr(config, k)) for k in SOFTCAP_KEYS if getattr(config, k, None) is not None}
        return json.dumps({"sliding_window": int(config.sliding_window), "layer_types": list(config.layer_types),
                           "rope_parameters": config.rope_parameters,
                           "query_pre_attn_scalar": float(config.query_pre_attn_scalar), **caps}, sort_keys=True)
    if not fam.multipliers:
        return None
    return json.dumps(multipliers_of(config), sort_keys=True)


def moe_block(layer) -> torch.nn.Module:
    """A mixture-of-experts layer's expert block: ``mlp`` (mixtral, qwen, olmoe) or
    ``block_sparse_moe`` (granitemoe)."""
    block = getattr(layer, "block_sparse_moe", None)
    return layer.mlp if block is None else block


def multipliers_of(config) -> dict:
    """Granite's scalar multipliers (the granite families' config values outside the weights)."""
    keys = ("embedding_multiplier", "residual_multiplier", "attention_multiplier", "logits_scaling")
    return {k: float(getattr(config, k)) for k in keys}


def rope_table_of(model) -> RopeTable:
    """The checkpoint's own RoPE: ``inv_freq`` and ``attention_scaling`` from transformers' rotary
    module, so every scaling is computed exactly as the model was trained."""
    params = getattr(model.config, "rope_parameters", None) or {}
    rope_type = params.get("rope_type", "default")
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise _rope_refusal(rope_type, model.config.model_type)
    rotary = model.model.rotary_emb
    return RopeTable(inv_freq=rotary.inv_freq.detach().to(torch.float32).clone(),
                     attention_scaling=float(rotary.attention_scaling), rope_type=rope_type)


@dataclass(frozen=True)
class LayerKind:
    """One kind of layer's attention (gemma3_text's "sliding_attention" / "full_attention"): its
    RoPE table and its window (a query at p sees keys at p - window + 1 .. p; None: global)."""
    name: str
    rope: RopeTable
    window: int | None


def layer_kinds(model) -> tuple[list[LayerKind], list[int]]:
    """The model's layer kinds, the global kind first (its table is the model fingerprint's), and
    each layer's kind index. One global kind for every family but gemma3_text, whose rotary
    module holds one table per kind (``{kind}_inv_freq``), and gemma2, whose kinds share its one
    table (the same object)."""
    config = model.config
    if not windowed(config):
        return [LayerKind("full_attention", rope_table_of(model), None)], [0] * config.num_hidden_layers
    rotary = model.model.rotary_emb
    types = list(config.layer_types)[:config.num_hidden_layers]
    names = sorted(set(types), key=lambda t: (t != "full_attention", t))
    window = lambda name: int(config.sliding_window) if name == "sliding_attention" else None  # noqa: E731
    if hasattr(rotary, "inv_freq"):   # one table for every kind (gemma2)
        table = rope_table_of(model)
        return [LayerKind(name, table, window(name)) for name in names], [names.index(t) for t in types]
    kinds = []
    for name in names:
        rope_type = rotary.rope_type[name]
        if rope_type not in SUPPORTED_ROPE_TYPES:
            raise _rope_refusal(rope_type, config.model_type)
        table = RopeTable(inv_freq=getattr(rotary, f"{name}_inv_freq").detach().to(torch.float32).clone(),
                          attention_scaling=float(getattr(rotary, f"{name}_attention_scaling")), rope_type=rope_type)
        kinds.append(LayerKind(name, table, window(name)))
    return kinds, [names.index(t) for t in types]


class ModelParts:
    """The checkpoint's modules in the order our forward uses them, its shape and RoPE table, and
    its family's layer (``LayerFamily``): ``embed_scale``, ``attention_in``, ``project_qkv``,
    ``attention_residual``, ``mlp_residual`` and ``logits`` are the forward's steps around attention."""

    def __init__(self, model):
        check_supported(model.config)
        self.model = model
        self.config = model.config
        self.family = FAMILIES[model.config.model_type]
        # each layer's kind (RoPE table and window) and RoPE table, which the pool keeps the
        # layer's keys rotated by; rope_table: the global layers' (the model fingerprint's)
        self.kinds, self.layer_kind = layer_kinds(model)
        self.rope_table = self.kinds[0].rope
        self.layer_rope = [self.kinds[k].rope for k in self.layer_kind]
        # a chunk's keys in every layer at once: the one table where every layer shares it, else
        # each layer's (LayerRopes)
        shared = all(t is self.rope_table for t in self.layer_rope)
        self.pool_rope = self.rope_table if shared else LayerRopes(tuple(k.rope for k in self.kinds),
                                                                   tuple(self.layer_kind))
        self.windowed = any(k.window is not None for k in self.kinds)
        inner = model.model
        self.embed = inner.embed_tokens
        self.vocab_rows = int(self.embed.weight.shape[0])  # ids from here up are wrapper slots (wrapper.py)
        self.virtual_rows: torch.Tensor | None = None     # the host's WrapperTable rows, if any
        self.final_norm = inner.norm
        self.lm_head = model.lm_head
        self.layers = list(inner.layers)
        attn = self.layers[0].self_attn
        c = self.config
        self.shape = ModelShape(
            num_layers=len(self.layers),
            num_heads=c.num_attention_heads,
            num_kv_heads=c.num_key_value_heads,
            head_dim=attn.head_dim,
            hidden_size=c.hidden_size,
            vocab_size=c.vocab_size,
            max_positions=int(getattr(c, "max_position_embeddings", 1 << 20)),
        )
        self.scaling = float(attn.scaling)   # the softmax scale (granite: attention_multiplier)
        # gemma2's soft-caps of the attention scores and the logits (None: not capped)
        self.softcap = getattr(c, "attn_logit_softcapping", None)
        self.final_softcap = getattr(c, "final_logit_softcapping", None)
        self.has_qk_norm = self.family.qk_norm is not None
        fam = self.family
        # granite's multipliers (None: the family has none, nothing is multiplied)
        self.embedding_multiplier = float(c.embedding_multiplier) if fam.multipliers else None
        self.residual_multiplier = float(c.residual_multiplier) if fam.multipliers else None
        self.logits_scaling = float(c.logits_scaling) if fam.multipliers else None

    # -- the layer around attention (ModelRunner.forward) -------------------------------------------
    def embed_scale(self, x: torch.Tensor) -> torch.Tensor:
        """The embeddings ``embed_ids`` returned as the first layer takes them (granite multiplies
        them, wrapper rows included, as transformers multiplies ``inputs_embeds``)."""
        return x if self.embedding_multiplier is None else x * self.embedding_multiplier

    def attention_in(self, layer, x: torch.Tensor) -> torch.Tensor:
        """What the q/k/v projections read: the residual stream pre-normed (sandwich included), or
        as it is (olmo2)."""
        return x if self.family.norms == "post" else self._norm(layer.input_layernorm, x)

    def attention_residual(self, layer, x: torch.Tensor, o: torch.Tensor) -> torch.Tensor:
        """The residual stream after attention, whose output ``o`` [n, H * D] is not yet projected."""
        a = layer.self_attn.o_proj(o)
        if self.family.norms in ("post", "sandwich"):
            return x + self._norm(layer.post_attention_layernorm, a)
        return x + (a if self.residual_multiplier is None else a * self.residual_multiplier)

    def mlp_residual(self, layer, x: torch.Tensor) -> torch.Tensor:
        """The residual stream after the layer's MLP (the checkpoint's module, fused gate/up included)."""
        if self.family.norms == "post":
            return x + self._norm(layer.post_feedforward_layernorm, self._mlp(layer, x))
        if self.family.norms == "sandwich":
            return x + self._norm(layer.post_feedforward_layernorm,
                                  self._mlp(layer, self._norm(layer.pre_feedforward_layernorm, x)))
        m = self._mlp(layer, self._norm(layer.post_attention_layernorm, x))
        return x + (m if self.residual_multiplier is None else m * self.residual_multiplier)

    def _mlp(self, layer, y: torch.Tensor) -> torch.Tensor:
        """The layer's MLP of y [n, hidden]. transformers' mixture-of-experts blocks read their
        input as [batch, seq, hidden]: the packed rows go in as one sequence (the router works per
        token, so packing does not change a token's experts); dense layers of a MoE model
        (qwen's ``mlp_only_layers``) take that shape too. The granite families keep their experts
        in ``block_sparse_moe``, beside an optional shared MLP that every token goes through."""
        if not self.family.moe:
            return layer.mlp(y)
        out = moe_block(layer)(y[None])
        if isinstance(out, tuple):   # transformers 4's blocks (and patched ones): (hidden states, router logits)
            out = out[0]
        shared = getattr(layer, "shared_mlp", None)
        return out[0] if shared is None else out[0] + shared(y)

    def logits(self, x: torch.Tensor) -> torch.Tensor:
        """fp32 logits of final hidden states x [n, hidden] (granite divides by logits_scaling, gemma2
        soft-caps, in the model's dtype first, as transformers does)."""
        out = self.lm_head(self._norm(self.final_norm, x))
        return softcap(out if self.logits_scaling is None else out / self.logits_scaling, self.final_softcap).float()

    def embed_ids(self, ids: torch.Tensor, virtual: bool = False, rows: torch.Tensor | None = None) -> torch.Tensor:
        """Input embeddings of ``ids`` (any shape); with ``virtual``, ids >= ``vocab_rows`` (chunk
        wrapper slots) read ``rows`` (default ``virtual_rows``; the trainer passes its trainable
        vectors, and gradients reach them) instead. Value-independent (no host sync), so it can be
        captured."""
        rows = self.virtual_rows if rows is None else rows
        if not virtual or rows is None:
            return self.embed(ids)
        extra = ids - self.vocab_rows
        x = self.embed(ids.clamp(max=self.vocab_rows - 1))
        w = rows[extra.clamp(min=0, max=rows.shape[0] - 1)]
        return torch.where((extra >= 0)[..., None], w.to(x.dtype), x)

    def project_qkv(self, layer, y: torch.Tensor):
        """q [n, Hq, D], k and v [n, Hkv, D] of the layer's input y [n, hidden] (``attention_in``),
        before RoPE: separate projections or phi3's fused ``qkv_proj`` (q, k, v by head counts);
        qwen3 normalises q and k per head, olmo2 over all heads at once, before any rotation."""
        attn, shp, n = layer.self_attn, self.shape, y.shape[0]
        fam = self.family
        if fam.qkv == "fused":
            widths = [shp.num_heads * shp.head_dim, shp.num_kv_heads * shp.head_dim, shp.num_kv_heads * shp.head_dim]
            q, k, v = (t.contiguous() for t in attn.qkv_proj(y).split(widths, dim=-1))
        else:
            q, k, v = attn.q_proj(y), attn.k_proj(y), attn.v_proj(y)
        if fam.qk_norm == "whole":
            q, k = self._norm(attn.q_norm, q), self._norm(attn.k_norm, k)
        q = q.reshape(n, shp.num_heads, shp.head_dim)
        k = k.reshape(n, shp.num_kv_heads, shp.head_dim)
        v = v.reshape(n, shp.num_kv_heads, shp.head_dim)
        if fam.qk_norm == "head":
            q, k = self._norm(attn.q_norm, q), self._norm(attn.k_norm, k)
        return q, k, v

    @staticmethod
    def norm(module, x: torch.Tensor, fused: bool = True) -> torch.Tensor:
        """The checkpoint's RMSNorm ``module`` applied to x (the llama-style families' is
        ``weight * (x.float() * rsqrt(mean(x.float()**2) + eps)).to(x.dtype)``). On CUDA the
        normalisation is torch's fused ``rms_norm`` (one kernel instead of ~6 small ones per norm,
        65 norms per 8B step: ~1.5 ms of an 82-token step on an H100), then the same weight
        multiply in x's dtype, so it rounds where the module rounds; only the order of the
        mean's fp32 sum differs. Elsewhere, and with ``fused=False`` (``LayerFamily.fused_norm``: a
        family whose norm multiplies the weight before rounding, olmo2), the module itself."""
        eps = getattr(module, "variance_epsilon", None)
        if not x.is_cuda or eps is None or not fused:
            return module(x)
        return module.weight * F.rms_norm(x, (x.shape[-1],), None, eps)

    def _norm(self, module, x: torch.Tensor) -> torch.Tensor:
        return self.norm(module, x, self.family.fused_norm)

    @property
    def dtype(self) -> torch.dtype:
        return self.embed.weight.dtype

    @property
    def device(self) -> torch.device:
        return self.embed.weight.device
