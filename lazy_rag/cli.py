"""The ``lazy-rag`` command: index a corpus, query it, inspect it."""
from __future__ import annotations

import json
import logging
import sys
from pathlib import Path
from typing import List, Optional

import typer
from rich.console import Console
from rich.markup import escape
from rich.table import Table

from .errors import LazyRagError
from .llm import MODES

app = typer.Typer(add_completion=False, no_args_is_help=True,
                  help="RAG over cached, position-free chunk KV (LazyAttention).")
out = Console()
err = Console(stderr=True)


def _fail(e: Exception) -> None:
    err.print(f"[bold red]error:[/] {escape(str(e))}", soft_wrap=True, highlight=False)
    raise typer.Exit(code=2)


def _quiet_libraries() -> None:
    import os

    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(message)s")
    for name in ("transformers", "sentence_transformers", "httpx"):
        logging.getLogger(name).setLevel(logging.ERROR)
    try:
        from transformers.utils import logging as hf_logging

        hf_logging.disable_progress_bar()
    except Exception:
        pass


def _human(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if n < 1024 or unit == "TiB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{int(n)} B"
        n /= 1024
    return str(n)


@app.command()
def index(
    sources: List[Path] = typer.Argument(..., help="Files or folders to index (.txt, .md)."),
    out_dir: Path = typer.Option(..., "--out", "-o", help="Index folder (created or updated)."),
    model: str = typer.Option("smollm2", help="Bundled name, HF folder, .gguf file or hub id."),
    device: str = typer.Option("auto", help="cpu, cuda, or auto (CUDA when present)."),
    chunk_size: int = typer.Option(256, help="Chunk size in model tokens."),
    chunk_overlap: int = typer.Option(32, help="Overlap between chunks in tokens."),
    shared_prefix: bool = typer.Option(False, help="Encode every chunk after the prompt's fixed head (attention sink)."),
    kv_dtype: str = typer.Option("auto", help="Stored KV dtype: auto (the model's), float32, bfloat16, float16."),
    boundary_recompute: int = typer.Option(0, help="Recompute each chunk's first N tokens at query time (EPIC)."),
    precompute: bool = typer.Option(True, help="Encode all chunk KV now (--no-precompute: on first retrieval)."),
):
    """Chunk, embed and precompute position-free KV for every chunk of SOURCES."""
    _quiet_libraries()
    from .index import LazyIndex

    try:
        idx, rep = LazyIndex.build([str(s) for s in sources], out_dir, model=model, device=device,
                                   chunk_size=chunk_size, chunk_overlap=chunk_overlap, shared_prefix=shared_prefix,
                                   kv_dtype=kv_dtype, progress=sys.stderr.isatty(), precompute_kv=precompute,
                                   boundary_recompute=boundary_recompute)
    except LazyRagError as e:
        _fail(e)
    skipped = ", ".join(f"{n} {why}" for why, n in sorted(rep.skipped.items())) or "none"
    out.print(f"Indexed {rep.files_indexed} file(s), {rep.files_unchanged} unchanged, {rep.files_removed} removed; "
              f"skipped: {skipped}.")
    out.print(f"{rep.chunks_total} chunks ({rep.chunks_added} new), {rep.tokens_total} tokens, "
              f"{_human(rep.kv_bytes_written)} of KV written in {rep.seconds:.1f} s -> {out_dir}")


@app.command()
def query(
    index_dir: Path = typer.Argument(..., help="An index folder made by `lazy-rag index`."),
    question: str = typer.Argument(..., help="The question to answer."),
    mode: str = typer.Option("lazy", help=f"KV reuse mode: {', '.join(MODES)}."),
    top_k: int = typer.Option(4, help="Chunks to retrieve."),
    max_new_tokens: int = typer.Option(128, help="Most tokens to generate."),
    temperature: float = typer.Option(0.0, help="0 = greedy."),
    model: Optional[str] = typer.Option(None, help="Override the model recorded in the index."),
    device: str = typer.Option("auto", help="cpu, cuda, or auto."),
    boundary_recompute: Optional[int] = typer.Option(None, help="Override the index's boundary recompute."),
    as_json: bool = typer.Option(False, "--json", help="Print one JSON object with answer, sources, stats."),
):
    """Answer QUESTION from the index, streaming the answer, then sources and TTFT."""
    _quiet_libraries()
    from .index import LazyIndex
    from .llm import LazyLLM

    if mode not in MODES:
        _fail(LazyRagError(f"Unknown mode {mode!r}; choose one of {', '.join(MODES)}."))
    try:
        llm = LazyLLM.from_pretrained(model, device=device) if model else None
        idx = LazyIndex.load(index_dir, llm=llm, device=device)
        if as_json:
            res = idx.query(question, top_k=top_k, mode=mode, max_new_tokens=max_new_tokens, temperature=temperature,
                            boundary_recompute=boundary_recompute)
            print(json.dumps(res.as_dict(), ensure_ascii=False))
            return
        sources, stream = idx.query(question, top_k=top_k, mode=mode, max_new_tokens=max_new_tokens,
                                    temperature=temperature, stream=True, boundary_recompute=boundary_recompute)
        for piece in stream:
            out.print(piece, end="", markup=False, highlight=False, soft_wrap=True)
        out.print()
    except LazyRagError as e:
        _fail(e)
    stats = stream.result.stats
    table = Table(title="Sources", show_lines=False)
    table.add_column("#"), table.add_column("score"), table.add_column("source"), table.add_column("chunk")
    for i, s in enumerate(sources, 1):
        table.add_row(str(i), f"{s.score:.3f}", s.source, s.chunk_id)
    out.print(table)
    out.print(f"TTFT {stats.ttft_ms:.0f} ms ({mode}) | prompt {stats.prompt_tokens} tokens: {stats.cached_tokens} "
              f"from cache, {stats.computed_tokens} computed | {stats.new_tokens} new tokens, "
              f"{stats.decode_tokens_per_s:.1f} tok/s")


@app.command()
def inspect(index_dir: Path = typer.Argument(..., help="An index folder."),
            as_json: bool = typer.Option(False, "--json", help="Print JSON.")):
    """Show an index's chunks, tokens, KV bytes and fingerprint (no model is loaded)."""
    _quiet_libraries()
    from .index import describe_index

    try:
        info = describe_index(index_dir)
    except LazyRagError as e:
        _fail(e)
    if as_json:
        print(json.dumps(info, indent=2))
        return
    t = Table(show_header=False)
    for k, v in info.items():
        if k == "kv_bytes":
            v = f"{_human(v)} ({v} bytes)"
        t.add_row(k, json.dumps(v) if isinstance(v, dict) else str(v))
    out.print(t)


@app.command()
def models():
    """List the bundled offline models and whether their packages are installed."""
    from .models import BUNDLED, _package_dir, install_command

    t = Table("name", "model", "installed", "install with")
    for name, m in BUNDLED.items():
        ok = all(_package_dir(mod) is not None for mod, _ in m.parts)
        t.add_row(name, m.description, "yes" if ok else "no", "" if ok else install_command(name))
    out.print(t)


eval_app = typer.Typer(no_args_is_help=True, help="Measure answer quality of KV reuse.")
app.add_typer(eval_app, name="eval")


@eval_app.command("squad")
def eval_squad(
    model: str = typer.Option("qwen2.5-0.5b", help="Model to evaluate (bundled name, folder, .gguf)."),
    configs: str = typer.Option("full,block,lazy,lazy+sink,lazy+epic16",
                                help="Comma-separated MODE[+sink][+epicN] configurations; full always runs."),
    n: int = typer.Option(200, help="Questions (seeded sample of the 10,570)."),
    k: int = typer.Option(4, "--top-k", "-k", help="Paragraphs retrieved per question."),
    seed: int = typer.Option(0, help="Sampling seed for the questions."),
    max_new_tokens: int = typer.Option(24, help="Most tokens per answer."),
    squad: Optional[Path] = typer.Option(None, help="squad_v1.1 dev JSON (default: ../shared/data or $LAZY_RAG_SQUAD)."),
    fetch: bool = typer.Option(False, help="If the data is missing, extract it from the bigbench sdist on PyPI."),
    device: str = typer.Option("auto", help="cpu, cuda, or auto."),
    dtype: str = typer.Option("auto", help="auto, float32, bfloat16."),
    results: Path = typer.Option(Path("benchmarks/results"), help="Where to write the JSON records."),
    quality_md: Optional[Path] = typer.Option(Path("QUALITY.md"), help="Markdown file to update (or '' for none)."),
):
    """Open-retrieval SQuAD v1.1: EM/F1 of lazy reuse (and mitigations) against full re-encoding."""
    _quiet_libraries()
    from .quality import markdown_table, run_squad_eval, write_report

    try:
        summary, answers = run_squad_eval(model=model, configs=[c.strip() for c in configs.split(",") if c.strip()],
                                          n=n, k=k, seed=seed, max_new_tokens=max_new_tokens, squad=squad,
                                          fetch=fetch, device=device, dtype=dtype, progress=sys.stderr.isatty())
    except LazyRagError as e:
        _fail(e)
    path = write_report(summary, answers, results, quality_md if quality_md and str(quality_md) else None)
    print(markdown_table(summary))
    out.print(f"records -> {path}")


bench_app = typer.Typer(help="Serving benchmark: every mode and plain transformers over request rates and KV budgets.")
app.add_typer(bench_app, name="bench")


def _bench_help(name: str) -> str:
    from .bench.command import HELP

    return HELP[name]


@bench_app.callback(invoke_without_command=True)
def bench(
    ctx: typer.Context,
    model: Optional[str] = typer.Option(None, help=_bench_help("model")),
    random_weights: Optional[str] = typer.Option(None, help=_bench_help("random_weights")),
    device: str = typer.Option("auto", help=_bench_help("device")),
    dtype: str = typer.Option("auto", help=_bench_help("dtype")),
    docs: Optional[int] = typer.Option(None, help=_bench_help("docs")),
    doc_tokens: Optional[int] = typer.Option(None, help=_bench_help("doc_tokens")),
    k: Optional[int] = typer.Option(None, help=_bench_help("k")),
    question_tokens: Optional[int] = typer.Option(None, help=_bench_help("question_tokens")),
    output_tokens: Optional[int] = typer.Option(None, help=_bench_help("output_tokens")),
    requests: Optional[int] = typer.Option(None, help=_bench_help("requests")),
    hf_requests: Optional[int] = typer.Option(None, help=_bench_help("hf_requests")),
    popularity: str = typer.Option("zipf", help=_bench_help("popularity")),
    zipf_a: float = typer.Option(2.1, help=_bench_help("zipf_a")),
    rates: Optional[str] = typer.Option(None, help=_bench_help("rates")),
    budgets: Optional[str] = typer.Option(None, help=_bench_help("budgets")),
    systems: str = typer.Option("lazy,block,prefix,full,transformers", help=_bench_help("systems")),
    page_size: int = typer.Option(64, help=_bench_help("page_size")),
    max_num_seqs: Optional[int] = typer.Option(None, help=_bench_help("max_num_seqs")),
    max_batched_tokens: int = typer.Option(16384, help=_bench_help("max_batched_tokens")),
    host_gb: Optional[float] = typer.Option(None, help=_bench_help("host_gb")),
    seed: int = typer.Option(0, help=_bench_help("seed")),
    out_name: Optional[str] = typer.Option(None, "--out", help=_bench_help("out")),
    results_dir: Path = typer.Option(Path("benchmarks/results"), help=_bench_help("results_dir")),
    plots: bool = typer.Option(True, help=_bench_help("plots")),
    as_json: bool = typer.Option(False, "--json", help=_bench_help("as_json")),
    progress: str = typer.Option("auto", help=_bench_help("progress")),
):
    """Serve the paper's RAG workload (CPU: a small SmolLM2 variant) in every mode; write JSON
    records and PNG plots to benchmarks/results/ and print a summary table."""
    if ctx.invoked_subcommand is not None:
        return
    _quiet_libraries()
    from .bench.command import run_command

    try:
        run_command(model=model, random_weights=random_weights, device=device, dtype=dtype, docs=docs,
                    doc_tokens=doc_tokens, k=k, question_tokens=question_tokens, output_tokens=output_tokens,
                    requests=requests, hf_requests=hf_requests, popularity=popularity, zipf_a=zipf_a, rates=rates,
                    budgets=budgets, systems=systems, page_size=page_size, max_num_seqs=max_num_seqs,
                    max_batched_tokens=max_batched_tokens, host_gb=host_gb, seed=seed, out=out_name,
                    results_dir=results_dir, plots=plots, as_json=as_json, progress=progress)
    except LazyRagError as e:
        _fail(e)


@bench_app.command("plot")
def bench_plot(results_json: List[Path] = typer.Argument(..., help="Results file(s) written by `lazy-rag bench`; "
                                                                   "several (a sweep run in pieces) are concatenated."),
               out_dir: Optional[Path] = typer.Option(None, help="Where to write the PNGs (default: beside the first JSON)."),
               name: Optional[str] = typer.Option(None, help="PNG name prefix (default: the first JSON's name).")):
    """Make the PNG plots of existing results (e.g. measured on a machine without matplotlib)."""
    from .bench.command import plot_command

    try:
        for p in plot_command(results_json, out_dir, name):
            out.print(f"plot -> {p}")
    except LazyRagError as e:
        _fail(e)


if __name__ == "__main__":
    app()
