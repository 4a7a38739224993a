"""``lazy-rag index --dry-run``: what a build would cost (chunks, tokens, bytes, time) before any of it.

Nothing is written to the index folder. The corpus is measured, not encoded:
- chunks and tokens: the files are found as a build finds them; a seeded sample of them (all of
  them when the corpus is under ``SAMPLE_BYTES``) is read and chunked exactly as the build would,
  and the rest is extrapolated by file size (tokens per byte and tokens per chunk of the sample);
- bytes: the KV per token of this model in the stored dtype (fp8: half, plus one fp16 scale per
  token, KV head and layer for K and V; int4: codes two a byte plus fp16 scales and zeros per
  group, ``kv_int4.bytes_per_token``), the chunk wrapper's slots, the vectors;
- time: the pipeline's stages overlap (build_pipeline), so the KV stage takes the longer of
  encoding (a timed probe encode on this device) and writing (a timed, fsync'ed probe write of
  ``PROBE_WRITE_BYTES`` in the index folder's file system); embedding (a timed probe batch) and
  chunking (timed on the sample) come before it.
"""
from __future__ import annotations

import os
import random
import shutil
import tempfile
import time
from pathlib import Path

import torch

from .chunking import CHUNK_OVERLAP, CHUNK_SIZE, TokenChunker, discover_files
from .documents import read_text
from . import kv_int4
from .kv_record import INT4, check_kv_dtype, kv_dtype_named

SAMPLE_BYTES = 4 << 20
PROBE_WRITE_BYTES = 256 << 20
PROBE_CHUNKS, PROBE_TOKENS = 8, 256


def kv_bytes_per_token(llm, kv_dtype) -> float:
    """Stored KV bytes per token (K and V over every layer and KV head). ``kv_dtype``: a name
    (``kv_record.KV_DTYPE_NAMES``' or a dtype's, auto: the model's) or a torch dtype (None: the
    model's, as ``ChunkStore.kv_dtype``)."""
    s = llm.shape
    elems = s.kv_bytes_per_token  # 2 * layers * kv heads * head_dim
    dtype = kv_dtype_named(kv_dtype, llm.dtype) if isinstance(kv_dtype, str) else kv_dtype or llm.dtype
    if dtype is None:
        raise KeyError(f"unknown KV dtype {kv_dtype!r}")
    if dtype == torch.float8_e4m3fn:
        return elems + 2 * s.num_layers * s.num_kv_heads * 2  # fp8 values + one fp16 scale per row
    if dtype == INT4:  # codes two a byte + fp16 scales and zeros per group (whole key groups)
        return kv_int4.bytes_per_token(s.num_layers, s.num_kv_heads, s.head_dim)
    return elems * dtype.itemsize


