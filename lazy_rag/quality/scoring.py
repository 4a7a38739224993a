"""Scores of one answer against SQuAD's gold answers, and how far an answer strays from full's.

Against full re-encoding (the reference every configuration is paired with): the first-token
KL, the teacher-forced KL over full's whole answer (``reference_rows`` / ``teacher_forced_kl``)
and ROUGE-L between the two answers' words.

Exact match and token F1 follow the official SQuAD v1.1 evaluation script (lowercase, drop
punctuation and the articles a/an/the, collapse whitespace; max over the gold answers).
``contains`` is ours: a verbose answer that holds a gold answer ("The Broncos won it in 2016"
for "2016") scores low EM/F1 but is still right, and this metric makes that visible.
"""
from __future__ import annotations

import collections
import re
import string
from dataclasses import dataclass

import torch

_PUNCTUATION = set(string.punctuation)


def normalize_answer(s: str) -> str:
    s = s.lower()
    s = "".join(ch for ch in s if ch not in _PUNCTUATION)
    s = re.sub(r"\b(a|an|the)\b", " ", s)
    return " ".join(s.split())


def f1_score(prediction: str, truth: str) -> float:
    pred, gold = normalize_answer(prediction).split(), normalize_answer(truth).split()
    common = collections.Counter(pred) & collections.Counter(gold)
    same = sum(common.values())
    if same == 0:
        return 0.0
    precision, recall = same / len(pred), same / len(gold)
    return 2 * precision * recall / (precision + recall)


def exact_match(prediction: str, truth: str) -> float:
    return float(normalize_answer(prediction) == normalize_answer(truth))


def contains_answer(prediction: str, truth: str) -> float:
    """1.0 when the normalised gold answer occurs in the normalised prediction as whole words
    ("1990" is not found in "19901"); a gold answer that normalises to nothing only matches an
    empty prediction."""
    gold, pred = normalize_answer(truth), normalize_answer(prediction)
    if not gold:
        return float(not pred)
    return float(f" {gold} " in f" {pred} ")


def best_over(metric, prediction: str, truths: list[str]) -> float:
    return max(metric(prediction, t) for t in truths)


def score_answer(prediction: str, truths: list[str]) -> dict[str, float]:
    """EM, F1 and contains of one prediction, each the max over the gold answers (0..1)."""
    return {"em": best_over(exact_match, prediction, truths), "f1": best_over(f1_score, prediction, truths),
            "contains": best_over(contains_answer, prediction, truths)}


def clean_prediction(text: str) -> str:
    """The answer as scored: its first line, without an echoed "Answer:" label or a final full stop."""
    text = text.strip().split("\n")[0].strip()
    text = re.sub(r"^answer\s*:\s*", "", text, flags=re.IGNORECASE)
    return text.rstrip(".").strip()


def same_answer(a: str, b: str) -> bool:
    """Whether two predictions are the same answer after SQuAD normalisation."""
    return normalize_answer(a) == normalize_answer(b)


def kl_divergence(p_logits: torch.Tensor, q_logits: torch.Tensor) -> float:
    """KL(P || Q) of two next-token distributions given as logits (in float64: the two
    distributions are often nearly equal, and fp32 cancellation would blur small values)."""
    logp = torch.log_softmax(p_logits.double(), -1)
    logq = torch.log_softmax(q_logits.double(), -1)
    return float((logp.exp() * (logp - logq)).sum())


def rouge_l(prediction: str, reference: str) -> float:
    """ROUGE-L F-measure (0..1) of two texts: the longest common subsequence of their words over
    both lengths, words as rouge-score's default tokenizer makes them (lowercase, runs of [a-z0-9]),
    without stemming. Two empty texts are the same answer (1.0); one empty text scores 0.0."""
    a, b = _rouge_words(prediction), _rouge_words(reference)
    if not a or not b:
        return float(not a and not b)
    lcs = _lcs_length(a, b)
    if lcs == 0:
        return 0.0
    precision, recall = lcs / len(a), lcs / len(b)
    return 2 * precision * recall / (precision + recall)


def _rouge_words(text: str) -> list[str]:
    return re.findall(r"[a-z0-9]+", text.lower())


def _lcs_length(a: list[str], b: list[str]) -> int:
    """Length of the longest common subsequence, one row of the table at a time (O(len(b)) memory)."""
    row = [0] * (len(b) + 1)
    for x in a:
        diagonal = 0  # the previous row's value one column to the left
        for j, y in enumerate(b, 1):
            diagonal, row[j] = row[j], (diagonal + 1 if x == y else max(row[j], row[j - 1]))
    return row[-1]


@dataclass
class ReferenceRows:
    """full's next-token distributions at each position of its answer, kept as each position's
    ``top_k`` most likely tokens (ids and log-probabilities, on the CPU) and the log of the
    probability of all the others: a [rows, vocab] distribution per question would not fit a
    batch's memory (150k-token vocabularies)."""

    token_ids: torch.Tensor      # [rows, k] int64
    logprobs: torch.Tensor       # [rows, k] float64
    rest_logprob: torch.Tensor   # [rows] float64: log P(any token not kept); -inf when every token was kept

    def tail_mass(self) -> list[float]:
        """Per position, the probability full gives to tokens outside its kept top-k."""
        return self.rest_logprob.exp().tolist()


def _rest_logprob(logp: torch.Tensor, kept: torch.Tensor) -> torch.Tensor:
    """log of the probability of the tokens outside ``kept``, summed over those tokens (not
    1 - the kept mass: that cancellation leaves ~1e-14 where nothing is left)."""
    return logp.scatter(-1, kept, float("-inf")).logsumexp(-1)


def reference_rows(logits: torch.Tensor, top_k: int | None) -> ReferenceRows:
    """full's logits [rows, vocab] (on the engine's device) reduced to their top ``top_k`` tokens
    per row (None, 0 or at least the vocabulary: every token, so the KL below is exact)."""
    logp = torch.log_softmax(logits.double(), -1)
    k = min(top_k or logp.shape[-1], logp.shape[-1])
    values, ids = logp.topk(k, dim=-1)
    return ReferenceRows(ids.cpu(), values.cpu(), _rest_logprob(logp, ids).cpu())


def teacher_forced_kl(reference: ReferenceRows, logits: torch.Tensor) -> list[float]:
    """KL(full || config) at each answer position, ``logits`` [rows, vocab] being the config's.

    Both distributions are coarsened to full's kept tokens plus one bucket for every other token:
    exact when the reference kept the whole vocabulary, otherwise a lower bound of the exact KL
    (coarsening never increases a KL) that misses only what happens inside full's tail, whose
    mass ``ReferenceRows.tail_mass`` reports. In float64: the two distributions are often nearly
    equal, and fp32 cancellation would blur small values."""
    logq = torch.log_softmax(logits.double(), -1)
    kept_ids = reference.token_ids.to(logq.device)
    logp = reference.logprobs.to(logq.device)
    kept = (logp.exp() * (logp - logq.gather(-1, kept_ids))).sum(-1)
    rest_p, rest_q = reference.rest_logprob.to(logq.device), _rest_logprob(logq, kept_ids)
    # an empty bucket (every token kept, or none left to full) adds nothing: 0 log 0 = 0
    rest = torch.where(rest_p > float("-inf"), rest_p.exp() * (rest_p - rest_q), torch.zeros_like(rest_p))
    return (kept + rest).cpu().tolist()
