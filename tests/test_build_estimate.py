"""`lazy-rag index --dry-run` (build_estimate): chunks and tokens exactly as the build splits them
(a sample small enough to be the whole corpus), KV bytes from the model's shape and dtype, rates
from timed probes; nothing written to the index folder."""
import torch

from lazy_rag import LazyLLM
from lazy_rag.build_estimate import estimate_build, kv_bytes_per_token
from lazy_rag.chunking import TokenChunker
from tests.tiny_models import tiny_model


def test_dry_run_counts_what_the_build_makes_and_writes_nothing(tmp_path, tokenizer):
    llm = LazyLLM(tiny_model("llama", seed=1).to(torch.bfloat16), tokenizer, page_size=4)
    src = tmp_path / "docs"
    src.mkdir()
    for i in range(3):
        (src / f"d{i}.md").write_text(" ".join(f"Sentence {j} of document {i} talks about harbours." for j in range(40)))
    out = tmp_path / "idx"
    est = estimate_build([src], out, llm, chunk_size=48, chunk_overlap=8, kv_dtype="fp8")
    assert not out.exists()  # nothing written, not even the folder
    assert est["exact"] and est["files"] == 3
    chunker = TokenChunker(tokenizer, 48, 8)
    parts = [p for f in sorted(src.iterdir()) for p in chunker.split(f.read_text())]
    assert est["chunks"] == len(parts) and est["tokens"] == sum(len(ids) for _, ids in parts)
    s = llm.shape
    assert kv_bytes_per_token(llm, "fp8") == s.kv_bytes_per_token + 4 * s.num_layers * s.num_kv_heads
    assert kv_bytes_per_token(llm, "auto") == 2 * s.kv_bytes_per_token  # bf16
    assert est["kv_bytes"] == est["tokens"] * kv_bytes_per_token(llm, "fp8")
    assert est["encode_tokens_per_s"] > 0 and est["write_bytes_per_s"] > 0 and est["total_s"] >= est["kv_s"] >= 0  # rounded to 0.1 s
