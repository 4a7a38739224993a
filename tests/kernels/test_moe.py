"""kernels/moe.py: the routed experts kernel against its torch reference (fp64 oracle) and against
transformers' own eager experts loop, at sizes that are no multiple of the tiles (hidden 40,
intermediate 24) and routings with empty experts, one expert taking every token, an expert with
more rows than a block; the kernels under launch configurations other than the default
(``MoeTiles``: each kernel's tiles, warps and stages; invalid ones refused); then a tiny Qwen3-MoE
model whose logits do not move when its experts switch to the kernel (lazy_rag.experts)."""
from __future__ import annotations

import pytest
import torch
from transformers import Qwen3MoeConfig
from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeExperts

from lazy_rag.errors import LazyRagError
from lazy_rag.experts import TRITON_EXPERTS, experts_in_use, triton_experts_forward, use_experts
from lazy_rag.kernels import moe
from lazy_rag.kernels.moe import MoeTiles, moe_experts, sort_pairs_by_expert
from lazy_rag.kernels.reference import moe_experts_ref

from _cases import DEVICE, DTYPES, rel_err

HIDDEN, INTER = 40, 24
# kernel vs the fp64 reference (which rounds silu(gate) * up to the dtype as the kernel does)
TOL = {torch.float32: 1e-5, torch.float16: 1e-3, torch.bfloat16: 1e-2}
# vs transformers' eager loop, which also rounds each projection's output to the dtype
EAGER_TOL = {torch.float32: 1e-5, torch.float16: 5e-3, torch.bfloat16: 4e-2}


def routing(kind: str, tokens: int, experts: int, top_k: int, gen: torch.Generator):
    """top_k_index [T, K] (distinct experts per token) and softmax-like weights [T, K]."""
    if kind == "random":
        index = torch.stack([torch.randperm(experts, generator=gen)[:top_k] for _ in range(tokens)])
    elif kind == "one_expert":       # every token's first pick is expert 2 (17 rows: two blocks)
        others = (3 + torch.randint(0, experts - 1, (tokens, top_k - 1), generator=gen)) % experts   # never 2
        index = torch.cat([torch.full((tokens, 1), 2), others], dim=1)
    elif kind == "expert_0_empty":
        index = torch.stack([1 + torch.randperm(experts - 1, generator=gen)[:top_k] for _ in range(tokens)])
    else:
        raise ValueError(kind)
    weights = torch.rand(tokens, top_k, generator=gen) + 0.1
    return index, weights / weights.sum(-1, keepdim=True)


def experts_module(experts: int, dtype, gen: torch.Generator) -> Qwen3MoeExperts:
    config = Qwen3MoeConfig(hidden_size=HIDDEN, moe_intermediate_size=INTER, num_experts=experts, hidden_act="silu")
    module = Qwen3MoeExperts(config)
    with torch.no_grad():
        module.gate_up_proj.copy_(torch.randn(module.gate_up_proj.shape, generator=gen) * HIDDEN ** -0.5)
        module.down_proj.copy_(torch.randn(module.down_proj.shape, generator=gen) * INTER ** -0.5)
    module.config._experts_implementation = "eager"
    return module.to(DEVICE, dtype)


CASES = [  # tokens, experts, top_k, routing
    (1, 4, 1, "random"),
    (3, 8, 2, "random"),            # 6 pairs over 8 experts: some experts get none
    (17, 8, 2, "random"),
    (17, 4, 1, "one_expert"),       # all 17 rows on one expert: more than a block of rows
    (17, 4, 2, "one_expert"),
    (3, 4, 2, "expert_0_empty"),
]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("tokens,experts,top_k,kind", CASES)
def test_kernel_equals_reference_and_eager(tokens, experts, top_k, kind, dtype):
    gen = torch.Generator().manual_seed(tokens * 100 + experts * 10 + top_k)
    module = experts_module(experts, dtype, gen)
    index, weights = routing(kind, tokens, experts, top_k, gen)
    index, weights = index.to(DEVICE), weights.to(DEVICE, dtype)
    hidden = torch.randn(tokens, HIDDEN, generator=gen).to(DEVICE, dtype)
    args = (hidden, module.gate_up_proj.detach(), module.down_proj.detach(), index, weights)
    oracle = moe_experts_ref(*args, compute_dtype=torch.float64)
    with torch.no_grad():
        eager = module(hidden, index, weights)
        out = triton_experts_forward(module, hidden, index, weights)
    assert out.dtype == dtype and out.shape == (tokens, HIDDEN)
    assert rel_err(out, oracle) <= TOL[dtype]
    assert rel_err(moe_experts_ref(*args), oracle) <= TOL[dtype]   # the CPU path, fp32
    assert rel_err(out, eager) <= EAGER_TOL[dtype]
    # small tiles: several column and reduction tiles, masked tails in each
    tiles = MoeTiles(gate_up_block_n=16, gate_up_block_k=16, down_block_n=16, down_block_k=16)
    assert rel_err(moe_experts(*args, tiles=tiles), oracle) <= TOL[dtype]