def write_bandwidth(folder: Path, nbytes: int = PROBE_WRITE_BYTES, block: int = 16 << 20) -> float:
    """Sequential write bandwidth (bytes/s, fsync included) of ``folder``'s file system."""
    folder.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=folder, prefix=".write-probe.", suffix=".tmp")
    buf = os.urandom(block)
    try:
        t0 = time.perf_counter()
        with os.fdopen(fd, "wb") as f:
            for _ in range(max(1, nbytes // block)):
                f.write(buf)
            f.flush()
            os.fsync(f.fileno())
        return nbytes / (time.perf_counter() - t0)
    finally:
        Path(tmp).unlink(missing_ok=True)


def encode_rate(llm) -> float:
    """Tokens/s of the build's encode on this device (a warm-up, then a timed probe batch)."""
    chunks = [[(17 * i + j) % 1000 + 10 for j in range(PROBE_TOKENS)] for i in range(PROBE_CHUNKS)]
    llm.engine.encode_chunks(chunks, cache=False)
    t0 = time.perf_counter()
    llm.engine.encode_chunks(chunks, cache=False)
    return PROBE_CHUNKS * PROBE_TOKENS / (time.perf_counter() - t0)


def embed_rate(embedder, texts: list[str]) -> float:
    """Chunks/s of the embedder (a timed probe batch of sample chunk texts)."""
    texts = (texts * 64)[:64] or ["a sentence to embed"] * 64
    embedder.encode(texts[:8])
    t0 = time.perf_counter()
    embedder.encode(texts)
    return len(texts) / (time.perf_counter() - t0)


def estimate_build(sources, out: Path, llm, *, chunk_size: int = CHUNK_SIZE, chunk_overlap: int = CHUNK_OVERLAP,
                   kv_dtype: str = "auto", wrapper_slots: int = 0, embedder=None, seed: int = 0,
                   encoding: str | None = None) -> dict:
    """The estimate as a flat dict (see the module docstring); ``encoding``: that of text files
    that are not UTF-8 (None: detected)."""
    check_kv_dtype(kv_dtype)  # (a name that means no dtype: the build's error, not a KeyError)
    files, skipped = discover_files(sources)
    sizes = {f: f.stat().st_size for f in files}
    total_bytes = sum(sizes.values())
    order = list(files)
    random.Random(seed).shuffle(order)
    chunker = TokenChunker(llm.tokenizer, chunk_size, chunk_overlap)
    sample_bytes = sample_tokens = sample_chunks = sampled = 0
    sample_texts: list[str] = []
    unreadable = 0
    t0 = time.perf_counter()
    for f in order:
        if sample_bytes >= SAMPLE_BYTES:
            break
        text = read_text(f, encoding).text
        sample_bytes += sizes[f]
        sampled += 1
        if text is None:
            unreadable += 1
            continue
        parts = chunker.split(text)
        sample_chunks += len(parts)
        sample_tokens += sum(len(ids) for _, ids in parts)
        sample_texts += [t for t, _ in parts[:2]]
    chunk_s = time.perf_counter() - t0
    scale = total_bytes / sample_bytes if sample_bytes else 0.0
    tokens = round(sample_tokens * scale)
    chunks = round(sample_chunks * scale)
    per_token = kv_bytes_per_token(llm, kv_dtype)
    kv_bytes = round((tokens + chunks * wrapper_slots) * per_token)
    vec_bytes = chunks * (embedder.dim if embedder is not None else 0) * 4
    out = Path(out).expanduser()
    probe_dir = out if out.exists() else next(p for p in out.parents if p.exists())
    w_bps = write_bandwidth(probe_dir)
    e_tps = encode_rate(llm)
    emb_cps = embed_rate(embedder, sample_texts) if embedder is not None else None
    kv_s = max(tokens / e_tps, kv_bytes / w_bps)
    embed_s = chunks / emb_cps if emb_cps else 0.0
    chunking_s = chunk_s * scale
    free = shutil.disk_usage(probe_dir).free
    return {
        "files": len(files), "files_skipped": len(skipped), "source_bytes": total_bytes,
        "sampled_files": sampled, "sample_bytes": sample_bytes,
        "exact": sample_bytes >= total_bytes, "chunks": chunks, "tokens": tokens,
        "kv_dtype": kv_dtype, "kv_bytes_per_token": round(per_token, 1), "kv_bytes": kv_bytes,
        "vector_bytes": vec_bytes, "disk_free_bytes": free, "fits_on_disk": kv_bytes + vec_bytes < free * 0.95,
        "encode_tokens_per_s": round(e_tps, 1), "write_bytes_per_s": round(w_bps, 1),
        "embed_chunks_per_s": None if emb_cps is None else round(emb_cps, 1),
        "bound": "write" if kv_bytes / w_bps > tokens / e_tps else "encode",
        "chunking_s": round(chunking_s, 1), "embedding_s": round(embed_s, 1), "kv_s": round(kv_s, 1),
        "total_s": round(chunking_s + embed_s + kv_s, 1), "device": str(llm.device),
    }
