"""Where a machine's first index build spends its encode warm-up (``build_pipeline.EncodeWarmup``):
Triton's compile of the encode's attention kernel against everything else (CUDA's first use of
the forward's kernels, Triton's own one-time setup), in fresh processes that share one Triton
cache: the first finds it empty, the later ones filled. GPU only (issue 24: the seconds before a
first build's first write).

    python3 benchmarks/encode_warmup.py --tokenizer DIR [--model llama-3.1-8b] [--out encode_warmup_h100]

Each process times three warm-ups in a row (``warmup0_s`` is the first: the one a build waits
for); ``triton_compile_call_s`` is the time inside ``triton.compiler.compile`` (a compile on an
empty cache, a cache load on a filled one) and ``ptxas_s`` the longest ptxas run in it. Modes:
``empty_cache`` (bf16), ``filled_cache`` (bf16), ``filled_cache_cuda_first`` (a matmul before the
model, timed as ``cuda_first_matmul_s``), ``fp8_filled_cache`` (an fp8 build's warm-up).

Records: benchmarks/results/<out>.json.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
MODES = (("empty_cache", "bf16"), ("filled_cache", "bf16"), ("filled_cache_cuda_first", "bf16"),
         ("fp8_filled_cache", "fp8"))


def child(mode: str, kv_dtype: str, model_name: str, tokenizer: str) -> dict:
    t0 = time.perf_counter()
    import torch
    import triton
    import triton.compiler
    from triton.backends.nvidia import compiler as nvidia_compiler

    rec = {"import_torch_s": time.perf_counter() - t0}
    compiles, ptxas = [], []
    compile_fn = triton.compiler.compile

    def timed_compile(src, target=None, options=None, _env_vars=None):
        t = time.perf_counter()
        kernel = compile_fn(src, target=target, options=options, _env_vars=_env_vars)
        compiles.append((getattr(src, "name", "?"), time.perf_counter() - t, threading.current_thread().name))
        return kernel

    triton.compiler.compile = timed_compile   # the JIT imports it from there at its first compile
    run = nvidia_compiler.subprocess.run

    def timed_run(cmd, *a, **k):
        t = time.perf_counter()
        try:
            return run(cmd, *a, **k)
        finally:
            ptxas.append(time.perf_counter() - t)

    nvidia_compiler.subprocess.run = timed_run
    from transformers import AutoTokenizer

    from lazy_rag import LazyLLM
    from lazy_rag.random_models import random_model
    from lazy_rag.build_pipeline import FP8, EncodeWarmup

    rec["import_all_s"] = time.perf_counter() - t0
    t = time.perf_counter()
    if mode.endswith("cuda_first"):
        a = torch.randn(1024, 4096, device="cuda", dtype=torch.bfloat16)
        (a @ a.T).sum().item()
        rec["cuda_first_matmul_s"] = time.perf_counter() - t
        t = time.perf_counter()
    model = random_model(model_name, "cuda")
    torch.cuda.synchronize()
    rec["model_s"] = time.perf_counter() - t
    llm = LazyLLM(model, AutoTokenizer.from_pretrained(tokenizer))
    for i in range(3):
        warmup = EncodeWarmup(llm, (), None, FP8 if kv_dtype == "fp8" else torch.bfloat16)
        rec[f"warmup{i}_s"] = warmup.wait()
        if warmup.error is not None:
            raise RuntimeError(f"the warm-up failed: {warmup.error!r}")
    rec["triton_compile_call_s"] = sum(c[1] for c in compiles)
    rec["compiled_kernels"] = ",".join(c[0] for c in compiles)
    rec["compile_threads"] = ",".join(sorted({c[2] for c in compiles}))
    rec["ptxas_s"] = max(ptxas) if ptxas else None
    return {k: round(v, 3) if isinstance(v, float) else v for k, v in rec.items()}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    ap.add_argument("--tokenizer", required=True, help="a tokenizer folder (the random model's prompts are text)")
    ap.add_argument("--model", default="llama-3.1-8b", help="a shape of lazy_rag.random_models")
    ap.add_argument("--out", default="encode_warmup")
    ap.add_argument("--results-dir", default=str(ROOT / "benchmarks" / "results"))
    ap.add_argument("--child", nargs=2, metavar=("MODE", "KV_DTYPE"), help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.child:
        print("RECORD " + json.dumps(child(*args.child, args.model, args.tokenizer)), flush=True)
        return 0

    import triton

    from lazy_rag.bench.records import environment, format_table, write_records

    env = environment()
    records = []
    out = Path(args.results_dir) / f"{args.out}.json"
    with tempfile.TemporaryDirectory(prefix="triton-cache-") as cache:
        for mode, kv_dtype in MODES:
            t = time.perf_counter()
            p = subprocess.run([sys.executable, __file__, "--tokenizer", args.tokenizer, "--model", args.model,
                                "--child", mode, kv_dtype], env=dict(os.environ, TRITON_CACHE_DIR=cache),
                               capture_output=True, text=True)
            lines = [ln for ln in p.stdout.splitlines() if ln.startswith("RECORD ")]
            if p.returncode or not lines:
                sys.stderr.write(p.stderr[-4000:])
                raise SystemExit(f"{mode}: the process failed ({p.returncode})")
            records.append({"benchmark": "encode_warmup", "mode": mode, "kv_dtype": kv_dtype, **env,
                            "triton": triton.__version__, "model": f"random:{args.model}",
                            **json.loads(lines[-1][len("RECORD "):]), "process_s": round(time.perf_counter() - t, 2)})
            write_records(out, records)
    print(format_table(records, ["mode", "kv_dtype", "warmup0_s", "triton_compile_call_s", "ptxas_s",
                                 "warmup1_s", "import_all_s"]))
    print(f"-> {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
