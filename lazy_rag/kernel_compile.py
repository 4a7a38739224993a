"""``lazy-rag compile``: a model's GPU kernels compiled into Triton's cache on disk ahead of the
machine's first build and first query, so that neither pays Triton's compile: once per machine,
or once per cache folder where machines of one GPU architecture share one (a volume, or an image
made on such a machine).

Triton compiles a kernel variant on its first launch in a process and keeps it in its cache on
disk (``triton.knobs.cache.dir``: ``TRITON_CACHE_DIR``, else under ``TRITON_HOME`` or ~/.triton);
every later process with the same Triton, GPU architecture and kernel source loads it from there.
A machine's first index build compiles the encode's attention kernel (~2.5 s on an H100) and
Triton's one-time setup (~1 s) while the disk it writes to waits, and its encode calibration's
kernels beside its writes: on the 8B shape that kept most first builds under 70% of the disk's write
bandwidth, against 74-106% for a machine's second build (BENCHMARKS.md, "The 8B build against the
disk's write bandwidth"). Compiling inside the build's own process, beside the model's load, gains
nothing: the compile and the load take turns.

A compiled variant depends on the attention's shape (heads, KV heads, head dim, RoPE), the model's
dtype, the pool's and the store's KV dtype and the page size, never on the number of layers, the
vocabulary or the weights. So this builds a one-layer model of the checkpoint's config (a layer per
layer kind: Gemma 2's sliding layers launch windowed variants) with random
weights (the config alone is read: no weights are loaded, and a random-weights architecture,
``random:NAME``, works as well) and runs on it what a build and a query run:

- per stored KV dtype, builds into temporary indexes as ``lazy-rag index`` builds (its encode
  warm-up, batches and writer; fp8 quantised on the GPU): three short chunks, then 64 of up to
  256 tokens (lengths varied: Triton also specialises on integer arguments' divisibility by 16);
- the encode calibration a build runs for the read-or-encode choice of cold queries (its fit is
  not kept: it would be a one-layer model's);
- per pool dtype (the model's, and fp8 pages where fp8 is asked for) and index, one-sequence lazy
  queries over contexts of 256 to 16k tokens whose chunks are read from the store, encoded in the
  query's prefill instead (a cold chunk's two paths) or found in the pool, with questions of
  every prefill token bucket up to 512 (``CONTEXT_CHUNKS``, ``QUESTION_TOKENS``: a prefill's tile
  and launch settings follow its new tokens, its and the decode's split count its context), each
  decoding through the engine's CUDA graphs; then 16 requests at once.

Not covered, so possibly still compiled on first use: builds with ``--shared-prefix``, contexts
past 16k tokens, and batches whose kernel settings differ from these. For the 8B shape,
BENCHMARKS.md ("A machine's first build and queries") lists what a build and a query compiled
after this command. On a CPU there is nothing to compile: the CPU runs torch's kernels, and this
says so.
"""
from __future__ import annotations

import contextlib
import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace

from .random_models import IdTokenizer
from .chunking import CHUNK_SIZE
from .errors import LazyRagError

# the one-layer model's vocabulary: the steps' token ids are small, and the lm_head of a large
# vocabulary would only take memory and time (no Triton kernel depends on its size)
COMPILE_VOCAB = 256
# the steps' index: chunks of up to the default chunk size, as many as the longest context below
# (and a build of three shorter ones)
CHUNK_TOKENS, SHORT_CHUNK_TOKENS, NEW_TOKENS = CHUNK_SIZE, (131, 144, 157), 4
# a query's prompt: a head before its chunks (a chat template's, with the instruction) and a
# question after them. Its new tokens pick the prefill kernel's tile and launch settings
# (kernels.prefill.runs_rows, prefill_runs.default_tuning) and its context the split count of the
# prefill and the decode (the merge kernel's SP): so queries over 1 to 64 chunks (256 to 16k
# tokens) read from the store, each with a question at every token bucket of the engine's prefill
# graphs from 32 to 512 new tokens (cuda_graphs.TOKEN_BUCKETS); over 1 to 16 chunks encoded in
# the query's prefill instead; and found in the pool, each of these with a short and a long question
HEAD_TOKENS = 24
QUESTION_TOKENS = tuple(b - HEAD_TOKENS for b in (32, 48, 64, 96, 128, 192, 256, 384, 512))
SHORT_LONG = (QUESTION_TOKENS[0], QUESTION_TOKENS[4])
CONTEXT_CHUNKS, ENCODED_CHUNKS = (1, 4, 16, 64), (1, 4, 16)
BATCH_REQUESTS = 16
# each engine's GPU pool: a few thousand pages of the one-layer model (no kernel variant depends on
# the pool's size), so that the second engine (fp8 pages) finds memory beside the first
COMPILE_POOL_BYTES = 1 << 30


