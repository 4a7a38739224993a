"""Training-free recovery of answer quality for chunks encoded alone: what a recovery is
(``Recovery``; its methods and their short names, ``METHODS``), and for one request which of its
chunk tokens are recomputed at query time (``choose_recomputed``). Nothing stored changes; the
shared pages are never written.

Where each part of a ``Recovery`` acts:

- ``boundary`` (EPIC): the prompt's layout (``ModelHost.prepare``: each chunk span's ``skip``),
  so a chunk's first tokens are computed by the request's prefill like its own tokens;
- ``select`` + ``ratio`` (CacheBlend, ProphetKV): ``recompute_budget`` fixes at admission how many
  chunk tokens are recomputed (the planner reserves their pages), and ``choose_recomputed`` picks
  them before the prefill, by the selector's score (``SCORERS``: a pass of the model runner);
  ``KVPlanner.recompute`` then hides them from the shared runs and computes them privately;
- ``ape_temperature`` / ``ape_scale`` (APE): the attention to the chunks (``model_runner``);
- ``auto``: after the request's prefill, its first token's reuse risk (``reuse_risk``) decides
  whether it is served again with part or all of its chunk tokens recomputed (``auto_escalation``,
  called by the engine's step).

A new method is a row of ``METHODS`` (its short name and the fields it sets) and, for a new
selector, a row of ``SCORERS``. ``choose_recomputed`` is the one place that decides which chunk
tokens a request recomputes beyond its boundary heads.
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Callable

from ..errors import LazyRagError

# a new index's queries' recovery: each answer's reuse risk is measured and a risky one recomputed
# as the model's calibration says ("none" turns it off)
DEFAULT_RECOVERY = "auto"

# short name -> the selector it names (a method that recomputes the tokens a score picks)
SELECTORS = {"cacheblend": "kv_deviation", "prophet": "question_attention"}


@dataclass(frozen=True)
class Method:
    """One recovery method as its short names spell it: ``pattern`` (a full match, numbers as its
    parameters), the part of a ``Recovery`` it sets (one method per part), what it does, and the
    fields its numbers give."""

    pattern: str
    part: str
    help: str
    fields: Callable[[list[str]], dict]


METHODS: dict[str, Method] = {
    "epic": Method(r"epic\d+", "boundary", "the first N tokens of every chunk recomputed at query time (EPIC)",
                   lambda n: {"boundary": int(n[0])}),
    "prophet": Method(r"prophet\d+(?:\.\d+)?", "select", "P% of the chunk tokens, those the question attends to "
                      "most, recomputed (ProphetKV)",
                      lambda n: {"select": SELECTORS["prophet"], "ratio": float(n[0]) / 100}),
    "cacheblend": Method(r"cacheblend\d+(?:\.\d+)?", "select", "P% of the chunk tokens, those whose KV deviates "
                         "most, recomputed (CacheBlend)",
                         lambda n: {"select": SELECTORS["cacheblend"], "ratio": float(n[0]) / 100}),
    "auto": Method(r"auto", "auto", "each answer's reuse risk measured after the prefill; a risky one served again "
                   "with chunk tokens recomputed, as the model's calibrated policy says (up to full re-encoding)",
                   lambda n: {"auto": True}),
    "ape": Method(r"ape\d+(?:\.\d+)?(?:s\d+(?:\.\d+)?)?", "ape", "attention to the chunks at temperature T and "
                  "scale S (APE)",
                  lambda n: {"ape_temperature": float(n[0]), "ape_scale": float(n[1]) if len(n) > 1 else 1.0}),
}


@dataclass(frozen=True)
class Recovery:
    """Training-free recovery of answer quality for chunks encoded alone, applied at query time.

    - ``boundary`` (EPIC): recompute the first N tokens of every chunk.
    - ``select`` + ``ratio``: recompute the fraction ``ratio`` of all the prompt's cached chunk
      tokens, chosen by ``select``: ``"kv_deviation"`` (CacheBlend: the tokens whose K/V at layer
      ``select_layer`` deviate most from a full-attention pass over the prompt) or
      ``"question_attention"`` (ProphetKV: the tokens the question attends to most, softmax
      attention averaged over layers and heads, the question run against the reused KV).
    - ``ape_temperature`` T and ``ape_scale`` S (APE): queries attend to the chunks' tokens as one
      group whose log-sum-exp is T * logsumexp(s / T) + ln S (softmax(s / T) inside it), merged
      with the other keys' group; T = S = 1 is plain attention.
    - ``auto``: measure the request's reuse risk from its first token (``reuse_risk``) and, where
      the calibrated policy says so, serve it again with that fraction of its chunk tokens
      recomputed (``auto_escalation``); without a calibration for the model and wrapper it only
      reports the entropy.
    Recomputed tokens attend to everything before them; every other chunk token stays zero-copy.
    Short names (``Recovery.parse``): ``epic16``, ``cacheblend15`` / ``prophet20`` (percent of
    the chunk tokens), ``ape0.8`` or ``ape0.8s1.2`` (T, S), ``auto``, joined with ``+``.
    """

    boundary: int = 0
    select: str | None = None
    ratio: float = 0.0
    select_layer: int = 1
    ape_temperature: float = 1.0
    ape_scale: float = 1.0
    auto: bool = False

    def __post_init__(self):
        if self.boundary < 0:
            raise LazyRagError(f"Recovery boundary must be >= 0 tokens, got {self.boundary}.")
        if self.select is not None and self.select not in SELECTORS.values():
            raise LazyRagError(f"Unknown token selector {self.select!r}; choose one of "
                               f"{', '.join(SELECTORS.values())}.")
        if not 0.0 <= self.ratio <= 1.0:
            raise LazyRagError(f"Recovery ratio must be a fraction in [0, 1], got {self.ratio}.")
        if self.ratio and self.select is None:
            raise LazyRagError("A recompute ratio needs a selector: select='kv_deviation' or 'question_attention'.")
        if self.select_layer < 0:
            raise LazyRagError(f"select_layer must be >= 0, got {self.select_layer}.")
        if not (self.ape_temperature > 0 and self.ape_scale > 0):
            raise LazyRagError(f"APE temperature and scale must be > 0, got {self.ape_temperature}, {self.ape_scale}.")
        if self.auto and self.selects:
            raise LazyRagError("auto picks each request's recompute fraction itself: give auto or a selector "
                               f"(prophetP, cacheblendP), not both (got {self.select} {self.ratio:g}).")

    @property
    def selects(self) -> bool:
        return self.select is not None and self.ratio > 0

    @property
    def ape(self) -> bool:
        return self.ape_temperature != 1.0 or self.ape_scale != 1.0

    @property
    def any(self) -> bool:
        return bool(self.boundary or self.selects or self.ape or self.auto)

    @classmethod
    def parse(cls, text: "str | Recovery | None") -> "Recovery":
        """``"epic16+prophet20"`` -> Recovery(boundary=16, select="question_attention", ratio=0.2)."""
        if isinstance(text, Recovery):
            return text
        fields: dict = {}
        for part in (text or "").split("+"):
            part = part.strip()
            if not part or part == "none":
                continue
            method = next((m for m in METHODS.values() if re.fullmatch(m.pattern, part)), None)
            if method is None:
                raise LazyRagError(f"Unknown recovery option {part!r} in {text!r}; use epicN (recompute each "
                                   "chunk's first N tokens), cacheblendP or prophetP (recompute P% of the chunk "
                                   "tokens), apeT or apeTsS (attention temperature / scale), auto (recompute "
                                   "as each answer's reuse risk asks), joined with '+'.")
            fields.update(method.fields(re.findall(r"\d+(?:\.\d+)?", part)))
        return cls(**fields)

    def name(self) -> str:
        """The short name ``parse`` reads back ("" for none)."""
        parts = []
        if self.boundary:
            parts.append(f"epic{self.boundary}")
        if self.selects:
            short = {v: k for k, v in SELECTORS.items()}[self.select]
            parts.append(f"{short}{self.ratio * 100:g}")
        if self.ape:
            parts.append(f"ape{self.ape_temperature:g}" + (f"s{self.ape_scale:g}" if self.ape_scale != 1.0 else ""))
        if self.auto:
            parts.append("auto")
        return "+".join(parts)


def resolve_recovery(recovery: "Recovery | str | None", boundary_recompute: int | None = 0) -> Recovery:
    """One Recovery from a request's options (``boundary_recompute=N`` is short for "epicN")."""
    recovery = Recovery.parse(recovery)
    if boundary_recompute:
        if recovery.boundary and recovery.boundary != boundary_recompute:
            raise LazyRagError(f"boundary_recompute={boundary_recompute} disagrees with recovery "
                               f"{recovery.name()!r}; give one of them.")
        recovery = Recovery(**{**recovery.__dict__, "boundary": boundary_recompute})
    return recovery


