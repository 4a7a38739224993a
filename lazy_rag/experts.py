"""Which implementation runs a mixture-of-experts model's routed experts: a choice made where the
model is loaded (``models.load_model_and_tokenizer``, ``random_models.random_model``), since it
belongs to the model, not to the engine around it.

transformers' experts modules (``Qwen3MoeExperts`` and its kin, decorated with
``use_experts_implementation``) dispatch their forward on ``config._experts_implementation``
through its ``ExpertsInterface``. ``use_experts`` registers lazy-rag's Triton experts there under
``TRITON_EXPERTS`` (on first use: transformers' MoE integration is not imported for a model that
keeps transformers' choice) and points a model at it. Choices (``EXPERTS``):

    "auto"        the default: "triton" for a model on a CUDA device whose experts the kernel
                  supports (``unsupported_reason``), else "grouped_mm"
    "grouped_mm"  transformers' grouped GEMM over the expert-sorted tokens (the model is left as
                  transformers built it, which falls back to its eager loop where grouped_mm
                  cannot run)
    "triton"      kernels/moe.py for decode-sized batches: per expert, every row of a step
                  against weights read once (issue 62); a prefill's larger batches still take
                  grouped_mm. On an H200 (Qwen3-30B-A3B's shape, bf16) a decode step took 8.18
                  ms against grouped_mm's 9.92 at batch 1 and 22.7 against 29.4 at batch 32
                  (BENCHMARKS.md, "Mixture-of-experts decode"), hence "auto"'s choice. Off
                  CUDA it runs the torch reference (or Triton's interpreter), so "auto" keeps
                  transformers' experts there
"""
from __future__ import annotations

import torch

from .errors import LazyRagError

TRITON_EXPERTS = "lazy_rag_triton"
EXPERTS = {"auto": None, "grouped_mm": "grouped_mm", "triton": TRITON_EXPERTS}
DEFAULT_EXPERTS = "auto"
# The kernel is shaped for decode: 16-row blocks against weights streamed once. A prefill's
# thousands of rows per expert are a compute-bound GEMM, which grouped_mm's tiles do better; the
# choice is on the shape alone (no host sync), so each captured graph keeps one path.
# 1024 pairs: a decode batch of 128 at top-8.
MOST_KERNEL_PAIRS = 1024


def unsupported_reason(experts: torch.nn.Module) -> str | None:
    """Why the Triton kernel cannot run this experts module (None: it can). The kernel knows one
    layout: gate and up concatenated in ``gate_up_proj`` [E, 2I, H] (gate first), ``down_proj``
    [E, H, I], no biases, SiLU(gate) * up, nothing after the down projection, all experts local."""
    from transformers.activations import SiLUActivation
    from transformers.integrations.moe import _default_apply_gate

    checks = {
        "no gate_up_proj / down_proj": hasattr(experts, "gate_up_proj") and hasattr(experts, "down_proj"),
        "gate and up not concatenated": getattr(experts, "has_gate", False) and getattr(experts, "is_concatenated", False),
        "transposed weights": not getattr(experts, "is_transposed", True),
        "biases": not getattr(experts, "has_bias", True),
        # Both flags arrived after transformers 5.17 (the GPU image): their absence means the
        # feature does not exist there, not that it is on.
        "a norm after the experts": not getattr(experts, "has_post_expert_norm", False),
        "expert parallelism": not getattr(experts, "_is_expert_parallel", False),
        "an activation other than SiLU": isinstance(getattr(experts, "act_fn", None), (SiLUActivation, torch.nn.SiLU)),
        "its own gating": getattr(type(experts), "_apply_gate", None) is _default_apply_gate,
    }
    failed = [why for why, ok in checks.items() if not ok]
    return ", ".join(failed) or None


def triton_experts_forward(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                           top_k_weights: torch.Tensor) -> torch.Tensor:
    """transformers' experts forward signature over kernels/moe.py (the kernel on CUDA, the
    interpreter under TRITON_INTERPRET=1, else the torch reference) for up to
    ``MOST_KERNEL_PAIRS`` token-expert pairs; more (a prefill) go to transformers' grouped_mm."""
    from transformers.integrations.moe import grouped_mm_experts_forward

    from .kernels.moe import moe_experts

    if top_k_index.numel() > MOST_KERNEL_PAIRS:
        return grouped_mm_experts_forward(self, hidden_states, top_k_index, top_k_weights)
    return moe_experts(hidden_states, self.gate_up_proj, self.down_proj, top_k_index, top_k_weights)


def register_triton_experts() -> None:
    """Make ``TRITON_EXPERTS`` a name transformers' ``set_experts_implementation`` accepts."""
    from transformers.integrations.moe import ALL_EXPERTS_FUNCTIONS

    ALL_EXPERTS_FUNCTIONS.register(TRITON_EXPERTS, triton_experts_forward)


def experts_modules(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The model's experts modules that dispatch through the ExpertsInterface: the ones whose
    ``__init__`` is ``use_experts_implementation``'s, which sets ``is_concatenated`` and ``config``
    (in every transformers 5 release; later ones add more flags)."""
    return [m for m in model.modules() if hasattr(m, "is_concatenated") and hasattr(m, "config")]


def on_cuda(model) -> bool:
    return any(p.is_cuda for p in model.parameters())


def use_experts(model, experts: str | None = None):
    """Run ``model``'s routed experts with ``experts`` (a key of ``EXPERTS``; None: ``DEFAULT_EXPERTS``);
    returns the model. "grouped_mm" leaves the model as transformers built it; a dense model has
    nothing to switch."""
    experts = experts or DEFAULT_EXPERTS
    if experts not in EXPERTS:
        raise LazyRagError(f"Unknown experts implementation {experts!r}; choose one of {', '.join(EXPERTS)}.")
    modules = experts_modules(model)
    if experts == "auto":
        supported = modules and not any(map(unsupported_reason, modules))
        experts = "triton" if supported and on_cuda(model) else "grouped_mm"
    if experts == "grouped_mm":
        return model
    if not modules:
        config = model.config
        if getattr(config, "num_experts", 0) or getattr(config, "num_local_experts", 0):
            raise LazyRagError(f"experts={experts!r}: {type(model).__name__}'s experts do not dispatch through "
                               "transformers' ExpertsInterface.")
        return model
    for m in modules:
        reason = unsupported_reason(m)
        if reason:
            raise LazyRagError(f"experts={experts!r} cannot run {type(m).__name__}: {reason}. "
                               f"Use experts='grouped_mm'.")
    register_triton_experts()
    model.set_experts_implementation(EXPERTS[experts])
    return model


def experts_in_use(model) -> str | None:
    """Which of ``EXPERTS`` runs ``model``'s routed experts ("triton" or "grouped_mm"; None for a
    dense model): what a record names, "auto" resolved."""
    if not experts_modules(model):
        return None
    return "triton" if getattr(model.config, "_experts_implementation", None) == TRITON_EXPERTS else "grouped_mm"
