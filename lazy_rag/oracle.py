"""The independent reference: plain transformers forwards that define every mode's answer.

``block_diagonal_logits``: one HF forward over the concatenated ids with ``position_ids`` = the
logical positions and a 4-D mask in which a chunk's tokens see only earlier tokens of the same
chunk, and every other token sees everything before it. ``lazy`` and ``block`` must match it.
``causal_logits``: a plain causal forward; ``full`` and ``prefix`` must match it.
Chunk wrapper slots (ids at and above the embedding rows, wrapper.py) enter as ``inputs_embeds``
rows taken from the wrapper's vectors (``virtual_rows``): the same forward, mask and positions.
A wrapper's chunk adapter (chunk_adapter.py) is on for its chunks' tokens in that forward, as
they were encoded, and off for every other token.
Sliding-window layers (Gemma 3's ``layer_types``): the model takes one 4-D mask per layer type (a
dict, as transformers' Gemma 3 builds for itself); a sliding type's is the visibility mask and
its window over the position ids (a query at p sees keys at p - window + 1 .. p), the window
exactly as transformers' own sliding causal mask draws it.
"""
from __future__ import annotations

import torch

from .chunk_adapter import encoding_chunks
from .segments import PromptLayout


def visibility_mask(layout: PromptLayout) -> torch.Tensor:
    """bool [T, T]: entry [i, j] is True iff token i attends to token j.

    Defined for layouts without boundary recompute (there, cached tokens were computed against
    the chunk-local head, which no single mask expresses)."""
    if any(p.skip for p in layout.spans):
        raise ValueError("The oracle mask is not defined for boundary recompute; compare lazy with block.")
    T = len(layout.token_ids)
    causal = torch.ones(T, T, dtype=torch.bool).tril()
    mask = causal.clone()
    for start, end in layout.chunk_spans:
        mask[start:end, :start] = False  # a chunk never sees what precedes it...
        if layout.prefix_len:
            mask[start:end, :layout.prefix_len] = True  # ...except the shared prefix
    return mask


def model_inputs(model, token_ids, virtual_rows: torch.Tensor | None = None) -> dict:
    """``input_ids``, or ``inputs_embeds`` where some ids are wrapper slots (row id - vocab rows
    of ``virtual_rows``)."""
    ids = torch.tensor([list(token_ids)], device=model.device)
    table = model.get_input_embeddings()
    rows = table.weight.shape[0]
    if not bool((ids >= rows).any()):
        return {"input_ids": ids}
    if virtual_rows is None:
        raise ValueError("The layout holds chunk wrapper slots; pass the host's wrapper rows (virtual_rows).")
    x = table(ids.clamp(max=rows - 1))
    slots = ids >= rows
    x[slots] = virtual_rows.to(x.device, x.dtype)[ids[slots] - rows]
    return {"inputs_embeds": x}


@torch.inference_mode()
def block_diagonal_logits(model, layout: PromptLayout, virtual_rows: torch.Tensor | None = None) -> torch.Tensor:
    """Logits [T, vocab] of an HF forward under the chunk-visibility mask."""
    check_softcap(model)
    dev = model.device
    allow = visibility_mask(layout).to(dev)
    pos = torch.arange(len(layout.token_ids), device=dev)[None]
    ids = layout.token_ids
    with encoding_chunks(model, [(0, a, b, ids[a:b]) for a, b in layout.chunk_spans], (1, len(ids)), dev):
        return model(**model_inputs(model, ids, virtual_rows), position_ids=pos,
                     attention_mask=layer_masks(model, allow, pos[0])).logits[0].float()


def additive_mask(model, allow: torch.Tensor) -> torch.Tensor:
    """[1, 1, T, T] ([B, 1, T, T] for a batch ``allow`` [B, T, T]) in the model's dtype: 0 where
    ``allow``, the dtype's minimum elsewhere."""
    additive = torch.zeros(allow.shape, dtype=model.dtype, device=allow.device)
    return additive.masked_fill_(~allow, torch.finfo(model.dtype).min).reshape(-1, 1, *allow.shape[-2:])


def sliding_window_of(model) -> int | None:
    """The window of a model with sliding-window layer types (``layer_types`` holding
    "sliding_attention"), else None."""
    c = model.config
    return c.sliding_window if "sliding_attention" in (getattr(c, "layer_types", None) or ()) else None


def layer_masks(model, allow: torch.Tensor, pos: torch.Tensor):
    """The 4-D additive mask of ``allow`` [T, T] (bool; or a batch [B, T, T]) for the model's
    forward; for a model with sliding layers a dict of one per layer type, the sliding type's also
    limited to its window over the positions ``pos`` [T] (or [B, T])."""
    window = sliding_window_of(model)
    if window is None:
        return additive_mask(model, allow)
    behind = pos[..., :, None] - pos[..., None, :]
    masks = {t: additive_mask(model, allow) for t in set(model.config.layer_types)}
    masks["sliding_attention"] = additive_mask(model, allow & (behind < window))
    return masks


