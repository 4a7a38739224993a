"""Which kernel makes a tuning example's loss or gradient non-finite: each example given runs one
trainer step alone (``trainer._finite_step``) under the fused SDPA kernels and under PyTorch's math
kernel, with the teacher outputs of a cached tuning run. Writes flat records (one per example and
kernel) to ``--out``; the trainer's own retry (``math_attention``) is what this checks.

    python3 benchmarks/device/tune_nonfinite_diag.py --model /tmp/stage/q15.gguf \
        --data /tmp/data/squad_v1.1_dev.json --teacher /tmp/stage/work-q15/teacher-9468c0a08aa88b7a.pt \
        --examples 219,1147,122,0,1,2 --gold-weight 1.0 --micro-batch 8 --out $OUT/diag.json
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", required=True)
    p.add_argument("--data", type=Path, required=True)
    p.add_argument("--teacher", type=Path, required=True, help="The run's teacher cache (teacher-*.pt).")
    p.add_argument("--examples", default="0,1,2", help="Indices into the run's examples, comma-separated.")
    p.add_argument("--n-examples", type=int, default=1500, help="The run's --examples (the same prompts).")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--gold-weight", type=float, default=1.0)
    p.add_argument("--micro-batch", type=int, default=8)
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--device", default="cuda")
    p.add_argument("--out", type=Path, default=Path("tune_nonfinite_diag.json"))
    a = p.parse_args()

    import torch

    from lazy_rag.llm import LazyLLM
    from lazy_rag.tune.examples import squad_examples
    from lazy_rag.tune.teacher import TeacherOutputs
    from lazy_rag.tune.trainer import TuneOptions, _finite_step, _gold_targets, _init_vectors, _items, math_attention

    llm = LazyLLM.from_pretrained(a.model, device=a.device, dtype=a.dtype, wrapper="none")
    options = TuneOptions(gold_weight=a.gold_weight, micro_batch=a.micro_batch, seed=a.seed)
    examples = squad_examples(llm.tokenizer, a.n_examples, k=4, seed=a.seed, data=a.data, retrieval=None, prompts="mixed")
    saved = torch.load(a.teacher, weights_only=True)
    teacher = TeacherOutputs(saved["answers"], saved["top_ids"], saved["top_logp"])
    gold = _gold_targets(llm, examples, teacher, options)
    items = {it["i"]: it for it in _items(llm, examples, teacher, gold, options)}
    for param in llm.model.parameters():
        param.requires_grad_(False)
    vectors = torch.nn.Parameter(_init_vectors(llm, options.header, options.trailer))
    weights = {"kl": 1.0, "gold": a.gold_weight}
    records = []
    for i in (int(x) for x in a.examples.split(",")):
        for mode, kernel in (("fused_sdpa", None), ("math_sdpa", math_attention)):
            vectors.grad = None
            if kernel is None:
                r = _finite_step(llm, vectors, [items[i]], teacher, None, weights, [vectors])
            else:
                with kernel():
                    r = _finite_step(llm, vectors, [items[i]], teacher, None, weights, [vectors])
            records.append({"benchmark": "tune_nonfinite_diag", "mode": mode, "device": torch.cuda.get_device_name() if a.device == "cuda" else a.device,
                            "model": a.model, "dtype": a.dtype, "torch": torch.__version__, "example": i,
                            "gold_weight": a.gold_weight, "finite": r is not None,
                            "kl": None if r is None else round(float(r["kl"]), 4)})
            print(i, mode, "finite" if r is not None else "NOT finite", flush=True)
    a.out.write_text(json.dumps(records, indent=1) + "\n")
    print("| example | kernel | finite | KL |\n|---:|---|---|---:|")
    for r in records:
        print(f"| {r['example']} | {r['mode']} | {r['finite']} | {r['kl']} |")


if __name__ == "__main__":
    main()
