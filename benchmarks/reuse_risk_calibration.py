"""Fit a model's reuse-risk calibration and its ``recovery="auto"`` policy on an evaluation's own
answers, and check both on held-out questions.

One `lazy-rag eval` run answers every question with `full`, the reused configuration (``--base``:
``lazy`` or ``lazy+wrapper``) and that configuration with fixed ProphetKV recompute fractions.
The questions are split in two at random: on the calibration half, the reused answer's
first-token entropy is fitted to whether it differs from `full`'s (``RiskCalibration.fit``) and
the policy is the pair of risk thresholds (recompute ``--fraction`` of the chunk tokens above the
first, all of them above the second) with the highest agreement with `full` whose mean recompute
fraction stays within ``--budget``; on the held-out half the same policy's agreement and mean
recompute are measured, with fixed ProphetKV beside it, and whether the risk ranks answers
(disagreement in the top risk decile vs the bottom half). ``--write`` puts the calibration where
the runtime finds it (``lazy_rag/risk_calibrations/``). The run's answers are kept beside its
records; ``--answers FILE`` fits again from them without answering anything, and also takes the
answers a `lazy-rag eval` run (or ``benchmarks/device/quality_gpu.py``) wrote beside its records.
``--fractions ""`` runs no partial recompute: the policy can then only send risky requests to
`full`. ``--transfer FILE ...`` checks the fitted calibration and policy on other sets' eval
answers (every question held out: a transfer test).

    python benchmarks/reuse_risk_calibration.py --model smollm2 --base lazy+wrapper --n 300 --write
    python benchmarks/reuse_risk_calibration.py --model qwen2.5-0.5b --base lazy+wrapper:faithful --fractions "" \
        --answers benchmarks/results/faithful_qwen05_squad_h200_n1000_answers.jsonl.gz \
        --transfer benchmarks/results/faithful_qwen05_{reddit,amazon}_h200_n1000_answers.jsonl.gz --write
"""
from __future__ import annotations

import argparse
import dataclasses
import gzip
import json
import random
import statistics as stats
import time
from itertools import product
from pathlib import Path

from lazy_rag.bench.records import environment, write_records
from lazy_rag.quality.evaluate import EvalOptions, run_eval
from lazy_rag.quality.runner import Runtime
from lazy_rag.quality.statistics import PairedBootstrap
from lazy_rag.reuse_risk import CALIBRATIONS, AutoPolicy, RiskCalibration, file_name

BENCHMARK = "reuse_risk_calibration"
RESULTS = Path(__file__).parent / "results"


def served(rows: dict[str, dict], policy: AutoPolicy, cal: RiskCalibration, prophet: dict[float, str],
           base: str) -> tuple[list[float], list[float]]:
    """Per question, whether ``policy``'s answer agrees with full's and the fraction it recomputes:
    each question is served as the configuration its risk picks (the reused answer, a ProphetKV
    fraction, or `full`, which agrees with itself)."""
    agree, recompute = [], []
    for q in rows.values():
        f = policy.fraction(cal.risk(q[base]["first_token_entropy"]))
        name = base if f == 0 else ("full" if f >= 1.0 else prophet[f])
        agree.append(q[name]["agree_with_full"])
        recompute.append(f)
    return agree, recompute


def simulate(rows, policy, cal, prophet, base) -> tuple[float, float]:
    """(agreement with full, mean recompute fraction) of ``policy`` over these questions."""
    agree, recompute = served(rows, policy, cal, prophet, base)
    return stats.fmean(agree), stats.fmean(recompute)


def choose_policy(rows, cal, prophet, base, budget: float, fraction: float) -> AutoPolicy:
    """The thresholds (at the calibration half's risk quantiles) with the best agreement within
    the recompute budget; ties go to less recompute."""
    risks = sorted({cal.risk(q[base]["first_token_entropy"]) for q in rows.values()})
    cuts = [r for r in risks if r > 0] + [float("inf")]
    best = (-1.0, 0.0, AutoPolicy())
    partial = cuts if prophet else [float("inf")]   # without ProphetKV answers: full or nothing
    for some, every in product(partial, cuts):
        if every < some != float("inf"):   # the partial step comes first; "inf" means none
            continue
        steps = tuple(s for s in ((some, fraction), (every, 1.0)) if s[0] != float("inf"))
        if len(steps) == 2 and steps[0][0] == steps[1][0]:
            steps = steps[1:]
        policy = AutoPolicy(steps)
        agree, rec = simulate(rows, policy, cal, prophet, base)
        if rec <= budget and (agree, -rec) > (best[0], -best[1]):
            best = (agree, rec, policy)
    return best[2]