@dataclass
class CompileStep:
    name: str
    seconds: float
    cache_entries_added: int
    # the kernel variants compiled (not found in Triton's cache on disk): name, launch options,
    # upper-case constexprs and value specialisations (``_variant_name``)
    variants: list[str] = field(default_factory=list)


@dataclass
class CompileReport:
    model: str
    device: str
    cache_dir: str
    cache_entries_before: int
    steps: list[CompileStep] = field(default_factory=list)

    @property
    def seconds(self) -> float:
        return sum(s.seconds for s in self.steps)

    @property
    def cache_entries_added(self) -> int:
        return sum(s.cache_entries_added for s in self.steps)


def triton_cache_dir() -> Path:
    """Triton's cache folder, as Triton itself resolves it (``TRITON_CACHE_DIR``, ``TRITON_HOME``)."""
    import triton

    return Path(triton.knobs.cache.dir)


def writable_cache_dir() -> Path:
    """Triton's cache folder, created if missing; an error that names it and the fix when it
    cannot be written (the compile would otherwise fail inside Triton, or fill nothing)."""
    folder = triton_cache_dir()
    try:
        folder.mkdir(parents=True, exist_ok=True)
        probe = folder / f".lazy-rag-write-probe-{os.getpid()}"
        probe.write_bytes(b"")
        probe.unlink()
    except OSError as e:
        raise LazyRagError(f"Triton's cache folder {folder} cannot be written ({e.strerror or e}); set "
                           "TRITON_CACHE_DIR to a writable folder (the same one the builds and queries will "
                           "use).") from e
    return folder


def triton_cache_entries() -> int:
    """Entries in Triton's cache on disk: a folder per kernel variant, launcher or helper library."""
    folder = triton_cache_dir()
    return sum(1 for _ in folder.iterdir()) if folder.is_dir() else 0


def one_layer_config(config):
    """A copy of ``config`` with one decoder layer per layer kind (one for most models; Gemma 2's
    global and sliding layers launch the kernels with and without a window, two variants) and a
    small vocabulary: the same attention (heads, KV heads, head dim, RoPE, windows, soft-cap) as
    the model's, so the same kernel variants."""
    cfg = config.__class__.from_dict(config.to_dict())
    kinds = list(dict.fromkeys(getattr(cfg, "layer_types", None) or []))
    cfg.num_hidden_layers = max(1, len(kinds))
    if kinds:
        cfg.layer_types = kinds
    cfg.vocab_size = COMPILE_VOCAB
    cfg.pad_token_id = None   # an embedding's padding row must lie inside the smaller vocabulary
    return cfg


def model_config(name_or_path: str):
    """The config of a bundled name, HF folder, .gguf file or hub id (what ``lazy-rag index
    --model`` takes), or of ``random:NAME`` (``random_models``), checked as the index's
    load checks it."""
    from .architecture import check_supported

    if name_or_path.startswith("random:"):
        from .random_models import random_config

        config = random_config(name_or_path.split(":", 1)[1])
    else:
        from transformers import AutoConfig

        from .models import resolve_model_path

        config = AutoConfig.from_pretrained(str(resolve_model_path(name_or_path)))
    check_supported(config)
    return config


def one_layer_model(config, device, dtype):
    """A one-layer model of ``config`` (``one_layer_config``) with random weights, created on
    ``device`` in ``dtype``."""
    import torch
    from transformers import AutoModelForCausalLM

    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            return AutoModelForCausalLM.from_config(one_layer_config(config)).eval()
    finally:
        torch.set_default_dtype(previous)


def _variant_name(fn, compile: dict) -> str:
    """A variant as ``kernel[warps, stages](CONSTEXPRS; =1: args; /16: args)``: the upper-case
    constexprs, then the arguments Triton specialised on their value (integers equal to 1,
    integers and pointers divisible by 16), which tell two variants of the same settings apart."""
    names = [p.name for p in fn.jit_function.params]
    consts = ", ".join(f"{names[k[0]]}={v}" for k, v in compile["constants"].items()
                       if len(k) == 1 and names[k[0]].isupper() and isinstance(v, (bool, int, str)))
    ones = " ".join(names[k[0]] for k, v in compile["constants"].items()
                    if len(k) == 1 and not names[k[0]].isupper() and v == 1 and not isinstance(v, bool))
    attrs = (compile.get("configs") or [{}])[0]
    div16 = " ".join(names[k[0]] for k, v in attrs.items()
                     if len(k) == 1 and any(a and a[0] == "tt.divisibility" for a in v))
    return (f"{fn.name}[warps {compile['num_warps']}, stages {compile['num_stages']}]({consts}"
            f"; =1: {ones or '-'}; /16: {div16 or '-'})")


