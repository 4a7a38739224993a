"""`lazy-rag tune --model M` on the GPU machine, whose image has no typer: the same run through the
Python API (``lazy_rag.tune.run.tune_model``). Writes the wrapper and a JSON record (recipe, held-out
KL curve, wall times) to --out.

    python3 benchmarks/device/tune_gpu.py --model /tmp/stage/qwen.gguf --name qwen2.5-0.5b \
        --data /tmp/data/squad_v1.1_dev.json --out $OUT
"""
import argparse
import json
import os
import shlex
import sys
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", required=True)
    p.add_argument("--name", required=True, help="The wrapper's name (the bundled model's name).")
    p.add_argument("--data", type=Path)
    p.add_argument("--examples", type=int, default=512)
    p.add_argument("--retrieval", type=Path, help="Ranking file of the train split (`lazy-rag eval retrieve --split train`).")
    p.add_argument("--gold-position", default="retrieved", help="With --retrieval: retrieved (the ranking's order) or random.")
    p.add_argument("--prompts", default="mixed", help="mixed, frozen or default")
    p.add_argument("--k", type=int, default=4)
    p.add_argument("--steps", type=int, default=240)
    p.add_argument("--lr", type=float, default=2e-3)
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--micro-batch", type=int, default=16)
    p.add_argument("--header", type=int, default=8)
    p.add_argument("--trailer", type=int, default=8)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--method", default="wrapper", help="wrapper or lora (a chunk adapter too)")
    p.add_argument("--rank", type=int, default=8)
    p.add_argument("--alpha", type=float, default=16.0)
    p.add_argument("--adapter-lr", type=float, default=5e-4)
    p.add_argument("--gold-weight", type=float, default=0.0, help="Cross-entropy on SQuAD's gold answers, this weight.")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--work-dir", type=Path, help="Teacher cache and checkpoints (runs differing only in their "
                                                 "training settings can share one).")
    p.add_argument("--out", type=Path, default=Path("."))
    a = p.parse_args()

    import torch

    from lazy_rag.tune import TuneOptions
    from lazy_rag.tune.run import tune_model

    options = TuneOptions(header=a.header, trailer=a.trailer, steps=a.steps, lr=a.lr, batch=a.batch,
                          micro_batch=a.micro_batch, seed=a.seed, method=a.method, rank=a.rank, alpha=a.alpha,
                          adapter_lr=a.adapter_lr, gold_weight=a.gold_weight)
    t0 = time.perf_counter()
    wrapper, report = tune_model(a.model, options, out=a.out / f"{a.name}.safetensors", data=a.data,
                                 examples=a.examples, k=a.k, device="cuda", dtype=a.dtype, progress="lines",
                                 retrieval=a.retrieval, prompts=a.prompts, work_dir=a.work_dir,
                                 gold_position=a.gold_position)
    report.update(benchmark="tune_wrapper", mode="lazy+wrapper", model=a.name, wrapper_digest=wrapper.digest,
                  device_name=torch.cuda.get_device_name(), torch=torch.__version__, wall_s=round(time.perf_counter() - t0, 1),
                  retrieval=a.retrieval.name if a.retrieval else None,
                  gold_position=a.gold_position if a.retrieval else "random",
                  command="python3 " + shlex.join(sys.argv))
    (a.out / f"tune_{a.name}.json").write_text(json.dumps([report], indent=1))
    h = report["history"]
    print(f"{a.name}: held-out KL {h[0]['held_out_kl']:.4f} -> {h[-1]['held_out_kl']:.4f}, "
          f"train {report['train_seconds']} s, teacher {report['teacher_seconds']} s, wrapper {wrapper.digest}")


if __name__ == "__main__":
    main()
