"""The teacher: the frozen model with full attention over the plain prompt (no wrapper).

For every example: its greedy answer (one line, through the engine, batched) and the top-K
log-probabilities of every answer position and the one after the answer (EOS or the newline
that ends it), from one plain causal forward. K = 64 keeps the cache small (a full vocabulary
row is 600 KB for Qwen) while the KL's tail mass stays below a percent in practice; the loss
treats the rest of the vocabulary as one bucket. Cached on disk (``torch.save`` of tensors and
lists, loaded with ``weights_only=True``), keyed by the model, the examples and the settings,
so a tuning run resumes without recomputing it.
"""
from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass
from pathlib import Path

import torch

from ..architecture import lm_logits
from ..progress import Progress
from ..requests import ChunkSource
from ..tempfiles import create_temp

STOP = ("\n",)


@dataclass
class TeacherOutputs:
    answers: list[list[int]]          # greedy answer tokens per example
    top_ids: list[torch.Tensor]       # [len(answer) + 1, K] int64
    top_logp: list[torch.Tensor]      # [len(answer) + 1, K] fp32


def teacher_key(llm, examples, top_k: int, max_new_tokens: int) -> str:
    h = hashlib.sha256(json.dumps([llm.fingerprint["id"], top_k, max_new_tokens]).encode())
    for e in examples:
        h.update(json.dumps([e.question, e.chunks, e.instruction, e.system_prompt]).encode())
    return h.hexdigest()[:16]


def _save(path: Path, obj) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = create_temp(path.parent, prefix=f".{path.name}.")
    os.close(fd)
    try:
        torch.save(obj, tmp)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def teacher_outputs(llm, examples, cache: Path | None, top_k: int = 64, max_new_tokens: int = 24,
                    batch_size: int = 32, progress: str = "auto") -> TeacherOutputs:
    key = teacher_key(llm, examples, top_k, max_new_tokens)
    path = cache / f"teacher-{key}.pt" if cache is not None else None
    if path is not None and path.exists():
        data = torch.load(path, weights_only=True)
        return TeacherOutputs(data["answers"], data["top_ids"], data["top_logp"])
    plain = ChunkSource()
    answers: list[list[int]] = []
    with Progress(len(examples), "teacher answers", progress) as bar:
        for s in range(0, len(examples), batch_size):
            part = examples[s:s + batch_size]
            reqs = [dict(segments=e.segments(llm.tokenizer), mode="full", max_new_tokens=max_new_tokens,
                         stop=list(STOP), source=plain) for e in part]
            answers += [list(r.token_ids) for r in llm.engine.generate(reqs)]
            bar.advance(len(part))
    top_ids, top_logp = [], []
    model = llm.model
    with Progress(len(examples), "teacher log-probs", progress) as bar, torch.inference_mode():
        for e, ans in zip(examples, answers):
            layout = llm.prepare(e.segments(llm.tokenizer) + ([ans] if ans else []), plain, mode="full")
            T = len(layout.token_ids) - len(ans)
            ids = torch.tensor([layout.token_ids], device=model.device)
            hidden = model.model(input_ids=ids).last_hidden_state[0, T - 1:]
            logp = torch.log_softmax(lm_logits(model, hidden), dim=-1)
            v, i = logp.topk(top_k, dim=-1)
            top_ids.append(i.cpu())
            top_logp.append(v.cpu())
            bar.advance()
    # plain tensors (made under inference mode they could not enter the student's autograd graph)
    out = TeacherOutputs(answers, [t.clone() for t in top_ids], [t.clone() for t in top_logp])
    if path is not None:
        _save(path, {"answers": answers, "top_ids": top_ids, "top_logp": top_logp})
    return out
