"""Small assertions shared by the tests."""
import torch


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    assert not torch.isnan(out).any(), "NaN in output"
    out = out.to(ref.device)  # engine logits come back on the host; oracle ones stay on the device
    return float((out - ref).abs().max() / ref.abs().max())



def small_llm(model, tokenizer, **options):
    """A LazyLLM with a small engine (256 MiB pool, 16-token pages on every device): tests build
    many, and the default pool is a fifth of the GPU."""
    from lazy_rag import LazyLLM

    return LazyLLM(model, tokenizer, **{"kv_bytes": 256 << 20, "host_bytes": 256 << 20, "page_size": 16, **options})


def squad_file(path, articles):
    """A SQuAD-format file: ``articles`` is a list of articles, each a list of (context, [(question, answer)])."""
    import json

    data = {"data": [{"title": f"t{a}", "paragraphs": [
        {"context": ctx, "qas": [{"id": f"q{a}-{p}-{i}", "question": q,
                                  "answers": [{"text": ans, "answer_start": ctx.find(ans)}]}
                                 for i, (q, ans) in enumerate(qas)]}
        for p, (ctx, qas) in enumerate(paras)]} for a, paras in enumerate(articles)]}
    path.write_text(json.dumps(data))
    return path