@contextlib.contextmanager
def compiled_variants():
    """The kernel variants Triton compiles inside the block, as a list filled as they are
    (``_variant_name``): a variant counts when its launch added an entry to Triton's cache on disk,
    not when it was loaded from there. Triton's jit hooks (``triton.knobs.runtime``), the previous
    ones chained and put back after."""
    import triton

    rt = triton.knobs.runtime
    found, before = [], {}
    ahead_was, after_was = rt.jit_cache_hook, rt.jit_post_compile_hook

    def ahead(*, key, **kw):
        before[key] = triton_cache_entries()
        return ahead_was(key=key, **kw) if ahead_was else False

    def after(*, key, fn, compile, **kw):
        if triton_cache_entries() > before.pop(key, 1 << 62):
            found.append(_variant_name(fn, compile))
        if after_was:
            after_was(key=key, fn=fn, compile=compile, **kw)

    rt.jit_cache_hook, rt.jit_post_compile_hook = ahead, after
    try:
        yield found
    finally:
        rt.jit_cache_hook, rt.jit_post_compile_hook = ahead_was, after_was


@contextlib.contextmanager
def _calibration_not_kept():
    """The encode calibration measured, never kept nor read: a one-layer model's fit is nobody's
    (and a kept fit of this shape would skip the probes whose kernels this compiles)."""
    from .engine.read_or_encode import CALIBRATION_ENV

    before = os.environ.get(CALIBRATION_ENV)
    os.environ[CALIBRATION_ENV] = "off"
    try:
        yield
    finally:
        if before is None:
            os.environ.pop(CALIBRATION_ENV, None)
        else:
            os.environ[CALIBRATION_ENV] = before


def parse_kv_dtypes(text: str, model_dtype) -> list:
    """``--kv-dtype``'s comma list (auto, or a store's names: fp8, bf16, ...) as torch dtypes,
    without repeats."""
    from .kv_record import INT4, KV_DTYPE_NAMES, kv_dtype_named

    out = []
    for name in (n.strip() for n in text.split(",")):
        if not name:
            continue
        dt = kv_dtype_named(name, model_dtype)
        if dt is None:
            raise LazyRagError(f"Unknown KV dtype {name!r} in --kv-dtype {text!r}; choose from auto, "
                               f"{', '.join(KV_DTYPE_NAMES)}, comma-separated (e.g. auto,fp8).")
        if dt is INT4:  # int4 is a storage format: its chunks are dequantised into the model's pool dtype
            dt = model_dtype
        if dt not in out:
            out.append(dt)
    if not out:
        raise LazyRagError(f"--kv-dtype {text!r} names no KV dtype; e.g. auto,fp8.")
    return out


class _NumberTokenizer(IdTokenizer):
    """Text of whitespace-separated token ids, for the steps' own build (``LazyIndex.from_texts``
    tokenizes its texts): the one-layer model has no tokenizer of its own."""

    def __call__(self, text, add_special_tokens=False):
        return SimpleNamespace(input_ids=[int(w) % COMPILE_VOCAB for w in text.split()])