# -- which chunk tokens a request recomputes ---------------------------------------------------------

# each selector's score of the candidate positions (higher: recomputed first), a pass of the model
# runner over the request as it is before its prefill
SCORERS = {
    "question_attention": lambda runner, seq, candidates: runner.question_attention(seq, candidates),
    "kv_deviation": lambda runner, seq, candidates: runner.kv_deviation(seq, candidates, seq.recovery.select_layer),
}


def recompute_candidates(seq) -> list[int]:
    """Positions of the request's chunk tokens still read from cache (its boundary heads and the
    shared prefix are computed anyway)."""
    return [p for span in seq.layout.spans for p in range(span.start + span.skip, span.end)]


def cached_chunk_tokens(seq) -> int:
    """How many of the request's chunk tokens are read from cache (its boundary heads and the
    shared prefix aside): the tokens a selector may recompute."""
    return sum(span.cached_tokens for span in seq.layout.spans)


def recompute_budget(seq) -> int:
    """How many chunk tokens the request's selector recomputes (0 without one): fixed at its
    admission, where the planner reserves their pages, so the selection never runs out of them."""
    rec = seq.recovery
    if not rec.selects:
        return 0
    candidates = cached_chunk_tokens(seq)
    return min(candidates, round(rec.ratio * candidates))


