"""Scores of one answer against SQuAD's gold answers, and the first-token divergence of two runs.

Exact match and token F1 follow the official SQuAD v1.1 evaluation script (lowercase, drop
punctuation and the articles a/an/the, collapse whitespace; max over the gold answers).
``contains`` is ours: a verbose answer that holds a gold answer ("The Broncos won it in 2016"
for "2016") scores low EM/F1 but is still right, and this metric makes that visible.
"""
from __future__ import annotations

import collections
import re
import string

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
