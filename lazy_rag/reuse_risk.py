"""Per-answer reuse risk: how likely an answer served from reused chunk KV differs from the one
full re-encoding would give, and the policy ``recovery="auto"`` follows.

The estimate is the entropy of the first answer token's distribution under reuse
(``first_token_entropy``): the logits are there anyway after the prefill, so it costs one softmax
over the vocabulary, no extra forward. A model is unsure where reuse has moved its attention off
the passage it needs, and that is where its answer changes. ``RiskCalibration`` turns entropy into
a probability, fitted on an evaluation's own answers (entropy of the lazy answer vs whether it
differs from `full`'s: a monotone fit, so more entropy never means less risk), and holds the
``AutoPolicy`` chosen on the same data: the risk above which a request's chunks are partly or
wholly recomputed. ``benchmarks/reuse_risk_calibration.py`` fits one from an evaluation's answers
and writes it beside the package (``CALIBRATIONS``), one file per model and chunk wrapper.
"""
from __future__ import annotations

import json
import math
from bisect import bisect_right
from dataclasses import asdict, dataclass, field
from pathlib import Path

from .errors import LazyRagError

CALIBRATIONS = Path(__file__).parent / "risk_calibrations"


def first_token_entropy(logits) -> float:
    """Entropy (nats) of softmax(``logits``) over the vocabulary (a [vocab] tensor)."""
    return first_token_entropies(logits[None])[0]


def first_token_entropies(logits) -> list[float]:
    """``first_token_entropy`` of each row of a [rows, vocab] tensor, with one host transfer."""
    import torch

    logp = torch.log_softmax(logits.float(), dim=-1)
    return (-(logp.exp() * logp).sum(-1)).tolist()


def describe_risk(stats) -> str:
    """" | reuse risk 12%" for a ``GenerationStats`` (the entropy where no calibration gives a
    risk; "" where nothing was reused)."""
    if stats.reuse_risk is not None:
        return f" | reuse risk {100 * stats.reuse_risk:.0f}%"
    if stats.first_token_entropy is not None:
        return f" | first-token entropy {stats.first_token_entropy:.2f} (no risk calibration)"
    return ""


def monotone_fit(xs: list[float], ys: list[float]) -> tuple[list[float], list[float]]:
    """Non-decreasing least-squares fit of ``ys`` over ``xs`` (pool adjacent violators): each
    fitted block's mean x (its knot) and its value."""
    if len(xs) != len(ys) or not xs:
        raise LazyRagError(f"A risk calibration needs as many outcomes as entropies, and at least one "
                           f"(got {len(xs)} entropies, {len(ys)} outcomes).")
    order = sorted(range(len(xs)), key=lambda i: xs[i])
    blocks: list[list[float]] = []   # [sum of y, count, sum of x]
    for i in order:
        blocks.append([float(ys[i]), 1.0, float(xs[i])])
        while len(blocks) > 1 and blocks[-2][0] / blocks[-2][1] >= blocks[-1][0] / blocks[-1][1]:
            s, n, x = blocks.pop()
            blocks[-1][0] += s
            blocks[-1][1] += n
            blocks[-1][2] += x
    return [b[2] / b[1] for b in blocks], [b[0] / b[1] for b in blocks]


@dataclass(frozen=True)
class AutoPolicy:
    """``recovery="auto"``: a request whose risk is at least ``steps[i][0]`` (the highest such
    step) has the fraction ``steps[i][1]`` of its chunk tokens recomputed (those the question
    attends to most); 1.0 recomputes every chunk token, which is full re-encoding."""

    steps: tuple[tuple[float, float], ...] = ()

    def __post_init__(self):
        risks = [r for r, _ in self.steps]
        if risks != sorted(risks) or any(not 0.0 < f <= 1.0 for _, f in self.steps):
            raise LazyRagError(f"An auto policy's steps must rise in risk, each with a recompute fraction in (0, 1] "
                               f"(got {self.steps}).")

    def fraction(self, risk: float | None) -> float:
        """The recompute fraction for a request of this risk (0: serve the reused answer)."""
        if risk is None:
            return 0.0
        out = 0.0
        for at, frac in self.steps:
            if risk >= at:
                out = frac
        return out