# H = 72, I = 48: no multiple of 32, 64 or 128, so each case below has several column or reduction
# tiles with masked tails in both kernels, and tiles wider than their dimension narrowed (_block)
TILE_HIDDEN, TILE_INTER = 72, 48
TILE_CASES = {   # per kernel: block_n / block_k (narrowed to what the size needs), warps, stages
    "n32_k128": MoeTiles(gate_up_block_n=32, gate_up_block_k=128, down_block_n=32, down_block_k=128),
    "n128_k32": MoeTiles(gate_up_block_n=128, gate_up_block_k=32, down_block_n=128, down_block_k=32),
    "mixed": MoeTiles(gate_up_block_n=16, gate_up_block_k=256, gate_up_num_warps=8, gate_up_num_stages=2,
                      down_block_n=64, down_block_k=16, down_num_warps=2, down_num_stages=4),
}


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("name", list(TILE_CASES))
def test_tiles_equal_reference(name, dtype):
    gen = torch.Generator().manual_seed(7)
    experts, tokens, top_k = 5, 17, 2          # expert 2 takes every token: two blocks of rows
    gate_up = torch.randn(experts, 2 * TILE_INTER, TILE_HIDDEN, generator=gen) * TILE_HIDDEN ** -0.5
    down = torch.randn(experts, TILE_HIDDEN, TILE_INTER, generator=gen) * TILE_INTER ** -0.5
    index, weights = routing("one_expert", tokens, experts, top_k, gen)
    hidden = torch.randn(tokens, TILE_HIDDEN, generator=gen)
    args = (hidden.to(DEVICE, dtype), gate_up.to(DEVICE, dtype), down.to(DEVICE, dtype), index.to(DEVICE),
            weights.to(DEVICE, dtype))
    oracle = moe_experts_ref(*args, compute_dtype=torch.float64)
    out = moe_experts(*args, tiles=TILE_CASES[name])
    assert out.dtype == dtype and out.shape == (tokens, TILE_HIDDEN)
    assert rel_err(out, oracle) <= TOL[dtype]


@pytest.mark.parametrize("field,value", [
    ("gate_up_block_n", 48),      # no power of 2
    ("gate_up_block_k", 8),       # below tl.dot's 16
    ("down_block_n", 0),
    ("down_block_k", 24),
    ("gate_up_num_warps", 3),
    ("down_num_stages", 0),
])
def test_invalid_tiles_refused(field, value):
    with pytest.raises(ValueError, match=f"MoeTiles.{field} must be"):
        MoeTiles(**{field: value})
    with pytest.raises(TypeError, match="MoeTiles"):
        moe_experts(torch.zeros(1, 16), torch.zeros(1, 32, 16), torch.zeros(1, 16, 16),
                    torch.zeros(1, 1, dtype=torch.long), torch.ones(1, 1), tiles={field: value})


def test_default_tiles():
    """Today's configuration, one place: what moe_experts runs when given none."""
    assert MoeTiles().of("gate_up") == (64, 64, 4, None) and MoeTiles().of("down") == (64, 64, 4, None)


def test_sort_pairs_by_expert():
    index = torch.tensor([[3, 1], [1, 0], [3, 1]], device=DEVICE)     # pairs 0..5; expert 2 empty
    order, start, count = sort_pairs_by_expert(index, 4)
    assert count.tolist() == [1, 3, 0, 2]
    assert start.tolist() == [0, 1, 4, 4]
    assert order.tolist() == [3, 1, 2, 5, 0, 4]                         # stable: token order per expert


def test_tiny_qwen3_moe_logits_unchanged(monkeypatch):
    from tests.tiny_models import tiny_model

    model = tiny_model("qwen3_moe", vocab_size=512).to(DEVICE)
    ids = torch.tensor([[5, 17, 99, 3, 250, 7, 42]], device=DEVICE)
    with torch.no_grad():
        before = model(ids).logits
    calls = []
    monkeypatch.setattr(moe, "moe_experts", lambda *a, **kw: calls.append(1) or moe_experts(*a, **kw))
    use_experts(model, "triton")
    assert model.config._experts_implementation == TRITON_EXPERTS
    with torch.no_grad():
        after = model(ids).logits
    assert len(calls) == model.config.num_hidden_layers     # the kernel ran, once per MoE layer
    assert rel_err(after, before) <= 1e-5


