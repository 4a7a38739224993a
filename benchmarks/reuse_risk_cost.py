"""What the reuse-risk estimate and ``recovery="auto"`` cost in time to first token, side by side
with plain ``lazy`` and ``full`` in one run.

Workload: SQuAD dev test-split questions, each over its paragraph and three others (k = 4, the
gold one at a seeded position), chat template, chunk KV already cached, one request at a time.
Per question and configuration the first token is timed (median of ``--reps``), interleaved
across configurations. The estimate itself (the entropy of the first token's distribution) is
timed alone on the same logits, as a fraction of plain lazy's TTFT; ``auto`` runs with the
model's calibration (``lazy_rag/risk_calibrations/``), so its mean TTFT includes the requests it
served again.

    python benchmarks/reuse_risk_cost.py --model smollm2 --n 40 --threads 2
"""
from __future__ import annotations

import argparse
import json
import random
import statistics
import time
from pathlib import Path

import torch

from lazy_rag.bench.records import environment, write_records

RESULTS = Path(__file__).resolve().parent / "results"
SQUAD = Path(__file__).resolve().parents[2] / "shared" / "data" / "squad_v1.1_dev.json"
BENCHMARK = "reuse_risk_cost"


def questions(path: Path, n: int, seed: int) -> list[tuple[str, list[str]]]:
    """(question, 4 paragraphs with the gold one at a random place) from the test articles."""
    data = json.loads(path.read_text())["data"]
    test = data[len(data) // 2:]
    paras = [p for art in test for p in art["paragraphs"]]
    rng = random.Random(seed)
    out = []
    for p in rng.sample(paras, n):
        others = rng.sample([q["context"] for q in paras if q is not p], 3)
        others.insert(rng.randrange(4), p["context"])
        out.append((rng.choice(p["qas"])["question"], others))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--n", type=int, default=40)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)

    from lazy_rag import Chunk, LazyLLM, build_rag_segments
    from lazy_rag.reuse_risk import first_token_entropy

    llm = LazyLLM.from_pretrained(args.model, device=args.device)
    work = questions(SQUAD, args.n, args.seed)
    configs = {"full": {"mode": "full"}, "lazy": {"mode": "lazy"}, "lazy+auto": {"mode": "lazy", "recovery": "auto"}}
    ttft: dict[str, list[float]] = {c: [] for c in configs}
    entropy_ms, served_again, recomputed, risks = [], [], [], []
    for question, paras in work:
        segments = build_rag_segments(llm.tokenizer, question, [Chunk(p) for p in paras])
        for opts in configs.values():  # untimed: the chunks' KV cached, as in deployment
            llm.generate(segments, max_new_tokens=1, **opts)
        for name, opts in configs.items():
            times = []
            for _ in range(args.reps):
                res = llm.generate(segments, max_new_tokens=1, output_first_logits=True, **opts)
                times.append(res.stats.ttft_ms)
            ttft[name].append(statistics.median(times))
            if name == "lazy":
                t = time.perf_counter()
                for _ in range(args.reps):
                    first_token_entropy(res.first_logits)
                entropy_ms.append((time.perf_counter() - t) * 1e3 / args.reps)
            if name == "lazy+auto":
                served_again.append(res.stats.served_again)
                recomputed.append(res.stats.recomputed_tokens / max(res.stats.prompt_tokens, 1))
                risks.append(res.stats.reuse_risk)
    mean = {c: statistics.fmean(v) for c, v in ttft.items()}
    common = {"benchmark": BENCHMARK, "model": args.model, "device": args.device, "threads": args.threads,
              "n": len(work), "reps": args.reps, "k": 4, **environment()}
    records = [{**common, "mode": c, "ttft_ms_mean": mean[c], "ttft_ms_p50": statistics.median(ttft[c]),
                "ttft_vs_lazy": mean[c] / mean["lazy"], "ttft_vs_full": mean[c] / mean["full"]} for c in configs]
    records[1].update({"risk_estimate_ms_mean": statistics.fmean(entropy_ms),
                       "risk_estimate_vs_lazy_ttft": statistics.fmean(entropy_ms) / mean["lazy"]})
    records[2].update({"served_again_pct": 100 * statistics.fmean(served_again),
                       "recomputed_prompt_pct": 100 * statistics.fmean(recomputed),
                       "calibrated": all(r is not None for r in risks)})
    out = args.out or RESULTS / f"{BENCHMARK}_{args.model}_{args.device}_n{len(work)}.json"
    write_records(out, records)
    for r in records:
        print({k: (round(v, 3) if isinstance(v, float) else v) for k, v in r.items()
               if k in ("mode", "ttft_ms_mean", "ttft_vs_lazy", "ttft_vs_full", "risk_estimate_ms_mean",
                        "risk_estimate_vs_lazy_ttft", "served_again_pct", "recomputed_prompt_pct", "calibrated")})
    print("records:", out)


if __name__ == "__main__":
    main()