@dataclass(frozen=True)
class RiskCalibration:
    """Entropy -> probability that the answer differs from full re-encoding's, for one model
    (``model_fingerprint``) serving chunks encoded inside one wrapper (``wrapper_digest``, None
    for plain chunks). ``edges``/``risks``: the monotone fit's knots (rising entropies) and their
    risks, interpolated linearly between knots and held beyond the ends, so the risk never falls
    as entropy rises and orders requests finely enough for a policy's thresholds. ``policy``: what
    ``auto`` does.
    ``source``: the evaluation it was fitted on (data, n, prompt), for the record."""

    model_fingerprint: str
    wrapper_digest: str | None
    edges: tuple[float, ...]
    risks: tuple[float, ...]
    policy: AutoPolicy = field(default_factory=AutoPolicy)
    source: dict = field(default_factory=dict)

    @classmethod
    def fit(cls, entropies: list[float], differs: list[bool], model_fingerprint: str,
            wrapper_digest: str | None, policy: AutoPolicy | None = None, source: dict | None = None):
        edges, risks = monotone_fit(entropies, [float(d) for d in differs])
        return cls(model_fingerprint, wrapper_digest, tuple(edges), tuple(risks), policy or AutoPolicy(),
                   source or {})

    def risk(self, entropy: float) -> float:
        if math.isnan(entropy) or entropy >= self.edges[-1]:
            return self.risks[-1]
        if entropy <= self.edges[0]:
            return self.risks[0]
        i = bisect_right(self.edges, entropy)   # edges[i - 1] < entropy < edges[i]
        x0, x1, y0, y1 = self.edges[i - 1], self.edges[i], self.risks[i - 1], self.risks[i]
        return y0 + (y1 - y0) * (entropy - x0) / (x1 - x0)

    def with_policy(self, policy: AutoPolicy) -> "RiskCalibration":
        return RiskCalibration(self.model_fingerprint, self.wrapper_digest, self.edges, self.risks, policy,
                               self.source)

    # -- files ----------------------------------------------------------------------------------
    def to_json(self) -> dict:
        d = asdict(self)
        d["policy"] = {"steps": [list(s) for s in self.policy.steps]}
        return d

    @classmethod
    def from_json(cls, d: dict) -> "RiskCalibration":
        try:
            return cls(d["model_fingerprint"], d.get("wrapper_digest"), tuple(d["edges"]), tuple(d["risks"]),
                       AutoPolicy(tuple(tuple(s) for s in d.get("policy", {}).get("steps", ()))),
                       d.get("source", {}))
        except (KeyError, TypeError) as e:
            raise LazyRagError(f"Not a reuse-risk calibration ({type(e).__name__}: {e}); write one with "
                               "benchmarks/reuse_risk_calibration.py.") from e

    def save(self, path: Path) -> Path:
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(self.to_json(), indent=1) + "\n")
        return path

    @classmethod
    def load(cls, path: Path) -> "RiskCalibration":
        return cls.from_json(json.loads(Path(path).read_text()))


def file_name(model_fingerprint: str, wrapper_digest: str | None) -> str:
    return f"{model_fingerprint}-{wrapper_digest or 'plain'}.json"


def find_calibration(model_fingerprint: str, wrapper_digest: str | None,
                     folder: Path = CALIBRATIONS) -> RiskCalibration | None:
    """The calibration for this model and wrapper, or None (the risk is then not known: entropy
    alone is reported and ``auto`` recomputes nothing)."""
    path = Path(folder) / file_name(model_fingerprint, wrapper_digest)
    return RiskCalibration.load(path) if path.exists() else None
