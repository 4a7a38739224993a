"""The student: the frozen model reading wrapped chunks under block attention, differentiable in
the wrapper's vectors.

One transformers forward per micro-batch over ``inputs_embeds`` (the wrapper's slots taken from
the trainable vectors), with the oracle's 4-D visibility mask (``oracle.visibility_mask``: a
chunk's tokens see only their own chunk, inside its wrapper; every other token sees everything
before it) and logical positions: exactly the function ``lazy`` serves with that wrapper. Only
the answer rows go through the LM head.
"""
from __future__ import annotations

import torch

from ..chunk_adapter import ChunkAdapters
from ..oracle import visibility_mask
from ..segments import assemble


def wrapped_layout(llm, example, answer: list[int], header: int, trailer: int):
    """The example's prompt plus its teacher answer, chunks wrapped in slots numbered from the
    model's embedding rows (header first); returns (layout, first answer row)."""
    V = llm.host.parts.vocab_rows
    wrap = (tuple(range(V, V + header)), tuple(range(V + header, V + header + trailer)))
    segs = example.segments(llm.tokenizer) + ([list(answer)] if answer else [])
    layout = assemble(llm.tokenizer, segs, (), 0, wrap)
    return layout, len(layout.token_ids) - len(answer) - 1


def student_logp(llm, vectors: torch.Tensor, batch, adapter_column: int | None = None) -> list[torch.Tensor]:
    """Log-probs (fp32) of each example's rows: [len(answer) + 1, vocab] per example.
    ``batch``: (layout, first row, number of rows) triples. ``adapter_column``: the trainable
    chunk adapter's column (``ChunkAdapters``), on for the chunks' tokens only, as the engine
    applies it when it encodes them."""
    model, parts = llm.model, llm.host.parts
    dev, dt = parts.device, parts.dtype
    L = max(len(lay.token_ids) for lay, _, _ in batch)
    B = len(batch)
    ids = torch.zeros(B, L, dtype=torch.long, device=dev)
    allow = torch.zeros(B, L, L, dtype=torch.bool, device=dev)
    pos = torch.zeros(B, L, dtype=torch.long, device=dev)
    for b, (lay, _, _) in enumerate(batch):
        n = len(lay.token_ids)
        ids[b, :n] = torch.tensor(lay.token_ids, device=dev)
        allow[b, :n, :n] = visibility_mask(lay).to(dev)
        pos[b, :n] = torch.arange(n, device=dev)
        allow[b, n:, n:] = torch.eye(L - n, dtype=torch.bool, device=dev)  # padding sees itself: no NaN
    x = parts.embed_ids(ids, virtual=True, rows=vectors)
    mask = torch.zeros(B, 1, L, L, dtype=dt, device=dev).masked_fill(~allow[:, None], torch.finfo(dt).min)
    adapters, gate = ChunkAdapters.of(model), None
    if adapter_column is not None:
        gate = torch.zeros(B, L, adapters.width, dtype=dt, device=dev)
        for b, (lay, _, _) in enumerate(batch):
            for start, end in lay.chunk_spans:
                gate[b, start:end, adapter_column] = 1
    with adapters.gated(gate):
        hidden = model.model(inputs_embeds=x, attention_mask=mask, position_ids=pos).last_hidden_state
    rows = torch.cat([hidden[b, first:first + n] for b, (_, first, n) in enumerate(batch)])
    logp = torch.log_softmax(model.lm_head(rows).float(), dim=-1)
    return list(logp.split([n for _, _, n in batch]))


def distill_kl(student: torch.Tensor, top_ids: torch.Tensor, top_logp: torch.Tensor) -> torch.Tensor:
    """KL(teacher || student) per row, the teacher known on its top-K tokens and the rest of the
    vocabulary as one bucket (exact when the teacher's top K hold all its mass)."""
    p = top_logp.exp()
    q_top = student.gather(-1, top_ids)
    kl = (p * (top_logp - q_top)).sum(-1)
    p_rest = (1 - p.sum(-1)).clamp(min=0)
    q_rest = (1 - q_top.exp().sum(-1)).clamp(min=1e-12)
    return kl + torch.where(p_rest > 0, p_rest * (p_rest.clamp(min=1e-12).log() - q_rest.log()), torch.zeros_like(kl))
