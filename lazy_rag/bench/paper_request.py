"""The paper's request as token ids, for the GPU benchmarks' random-weight models (no tokenizer):
a pool of 10 chunks of 2,048 ids, a 40-id head, 5 chunks per request each followed by two
separator ids, and a 32-id question: 10,322 prompt tokens, 10,240 of them in chunks. One seeded
generator draws everything in order, so a benchmark's requests are the same from run to run."""
from __future__ import annotations

import random

from ..segments import Chunk

IDS = (1000, 120000)   # ids drawn from here: ordinary tokens of a 128k vocabulary


class PaperRequests:
    def __init__(self, seed: int = 0, chunk_tokens: int = 2048, pool: int = 10, chunks: int = 5,
                 head_tokens: int = 40, question_tokens: int = 32):
        self.rng = random.Random(seed)
        self.chunks, self.question_tokens = chunks, question_tokens
        self.pool = [self.ids(chunk_tokens) for _ in range(pool)]
        self.head = self.ids(head_tokens)

    def ids(self, n: int) -> list[int]:
        return [self.rng.randrange(*IDS) for _ in range(n)]

    def choose(self) -> list[int]:
        """Which pool chunks the next request retrieves, in its order."""
        return self.rng.sample(range(len(self.pool)), self.chunks)

    def question(self) -> list[int]:
        return self.ids(self.question_tokens)

    def prompt(self, chosen: list[int] | None = None, question: list[int] | None = None) -> list:
        """Segments: the head, each chosen chunk and its separator, the question (drawn when not given)."""
        chosen = self.choose() if chosen is None else chosen
        segs: list = [self.head]
        for c in chosen:
            segs += [Chunk(self.pool[c]), [13, 13]]
        return segs + [self.question() if question is None else question]
