"""A machine's first build: its encode kernel compiled from the model's config while the model
loads (``lazy_rag.build_precompile``, as ``lazy-rag index`` does), against the load alone and the
compile after it. GPU only (issue 24: the seconds before a first build's first write).

    # the random 8B shape saved as a checkpoint (15 GiB), as a user's model is on disk
    python3 benchmarks/load_beside_compile.py save --ckpt /tmp/ckpt --tokenizer DIR [--model llama-3.1-8b]
    python3 benchmarks/load_beside_compile.py run --ckpt /tmp/ckpt [--repeats 3] [--kv-dtype bf16] \
        [--out load_beside_compile_h100]

Each measurement is a fresh process with an empty Triton cache (``TRITON_CACHE_DIR``) whose
checkpoint was dropped from the page cache first: a machine's first ``lazy-rag index``. The
modes alternate (``alone`` first on even repeats, ``beside`` first on odd ones):
  alone    ``LazyLLM.from_pretrained`` (``load_s``), then the build's encode warm-up
           (``warmup_s``: the compile, as a build's first batch waits for it);
  beside   ``build_precompile.warm_for_pretrained`` started first, then the same load; then the
           wait for that warm-up (``precompile_wait_s``; ``precompile_s``: its own seconds) and
           the build's warm-up (``warmup_s``: the kernel found compiled).
``ready_s`` = load + wait + warm-up: when a build's first batch could start encoding. The
difference of the modes' ``load_s`` is what the compile beside it costs the load (the GIL,
the cores); of their ``ready_s``, what the user gains.

Records: benchmarks/results/<out>.json.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def child(mode: str, ckpt: str, kv_dtype: str) -> dict:
    t0 = time.perf_counter()
    import torch

    from lazy_rag import LazyLLM, build_precompile
    from lazy_rag.bench.disk import drop_page_cache
    from lazy_rag.build_pipeline import EncodeWarmup
    from lazy_rag.store import KV_DTYPE_NAMES

    rec = {"import_s": time.perf_counter() - t0, "checkpoint_bytes": drop_page_cache(Path(ckpt))}
    kv = KV_DTYPE_NAMES.get(kv_dtype, kv_dtype)
    t = time.perf_counter()
    pre = build_precompile.warm_for_pretrained(ckpt, kv_dtype=kv) if mode == "beside" else None
    if mode == "beside" and pre is None:
        raise RuntimeError("no warm-up from the config (not CUDA, or LAZY_RAG_PRECOMPILE=off)")
    llm = LazyLLM.from_pretrained(ckpt)
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    rec["load_s"] = time.perf_counter() - t
    if pre is not None:
        rec["precompile_s"] = pre.wait()
        rec["precompile_wait_s"] = time.perf_counter() - t - rec["load_s"]
        rec["precompile_end_s"] = pre.ended - t   # from the load's start
        if pre.error is not None:
            raise RuntimeError(f"the warm-up from the config failed: {pre.error!r}")
    warmup = EncodeWarmup(llm, (), None, llm.dtype if kv == "auto" else getattr(torch, kv))
    rec["warmup_s"] = warmup.wait()
    if warmup.error is not None:
        raise RuntimeError(f"the build's warm-up failed: {warmup.error!r}")
    rec["ready_s"] = rec["load_s"] + rec.get("precompile_wait_s", 0.0) + rec["warmup_s"]
    return {k: round(v, 3) if isinstance(v, float) else v for k, v in rec.items()}


def save(a) -> None:
    from lazy_rag.bench.random_models import random_model

    t = time.perf_counter()
    import torch
    from transformers import AutoTokenizer

    random_model(a.model, "cuda" if torch.cuda.is_available() else "cpu").save_pretrained(a.ckpt)
    AutoTokenizer.from_pretrained(a.tokenizer).save_pretrained(a.ckpt)
    print(f"saved random:{a.model} to {a.ckpt} in {time.perf_counter() - t:.1f} s")


def run(a) -> None:
    import triton

    from lazy_rag.bench.records import environment, format_table, write_records

    env = environment()
    records = []
    out = Path(a.results_dir) / f"{a.out}.json"
    for r in range(a.repeats):
        for mode in (("alone", "beside") if r % 2 == 0 else ("beside", "alone")):
            with tempfile.TemporaryDirectory(prefix="triton-cache-") as cache:
                t = time.perf_counter()
                p = subprocess.run([sys.executable, __file__, "child", mode, a.ckpt, a.kv_dtype],
                                   env=dict(os.environ, TRITON_CACHE_DIR=cache), capture_output=True, text=True)
            lines = [ln for ln in p.stdout.splitlines() if ln.startswith("RECORD ")]
            if p.returncode or not lines:
                sys.stderr.write(p.stderr[-4000:])
                raise SystemExit(f"{mode}: the process failed ({p.returncode})")
            records.append({"benchmark": "load_beside_compile", "mode": mode, "repeat": r, "kv_dtype": a.kv_dtype,
                            **env, "triton": triton.__version__, "model": a.ckpt, "triton_cache": "empty",
                            **json.loads(lines[-1][len("RECORD "):]), "process_s": round(time.perf_counter() - t, 2)})
            write_records(out, records)
    print(format_table(records, ["mode", "repeat", "load_s", "precompile_wait_s", "precompile_s", "warmup_s",
                                 "ready_s"]))
    print(f"-> {out}")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    sub = ap.add_subparsers(dest="cmd", required=True)
    s = sub.add_parser("save")
    s.add_argument("--ckpt", required=True)
    s.add_argument("--tokenizer", required=True, help="a tokenizer folder, copied beside the weights")
    s.add_argument("--model", default="llama-3.1-8b", help="a shape of lazy_rag.bench.random_models")
    r = sub.add_parser("run")
    r.add_argument("--ckpt", required=True)
    r.add_argument("--repeats", type=int, default=3)
    r.add_argument("--kv-dtype", default="bf16")
    r.add_argument("--out", default="load_beside_compile")
    r.add_argument("--results-dir", default=str(ROOT / "benchmarks" / "results"))
    c = sub.add_parser("child")
    c.add_argument("mode", choices=("alone", "beside"))
    c.add_argument("ckpt")
    c.add_argument("kv_dtype")
    a = ap.parse_args(argv)
    if a.cmd == "child":
        print("RECORD " + json.dumps(child(a.mode, a.ckpt, a.kv_dtype)), flush=True)
    elif a.cmd == "save":
        save(a)
    else:
        run(a)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
