"""Every call the evaluation makes into the lazy-rag runtime, in one module.

The runtime is used only through its public entry points (``LazyLLM.from_pretrained``,
``LazyIndex.from_texts``/``load``, ``retrieve``, ``segments``, ``chunk_source``, ``LazyLLM.generate``
and the serving engine's ``generate``), so a change of the runtime's API is adapted here and
nowhere else.

Answers are generated in batches through the serving engine (the one runtime of every request,
recovery included). Batched requests share their wall time, so their TTFT is not a single
request's: ``first_token`` times one request alone.

Teacher forcing (``reference_rows`` for ``full``, ``teacher_forced_kl`` for the others) serves
the same prompt again with full's answer appended as uncached text, one new token, and reads the
logits at every position of that answer through the engine's ``score_rows`` / ``score_fn``,
reduced on the engine's device (``scoring.reference_rows`` / ``scoring.teacher_forced_kl``).
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Sequence

import torch

from ..requests import CHUNK_MODES as REUSE_MODES, MODES  # noqa: F401  (the configurations' modes)
from .scoring import ReferenceRows, reference_rows, teacher_forced_kl
STOP = ("\n",)                   # an answer is one line


@dataclass
class Request:
    index: object                  # the LazyIndex that holds the chunks (and their KV)
    question: str                  # as placed in the prompt
    chunk_ids: tuple[str, ...]     # in prompt order
    mode: str
    max_new_tokens: int
    generate_options: dict = field(default_factory=dict)


@dataclass
class Answer:
    text: str
    first_logits: torch.Tensor     # fp32 [vocab], on the CPU
    cached_tokens: int
    prompt_tokens: int
    seconds: float                 # the request's share of its batch's wall time
    token_ids: list[int] = field(default_factory=list)  # generated, without an end-of-sequence token
    ended_by_eos: bool = False     # the model chose to stop (an end-of-sequence token, not kept in token_ids)
    chunk_tokens: int = 0          # the prompt's chunk tokens
    recomputed_tokens: int = 0     # chunk tokens a reuse mode computed at query time (recovery)

    def decisions(self) -> int:
        """Positions at which the model chose a token: each generated token, and the end of
        sequence where it chose to stop (teacher forcing scores one row per decision)."""
        return len(self.token_ids) + int(self.ended_by_eos)


class _MemoEmbedder:
    """Remembers vectors by text, so a second index over the same texts embeds nothing."""

    def __init__(self, inner):
        self.inner, self.name, self.dim, self._memo = inner, inner.name, inner.dim, {}

    def encode(self, texts, **kwargs):
        import numpy as np

        missing = [t for t in dict.fromkeys(texts) if t not in self._memo]
        if missing:
            self._memo.update(zip(missing, self.inner.encode(missing, **kwargs)))
        return np.stack([self._memo[t] for t in texts]) if texts else np.zeros((0, self.dim), np.float32)


class Runtime:
    """A loaded model, its indexes and generation, as the evaluation needs them."""

    def __init__(self, llm, model: str, embedder=None):
        self.llm = llm
        self.model_name = llm.model_name or model
        self.embedder = _MemoEmbedder(embedder) if embedder is not None else None
        self._wrappers: dict[str, object] = {}  # spec -> resolved wrapper (index_for asks on every request)

    @classmethod
    def load(cls, model: str, device: str = "auto", dtype: str = "auto", retrieval: bool = True) -> "Runtime":
        """``retrieval=False``: no embedder is loaded (retrieval comes from a file) and indexes are
        built without vectors, so neither faiss nor the embedder's weights are needed."""
        from ..llm import LazyLLM

        embedder = None
        if retrieval:
            from ..embedder import Embedder

            embedder = Embedder()
        return cls(LazyLLM.from_pretrained(model, device=device, dtype=dtype), model, embedder)

    # -- what the records say about the run -------------------------------------------------------
    @property
    def fingerprint_id(self) -> str:
        return self.llm.fingerprint["id"]

    @property
    def dtype(self) -> str:
        return str(self.llm.dtype).removeprefix("torch.")

    @property
    def device(self) -> str:
        return str(self.llm.device)

    def device_name(self) -> str:
        dev = self.llm.device
        if dev.type == "cuda":
            return torch.cuda.get_device_name(dev)
        threads = torch.get_num_threads()
        return f"{threads} CPU thread{'s' if threads != 1 else ''}"

    def wrapper(self, spec: str):
        """The chunk wrapper a configuration names ("none", "auto": the model's bundled one, a name
        or a path), checked against the model."""
        from ..errors import LazyRagError

        if spec not in self._wrappers:  # resolving reads the file and hashes the vectors
            self._wrappers[spec] = self.llm.host.resolve_wrapper(spec)
        wrapper = self._wrappers[spec]
        if wrapper is None and str(spec).lower() == "auto":
            raise LazyRagError(f"+wrapper: {self.model_name} has no bundled chunk wrapper trained for these weights; "
                               "name one with +wrapper:PATH (a file from `lazy-rag tune`).")
        return wrapper

    # -- indexes ------------------------------------------------------------------------------------
    def index_folder(self, folder: Path) -> Path:
        """Where an index of this runtime lives: one without vectors (no embedder) apart."""
        return folder if self.embedder is not None else folder.with_name(folder.name + "-novectors")

    def open_index(self, passages, folder: Path, system_prompt: str | None, instruction: str, index_options: dict,
                   progress: bool):
        """The index of ``passages`` in ``folder``: loaded when built before, else built (chunk KV
        is encoded on first use, so only the chunks the questions use are ever encoded; quantised
        KV is encoded up front). Without an
        embedder (retrieval from a file) the index has no vectors, and its folder says so."""
        from ..index import LazyIndex
        from ..kv_record import quantized_kv_dtype

        if (folder / "manifest.json").exists():
            return LazyIndex.load(folder, llm=self.llm, embedder=self.embedder)
        # quantised KV (+fp8, +int4) is encoded up front: an index of it answers from its stored KV,
        # except at a chunk's first use, which would answer from the unquantised KV it just encoded
        precompute = quantized_kv_dtype(index_options.get("kv_dtype"))
        return LazyIndex.from_texts([p.text for p in passages], folder, llm=self.llm, embedder=self.embedder,
                                    ids=[p.id for p in passages], split=False, precompute_kv=precompute,
                                    progress=progress, system_prompt=system_prompt, instruction=instruction,
                                    vectors=self.embedder is not None, **index_options)

    def retrieve(self, index, question: str, depth: int) -> list[tuple[str, float]]:
        return [(s.chunk_id, float(s.score)) for s in index.retrieve(question, depth)]

    # -- generation -------------------------------------------------------------------------------
    def answer(self, requests: Sequence[Request]) -> list[Answer]:
        """Greedy answers in request order, as one engine batch."""
        if not requests:
            return []
        t0 = time.perf_counter()
        results = self.llm.engine.generate([self._request(r, r.max_new_tokens) for r in requests])
        share = (time.perf_counter() - t0) / len(requests)
        return [self._answer(r, res, share) for r, res in zip(requests, results)]

    def reference_rows(self, requests: Sequence[Request], answers: Sequence[Answer],
                       top_k: int | None) -> list[tuple[ReferenceRows, list[float]]]:
        """For each ``full`` request and its answer: full's distributions at every decision of
        that answer (``scoring.reference_rows``, its top ``top_k`` tokens), and their KL to
        themselves through ``teacher_forced_kl`` (0 up to rounding: full's row goes through
        the same arithmetic as every other configuration's)."""
        def score(logits):
            ref = reference_rows(logits, top_k)
            return ref, teacher_forced_kl(ref, logits)

        return self._teacher_forced(requests, answers, [score] * len(requests))

    def teacher_forced_kl(self, requests: Sequence[Request], answers: Sequence[Answer],
                          references: Sequence[ReferenceRows]) -> list[list[float]]:
        """KL(full || config) at every decision of full's answer (``answers[i]``, whose reference
        rows are ``references[i]``), request i being the configuration's prompt."""
        return self._teacher_forced(requests, answers,
                                    [lambda logits, ref=ref: teacher_forced_kl(ref, logits) for ref in references])

    def _teacher_forced(self, requests, answers, score_fns) -> list:
        """One engine batch: each prompt followed by ``answer.token_ids`` except the last decision's
        (its row is the last scored; an end of sequence is never fed), one new token, and
        ``score_fn`` given the logits of the rows that predict each decision: the prompt's last
        row predicts the answer's first token."""
        batch = []
        for r, answer, fn in zip(requests, answers, score_fns):
            rows = max(answer.decisions(), 1)  # an answer with no decision at all (never: max_new_tokens >= 1)
            fed = answer.token_ids[:rows - 1]
            req = self._request(r, 1)
            if fed:
                req["segments"] = list(req["segments"]) + [list(fed)]
            batch.append({**req, "output_first_logits": False, "score_rows": rows, "score_fn": fn})
        return [res.score for res in self.llm.engine.generate(batch)] if batch else []

    def first_token(self, request: Request) -> tuple[float, dict[str, int]]:
        """TTFT (ms) of ``request`` served alone (one request in flight, one new token), and where
        its chunks came from (tier -> count: pool, host, disk, encoded, recomputed): a TTFT is
        read with them, as a cold chunk encoded costs a forward a hot one does not."""
        (res,) = self.llm.engine.generate([self._request(request, 1)])
        return float(res.stats.ttft_ms), dict(res.stats.chunk_sources)

    def _request(self, r: Request, max_new_tokens: int) -> dict:
        return dict(segments=r.index.segments(r.question, list(r.chunk_ids)), mode=r.mode,
                    max_new_tokens=max_new_tokens, source=r.index.chunk_source, output_first_logits=True,
                    stop=list(STOP), **r.generate_options)

    def _answer(self, r: Request, res, seconds: float) -> Answer:
        # a stop is either a stop string (its token is kept) or an end-of-sequence token (not kept)
        ids = list(res.token_ids)
        text = self.llm.tokenizer.decode(ids, skip_special_tokens=True)
        ended_by_eos = res.finish_reason == "stop" and not any(s in text for s in STOP)
        chunk_tokens = sum(len(r.index.by_id[c].token_ids) for c in r.chunk_ids)
        return Answer(res.text, res.first_logits.float().cpu(), int(res.stats.cached_tokens),
                      int(res.stats.prompt_tokens), seconds, ids, ended_by_eos, chunk_tokens,
                      int(res.stats.recomputed_tokens))