@torch.inference_mode()
def ape_logits(model, layout: PromptLayout, temperature: float, scale: float) -> torch.Tensor:
    """Logits [T, vocab] of an HF forward in which every token computed at query time (not a
    cached chunk token) attends APE-style: the chunks' tokens as one group with softmax(s / T)
    inside and log-sum-exp T * logsumexp(s / T) + ln S, the other visible keys as a plain group,
    merged by log-sum-exp; chunk tokens attend as they were encoded (the visibility mask). The
    attention runs through transformers' own AttentionInterface, so it is independent of ours."""
    from transformers import AttentionInterface

    dev = model.device
    T = len(layout.token_ids)
    allow = visibility_mask(layout).to(dev)
    in_chunk = torch.zeros(T, dtype=torch.bool, device=dev)
    for start, end in layout.chunk_spans:
        in_chunk[start:end] = True
    log_scale = torch.log(torch.tensor(scale, dtype=torch.float64))

    behind = torch.arange(T, device=dev)[:, None] - torch.arange(T, device=dev)[None, :]

    def attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
        window = kwargs.get("sliding_window")   # a sliding layer's (Gemma 3, Gemma 2)
        cap = kwargs.get("softcap")              # Gemma 2's score soft-cap, as its eager attention applies it
        allow_here = allow if window is None else allow & (behind < window)
        g = query.shape[1] // key.shape[1]
        k = key.repeat_interleave(g, dim=1).double()
        v = value.repeat_interleave(g, dim=1).double()
        s = torch.matmul(query.double(), k.transpose(-1, -2)) * scaling          # [1, H, T, T]
        if cap is not None:
            s = torch.tanh(s / cap) * cap
        plain = torch.softmax(s.masked_fill(~allow_here, float("-inf")), dim=-1) @ v
        groups = []
        for cols, t, ls in ((in_chunk, temperature, log_scale), (~in_chunk, 1.0, 0.0)):
            sg = (s / t).masked_fill(~(allow_here & cols[None, :]), float("-inf"))
            lse = torch.logsumexp(sg, dim=-1, keepdim=True)
            groups.append((t * lse + ls, torch.exp(sg - lse).nan_to_num(0.0) @ v))
        (la, oa), (lb, ob) = groups
        top = torch.maximum(la, lb).nan_to_num(0.0, neginf=0.0)
        wa, wb = torch.exp(la - top), torch.exp(lb - top)
        ape = (wa * oa + wb * ob) / (wa + wb)
        out = torch.where(in_chunk[None, None, :, None], plain, ape)                # chunk rows: as encoded
        return out.transpose(1, 2).to(query.dtype).contiguous(), None

    name = "lazy_rag_ape_oracle"
    AttentionInterface.register(name, attention)
    previous = model.config._attn_implementation
    model.set_attn_implementation(name)
    try:
        ids = torch.tensor([layout.token_ids], device=dev)
        return model(input_ids=ids, position_ids=torch.arange(T, device=dev)[None]).logits[0].float()
    finally:
        model.set_attn_implementation(previous)


def check_softcap(model) -> None:
    """Refuse a reference that would skip Gemma 2's score soft-capping: transformers applies it in
    its eager (and flash / flex) attention, not in SDPA."""
    cap = getattr(model.config, "attn_logit_softcapping", None)
    if cap is not None and model.config._attn_implementation == "sdpa":
        raise ValueError(f"This {model.config.model_type} model soft-caps its attention scores (cap {cap}), which "
                         "transformers' SDPA attention skips; load it with attn_implementation='eager' for the oracle.")


@torch.inference_mode()
def causal_logits(model, token_ids: list[int]) -> torch.Tensor:
    check_softcap(model)
    ids = torch.tensor([token_ids], device=model.device)
    return model(input_ids=ids).logits[0].float()


@torch.inference_mode()
def greedy_block_diagonal(model, layout: PromptLayout, max_new_tokens: int, eos_ids=(),
                          virtual_rows: torch.Tensor | None = None) -> list[int]:
    """Greedy tokens under the oracle mask, recomputing the whole prompt every step (slow, exact):
    each generated token sees everything before it."""
    out: list[int] = []
    cur = PromptLayout(token_ids=list(layout.token_ids), spans=list(layout.spans),
                       uncached=list(layout.uncached), prefix_len=layout.prefix_len)
    for _ in range(max_new_tokens):
        tok = int(block_diagonal_logits(model, cur, virtual_rows)[-1].argmax())
        if tok in eos_ids:
            break
        out.append(tok)
        cur.uncached.append(len(cur.token_ids))
        cur.token_ids.append(tok)
    return out


@torch.inference_mode()
def greedy_causal(model, token_ids: list[int], max_new_tokens: int, eos_ids=()) -> list[int]:
    """Greedy tokens of a plain causal forward, recomputing the whole prompt every step."""
    ids = list(token_ids)
    out: list[int] = []
    for _ in range(max_new_tokens):
        tok = int(causal_logits(model, ids)[-1].argmax())
        if tok in eos_ids:
            break
        out.append(tok)
        ids.append(tok)
    return out


@torch.inference_mode()
def teacher_forced_logits(llm, segments, mode: str, tokens: list[int]) -> torch.Tensor:
    """Oracle logits [len(tokens), vocab] predicting each of ``tokens`` after the prompt and the
    tokens before it (one forward): the block-diagonal mask for lazy/block, causal otherwise."""
    segments = list(segments) if isinstance(segments, (list, tuple)) else [segments]
    fed = list(tokens[:-1])
    layout = llm.prepare(segments + ([fed] if fed else []), mode=mode)
    T = len(layout.token_ids) - len(fed)  # the prompt's own length
    if mode in ("lazy", "block"):
        logits = block_diagonal_logits(llm.model, layout, llm.host.parts.virtual_rows)
    else:
        logits = causal_logits(llm.model, layout.token_ids)
    return logits[T - 1:T - 1 + len(tokens)]


def oracle_gaps(llm, segments, mode: str, tokens: list[int]) -> list[float]:
    """For each generated token, how far it is below the oracle's best logit, relative to the
    largest |logit| of that step: 0 = the oracle's argmax; a small value = a near-tie that a
    different summation order may flip. A sequence is oracle-consistent when every gap is
    within the precision's tolerance."""
    rows = teacher_forced_logits(llm, segments, mode, tokens)
    return [float((r.max() - r[t]) / r.abs().max()) for r, t in zip(rows, tokens)]
