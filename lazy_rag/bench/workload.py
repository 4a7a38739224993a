"""The serving workload: a pool of documents, requests that each retrieve k of them, arrivals.

Defaults are the paper's: 100 documents of 2048 tokens, 5 per request drawn Zipf(2.1) without
replacement and put in random order, a 32-token question, 16 output tokens, 120 requests.
Everything is drawn from one seed; the requests (documents, questions) do not depend on the
arrival rate, so every rate and every system sees the same requests.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass

import numpy as np

from ..errors import LazyRagError
from ..segments import Chunk

POPULARITIES = ("zipf", "uniform")


@dataclass(frozen=True)
class WorkloadSpec:
    docs: int = 100
    doc_tokens: int = 2048
    k: int = 5
    question_tokens: int = 32
    output_tokens: int = 16
    requests: int = 120
    popularity: str = "zipf"
    zipf_a: float = 2.1
    head_tokens: int = 16  # a fixed template head shared by every request (a system prompt)
    seed: int = 0

    def validate(self) -> "WorkloadSpec":
        for name in ("docs", "doc_tokens", "k", "question_tokens", "output_tokens", "requests"):
            if getattr(self, name) < 1:
                raise LazyRagError(f"--{name.replace('_', '-')} must be at least 1 (got {getattr(self, name)}).")
        if self.k > self.docs:
            raise LazyRagError(f"--k {self.k} exceeds --docs {self.docs}: a request retrieves k distinct "
                               "documents; lower --k or raise --docs.")
        if self.popularity not in POPULARITIES:
            raise LazyRagError(f"Unknown --popularity {self.popularity!r}; choose zipf or uniform.")
        if self.popularity == "zipf" and not self.zipf_a > 0:
            raise LazyRagError(f"--zipf-a must be > 0 (got {self.zipf_a}); use --popularity uniform for none.")
        if self.head_tokens < 0:
            raise LazyRagError("head_tokens must be >= 0.")
        return self

    def as_dict(self) -> dict:
        return asdict(self)


@dataclass(frozen=True)
class Request:
    index: int
    doc_ids: tuple[int, ...]      # in prompt order
    segments: list               # [head ids] + k Chunks + [question ids]


@dataclass
class Workload:
    spec: WorkloadSpec
    docs: list[Chunk]
    requests: list[Request]


def allowed_token_ids(llm) -> np.ndarray:
    """Vocabulary ids a random prompt may use: none of the special ids (BOS/EOS/PAD/...), so that a
    prompt never contains an end of sequence or a chat marker."""
    vocab = int(llm.model.config.vocab_size)
    tok = llm.tokenizer
    if hasattr(tok, "__len__"):
        vocab = min(vocab, len(tok))  # the embedding table may be padded beyond the tokenizer
    special = set(llm.eos_ids) | set(getattr(tok, "all_special_ids", None) or [])
    for src in (llm.model.config, tok):
        for attr in ("bos_token_id", "eos_token_id", "pad_token_id", "unk_token_id"):
            v = getattr(src, attr, None)
            if isinstance(v, int):
                special.add(v)
            elif isinstance(v, (list, tuple)):
                special.update(int(x) for x in v)
    ids = np.setdiff1d(np.arange(vocab), np.fromiter(special, dtype=np.int64, count=len(special)))
    if len(ids) == 0:
        raise LazyRagError("The model's vocabulary has no ordinary token ids to draw prompts from.")
    return ids


def popularity_weights(spec: WorkloadSpec) -> np.ndarray:
    """P(document i) before sampling without replacement: Zipf over ranks 1..N (document 0 most
    popular) or uniform."""
    if spec.popularity == "uniform":
        w = np.ones(spec.docs)
    else:
        w = 1.0 / np.arange(1, spec.docs + 1, dtype=np.float64) ** spec.zipf_a
    return w / w.sum()


def make_workload(spec: WorkloadSpec, vocab_ids: np.ndarray) -> Workload:
    """Documents and requests of ``spec``, token ids drawn uniformly from ``vocab_ids``."""
    spec.validate()
    rng = np.random.default_rng(spec.seed)

    def ids(n: int) -> list[int]:
        return [int(t) for t in rng.choice(vocab_ids, size=n)]

    docs = [Chunk(ids(spec.doc_tokens), chunk_id=f"doc{i}") for i in range(spec.docs)]
    head = ids(spec.head_tokens)
    p = popularity_weights(spec)
    requests = []
    for r in range(spec.requests):
        # choice without replacement returns popular documents first: shuffle into a random order
        picked = rng.permutation(rng.choice(spec.docs, size=spec.k, replace=False, p=p))
        segments = ([head] if head else []) + [docs[d] for d in picked] + [ids(spec.question_tokens)]
        requests.append(Request(r, tuple(int(d) for d in picked), segments))
    return Workload(spec, docs, requests)


def arrival_times(n: int, rate_rps: float | None, seed: int = 0) -> np.ndarray:
    """Arrival offsets in seconds of n requests: a Poisson process of ``rate_rps`` (exponential
    gaps), or all at 0 when ``rate_rps`` is None (offline throughput)."""
    if rate_rps is None:
        return np.zeros(n)
    if not rate_rps > 0:
        raise LazyRagError(f"A request rate must be > 0 (got {rate_rps}).")
    # a stream of its own per rate, independent of the request contents
    rng = np.random.default_rng([seed, 1, int(round(rate_rps * 1000))])
    return np.cumsum(rng.exponential(1.0 / rate_rps, size=n))