def run_steps(llm, kv_dtypes, step=None, *, contexts=CONTEXT_CHUNKS, encoded=ENCODED_CHUNKS,
              questions=QUESTION_TOKENS, short_long=SHORT_LONG) -> None:
    """What a build and its queries run, on ``llm`` (module docstring): ``step(name, fn)`` runs
    and times each (default: just runs it). A step that fails raises: a kernel that does not
    compile here would fail the build the same way.

    Per stored KV dtype, a build of three chunks and one of 64 into temporary indexes, as
    ``lazy-rag index`` builds (its encode warm-up, batches, writer; fp8 quantised on the GPU); the encode
    calibration; then, per pool dtype (the model's, and fp8 where asked for), queries over each
    index's chunks (``runs``: read from the store, encoded in the query's prefill instead, the
    engine's two paths for a cold chunk, and from the pool), and a batch of requests."""
    import tempfile

    from .index import LazyIndex
    from .kernels import FP8
    from .llm import LazyLLM
    from .segments import Chunk

    step = step or (lambda name, fn: fn())
    def texts(lengths):
        return [" ".join(str(2 + (7 * i + j) % 97) for j in range(n)) for i, n in enumerate(lengths)]

    # Triton specialises a kernel on its integer arguments' values (divisible by 16, equal to 1);
    # the attention kernels' per-split counts no longer are (their decorators), the other
    # arguments still may be, so the chunks' lengths vary: three short ones of their own build
    # (what the GPU test checked first), then the queries' index of 64, 256 tokens and less
    short = texts(SHORT_CHUNK_TOKENS)
    full = texts([CHUNK_TOKENS - (13 * i) % 32 for i in range(max(contexts))])
    with tempfile.TemporaryDirectory(prefix="lazy-rag-compile-") as tmp, _calibration_not_kept():
        indexes = {}
        for kv in kv_dtypes:
            def build(kv=kv):
                for name, chunks in (("short", short), ("full", full)):
                    idx = LazyIndex.from_texts(chunks, Path(tmp) / f"{_name(kv)}-{name}", llm=llm, vectors=False,
                                               split=False, kv_dtype=_name(kv), progress=False)
                    if name == "short":
                        idx.close()
                indexes[kv] = idx
            step(f"build, {_name(kv)} KV", build)
        step("build encode calibration", llm.engine.calibrate_read_or_encode)

        pools = [llm]
        if FP8 in kv_dtypes and llm.dtype != FP8:
            fp8_pool = llm.engine_config.with_options(kv_dtype="fp8")
            pools.append(LazyLLM(llm.model, llm.tokenizer, engine_config=fp8_pool))
        def prompt(idx, chunks, question_tokens):
            return [[5] * HEAD_TOKENS, *(Chunk(r.token_ids, chunk_id=r.id) for r in list(idx.records)[:chunks]),
                    [6] * question_tokens]

        runs = ([(k, n, "read") for k in contexts for n in questions]
                + [(k, n, "encode") for k in encoded for n in short_long]
                + [(k, n, "warm") for k in contexts for n in short_long])

        try:
            for pool in pools:
                for kv, idx in indexes.items():
                    def query(pool=pool, idx=idx):
                        for k, n, path in runs:   # cold from the store, cold re-encoded, warm
                            if path == "encode" and idx.store.kv_format:
                                continue   # stored quantised KV is always read (chunk_tiers)
                            pool.engine.clear_cache()
                            with pool.engine.planner.chooser.forcing(encode=path == "encode"):
                                for _ in range(2 if path == "warm" else 1):   # (the second finds them)
                                    pool.generate(prompt(idx, k, n), max_new_tokens=NEW_TOKENS,
                                                  source=idx.chunk_source)
                    step(f"query, {_name(kv)} KV into {_name(pool.engine.pool.dtype)} pages", query)

                def batch(pool=pool, idx=next(iter(indexes.values()))):
                    handles = [pool.engine.submit(prompt(idx, min(4, max(contexts)), short_long[-1] + i),
                                                  max_new_tokens=NEW_TOKENS,
                                                  source=idx.chunk_source) for i in range(BATCH_REQUESTS)]
                    for h in handles:   # the first drain steps them all together
                        for _ in pool.engine.pieces(h):
                            pass
                step(f"{BATCH_REQUESTS} queries at once, {_name(pool.engine.pool.dtype)} pages", batch)
        finally:
            for idx in indexes.values():
                idx.close()


def _name(dtype) -> str:
    from .kv_record import KV_DTYPE_NAMES

    plain = str(dtype).removeprefix("torch.")
    return next((short for short, long in KV_DTYPE_NAMES.items() if long == plain), plain)


def compile_kernels(model: str, *, device: str = "auto", dtype: str = "auto", kv_dtype: str = "auto,fp8",
                    log_step=None) -> CompileReport:
    """Compile the GPU kernels that builds and queries of ``model`` run on ``device`` into
    Triton's cache on disk (module docstring); ``kv_dtype``: the stored KV dtypes to compile for,
    comma-separated. ``log_step(step)`` is told of each step as it ends."""
    import torch

    from .llm import LazyLLM
    from .models import resolve_device, resolve_dtype

    dev = resolve_device(device)
    if dev.type != "cuda":
        raise LazyRagError(f"Nothing to compile on {dev.type!r}: lazy-rag's Triton kernels run on CUDA GPUs, and "
                           "a CPU runs torch's kernels, which need no compile. Run `lazy-rag compile` on the GPU "
                           "machine that will build and query.")
    if not torch.cuda.is_available():
        raise LazyRagError("--device cuda, but torch sees no CUDA GPU here: run `lazy-rag compile` on the GPU "
                           "machine that will build and query.")
    dt = resolve_dtype(dtype, dev)
    kv_dtypes = parse_kv_dtypes(kv_dtype, dt)
    config = model_config(model)
    report = CompileReport(model=model, device=torch.cuda.get_device_name(dev), cache_dir=str(writable_cache_dir()),
                           cache_entries_before=triton_cache_entries())

    def step(name, fn):
        before, t0 = triton_cache_entries(), time.perf_counter()
        with compiled_variants() as variants:
            result = fn()
            torch.cuda.synchronize(dev)
        done = CompileStep(name, round(time.perf_counter() - t0, 3), triton_cache_entries() - before, variants)
        report.steps.append(done)
        if log_step is not None:
            log_step(done)
        return result

    llm = step("one-layer model of the config", lambda: LazyLLM(one_layer_model(config, dev, dt), _NumberTokenizer(),
                                                                  kv_bytes=COMPILE_POOL_BYTES))
    run_steps(llm, kv_dtypes, step)
    return report
