"""The timing attack on a shared cache, as a measurement: can tenant B tell, from how long its
request takes, whether tenant A sent the same document before?

Tenant a sends ``trials`` documents, ``prime_batch`` to a request; after each such request, per
document it sent and in random order, b sends it (the probe), b sends a fresh one (a cold miss),
and a sends it again (its own repeat, a hit). Priming block by block keeps what the trials need
in the KV pool, a block's documents, probes and cold misses, whatever the number of trials: with
every document sent first, 200 trials of 250 words (some 600 documents with the probes and cold
misses) outgrew SmolLM2's 2 GiB CPU pool and a's later repeats were no longer pool hits. The cold
misses are fresh documents (cached nowhere) and a's repeats must be pool hits, as before. The
classifier "slower than a threshold means a cold miss" is scored by the area under its ROC
curve (``auc``): 0.5 when the times tell nothing. The same classifier's AUC on a's repeats
shows that it can tell hits from misses at all, so a probe AUC near 0.5 means the salt hides
them, not that the clock is too coarse. (tests/server/test_tenants.py runs it in CI;
benchmarks/tenant_timing.py on other models and devices.)
"""
from __future__ import annotations

import random
from typing import Awaitable, Callable


def auc(negatives, positives) -> float:
    """P(a negative's time > a positive's), ties counting half: the ROC area of the threshold
    classifier that calls the slower requests cold misses."""
    return sum((n > p) + 0.5 * (n == p) for n in negatives for p in positives) / (len(negatives) * len(positives))


async def timing_trials(ask: Callable[[str, list[str]], Awaitable[tuple[float, dict]]],
                        document: Callable[[], str], trials: int, rng: random.Random,
                        prime_batch: int = 25, shared: bool = False) -> dict[str, list[tuple[float, float]]]:
    """``ask(tenant, documents)`` -> (seconds, the response's ``lazy_rag`` field); ``tenant`` is
    "a" or "b". Returns {"probe", "cold", "own"}: (client seconds, server ttft_ms) per trial.
    Raises AssertionError if a response's chunk sources contradict what the trial expects
    (b's cold: encoded; a's repeat: found in the pool; b's probe: encoded, or found in the pool
    when ``shared``: a and b share one cache, the attack's target)."""
    for _ in range(3):  # warm-up: first steps, allocator
        await ask("b", [document()])
    sent = [document() for _ in range(trials)]
    times: dict[str, list[tuple[float, float]]] = {"probe": [], "cold": [], "own": []}
    for i in range(0, trials, prime_batch):
        block = sent[i:i + prime_batch]
        await ask("a", block)
        for doc in block:
            trial = [("probe", "b", doc), ("cold", "b", document()), ("own", "a", doc)]
            rng.shuffle(trial)
            for kind, tenant, text in trial:
                seconds, extra = await ask(tenant, [text])
                want = {"pool": 1} if kind == "own" or (kind == "probe" and shared) else {"encoded": 1}
                assert extra["chunk_sources"] == want, (kind, extra)
                times[kind].append((seconds, extra["ttft_ms"]))
    return times


def summary(times: dict[str, list[tuple[float, float]]]) -> dict:
    """AUCs (cold vs probe: the leak; cold vs own: the classifier's power) and medians, for the
    client's clock and the server's reported TTFT."""
    from statistics import median

    out = {"trials": len(times["probe"])}
    for i, clock in enumerate(("client_s", "server_ttft_ms")):
        probe, cold, own = ([t[i] for t in times[k]] for k in ("probe", "cold", "own"))
        out[clock] = {"auc_probe": round(auc(cold, probe), 3), "auc_own": round(auc(cold, own), 3),
                      "median_cold": round(median(cold), 5), "median_probe": round(median(probe), 5),
                      "median_own": round(median(own), 5)}
    return out
