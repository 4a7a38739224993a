"""Per-index tuning on the GPU machine (issue 20): index the paragraphs of a labelled set, then
`lazy-rag tune INDEX_DIR` through the Python API (the image has no typer). The questions are not
used: the tuning prompts are questions the model writes for the index's own chunks. The set's
questions score the wrapper afterwards (`quality_gpu.py --configs "...,lazy+wrapper:FILE"`), so
the gap before (the index's starting wrapper) and after is paired on the same questions.

    python3 benchmarks/device/tune_index_gpu.py --model /tmp/stage/qwen.gguf --data .gpu/data/squad_v1.1_dev.json \
        --index /tmp/stage/squad-index --examples 512 --out $OUT

Needs faiss and the MiniLM embedder on the machine (benchmarks/device/README.md, "Per-index
tuning"). Writes ``index-tuned-<set>.safetensors`` (a copy of the index's new wrapper) and
``tune_index_<set>.json`` (recipe, held-out KL curve, wall times) to --out.
"""
import argparse
import json
import os
import shlex
import shutil
import sys
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", required=True)
    p.add_argument("--data", type=Path, required=True, help="A SQuAD-format file: its paragraphs are the corpus.")
    p.add_argument("--index", type=Path, required=True, help="Where the index goes (reused when it exists).")
    p.add_argument("--prompt", default=None, help="The index's prompt (a quality prompt name; default the eval's).")
    p.add_argument("--examples", type=int, default=512)
    p.add_argument("--k", type=int, default=4)
    p.add_argument("--steps", type=int, default=240)
    p.add_argument("--lr", type=float, default=2e-3)
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--micro-batch", type=int, default=16)
    p.add_argument("--wrapper", default="auto", help="The index's wrapper before tuning (auto: the model's bundled one).")
    p.add_argument("--init", default="auto", help="auto (the index's wrapper), none, or a wrapper name/file")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", type=Path, default=Path("."))
    a = p.parse_args()

    import torch

    from lazy_rag import LazyIndex, LazyLLM
    from lazy_rag.quality.data import load_dataset
    from lazy_rag.quality.prompts import FROZEN, get_prompt
    from lazy_rag.tune import TuneOptions
    from lazy_rag.tune.run import tune_index

    t0 = time.perf_counter()
    llm = LazyLLM.from_pretrained(a.model, device="cuda", dtype="bfloat16")
    ds = load_dataset("squad", a.data)
    prompt = get_prompt(a.prompt or FROZEN)  # the prompt the index serves with: the eval's
    if not (a.index / "index.sqlite").exists():
        LazyIndex.from_texts([q.text for q in ds.passages], a.index, llm=llm, ids=[q.id for q in ds.passages],
                             split=False, system_prompt=prompt.system_prompt, instruction=prompt.instruction,
                             progress="lines", wrapper=a.wrapper)
    t_build = time.perf_counter() - t0
    options = TuneOptions(steps=a.steps, lr=a.lr, batch=a.batch, micro_batch=a.micro_batch, seed=a.seed)
    wrapper, report = tune_index(a.index, options, examples=a.examples, k=a.k, device="cuda", progress="lines",
                                 init=a.init, llm=llm)
    a.out.mkdir(parents=True, exist_ok=True)
    stem = Path(a.data).stem
    path = a.out / f"index-tuned-{stem}{'' if a.wrapper == 'auto' else '-from-' + Path(a.wrapper).name.removesuffix('.safetensors')}.safetensors"
    wrapper.save(path)
    report.update(benchmark="tune_index", mode="lazy+wrapper", dataset=stem, passages=len(ds.passages),
                  wrapper_digest=wrapper.digest, index_build_s=round(t_build, 1), device_name=torch.cuda.get_device_name(),
                  torch=torch.__version__, wall_s=round(time.perf_counter() - t0, 1), command="python3 " + shlex.join(sys.argv))
    (a.out / f"tune_index_{stem}.json").write_text(json.dumps([report], indent=1))
    shutil.copy(path, a.index.parent / path.name)  # beside the index, for the eval's next call
    h = report["history"]
    print(f"{stem}: held-out KL {h[0]['held_out_kl']:.4f} -> {h[-1]['held_out_kl']:.4f}, train {report['train_seconds']} s, "
          f"teacher {report['teacher_seconds']} s, wrapper {wrapper.digest} (-> {path})")


if __name__ == "__main__":
    main()