def decile_ratio(rows, cal, base) -> dict:
    """Disagreement with full among the riskiest tenth of the answers vs among the safer half."""
    ranked = sorted(rows.values(), key=lambda q: cal.risk(q[base]["first_token_entropy"]))
    n = len(ranked)
    top = ranked[n - max(n // 10, 1):]
    bottom = ranked[:n // 2]
    d_top = 1 - stats.fmean(q[base]["agree_with_full"] for q in top)
    d_bottom = 1 - stats.fmean(q[base]["agree_with_full"] for q in bottom) if bottom else float("nan")
    return {"disagree_top_decile_pct": 100 * d_top, "disagree_bottom_half_pct": 100 * d_bottom,
            "top_decile_vs_bottom_half": d_top / d_bottom if d_bottom else None}


def load_answers(path: Path, base: str) -> tuple[dict, list[dict]]:
    """(meta, answer rows) of a saved run: this script's own file (meta on its first line) or an
    eval's answers, whose meta comes from the records file beside it."""
    with gzip.open(path, "rt") as f:
        saved = [json.loads(line) for line in f]
    if "question_id" not in saved[0]:
        return saved[0], saved[1:]
    records = json.loads(path.with_name(path.name.removesuffix("_answers.jsonl.gz") + ".json").read_text())
    rec = next((r for r in records if r["mode"] == base), None)
    if rec is None:
        raise SystemExit(f"{path} has no {base!r} answers (its configurations: "
                         f"{', '.join(r['mode'] for r in records)}); choose one with --base")
    return {"device": rec["device"], "device_name": rec.get("device_name"), "data_hash": rec["data_hash"],
            "wrapper_digest": rec.get("wrapper_digest"), "dataset": rec["dataset"]}, saved


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--base", default="lazy+wrapper", help="the reused configuration: lazy or lazy+wrapper")
    ap.add_argument("--fractions", default="20,50", help="ProphetKV percentages run beside it (the policy's "
                                                           "first step is --fraction, one of them)")
    ap.add_argument("--fraction", type=float, default=50, help="the policy's partial recompute, percent")
    ap.add_argument("--budget", type=float, default=0.2, help="mean recompute fraction the policy may spend")
    ap.add_argument("--dataset", default="squad")
    ap.add_argument("--split", default="test")
    ap.add_argument("--n", type=int, default=300)
    ap.add_argument("--top-k", type=int, default=4)
    ap.add_argument("--max-new-tokens", type=int, default=24)
    ap.add_argument("--batch-size", type=int, default=16)
    ap.add_argument("--device", default="auto")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--write", action="store_true", help="write the calibration into lazy_rag/risk_calibrations/")
    ap.add_argument("--out", type=Path, default=None)
    ap.add_argument("--answers", type=Path, default=None,
                    help="fit from this run's answers (the .jsonl.gz written beside its records) instead of running")
    ap.add_argument("--transfer", type=Path, nargs="*", default=[],
                    help="eval answers of other sets to check the fitted calibration and policy on")
    ap.add_argument("--also-fingerprint", default=None,
                    help="with --write, also file the calibration under this fingerprint id: the same weights "
                         "loaded by another transformers version (a GPU image's), as the wrapper file lists")
    args = ap.parse_args()

    percents = [float(p) for p in args.fractions.split(",") if p.strip()]
    if percents and args.fraction not in percents:
        ap.error(f"--fraction {args.fraction:g} must be one of --fractions {args.fractions}")
    prophet = {p / 100: f"{args.base}+prophet{p:g}" for p in percents}
    configs = ["full", args.base, *prophet.values()]
    t0 = time.perf_counter()
    out = args.out or RESULTS / f"{BENCHMARK}_{args.model}_{args.base.replace('+', '_')}_n{args.n}.json"
    answers_file = args.answers or out.with_name(out.stem + "_answers.jsonl.gz")
    runtime = Runtime.load(args.model, args.device)
    if args.answers:
        meta, answers = load_answers(args.answers, args.base)
    else:
        run = run_eval(EvalOptions(model=args.model, configs=tuple(configs), dataset=args.dataset,
                                   split=args.split, n=args.n, seed=args.seed, ks=(args.top_k,),
                                   max_new_tokens=args.max_new_tokens, batch_size=args.batch_size, ttft_n=0,
                                   device=args.device, progress="lines"), runtime)
        base_record = next(r for r in run.records if r["mode"] == args.base)
        meta = {**{k: run.meta[k] for k in ("device", "device_name", "data_hash")},
                "wrapper_digest": base_record["wrapper_digest"]}
        answers = run.answers
        with gzip.open(answers_file, "wt") as f:
            for line in [meta, *answers]:
                f.write(json.dumps(line) + "\n")
    by_question: dict[str, dict] = {}
    for row in answers:
        by_question.setdefault(row["question_id"], {})[row["config"]] = row
    ids = sorted(by_question)
    random.Random(args.seed).shuffle(ids)
    half = len(ids) // 2
    calib = {q: by_question[q] for q in ids[:half]}
    held = {q: by_question[q] for q in ids[half:]}

    wrapper = meta["wrapper_digest"]
    fingerprint = runtime.fingerprint_id
    source = {"dataset": args.dataset, "split": args.split, "n_calibration": len(calib), "base": args.base,
              "top_k": args.top_k, "seed": args.seed, "data_hash": meta["data_hash"],
              "date": time.strftime("%Y-%m-%d"), "device": meta["device_name"],
              "answers": answers_file.name}
    cal = RiskCalibration.fit([q[args.base]["first_token_entropy"] for q in calib.values()],
                              [not q[args.base]["agree_with_full"] for q in calib.values()],
                              fingerprint, wrapper, source=source)
    policy = choose_policy(calib, cal, prophet, args.base, args.budget, args.fraction / 100)
    cal = cal.with_policy(policy)

    records = []
    common = {"benchmark": BENCHMARK, "model": args.model, "base": args.base, "dataset": args.dataset,
              "split": args.split, "n_held_out": len(held), "n_calibration": len(calib), "top_k": args.top_k,
              "budget_fraction": args.budget, "device": meta["device"], "device_name": meta["device_name"],
              "wrapper_digest": wrapper, "answers_file": answers_file.name, **environment()}
    boot = PairedBootstrap(len(held), 5000, args.seed)
    base_agree = [q[args.base]["agree_with_full"] for q in held.values()]

    def vs_base(agree: list[float]) -> dict:
        d = boot.mean_difference(agree, base_agree).scaled(100)
        return {"agreement_vs_base_pct": d.estimate, "agreement_vs_base_ci_low": d.low,
                "agreement_vs_base_ci_high": d.high}

    for name, f in [(args.base, 0.0), *[(c, p) for p, c in prophet.items()], ("full", 1.0)]:
        agree = [q[name]["agree_with_full"] for q in held.values()]
        records.append({**common, "mode": name, "agreement_with_full_pct": 100 * stats.fmean(agree),
                        "recompute_fraction_mean": f, **vs_base(agree)})
    agree, rec = served(held, policy, cal, prophet, args.base)
    records.append({**common, "mode": f"{args.base}+auto", "agreement_with_full_pct": 100 * stats.fmean(agree),
                    "recompute_fraction_mean": stats.fmean(rec), **vs_base(agree),
                    "policy_steps": [list(s) for s in policy.steps],
                    **decile_ratio(held, cal, args.base), "seconds": time.perf_counter() - t0})
    for path in args.transfer:   # the same calibration and policy on another set, every question held out
        t_meta, t_answers = load_answers(path, args.base)
        rows: dict[str, dict] = {}
        for row in t_answers:
            rows.setdefault(row["question_id"], {})[row["config"]] = row
        agree, rec = served(rows, policy, cal, prophet, args.base)
        base = [q[args.base]["agree_with_full"] for q in rows.values()]
        d = PairedBootstrap(len(rows), 5000, args.seed).mean_difference(agree, base).scaled(100)
        records.append({**common, "mode": f"{args.base}+auto", "transfer": path.name,
                        "dataset": t_meta.get("dataset"), "n_held_out": len(rows), "n_calibration": 0,
                        "base_agreement_with_full_pct": 100 * stats.fmean(base),
                        "agreement_with_full_pct": 100 * stats.fmean(agree), "recompute_fraction_mean": stats.fmean(rec),
                        "agreement_vs_base_pct": d.estimate, "agreement_vs_base_ci_low": d.low,
                        "agreement_vs_base_ci_high": d.high, "policy_steps": [list(s) for s in policy.steps],
                        **decile_ratio(rows, cal, args.base)})
    write_records(out, records)
    for r in records:
        print(f"{r.get('transfer', r['dataset'])[:28]:28s} {r['mode']:32s} agreement {r['agreement_with_full_pct']:5.1f}% ({r['agreement_vs_base_pct']:+.1f} "
              f"[{r['agreement_vs_base_ci_low']:+.1f}, {r['agreement_vs_base_ci_high']:+.1f}] vs {args.base})  "
              f"recompute {100 * r['recompute_fraction_mean']:5.1f}%")
    print(json.dumps({k: records[-1][k] for k in ("policy_steps", "disagree_top_decile_pct",
                                                   "disagree_bottom_half_pct", "top_decile_vs_bottom_half")}))
    if args.write:
        print("calibration:", cal.save(CALIBRATIONS / file_name(fingerprint, wrapper)))
        if args.also_fingerprint:
            twin = dataclasses.replace(cal, model_fingerprint=args.also_fingerprint)
            print("calibration:", twin.save(CALIBRATIONS / file_name(args.also_fingerprint, wrapper)))
    print("records:", out)


if __name__ == "__main__":
    main()
