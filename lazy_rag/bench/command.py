"""The benchmark's command: option resolution, the run, the summary, the plots.

Shared by ``lazy-rag bench`` (typer, in ``lazy_rag.cli``) and ``benchmarks/serving.py`` (argparse:
the GPU image has neither typer nor rich). Options left at None take the preset's value
(``--preset``, ``defaults.PRESETS``), else the device's default (``defaults.GPU_DEFAULTS`` on CUDA,
``defaults.CPU_DEFAULTS`` on the CPU): an option given explicitly always wins.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from ..errors import LazyRagError
from .defaults import PRESETS, SYSTEMS, both, defaults_for, preset_values
from ..random_models import ARCHITECTURES
from .records import load_records

RESULTS_DIR = Path("benchmarks/results")

HELP = {
    "model": "Checkpoint: bundled name, HF folder, .gguf file or hub id (CPU default: smollm2).",
    "random_weights": f"Named architecture with random weights, built on the device ({', '.join(ARCHITECTURES)}; "
                      "CUDA default: llama-3.1-8b).",
    "device": "cpu, cuda, or auto (CUDA when present).",
    "dtype": "auto (bf16 on CUDA, fp32 on CPU), float32, bfloat16, float16.",
    "docs": f"Documents in the pool ({both('docs')}).",
    "doc_tokens": f"Tokens per document ({both('doc_tokens')}).",
    "k": f"Documents per request ({both('k')}).",
    "question_tokens": f"Question tokens per request ({both('question_tokens')}).",
    "output_tokens": f"Tokens generated per request ({both('output_tokens')}; fewer if the model emits EOS).",
    "requests": f"Requests per point ({both('requests')}).",
    "hf_requests": f"Requests per point for plain transformers, the first N of the same list ({both('hf_requests')}).",
    "popularity": f"How documents are drawn: zipf or uniform ({both('popularity')}).",
    "zipf_a": f"Zipf exponent ({both('zipf_a')}).",
    "rates": "Comma-separated arrival rates in requests/s (Poisson); 'offline' = all at once "
             f"({both('rates')}).",
    "budgets": "Comma-separated KV budgets: fraction of the documents whose KV fits the GPU pool, in (0, 1] "
               f"({both('budgets')}).",
    "systems": f"Comma-separated systems: {','.join(SYSTEMS)} (default: all).",
    "shared_chunks": "Comma-separated engine shared-chunk attention settings to compare: auto, on, off "
                     "(EngineConfig.shared_chunks). lazy runs once per setting; block, prefix and full share no "
                     f"chunk pages and run once, with the first ({both('shared_chunks')}).",
    "preset": f"A named workload ({', '.join(PRESETS)}): sets the options it names for the device "
              "(decode-shared: decode-heavy paper workload, lazy with and without shared-chunk grouping vs "
              "block, offline, budget 0.25); options given explicitly override it.",
    "page_size": "Engine KV page size in tokens.",
    "max_num_seqs": f"Engine: most requests running at once ({both('max_num_seqs')}).",
    "max_batched_tokens": "Engine: most tokens per step.",
    "tensor_parallel": "Engine: split the model over N ranks, one process (and on CUDA one GPU) each, each "
                       "loading its own share (default 1; not with the transformers system).",
    "host_gb": "Host tier size in GiB (default: every document's KV + 10%).",
    "seed": "Seed of the documents, requests and arrivals.",
    "out": f"Results name: <results-dir>/<out>.json and <out>_*.png ({both('out')}).",
    "results_dir": "Folder for the JSON records and PNG plots.",
    "plots": "Write PNG plots at the end (needs matplotlib; skipped with a note if it is missing).",
    "as_json": "Print the records as JSON instead of the summary table.",
    "progress": "Progress display: auto, rich, plain, off.",
}


def resolve_options(device: str, preset: str | None = None, **opts) -> dict:
    """Fill the options left at None from the preset's values, else the device's defaults; a given
    --model or --random-weights replaces the preset's or default model choice altogether."""
    from ..models import resolve_device

    dev = resolve_device(device)
    d = defaults_for(dev) | preset_values(preset, dev)
    if opts.get("model") or opts.get("random_weights"):
        d["model"] = d["random_weights"] = None
    return {k: (d.get(k) if v is None else v) for k, v in opts.items()} | {"device": str(dev)}


