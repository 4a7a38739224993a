"""An index build encodes many chunks per forward (on CUDA, several fresh chunks share one Triton
prefill launch per layer instead of one SDPA call each): the KV must be the chunk's own, equal to
encoding it alone, with or without a shared prefix, whatever the chunks' lengths."""
import torch

from lazy_rag import LazyLLM
from tests.tiny_models import tiny_model


def test_chunks_encoded_together_equal_each_encoded_alone(tokenizer, device):
    # head_dim 32: on CUDA the packed path runs the Triton kernel (head_dim 16 would take torch)
    model = tiny_model("llama", "llama3", seed=3, hidden_size=128).to(device)
    llm = LazyLLM(model, tokenizer, page_size=16)
    eng = llm.engine
    g = torch.Generator().manual_seed(0)
    lengths = [1, 5, 16, 17, 40, 131, 64, 3]  # partial pages, exact pages, a >128-token chunk
    chunks = [torch.randint(200, 4000, (n,), generator=g).tolist() for n in lengths]
    for prefix in ((), tuple(range(500, 520)), tuple(range(600, 740))):  # none, short, a >= 128-token tail
        together = eng.encode_chunks(chunks, prefix, cache=False)
        for ids, kv in zip(chunks, together):
            alone = eng.encode_chunks([ids], prefix, cache=False)[0]
            assert kv.num_tokens == len(ids)
            # fp32 on both paths: the kernel and SDPA differ in summation order only
            torch.testing.assert_close(kv.k, alone.k, rtol=1e-4, atol=1e-5)
            torch.testing.assert_close(kv.v, alone.v, rtol=1e-4, atol=1e-5)
