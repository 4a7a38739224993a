"""The student: the frozen model reading wrapped chunks under block attention, differentiable in
the wrapper's vectors.

One transformers forward per micro-batch over ``inputs_embeds`` (the wrapper's slots taken from
the trainable vectors), with the oracle's 4-D visibility mask (``oracle.visibility_mask``: a
chunk's tokens see only their own chunk, inside its wrapper; every other token sees everything
before it) and logical positions: exactly the function ``lazy`` serves with that wrapper. Only
the rows that are read go through the LM head.

An example with a labelled answer is one sequence, not two: prompt, teacher answer, then the
gold answer as a side branch that forks at the end of the prompt (it sees the prompt and itself,
not the teacher's answer, at the positions it would have right after the prompt). Each branch's
rows are then what a separate prompt + answer forward gives, and the prompt is encoded once.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from ..architecture import lm_logits
from ..chunk_adapter import ChunkAdapters
from ..oracle import layer_masks, visibility_mask
from ..segments import PromptLayout, assemble


def wrapped_layout(llm, example, answer: list[int], header: int, trailer: int):
    """The example's prompt plus ``answer``'s tokens, chunks wrapped in slots numbered from the
    model's embedding rows (header first); returns (layout, the last prompt token's row)."""
    V = llm.host.parts.vocab_rows
    wrap = (tuple(range(V, V + header)), tuple(range(V + header, V + header + trailer)))
    segs = example.segments(llm.tokenizer) + ([list(answer)] if answer else [])
    layout = assemble(llm.tokenizer, segs, (), 0, wrap)
    return layout, len(layout.token_ids) - len(answer) - 1


@dataclass(frozen=True)
class StudentInput:
    """One sequence of a student forward and the rows read from it.

    ``layout``: the wrapped prompt and what follows it; its last ``branch`` tokens are a side
    branch forking after the first ``prompt`` tokens: they see the prompt (as a token right after
    it would) and each other causally, not the tokens between, and take the positions that follow
    the prompt. ``reads``: kind -> the rows whose log-probs are returned, in order (a row may be
    read by several kinds)."""
    layout: PromptLayout
    reads: dict[str, tuple[int, ...]]
    prompt: int = 0
    branch: int = 0


def student_input(llm, example, answer: list[int], gold: list[int], header: int, trailer: int) -> StudentInput:
    """The example's one sequence: prompt, the teacher's ``answer``, then (``gold`` non-empty) the
    gold answer's branch. Reads "kl": len(answer) + 1 rows from the last prompt token on (the
    teacher's rows); "gold": the row predicting each gold token, the last prompt token's first.
    The branch holds every gold token but the last: that one's row would predict past the
    answer, which nothing reads, so feeding it would only lengthen the forward."""
    branch = list(gold[:-1])
    layout, last = wrapped_layout(llm, example, list(answer) + branch, header, trailer)
    fork = last + 1 + len(answer)  # the first branch token
    reads = {"kl": tuple(range(last, fork))}
    if gold:
        reads["gold"] = (last, *range(fork, fork + len(branch)))
    return StudentInput(layout, reads, last + 1, len(branch))


def _visibility(item: StudentInput) -> torch.Tensor:
    """bool [T, T]: the oracle's mask, the branch cut off from the tokens between it and the prompt
    (it sees the prompt under the oracle's own rule for a token that follows it)."""
    allow = visibility_mask(item.layout)
    if item.branch:
        fork = len(item.layout.token_ids) - item.branch
        allow[fork:, item.prompt:fork] = False
    return allow


def _positions(item: StudentInput) -> torch.Tensor:
    """Logical positions: 0.. along the layout, the branch's continuing from the prompt's end."""
    n = len(item.layout.token_ids)
    pos = torch.arange(n)
    if item.branch:
        pos[n - item.branch:] = torch.arange(item.prompt, item.prompt + item.branch)
    return pos


def student_logp(llm, vectors: torch.Tensor, batch: list[StudentInput],
                 adapter_column: int | None = None) -> list[dict[str, torch.Tensor]]:
    """Log-probs (fp32) of the rows each input reads: kind -> [rows, vocab], per input.
    ``adapter_column``: the trainable chunk adapter's column (``ChunkAdapters``), on for the
    chunks' tokens only, as the engine applies it when it encodes them."""
    model, parts = llm.model, llm.host.parts
    dev, dt = parts.device, parts.dtype
    L = max(len(item.layout.token_ids) for item in batch)
    B = len(batch)
    ids = torch.zeros(B, L, dtype=torch.long, device=dev)
    allow = torch.zeros(B, L, L, dtype=torch.bool, device=dev)
    pos = torch.zeros(B, L, dtype=torch.long, device=dev)
    for b, item in enumerate(batch):
        n = len(item.layout.token_ids)
        ids[b, :n] = torch.tensor(item.layout.token_ids, device=dev)
        allow[b, :n, :n] = _visibility(item).to(dev)
        pos[b, :n] = _positions(item).to(dev)
        allow[b, n:, n:] = torch.eye(L - n, dtype=torch.bool, device=dev)  # padding sees itself: no NaN
    x = parts.embed_ids(ids, virtual=True, rows=vectors)
    mask = layer_masks(model, allow, pos)   # the oracle's: sliding layers (Gemma 2/3) take their window
    adapters, gate = ChunkAdapters.of(model), None
    if adapter_column is not None:
        gate = torch.zeros(B, L, adapters.width, dtype=dt, device=dev)
        for b, item in enumerate(batch):
            for start, end in item.layout.chunk_spans:
                gate[b, start:end, adapter_column] = 1
    with adapters.gated(gate, {adapter_column} if adapter_column is not None else set()):
        hidden = model.model(inputs_embeds=x, attention_mask=mask, position_ids=pos).last_hidden_state
    reads = [(b, kind, rows) for b, item in enumerate(batch) for kind, rows in item.reads.items()]
    at_b = torch.tensor([b for b, _, rows in reads for _ in rows], dtype=torch.long, device=dev)
    at_row = torch.tensor([r for _, _, rows in reads for r in rows], dtype=torch.long, device=dev)
    # a row read by two kinds is gathered twice: one LM-head row more, and its gradients add up
    logp = torch.log_softmax(lm_logits(model, hidden[at_b, at_row]), dim=-1)
    out: list[dict[str, torch.Tensor]] = [{} for _ in batch]
    for (b, kind, _), part in zip(reads, logp.split([len(rows) for _, _, rows in reads])):
        out[b][kind] = part
    return out


def distill_kl(student: torch.Tensor, top_ids: torch.Tensor, top_logp: torch.Tensor) -> torch.Tensor:
    """KL(teacher || student) per row, the teacher known on its top-K tokens and the rest of the
    vocabulary as one bucket (exact when the teacher's top K hold all its mass)."""
    p = top_logp.exp()
    q_top = student.gather(-1, top_ids)
    kl = (p * (top_logp - q_top)).sum(-1)
    p_rest = (1 - p.sum(-1)).clamp(min=0)
    q_rest = (1 - q_top.exp().sum(-1)).clamp(min=1e-12)
    return kl + torch.where(p_rest > 0, p_rest * (p_rest.clamp(min=1e-12).log() - q_rest.log()), torch.zeros_like(kl))