def run_command(*, preset=None, model=None, random_weights=None, device="auto", dtype="auto", docs=None,
                doc_tokens=None, k=None, question_tokens=None, output_tokens=None, requests=None, hf_requests=None,
                popularity=None, zipf_a=None, rates=None, budgets=None, systems=None, shared_chunks=None,
                page_size=64, max_num_seqs=None, max_batched_tokens=16384, tensor_parallel=1, host_gb=None, seed=0,
                out=None,
                results_dir=RESULTS_DIR, plots=True, as_json=False, progress="auto") -> list[dict]:
    from .runner import (BenchConfig, load_llm, parse_budgets, parse_rates, parse_shared_chunks, parse_systems,
                         run_bench, summary_table)
    from .workload import WorkloadSpec

    o = resolve_options(device, preset, model=model, random_weights=random_weights, docs=docs, doc_tokens=doc_tokens,
                        k=k, question_tokens=question_tokens, output_tokens=output_tokens, requests=requests,
                        hf_requests=hf_requests, popularity=popularity, zipf_a=zipf_a, rates=rates, budgets=budgets,
                        systems=systems, shared_chunks=shared_chunks, max_num_seqs=max_num_seqs, out=out)
    spec = WorkloadSpec(docs=o["docs"], doc_tokens=o["doc_tokens"], k=o["k"], question_tokens=o["question_tokens"],
                        output_tokens=o["output_tokens"], requests=o["requests"], popularity=o["popularity"],
                        zipf_a=o["zipf_a"], seed=seed)
    if host_gb is not None and not host_gb > 0:
        raise LazyRagError(f"--host-gb must be > 0 (got {host_gb}).")
    cfg = BenchConfig(spec=spec, rates=parse_rates(o["rates"]), budgets=parse_budgets(o["budgets"]),
                      systems=parse_systems(o["systems"]), shared_chunks=parse_shared_chunks(o["shared_chunks"]),
                      hf_requests=o["hf_requests"], page_size=page_size,
                      max_num_seqs=o["max_num_seqs"], max_batched_tokens=max_batched_tokens,
                      tensor_parallel=tensor_parallel,
                      host_bytes=None if host_gb is None else int(host_gb * (1 << 30))).validate()
    if not o["out"] or "/" in o["out"]:
        raise LazyRagError(f"--out {o['out']!r} must be a plain name (no folder): use --results-dir for the folder.")
    out_path = Path(results_dir) / f"{o['out']}.json"
    t0 = time.perf_counter()
    llm, label = load_llm(o["model"], o["random_weights"], o["device"], dtype, tensor_parallel)
    records = run_bench(llm, cfg, label, out_path, progress)
    took = time.perf_counter() - t0
    if as_json:
        print(json.dumps(records, indent=1))
    else:
        print(summary_table(records))
    print(f"{len(records)} records -> {out_path} ({took / 60:.1f} min, model load included)", file=sys.stderr)
    if plots:
        try:
            import matplotlib  # noqa: F401
        except ImportError:
            print(f"matplotlib is not installed: no plots (pip install matplotlib, then "
                  f"`lazy-rag bench plot {out_path}`).", file=sys.stderr)
        else:
            for p in plot_command(out_path):
                print(f"plot -> {p}", file=sys.stderr)
    return records


def plot_command(results_json, out_dir: Path | None = None, name: str | None = None) -> list[Path]:
    """PNG plots of one results file or several (e.g. a sweep run in pieces: their records are
    concatenated), written beside the first (or in out_dir), named after it (or ``name``)."""
    from .plots import plot_results

    paths = [Path(p) for p in ([results_json] if isinstance(results_json, (str, Path)) else results_json)]
    records = [r for p in paths for r in load_records(p)]
    return plot_results(records, out_dir or paths[0].parent, name or paths[0].stem)


def argparse_main(argv=None) -> int:
    """``python benchmarks/serving.py``: the same options as ``lazy-rag bench``."""
    ap = argparse.ArgumentParser(description="Serving benchmark: lazy, block, prefix, full and plain transformers "
                                             "over request rates and KV budgets.")
    ap.add_argument("--plot-only", type=Path, nargs="+", metavar="RESULTS_JSON",
                    help="Only make the PNGs of results file(s) (several: records concatenated; name: --out).")
    typed = {"docs": int, "doc_tokens": int, "k": int, "question_tokens": int, "output_tokens": int, "requests": int,
             "hf_requests": int, "page_size": int, "max_num_seqs": int, "max_batched_tokens": int,
             "tensor_parallel": int, "seed": int,
             "zipf_a": float, "host_gb": float, "results_dir": Path}
    # options missing here default to None: the preset's value or the device's default
    defaults = {"device": "auto", "dtype": "auto", "page_size": 64, "max_batched_tokens": 16384, "tensor_parallel": 1,
                "seed": 0,
                "results_dir": RESULTS_DIR, "progress": "auto"}
    for name, text in HELP.items():
        if name in ("plots", "as_json"):
            continue
        ap.add_argument("--" + name.replace("_", "-"), dest=name, type=typed.get(name, str),
                        default=defaults.get(name), help=text.replace("%", "%%"))
    ap.add_argument("--no-plots", dest="plots", action="store_false", help="Do not write PNG plots.")
    ap.add_argument("--json", dest="as_json", action="store_true", help=HELP["as_json"])
    args = vars(ap.parse_args(argv))
    try:
        plot_only = args.pop("plot_only")
        if plot_only is not None:
            for p in plot_command(plot_only, args["results_dir"] if args["results_dir"] != RESULTS_DIR else None,
                                  args["out"]):
                print(f"plot -> {p}")
            return 0
        run_command(**args)
    except LazyRagError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0
