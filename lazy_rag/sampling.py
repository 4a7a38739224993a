"""Next-token choice (greedy, temperature, top-p) and stop handling for streamed text."""
from __future__ import annotations

import torch


def sample_next(logits: torch.Tensor, temperature: float, top_p: float, generator: torch.Generator | None) -> int:
    if temperature <= 0.0:
        return int(torch.argmax(logits))
    probs = torch.softmax(logits.float() / temperature, dim=-1)
    if top_p < 1.0:
        sorted_p, idx = torch.sort(probs, descending=True)
        keep = torch.cumsum(sorted_p, dim=-1) - sorted_p < top_p  # always keeps the top token
        sorted_p = sorted_p * keep
        choice = torch.multinomial(sorted_p / sorted_p.sum(), 1, generator=generator)
        return int(idx[choice])
    return int(torch.multinomial(probs, 1, generator=generator))


def apply_penalties(logits: torch.Tensor, output: list[int], presence: float, frequency: float) -> torch.Tensor:
    """OpenAI's presence and frequency penalties over the tokens generated so far: a token that
    occurred c times loses ``frequency * c + presence`` from its logit (a copy is returned)."""
    logits = logits.float().clone()
    if output:
        ids, counts = torch.tensor(output).unique(return_counts=True)
        ids, counts = ids[ids < logits.numel()], counts[ids < logits.numel()]
        logits[ids] -= frequency * counts.float() + presence
    return logits


class TextAssembler:
    """Turns generated ids into text pieces, cutting at stop strings.

    Decodes the whole generation each step (so multi-token characters come out whole) and holds
    back any tail that could still become a stop string or is an incomplete character.
    """

    def __init__(self, tokenizer, stop: list[str] | None):
        self.tokenizer = tokenizer
        self.stop = [s for s in (stop or []) if s]
        self.emitted = 0
        self.text = ""
        self.stopped = False

    def push(self, ids: list[int]) -> str:
        text = self.tokenizer.decode(ids, skip_special_tokens=True)
        for s in self.stop:
            cut = text.find(s)
            if cut != -1:
                text = text[:cut]
                self.stopped = True
        self.text = text
        safe = len(text)
        if not self.stopped:
            if text.endswith("\ufffd"):
                safe = len(text.rstrip("\ufffd"))
            for s in self.stop:
                for k in range(min(len(s) - 1, len(text)), 0, -1):
                    if text.endswith(s[:k]):
                        safe = min(safe, len(text) - k)
                        break
        piece = text[self.emitted:safe] if safe > self.emitted else ""
        self.emitted = max(self.emitted, safe)
        return piece

    def flush(self) -> str:
        piece = self.text[self.emitted:]
        self.emitted = len(self.text)
        return piece