def test_experts_found_without_later_transformers_flags():
    """transformers 5.17 (the GPU image) sets neither ``_is_expert_parallel`` nor
    ``has_post_expert_norm``: the experts are still found, and still supported."""
    from lazy_rag.experts import experts_modules, unsupported_reason
    from tests.tiny_models import tiny_model

    model = tiny_model("qwen3_moe", vocab_size=512)
    modules = experts_modules(model)
    assert len(modules) == model.config.num_hidden_layers
    for m in modules:
        for flag in ("_is_expert_parallel", "has_post_expert_norm"):
            m.__dict__.pop(flag, None)
        assert not hasattr(m, "_is_expert_parallel")
        assert unsupported_reason(m) is None
    assert experts_modules(model) == modules
    use_experts(model, "triton")
    assert model.config._experts_implementation == TRITON_EXPERTS


def test_large_batches_take_grouped_mm(monkeypatch):
    """Past MOST_KERNEL_PAIRS (a prefill) the forward is transformers' grouped_mm, same result."""
    import lazy_rag.experts as experts

    gen = torch.Generator().manual_seed(1)
    module = experts_module(4, torch.float32, gen)
    index, weights = routing("random", 17, 4, 2, gen)
    hidden = torch.randn(17, HIDDEN, generator=gen).to(DEVICE)
    index, weights = index.to(DEVICE), weights.to(DEVICE)
    calls = []
    monkeypatch.setattr(moe, "moe_experts", lambda *a, **kw: calls.append(1) or moe_experts(*a, **kw))
    monkeypatch.setattr(experts, "MOST_KERNEL_PAIRS", 16)
    with torch.no_grad():
        out = triton_experts_forward(module, hidden, index, weights)
        eager = module(hidden, index, weights)
    assert not calls and rel_err(out, eager) <= 1e-5


def test_use_experts_choices():
    from tests.tiny_models import tiny_model

    dense = tiny_model("qwen3", vocab_size=512)
    assert use_experts(dense, "triton") is dense                      # nothing to switch
    with pytest.raises(LazyRagError, match="Unknown experts"):
        use_experts(dense, "fast")
    mixtral = tiny_model("mixtral", vocab_size=512)
    use_experts(mixtral, "grouped_mm")                                  # left as built
    assert mixtral.config._experts_implementation != TRITON_EXPERTS
    assert experts_in_use(mixtral) == "grouped_mm" and experts_in_use(dense) is None


def test_auto_takes_the_kernel_on_cuda_only(monkeypatch):
    """The default, "auto": the Triton experts for a supported MoE model on a CUDA device,
    transformers' own elsewhere or where the kernel cannot run the experts."""
    import lazy_rag.experts as experts
    from tests.tiny_models import tiny_model

    model = tiny_model("qwen3_moe", vocab_size=512)
    use_experts(model)                                                  # here: the CPU
    assert experts_in_use(model) == ("triton" if DEVICE == "cuda" else "grouped_mm")
    monkeypatch.setattr(experts, "on_cuda", lambda m: True)
    use_experts(model)
    assert experts_in_use(model) == "triton"
    unsupported = tiny_model("qwen3_moe", vocab_size=512)
    monkeypatch.setattr(experts, "unsupported_reason", lambda m: "biases")
    use_experts(unsupported)
    assert experts_in_use(unsupported) == "grouped_mm"
    with pytest.raises(LazyRagError, match="cannot run"):
        use_experts(unsupported, "triton")


def test_from_pretrained_takes_the_experts_choice(tmp_path, tokenizer):
    """The switch from the Python API a user loads models with (a saved MoE checkpoint)."""
    from lazy_rag import LazyLLM
    from tests.tiny_models import tiny_model

    tiny_model("qwen3_moe", vocab_size=len(tokenizer)).save_pretrained(tmp_path)
    tokenizer.save_pretrained(tmp_path)
    chosen = LazyLLM.from_pretrained(str(tmp_path), device="cpu", wrapper=None, experts="triton")
    assert chosen.host.model.config._experts_implementation == TRITON_EXPERTS
    default = LazyLLM.from_pretrained(str(tmp_path), device="cpu", wrapper=None)
    assert default.host.model.config._experts_implementation != TRITON_EXPERTS
    with pytest.raises(LazyRagError, match="Unknown experts"):
        LazyLLM.from_pretrained(str(tmp_path), device="cpu", wrapper=None, experts="fast")
