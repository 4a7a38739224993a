"""Each tensor-parallel rank loads its own share of the model (``engine/shard_loading``), and no
process holds the whole model: from a folder of safetensors (each rank reads its slices) and from
random weights (each rank draws the modules it holds, with the single process's values).

In process, for every family the TP tests cover: a rank's share of every split tensor is exactly
the slice of the whole model's it keeps, its other tensors are whole, and its decoder layers hold
half the bytes of the whole model's split tensors. Over 2 ranks (gloo): the engine loaded by
shares answers with the single-process engine's logits and tokens (test_tensor_parallel.py's 1e-5)
and the same fingerprint, and every rank reports holding its share of the weights, not the whole
model, which a model given in memory still is (shared with the workers).
"""
import random

import pytest
import torch

from helpers import rel_err
from lazy_rag import Chunk, LazyLLM
from lazy_rag.engine.shard_loading import CheckpointSource, RankShare
from lazy_rag.engine.tensor_parallel import layer_shares
from lazy_rag.errors import LazyRagError
from lazy_rag.random_models import IdTokenizer, random_llm, random_model
from tiny_models import FAMILIES, MOE_FAMILIES, tiny_model

TOL, NEW = 1e-5, 4


def _bytes(tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def _split_bytes(model) -> int:
    """Bytes of the whole model's tensors that tensor parallelism splits."""
    return sum(_bytes([layer.get_parameter(k)]) for layer in model.model.layers
               for k in layer_shares(model.config, layer, 0, 2) if _has(layer, k))


def _has(layer, name) -> bool:
    owner, _, attr = name.rpartition(".")
    return getattr(layer.get_submodule(owner), attr, None) is not None


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_a_rank_reads_its_share_of_every_layer_and_the_rest_whole(family, tmp_path):
    whole = tiny_model(family, "default", hidden_size=128)
    whole.save_pretrained(tmp_path)
    source = CheckpointSource.of(tmp_path, torch.float32)
    layer_bytes = _bytes(whole.model.layers.parameters())
    for rank in (0, 1):
        mine = source.load_share(rank, 2, "cpu")
        assert mine.rank_share == RankShare(source, rank, 2, torch.device("cpu"))
        for ours, theirs in zip(mine.model.layers, whole.model.layers):
            shares = layer_shares(whole.config, theirs, rank, 2)
            for name, p in theirs.named_parameters():
                got = ours.get_parameter(name)
                want = shares[name].of(p) if name in shares else p
                assert got.shape == want.shape and torch.equal(got, want), (family, rank, name)
        assert _bytes(mine.model.layers.parameters()) == layer_bytes - _split_bytes(whole) // 2
        for name, p in whole.named_parameters():   # embeddings, norms, LM head: whole
            if ".layers." not in name:
                assert torch.equal(mine.get_parameter(name), p), name
        for name, b in whole.named_buffers():   # RoPE tables
            assert torch.equal(mine.get_buffer(name), b), name
    # what the host's fingerprint hashes: the whole model's tensors, read again one module at a time
    state = dict(RankShare(source, 0, 2, torch.device("cpu")).whole_state())
    assert state.keys() == whole.state_dict().keys()
    assert all(torch.equal(state[k], v) for k, v in whole.state_dict().items())


@pytest.mark.parametrize("family", sorted(MOE_FAMILIES))
def test_a_moe_checkpoint_is_read_whole_and_random_moe_weights_by_share(family, tmp_path):
    """transformers saves a MoE model's experts one by one, under the checkpoint's own names, and
    merges them into [experts, ...] tensors as it loads: such a folder has no source to read shares
    from (it is loaded whole, each rank keeping its share). Random weights are drawn by share: each
    rank's expert slices are the whole model's."""
    from lazy_rag.architecture import moe_block
    from lazy_rag.engine.shard_loading import RandomSource

    whole = tiny_model(family, "default", hidden_size=128)
    whole.save_pretrained(tmp_path)
    assert CheckpointSource.of(tmp_path, torch.float32) is None
    source = RandomSource(whole.config, 3, torch.float32)
    one = source.load_share(0, 1, "cpu")
    expert_shares = 0
    for rank in (0, 1):
        mine = source.load_share(rank, 2, "cpu")
        for ours, theirs in zip(mine.model.layers, one.model.layers):
            shares = layer_shares(one.config, theirs, rank, 2)
            expert_shares += sum(".experts." in k for k in shares)
            for name, p in theirs.named_parameters():
                want = shares[name].of(p) if name in shares else p
                assert torch.equal(ours.get_parameter(name), want), (family, rank, name)
    expert_layers = sum(hasattr(moe_block(layer), "experts") for layer in one.model.layers)   # (qwen2_moe's
    assert expert_layers and expert_shares == 2 * 2 * expert_layers   # tiny model has a dense layer too)


def test_random_weights_shares_hold_the_single_process_models_values():
    whole = random_model("tiny-llama", seed=5)
    again = random_model("tiny-llama", seed=5)
    assert all(torch.equal(a, b) for a, b in zip(whole.parameters(), again.parameters()))
    assert not torch.equal(random_model("tiny-llama", seed=6).lm_head.weight, whole.lm_head.weight)
    rank0 = random_model("tiny-llama", seed=5, tensor_parallel=2)
    rank1 = RankShare(rank0.rank_share.source, 1, 2, torch.device("cpu")).load()
    for rank, mine in enumerate((rank0, rank1)):
        for ours, theirs in zip(mine.model.layers, whole.model.layers):
            shares = layer_shares(whole.config, theirs, rank, 2)
            for name, p in theirs.named_parameters():
                assert torch.equal(ours.get_parameter(name), shares[name].of(p) if name in shares else p), name
        assert torch.equal(mine.model.embed_tokens.weight, whole.model.embed_tokens.weight)


def _segments():
    rng = random.Random(0)
    ids = lambda n: [rng.randrange(100, 4000) for _ in range(n)]   # noqa: E731
    return [ids(5), Chunk(ids(20)), ids(3), Chunk(ids(33)), ids(6)]


def _same_answers(tp, one, modes=("lazy", "block", "full")):
    tp.eos_ids = one.eos_ids = set()   # every answer runs its NEW tokens
    for mode in modes:
        a = tp.generate(_segments(), mode=mode, max_new_tokens=NEW, output_first_logits=True)
        b = one.generate(_segments(), mode=mode, max_new_tokens=NEW, output_first_logits=True)
        assert rel_err(a.first_logits, b.first_logits) < TOL and a.token_ids == b.token_ids, mode


def test_a_saved_folder_serves_over_two_ranks_each_holding_its_share(tmp_path, tokenizer):
    whole = tiny_model("olmo2", "default", hidden_size=128)   # q/k norms split too
    whole.save_pretrained(tmp_path)
    tokenizer.save_pretrained(tmp_path)
    tp = LazyLLM.from_pretrained(str(tmp_path), device="cpu", wrapper="none", tensor_parallel=2, num_pages=64)
    one = LazyLLM.from_pretrained(str(tmp_path), device="cpu", wrapper="none", num_pages=64)
    assert tp.model.rank_share.rank == 0   # this process loaded rank 0's share alone
    _same_answers(tp, one)
    assert tp.fingerprint == one.fingerprint   # an index of either serves the other
    whole_bytes = _bytes([*whole.parameters(), *whole.buffers()])   # (RoPE tables: a few bytes)
    assert tp.stats()["rank_weight_bytes"] == [whole_bytes - _split_bytes(whole) // 2] * 2
    # a model given in memory: every rank still holds it whole (shared), and its share besides
    given = LazyLLM(whole, IdTokenizer(), tensor_parallel=2, num_pages=16)
    assert all(b >= whole_bytes for b in given.stats()["rank_weight_bytes"])


def test_random_weights_serve_over_two_ranks_each_drawing_its_share():
    tp = random_llm("tiny-llama", tensor_parallel=2, num_pages=64)
    one = random_llm("tiny-llama", num_pages=64)
    _same_answers(tp, one, modes=("lazy", "block"))
    whole_bytes = _bytes([*one.model.parameters(), *one.model.buffers()])
    assert tp.stats()["rank_weight_bytes"] == [whole_bytes - _split_bytes(one.model) // 2] * 2


def test_a_share_serves_only_the_size_it_was_loaded_for():
    share = random_model("tiny-llama", tensor_parallel=2)
    with pytest.raises(LazyRagError, match=r"loaded as one rank's share for tensor_parallel=2.*tensor_parallel=1"):
        LazyLLM(share, IdTokenizer(), num_pages=8).engine