def recomputes_every_chunk_token(seq) -> bool:
    """Does the request's selector recompute all of its cached chunk tokens (a ratio of 1, as
    ``auto`` escalates to full re-encoding)? The planner then admits it as ``full`` does. APE
    still groups recomputed chunk tokens apart, and a shared prefix stays read from its cache,
    so both keep the selector's path."""
    rec = seq.recovery
    if (seq.mode not in ("lazy", "block") or not rec.selects or rec.ape or not seq.layout.spans
            or seq.layout.prefix_len):
        return False
    candidates = cached_chunk_tokens(seq)
    return candidates > 0 and recompute_budget(seq) >= candidates


def choose_recomputed(seq, runner) -> list[int]:
    """The chunk tokens (positions) the request recomputes beyond its boundary heads: the
    ``seq.recompute_budget`` candidates its selector scores highest."""
    candidates = recompute_candidates(seq)
    if seq.recompute_budget <= 0:
        return []
    if seq.recompute_budget >= len(candidates):
        # all of them (``auto`` serving a risky answer again as full re-encoding): no scoring pass,
        # which is an extra eager forward
        return candidates
    scores = SCORERS[seq.recovery.select](runner, seq, candidates)
    top = scores.topk(seq.recompute_budget).indices.tolist()
    return [candidates[j] for j in top]


def auto_escalation(recovery: Recovery, fraction: float) -> Recovery:
    """What an ``auto`` request is served again with when its policy asks for ``fraction`` of its
    chunk tokens recomputed: those the question attends to most (ProphetKV's selector; 1.0 is
    every chunk token, i.e. full re-encoding), its other parts (boundary, APE) kept."""
    return Recovery(**{**recovery.__dict__, "auto": False, "select": SELECTORS["prophet"], "ratio": fraction})
