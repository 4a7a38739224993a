"""`lazy-rag eval squad` on the GPU machine, whose image has no typer: the same evaluation through
the Python API, the run saved whole (``run.pkl``) so that the report, the plot and the QUALITY.md
section are written back here with ``--report``.

On the GPU machine (real weights staged as in benchmarks/device/README.md):

    python3 benchmarks/device/quality_gpu.py --model /tmp/stage/qwen.gguf --data .gpu/data/squad_v1.1_dev.json \
        --retrieval .gpu/retrieval_squad_test_d8.json --n 500 --k 4 --configs full,lazy,lazy+prophet20 --out $OUT

Here, with the run that came back:

    python benchmarks/device/quality_gpu.py --report PATH/NAME.run.pkl --model-name qwen2.5-0.5b

A call that hits the device's time limit leaves ``NAME.partial.run.pkl`` (the run so far,
rewritten every minute: ``--report`` takes it too, with n = the questions answered), and the
answers' checkpoint under ~/.cache/lazy-rag/eval/checkpoints on the machine, so the same command
in the next call (while the machine is warm) goes on where the last one stopped.
"""
import argparse
import dataclasses
import os
import pickle
import shlex
import sys
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--report", type=Path, help="Write the records, plot and QUALITY.md section of a saved run.")
    p.add_argument("--model-name", help="With --report: the model's name in the report (the run names its file).")
    p.add_argument("--torch", default="2.11.0+cu130", help="With --report: the torch version of a run whose records "
                                                           "do not name it (the GPU image's).")
    p.add_argument("--model", default="qwen2.5-0.5b")
    p.add_argument("--dataset", default="squad", help="squad, reddit or amazon_reviews (the file: --data)")
    p.add_argument("--data", type=Path)
    p.add_argument("--prompts", default="system-short", help="comma-separated prompt names (longform: 128 tokens)")
    p.add_argument("--max-new-tokens", type=int, default=24)
    p.add_argument("--retrieval", type=Path)
    p.add_argument("--configs", default="full,lazy")
    p.add_argument("--split", default="test")
    p.add_argument("--n", type=int, default=500)
    p.add_argument("--k", default="4", help="comma-separated")
    p.add_argument("--gold-position", default="retrieved", help="comma-separated")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--ttft-n", type=int, default=20)
    p.add_argument("--batch-size", type=int, default=64)
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--device", default="cuda")
    p.add_argument("--name", default=None, help="File name stem of the outputs.")
    p.add_argument("--out", type=Path, default=Path("benchmarks/results"))
    a = p.parse_args()

    from lazy_rag.quality import EvalOptions, run_eval, write_report

    if a.report:
        with open(a.report, "rb") as f:
            saved = pickle.load(f)
        for r in saved["run"].records:  # runs saved before the records named their versions: the GPU image's
            r.setdefault("torch", a.torch)
        if a.model_name:
            saved["run"].meta["model"] = a.model_name
            for r in saved["run"].records:
                r["model"] = a.model_name
        paths = write_report(saved["run"], Path("benchmarks/results"), Path("QUALITY.md"), command=saved["command"],
                             stem=saved["stem"])
        for what, path in paths.items():
            print(f"{what} -> {path}")
        return
    options = EvalOptions(model=a.model, configs=a.configs, dataset=a.dataset, data=a.data, split=a.split, n=a.n,
                          seed=a.seed, prompts=tuple(a.prompts.split(",")), max_new_tokens=a.max_new_tokens,
                          ks=tuple(int(k) for k in a.k.split(",")), gold_positions=tuple(a.gold_position.split(",")),
                          retrieval_file=a.retrieval, ttft_n=a.ttft_n, batch_size=a.batch_size, device=a.device,
                          dtype=a.dtype, progress="lines")
    from lazy_rag.quality.report import markdown_tables, run_stem

    command = "python3 " + shlex.join(sys.argv)
    a.out.mkdir(parents=True, exist_ok=True)

    def save(run, suffix: str) -> str:
        stem = a.name or run_stem(run)
        tmp = a.out / f".{stem}{suffix}.run.pkl.tmp"
        with open(tmp, "wb") as f:
            pickle.dump({"run": dataclasses.replace(run, checkpoint=None), "command": command, "stem": stem}, f)
        os.replace(tmp, a.out / f"{stem}{suffix}.run.pkl")
        return stem

    run = run_eval(options, on_partial=lambda partial: save(partial, ".partial"))
    stem = save(run, "")
    write_report(run, a.out, None, command=command, plot=False, stem=stem)
    (a.out / f"{stem}.partial.run.pkl").unlink(missing_ok=True)
    run.discard_checkpoint()
    print(markdown_tables(run))


if __name__ == "__main__":
    main()
