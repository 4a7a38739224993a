"""Benchmark the lazy-RoPE attention kernels on the GPU (Llama-3.1-8B attention shape).

    python benchmarks/attention_kernels.py [--out DIR] [--quick] [--sweep [all|runs]]
                                           [--only decode|prefill|fp8]

Needs a CUDA device and the package installed (`pip install -e .`, as tests/kernels/run_gpu.sh
does). Shape: Llama-3.1-8B's attention (32 query heads, 8 KV heads, head dim 128, llama3 RoPE),
bf16, page size 64 (one KV head of a page is a 16 KiB contiguous run). Modes per case:
  lazy            lazy_decode / lazy_prefill, field `rope_mode` = rotate_q (chunk-local store,
                  query rotated once per chunk; the engine's)
  no_rope         the same kernel with rope_mode="none" on the same pages (keys taken as rotated)
  Prefill modes carry the kernel in their name, both timed on the same inputs: lazy_runs /
  no_rope_runs = kernels/prefill_runs.py (lazy_prefill's: runs of equal rot_shift, query
  rotated once per run), lazy_tiles / no_rope_tiles = the tiles kernel of paged_attention.py
  with several query rows per program (lazy_rag.bench.tiles_prefill). Field `kernel`.
  sdpa_contiguous torch SDPA decode over the same KV laid out contiguously, keys rotated
  block           Block-Attention (lazy_rag.bench.block_attention): fused gather + re-rotate
                  copy of an unrotated store (rope_mode rotate_k), then SDPA
Cases: decode (each sequence on its own permuted pages), decode_shared and prefill (Zipf-shared
2048-token chunks), decode_slot_pos / prefill_slot_pos (rotate_q on the shared case, field
`slot_pos`: "absent" = no explicit positions, "rows_-1" = explicit rows all -1, the kernel
variant that reads them with nothing changed, "hide20+compact" = 20% of every chunk page's
slots hidden and recomputed into a compact private run with explicit positions).
fp8 cases (benchmark decode_fp8 / prefill_fp8 / write_fp8, field `kv_dtype`; `--only fp8` runs
them alone): the same inputs in bf16 pages and in float8_e4m3fn pages with per-token fp16 scales
(kernels/kv_quant.py), rotate_q, timed side by side; `bytes` counts what each kernel actually
reads (fp8: head_dim + 2 bytes per token, KV head and tensor, 50.8% of bf16), so `gbps` is the
achieved bandwidth of each and `bw_vs_bf16` the fp8 record's gbps over its bf16 twin's (the
issue-24 target: decode >= 0.9), `speedup_vs_bf16` the time ratio. write_fp8: one layer's write
of a step's new tokens, bf16 indexed store vs the fused quantise-and-write kernel.
Every case also records the copy bandwidth and bf16 matmul rate measured in the same run;
`pct_of_copy_bw` = achieved bytes/s over that copy bandwidth, `pct_of_roofline` = the larger of
bytes/copy_bw and flops/matmul_rate over the measured time. Lazy records carry the compiled
kernel's registers, spills and shared memory. Small cases cycle over several disjoint input sets
inside one timed call so that the KV does not sit in L2. Times are medians of CUDA-graph replays
(triton.testing.do_bench_cudagraph). --sweep also times tuning variants (block_n, num_warps,
num_stages, split_target; block_m for prefill; for prefill both kernels: runs_sweep_sets).
Writes benchmarks/results/kernels_<device>.json (kernels_<device>_fp8.json with --only fp8; or
DIR/...): a JSON list of flat records.
"""
from __future__ import annotations

import argparse
import json
import time
from functools import partial
from pathlib import Path

RESULTS = Path(__file__).resolve().parent / "results"
DEVICE = "cuda"
PAGE, CHUNK = 64, 2048
DTYPE_NAME = "bfloat16"
L2_FLUSH_BYTES = 256 << 20
HIDE_FRACTION = 0.2      # slot_pos cases: share of each chunk page's slots hidden (recomputed)
TABLE_COLUMNS = ["benchmark", "case", "mode", "rope_mode", "kernel", "slot_pos", "kv_dtype",
                 "time_us", "gbps", "pct_of_copy_bw", "bw_vs_bf16", "tflops", "pct_of_roofline"]
PREFILL_KERNELS = ("runs", "tiles")   # lazy_prefill's, then tiles_prefill (prefill_fn)


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, default=RESULTS, help="results folder")
    ap.add_argument("--quick", action="store_true", help="fewer batches and contexts")
    ap.add_argument("--sweep", nargs="?", const="all", choices=("all", "runs"),
                    help="time tuning variants (records with benchmark *_sweep) before the cases; "
                         "`--sweep runs`: only the runs prefill kernel's")
    ap.add_argument("--only", choices=("decode", "prefill", "fp8", "shared"),
                    help="time only these cases (decode: decode, decode_shared and decode_slot_pos; "
                         "prefill: prefill and prefill_slot_pos; fp8: the fp8-vs-bf16 cases; shared: "
                         "decode_shared alone, Zipf and uniform, with shared_chunk_decode's tuning sweep)")
    return ap.parse_args(argv)


# --------------------------------------------------------------------------------------------
# Shape, inputs, timing
# --------------------------------------------------------------------------------------------

class Shape:
    """Llama-3.1-8B's attention shape and RoPE, from the package's named random architecture."""

    def __init__(self):
        import torch
        from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

        from lazy_rag.random_models import random_config

        cfg = random_config("llama-3.1-8b")
        self.H = cfg.num_attention_heads
        self.HKV = cfg.num_key_value_heads
        self.D = cfg.hidden_size // cfg.num_attention_heads
        self.dtype = getattr(torch, DTYPE_NAME)
        self.elem_bytes = torch.finfo(self.dtype).bits // 8
        self.token_kv_bytes = 2 * self.HKV * self.D * self.elem_bytes  # K and V, one layer
        inv, self.attention_scaling = ROPE_INIT_FUNCTIONS[cfg.rope_parameters["rope_type"]](
            cfg, DEVICE)
        self.inv_freq = inv.float().to(DEVICE)


def bench(fn, reps_inner=1):
    """Median microseconds per inner repetition: CUDA-graph replays, else plain events."""
    import torch
    from triton.testing import do_bench, do_bench_cudagraph

    fn()
    torch.cuda.synchronize()
    try:
        t = do_bench_cudagraph(fn, rep=60, return_mode="median")
        timer = "cudagraph"
    except Exception:  # noqa: BLE001  (capture failed: plain events)
        t = do_bench(fn, warmup=10, rep=60, return_mode="median")
        timer = "events"
    return t * 1e3 / reps_inner, timer


def measure_copy_gbps():
    import torch
    from triton.testing import do_bench

    x = torch.empty(1 << 30, dtype=torch.uint8, device=DEVICE)
    y = torch.empty_like(x)
    t = do_bench(lambda: y.copy_(x), warmup=20, rep=200, return_mode="median")
    return 2 * x.numel() / (t * 1e-3) / 1e9  # reads + writes


def measure_matmul_tflops(shape):
    import torch
    from triton.testing import do_bench

    a = torch.randn(8192, 8192, device=DEVICE, dtype=shape.dtype)
    b = torch.randn(8192, 8192, device=DEVICE, dtype=shape.dtype)
    t = do_bench(lambda: a @ b, warmup=20, rep=200, return_mode="median")
    return 2 * 8192 ** 3 / (t * 1e-3) / 1e12


def new_pool(shape, num_pages):
    import torch

    k = torch.randn(num_pages, shape.HKV, PAGE, shape.D, device=DEVICE, dtype=shape.dtype)
    v = torch.randn(num_pages, shape.HKV, PAGE, shape.D, device=DEVICE, dtype=shape.dtype)
    return k, v


def seq_table(seqs, slot_pos=None):
    """seqs: per sequence a list of (page_id, page_pos, page_len, rot_shift); slot_pos: per
    sequence, per entry, None or the entry's explicit slot positions."""
    from lazy_rag.kernels import PageTable

    field = lambda i: [[e[i] for e in s] for s in seqs]  # noqa: E731
    return PageTable.from_lists(field(0), field(1), field(2), field(3), device=DEVICE,
                                slot_pos=slot_pos)


def each(calls):
    """One callable running every call of `calls` (input sets cycled inside one timing)."""
    calls = list(calls)
    return lambda: [c() for c in calls]


LAUNCHED = None   # main's record of the attention kernels' launches (lazy_rag.bench.launches)


def kernel_report():
    """Registers, spills and shared memory of the last attention kernel launched."""
    k = LAUNCHED.last if LAUNCHED is not None else None
    if k is None:
        return {}
    return dict(regs=getattr(k, "n_regs", None), spills=getattr(k, "n_spills", None),
                smem=getattr(k.metadata, "shared", None))


class Recorder:
    """Flat records with bandwidth / roofline figures against this run's measured limits."""

    def __init__(self, env):
        self.env = env
        self.records = []

    def add(self, base, t_us, timer, nbytes, flops, **extra):
        env = self.env
        gbps = nbytes / (t_us * 1e-6) / 1e9
        roof = max(nbytes / (env["copy_gbps"] * 1e9), flops / (env["matmul_tflops"] * 1e12))
        r = dict(base, time_us=round(t_us, 2), bytes=int(nbytes), flops=int(flops),
                 gbps=round(gbps, 1), pct_of_copy_bw=round(100 * gbps / env["copy_gbps"], 1),
                 tflops=round(flops / (t_us * 1e-6) / 1e12, 2),
                 pct_of_roofline=round(100 * roof / (t_us * 1e-6), 1), timer=timer, **extra)
        r.update(env)
        self.records.append(r)
        print(f"  {r['benchmark']:<16} {r['mode']:<16} {r.get('rope_mode', ''):<9} "
              f"{r.get('slot_pos', ''):<14} {str(r.get('case', '')):<20} {t_us:9.1f} us "
              f"{gbps:8.0f} GB/s {r['pct_of_copy_bw']:6.1f}% copy "
              f"{r['pct_of_roofline']:6.1f}% roof", flush=True)


def lazy_mode(rope_mode):
    return "no_rope" if rope_mode == "none" else "lazy"


def prefill_fn(kernel):
    """(prefill, plan) of a prefill kernel: lazy_prefill and plan_prefill for "runs", the lab's
    tiles_prefill and plan_tiles_prefill for "tiles"."""
    if kernel == "runs":
        from lazy_rag.kernels import lazy_prefill, plan_prefill
        return lazy_prefill, plan_prefill
    from lazy_rag.bench.tiles_prefill import plan_tiles_prefill, tiles_prefill
    return tiles_prefill, plan_tiles_prefill


def prefill_mode(rope_mode, kernel):
    """lazy_runs, lazy_tiles, no_rope_runs, no_rope_tiles."""
    return f"{lazy_mode(rope_mode)}_{kernel}"


# --------------------------------------------------------------------------------------------
# Decode on private permuted pages: the strategies against contiguous SDPA and the block copy
# --------------------------------------------------------------------------------------------

def decode_inputs(shape, B, T):
    """B sequences of T tokens on permuted pages, in enough independent sets (pages, tables,
    queries) that cycling through them defeats the L2 cache; rot_shift groups of CHUNK tokens."""
    import torch

    kv_bytes = B * T * shape.token_kv_bytes
    n_sets = max(1, min(8, -(-L2_FLUSH_BYTES // kv_bytes)))
    ppseq = T // PAGE
    total = B * ppseq * n_sets
    k_pages, v_pages = new_pool(shape, total)
    perm = torch.randperm(total).tolist()
    tables, qs = [], []
    for s in range(n_sets):
        seqs = []
        for b in range(B):
            base = (s * B + b) * ppseq
            seqs.append([(perm[base + j], j * PAGE, PAGE, (j * PAGE // CHUNK) * CHUNK)
                         for j in range(ppseq)])
        tables.append(seq_table(seqs))
        qs.append(torch.randn(B, shape.H, shape.D, device=DEVICE, dtype=shape.dtype))
    q_pos = torch.full((B,), T - 1, dtype=torch.int32, device=DEVICE)
    return kv_bytes, n_sets, k_pages, v_pages, tables, qs, q_pos


def decode_cases(shape, rec, batches, ctxs, tuning_sets=None, rope_modes=("rotate_q", "none")):
    import torch
    import torch.nn.functional as F

    from lazy_rag.bench.block_attention import block_attention_decode
    from lazy_rag.kernels import lazy_decode

    H, HKV, D = shape.H, shape.HKV, shape.D
    for B in batches:
        for T in ctxs:
            kv_bytes, n_sets, k_pages, v_pages, tables, qs, q_pos = decode_inputs(shape, B, T)
            nbytes = kv_bytes + 2 * B * H * D * shape.elem_bytes
            flops = 4 * B * H * T * D
            base = dict(benchmark="decode", batch=B, context=T, page_size=PAGE, n_sets=n_sets,
                        case=f"B{B} x {T // 1024}k")
            outs = [torch.empty(B, H, D, device=DEVICE, dtype=shape.dtype)
                    for _ in range(n_sets)]
            for rope_mode in rope_modes:
                for tun in (tuning_sets or [{}]):
                    t, timer = bench(each(partial(
                        lazy_decode, qs[i], k_pages, v_pages, tables[i], q_pos, shape.inv_freq,
                        rope_mode=rope_mode, out=outs[i], **tun) for i in range(n_sets)), n_sets)
                    rec.add(dict(base, mode=lazy_mode(rope_mode), rope_mode=rope_mode,
                                 tuning=json.dumps(tun)), t, timer, nbytes, flops,
                            **kernel_report())
            if tuning_sets:
                del k_pages, v_pages
                continue
            # Contiguous KV, keys rotated, torch SDPA (the bar).
            kc = [torch.randn(B, HKV, T, D, device=DEVICE, dtype=shape.dtype)
                  for _ in range(n_sets)]
            vc = [torch.randn(B, HKV, T, D, device=DEVICE, dtype=shape.dtype)
                  for _ in range(n_sets)]
            q4 = [q[:, :, None, :] for q in qs]
            t, timer = bench(each(partial(F.scaled_dot_product_attention, q4[i], kc[i], vc[i],
                                          enable_gqa=True) for i in range(n_sets)), n_sets)
            rec.add(dict(base, mode="sdpa_contiguous", rope_mode=""), t, timer, nbytes, flops)
            del kc, vc
            # Block-Attention: gather + re-rotate into a per-request copy, then SDPA.
            t, timer = bench(each(partial(
                block_attention_decode, qs[i], k_pages, v_pages, tables[i], q_pos,
                shape.inv_freq, rope_mode="rotate_k", max_len=T, equal_lengths=True)
                for i in range(n_sets)), n_sets)
            rec.add(dict(base, mode="block", rope_mode="rotate_k"), t, timer, 3 * kv_bytes,
                    flops, note="bytes = KV read + copy written + copy read by SDPA")
            del k_pages, v_pages
            torch.cuda.empty_cache()


# --------------------------------------------------------------------------------------------
# Shared chunks: decode_shared, prefill, and the explicit slot position cases
# --------------------------------------------------------------------------------------------

def zipf_chunks(rng, n_chunks, k, a=2.1):
    import numpy as np

    w = 1.0 / np.arange(1, n_chunks + 1) ** a
    return rng.choice(n_chunks, size=k, replace=False, p=w / w.sum()).tolist()


class SharedCase:
    """A pool of n_chunks chunks of CHUNK tokens; each sequence = per_seq Zipf(2.1) chunks then
    q_tokens + n_new private tokens (the last n_new are the new tokens). recompute_room: spare
    pages for hidden_and_compact's runs (at most every chunk token of every sequence)."""

    def __init__(self, shape, B, n_new, rng, n_chunks=100, per_seq=5, q_tokens=32,
                 recompute_room=False, popularity="zipf"):
        import torch

        cp = CHUNK // PAGE
        self.n_priv = q_tokens + n_new
        self.n_chunk_entries = per_seq * cp
        priv_pages = -(-self.n_priv // PAGE)
        spare = B * per_seq * cp if recompute_room else 0
        total = n_chunks * cp + B * priv_pages + spare
        self.k_pages, self.v_pages = new_pool(shape, total)
        perm = torch.randperm(total).tolist()
        self.free = iter(perm[n_chunks * cp + B * priv_pages:])
        self.seqs, self.picks = [], []
        for b in range(B):
            chunks = (zipf_chunks(rng, n_chunks, per_seq) if popularity == "zipf"
                      else rng.choice(n_chunks, size=per_seq, replace=False).tolist())
            self.picks.append(chunks)
            ent, p = [], 0
            for c in chunks:
                ent += [(perm[c * cp + j], p + j * PAGE, PAGE, p) for j in range(cp)]
                p += CHUNK
            base = n_chunks * cp + b * priv_pages
            for j in range(priv_pages):
                ent.append((perm[base + j], p + j * PAGE, min(PAGE, self.n_priv - j * PAGE), 0))
            self.seqs.append(ent)
        self.T = per_seq * CHUNK + self.n_priv
        self.table = seq_table(self.seqs)

    def rows_of_minus_one(self):
        """The same table with explicit rows all -1 (the HAS_SLOT_POS kernel, no position
        changed)."""
        return seq_table(self.seqs, [[None] * len(s) for s in self.seqs])

    def hidden_and_compact(self, rng, fraction=HIDE_FRACTION):
        """Every chunk entry hides `fraction` of its slots (random), and each sequence's hidden
        tokens sit in a compact private run (rot_shift 0) with their positions. Returns the
        table and the number of recomputed tokens. Once per case: the runs take the spare
        pages of recompute_room."""
        from lazy_rag.kernels import HIDDEN_POS

        seqs, rows, n_recomputed = [], [], 0
        for ent in self.seqs:
            s_ent, hidden = list(ent), []
            s_rows = [None] * len(ent)                  # private pages: as they are
            for e, (_, pos, _, _) in enumerate(ent[:self.n_chunk_entries]):
                hide = rng.random(PAGE) < fraction
                s_rows[e] = [HIDDEN_POS if hide[j] else pos + j for j in range(PAGE)]
                hidden += [pos + j for j in range(PAGE) if hide[j]]
            rng.shuffle(hidden)
            for i in range(0, len(hidden), PAGE):
                run = hidden[i:i + PAGE]
                s_ent.append((next(self.free), 0, len(run), 0))
                s_rows.append(run + [HIDDEN_POS] * (PAGE - len(run)))
            n_recomputed += len(hidden)
            seqs.append(s_ent)
            rows.append(s_rows)
        return seq_table(seqs, rows), n_recomputed


# shared_chunk_decode variants (rows per work tile: the engine's rule picks 32 or 64; an H100
# sweep of rows 64/128 x block_n 64/128 x warps 4/8 x stages 2/3 put block_n 64, 4 warps,
# 2 stages at or near the best in every case)
SHARED_TUNING = [dict(rows=32), dict(rows=64), dict(split_target=8), dict(block_n=128, num_stages=3)]


def shared_chunks_of(case, shape, rows=None):
    """The case's decode step as the engine plans it (engine/shared_chunks.plan_shared_decode,
    shared_chunks="on"): every chunk and each sequence's own pages as (sequence, chunk) pairs
    of shared_chunk_decode; `rows` overrides the engine's query rows per work tile. Returns
    (private table or None, SharedChunks, pages read)."""
    from types import SimpleNamespace

    import triton

    from lazy_rag.engine.sequence import Run
    from lazy_rag.engine.shared_chunks import plan_shared_decode

    cp = CHUNK // PAGE
    seqs = []
    for ent in case.seqs:
        runs = [Run(pos=ent[i * cp][1], length=CHUNK, pages=tuple(e[0] for e in ent[i * cp:(i + 1) * cp]),
                    rot_shift=ent[i * cp][3]) for i in range(case.n_chunk_entries // cp)]
        own = ent[case.n_chunk_entries:]
        mine = Run(pos=own[0][1], length=case.n_priv, pages=tuple(e[0] for e in own), rot_shift=0)
        seqs.append(SimpleNamespace(cached_runs=runs, private_runs=[mine], num_tokens=case.T))
    plan = plan_shared_decode(seqs, PAGE, "on", shape.H, shape.HKV)
    if rows is not None:
        plan.pairs_per_tile = max(1, rows // triton.next_power_of_2(shape.H // shape.HKV))
    private, shared = plan.tensors(DEVICE, len(seqs))
    return private, shared, sum(len(p) for p, _ in plan.chunks)


def shared_decode_cases(shape, rec, batches, rng, popularities=("zipf",), tuning_sets=None):
    """decode_shared: per-sequence lazy_decode (rotate_q / none), Block-Attention and
    shared_chunk_decode (mode `shared`: the engine's plan, each chunk read once per work tile of
    the sequences holding it, their own pages too; `bytes` = the unique pages it reads) on the same inputs; `speedup_vs_lazy` = lazy rotate_q's time over
    this record's. tuning_sets: shared_chunk_decode variants (rows per work tile, block_n,
    num_warps, num_stages, split_target)."""
    import torch

    from lazy_rag.bench.block_attention import block_attention_decode
    from lazy_rag.kernels import lazy_decode
    from lazy_rag.kernels.shared_chunks import shared_chunk_decode

    for popularity in popularities:
        for B in batches:
            case = SharedCase(shape, B, 1, rng, popularity=popularity)
            T = case.T
            q = torch.randn(B, shape.H, shape.D, device=DEVICE, dtype=shape.dtype)
            q_pos = torch.full((B,), T - 1, dtype=torch.int32, device=DEVICE)
            uniq = len({c for p in case.picks for c in p})
            nbytes = B * T * shape.token_kv_bytes
            flops = 4 * B * shape.H * T * shape.D
            base = dict(benchmark="decode_shared", batch=B, context=T, page_size=PAGE, popularity=popularity,
                        unique_chunks=uniq, unique_bytes=uniq * CHUNK * shape.token_kv_bytes,
                        case=f"B{B} 5/100 {'zipf2.1' if popularity == 'zipf' else popularity}")
            o = torch.empty_like(q)
            t_lazy = None
            for rope_mode in ("rotate_q", "none"):
                t, timer = bench(partial(lazy_decode, q, case.k_pages, case.v_pages, case.table,
                                         q_pos, shape.inv_freq, rope_mode=rope_mode, out=o))
                t_lazy = t_lazy or t
                rec.add(dict(base, mode=lazy_mode(rope_mode), rope_mode=rope_mode), t, timer,
                        nbytes, flops, **kernel_report())
            ref = lazy_decode(q, case.k_pages, case.v_pages, case.table, q_pos, shape.inv_freq).float()
            for tun in (tuning_sets or [{}]):
                tun = dict(tun)
                private, shared, pages_read = shared_chunks_of(case, shape, rows=tun.pop("rows", None))
                run = partial(shared_chunk_decode, q, case.k_pages, case.v_pages, private, shared, q_pos,
                              shape.inv_freq, out=o, **tun)
                try:
                    t, timer = bench(run)
                except Exception as exc:  # noqa: BLE001  (OutOfResources of a variant)
                    print(f"  shared {tun}: {type(exc).__name__}", flush=True)
                    continue
                got = run().float()
                err = ((got - ref).abs().max() / ref.abs().max()).item()
                rec.add(dict(base, mode="shared", rope_mode="rotate_q", pairs=shared.num_pairs,
                             grouped_chunks=shared.chunk_len.numel(), pairs_per_tile=shared.pairs_per_tile,
                             tuning=json.dumps(tun), speedup_vs_lazy=round(t_lazy / t, 2),
                             rel_err_vs_lazy=float(f"{err:.2e}")),
                        t, timer, pages_read * PAGE * shape.token_kv_bytes, flops)
            t, timer = bench(partial(block_attention_decode, q, case.k_pages, case.v_pages,
                                     case.table, q_pos, shape.inv_freq, rope_mode="rotate_k",
                                     max_len=T, equal_lengths=True))
            rec.add(dict(base, mode="block", rope_mode="rotate_k"), t, timer, 3 * nbytes, flops,
                    note="bytes = KV read + copy written + copy read by SDPA")
            del case
            torch.cuda.empty_cache()


def prefill_inputs(shape, B, n_new, cached):
    import torch

    q = torch.randn(B * n_new, shape.H, shape.D, device=DEVICE, dtype=shape.dtype)
    qo = torch.arange(0, B * n_new + 1, n_new, dtype=torch.int32, device=DEVICE)
    q_pos = (cached + torch.arange(n_new, dtype=torch.int32, device=DEVICE)).repeat(B)
    # causal over the new tokens: query i sees cached + i + 1 keys
    flops = 4 * shape.H * shape.D * B * (n_new * cached + n_new * (n_new + 1) // 2)
    return q, qo, q_pos, flops


def prefill_cases(shape, rec, batches, news, rng, tuning_sets=None,
                  rope_modes=("rotate_q", "none"), kernels=PREFILL_KERNELS):
    """Every (rope_mode, kernel) side by side on the same inputs; with tuning_sets, each set
    (block_m goes to the kernel's plan, the rest to its prefill: prefill_fn)."""
    import torch

    for B in batches:
        for n_new in news:
            case = SharedCase(shape, B, n_new, rng, q_tokens=0)
            cached = case.T - n_new
            q, qo, q_pos, flops = prefill_inputs(shape, B, n_new, cached)
            nbytes = B * case.T * shape.token_kv_bytes + 2 * q.numel() * shape.elem_bytes
            base = dict(benchmark="prefill", batch=B, new_tokens=n_new, cached_tokens=cached,
                        page_size=PAGE, case=f"B{B} +{n_new} / 10k")
            o = torch.empty_like(q)
            for rope_mode in rope_modes:
                for kernel in kernels:
                    prefill, plan_of = prefill_fn(kernel)
                    for tun in (tuning_sets or [{}]):
                        tun = dict(tun)
                        plan = plan_of(qo.cpu(), shape.H, shape.HKV, DEVICE,
                                       block_m=tun.pop("block_m", None))
                        try:
                            t, timer = bench(partial(
                                prefill, q, qo, q_pos, case.k_pages, case.v_pages,
                                case.table, shape.inv_freq, rope_mode=rope_mode, plan=plan,
                                out=o, **tun))
                        except Exception as exc:  # noqa: BLE001  (OutOfResources of a variant)
                            print(f"  prefill {rope_mode} {kernel} {tun}: "
                                  f"{type(exc).__name__}", flush=True)
                            continue
                        rec.add(dict(base, mode=prefill_mode(rope_mode, kernel),
                                     rope_mode=rope_mode, kernel=kernel,
                                     tuning=json.dumps(dict(tun, block_m=plan.block_m))),
                                t, timer, nbytes, flops, **kernel_report())
            del case
            torch.cuda.empty_cache()


def slot_pos_cases(shape, rec, batches, news, rng):
    """Overhead of explicit slot positions (rotate_q): the shared case as is, with rows all -1,
    and with HIDE_FRACTION of every chunk page's slots hidden plus the compact recomputed run.
    n_new 1 is decode (lazy_decode), more is prefill."""
    import torch

    from lazy_rag.kernels import lazy_decode, lazy_prefill, plan_prefill

    for B in batches:
        for n_new in news:
            case = SharedCase(shape, B, n_new, rng, q_tokens=32 if n_new == 1 else 0,
                              recompute_room=True)
            cached = case.T - n_new
            q, qo, q_pos, flops = prefill_inputs(shape, B, n_new, cached)
            hidden_table, n_recomputed = case.hidden_and_compact(rng)
            tables = {"absent": (case.table, 0), "rows_-1": (case.rows_of_minus_one(), 0),
                      f"hide{int(HIDE_FRACTION * 100)}+compact": (hidden_table, n_recomputed)}
            decode = n_new == 1
            plan = None if decode else plan_prefill(qo.cpu(), shape.H, shape.HKV, DEVICE)
            o = torch.empty_like(q)
            base = dict(benchmark="decode_slot_pos" if decode else "prefill_slot_pos", batch=B,
                        new_tokens=n_new, cached_tokens=cached, page_size=PAGE,
                        case=f"B{B} +{n_new} / 10k", mode="lazy", rope_mode="rotate_q",
                        kernel="tiles" if decode else "runs")
            for name, (table, extra_tokens) in tables.items():
                if decode:
                    fn = partial(lazy_decode, q, case.k_pages, case.v_pages, table, q_pos,
                                 shape.inv_freq, out=o)
                else:
                    fn = partial(lazy_prefill, q, qo, q_pos, case.k_pages, case.v_pages, table,
                                 shape.inv_freq, plan=plan, out=o)
                t, timer = bench(fn)
                nbytes = (B * case.T + extra_tokens) * shape.token_kv_bytes
                rec.add(dict(base, slot_pos=name, recomputed_tokens=extra_tokens), t, timer,
                        nbytes, flops, **kernel_report())
            del case, tables, hidden_table
            torch.cuda.empty_cache()


def check_once(shape):
    """bf16 decode + prefill vs the fp64 reference on benchmark-shaped inputs, with and without
    explicit slot positions: rel err per case."""
    import numpy as np
    import torch

    from lazy_rag.kernels import paged_attention_ref

    rng = np.random.default_rng(1)
    case = SharedCase(shape, 2, 40, rng, n_chunks=6, per_seq=2, q_tokens=0,
                      recompute_room=True)
    q, qo, q_pos, _ = prefill_inputs(shape, 2, 40, case.T - 40)
    errs = {}
    for name, table in (("plain", case.table), ("slot_pos", case.hidden_and_compact(rng)[0])):
        for rope_mode in ("rotate_q", "none"):
            r = paged_attention_ref(q, qo, q_pos, case.k_pages, case.v_pages, table,
                                    shape.inv_freq, rope_mode, compute_dtype=torch.float64)
            for kernel in PREFILL_KERNELS:
                o = prefill_fn(kernel)[0](q, qo, q_pos, case.k_pages, case.v_pages, table,
                                          shape.inv_freq, rope_mode=rope_mode)
                err = ((o.double() - r).abs().max() / r.abs().max()).item()
                errs[f"{name}/{rope_mode}/{kernel}"] = float(f"{err:.3g}")
    return errs


# --------------------------------------------------------------------------------------------
# fp8 KV: the same inputs in bf16 and in fp8 pages with per-token scales
# --------------------------------------------------------------------------------------------

def quantize_pool(pages, step=2048):
    """fp8 pages and their fp16 scales [num_pages, HKV, PAGE] of a bf16 pool, a few pages at a
    time (the fp32 temporaries of a whole 32k-context pool would not fit)."""
    import torch

    from lazy_rag.kernels import quantize_rows

    q8 = torch.empty(pages.shape, dtype=torch.float8_e4m3fn, device=pages.device)
    sc = torch.empty(pages.shape[:-1], dtype=torch.float16, device=pages.device)
    for i in range(0, pages.shape[0], step):
        q8[i:i + step], sc[i:i + step] = quantize_rows(pages[i:i + step])
    return q8, sc


def fp8_token_bytes(shape):
    """Bytes of K and V one token occupies in one layer of an fp8 pool (scales included)."""
    return 2 * shape.HKV * (shape.D + 2)


def add_pair(rec, base, times, nbytes, flops, reports=None):
    """The bf16 and fp8 records of one case, each fp8 one with its bandwidth and speed relative
    to bf16's. times: {kv_dtype: (t_us, timer)}, "bf16" first, then the fp8 variants in their
    timing order ("fp8": V pages keys-major as the engine's pool lays them out;
    "fp8_dims_major": V dims-major, the layout before); nbytes: {"bf16" / "fp8": bytes read};
    reports: {kv_dtype: the attention kernel's compiled report} (none for the write cases, whose
    kernel is not an attention kernel)."""
    for kv_dtype, (t, timer) in times.items():
        fp8 = kv_dtype != "bf16"
        extra = {}
        if fp8:
            tb = times["bf16"][0]
            nb = nbytes["fp8"]
            extra = dict(bw_vs_bf16=round((nb / t) / (nbytes["bf16"] / tb), 3),
                         speedup_vs_bf16=round(tb / t, 3),
                         v_layout="dims_major" if kv_dtype == "fp8_dims_major" else "keys_major",
                         **(reports or {}).get(kv_dtype, {}))
        rec.add(dict(base, kv_dtype="fp8" if fp8 else kv_dtype), t, timer,
                nbytes["fp8" if fp8 else "bf16"], flops, **extra)


# fp8 decode tuning variants (--sweep with --only fp8): an fp8 tile holds half a bf16 tile's
# bytes, so the bytes in flight per SM that hide the memory latency need longer tiles, more
# stages or more programs per SM than bf16's defaults (block_n 128, 4 warps, 3 stages, 2
# programs per SM)
FP8_DECODE_TUNING = [dict(block_n=bn, num_warps=w, num_stages=st, split_target=sp)
                     for bn, w, st, sp in ((128, 4, 4, 2), (128, 4, 3, 4), (128, 4, 4, 4),
                                           (128, 4, 6, 4), (256, 4, 3, 2), (256, 8, 3, 2),
                                           (256, 8, 4, 2), (256, 4, 3, 4), (64, 4, 6, 4),
                                           (128, 8, 4, 4))]


def fp8_cases(shape, rec, batches, ctxs, prefill_batches, news, rng, sweep=False):
    """decode_fp8 (private permuted pages, as `decode`), prefill_fp8 (the shared 10k case, runs
    kernel) and write_fp8, each bf16 against fp8 on the same values. sweep: also decode_fp8_sweep
    records, the keys-major fp8 decode under FP8_DECODE_TUNING's variants."""
    import torch

    from lazy_rag.kernels import lazy_decode, lazy_prefill, plan_prefill, to_keys_major, write_kv

    H, D = shape.H, shape.D
    q_io = lambda n: 2 * n * H * D * shape.elem_bytes  # noqa: E731  (q read, out written)
    for B in batches:
        for T in ctxs:
            kv_bytes, n_sets, k_pages, v_pages, tables, qs, q_pos = decode_inputs(shape, B, T)
            (k8, ks), (v8, vs) = quantize_pool(k_pages), quantize_pool(v_pages)
            v8_keys = to_keys_major(v8)
            outs = [torch.empty(B, H, D, device=DEVICE, dtype=shape.dtype) for _ in range(n_sets)]
            times, reports = {}, {}
            fp8 = dict(k_scale=ks, v_scale=vs)
            for kv_dtype, pages, scales in (("bf16", (k_pages, v_pages), {}),
                                            ("fp8", (k8, v8_keys), fp8),
                                            ("fp8_dims_major", (k8, v8), fp8)):
                times[kv_dtype] = bench(each(partial(
                    lazy_decode, qs[i], *pages, tables[i], q_pos, shape.inv_freq,
                    rope_mode="rotate_q", out=outs[i], **scales) for i in range(n_sets)), n_sets)
                reports[kv_dtype] = kernel_report()
            bf16_report = reports.pop("bf16")
            base = dict(benchmark="decode_fp8", batch=B, context=T, page_size=PAGE,
                        n_sets=n_sets, case=f"B{B} x {T // 1024}k", mode="lazy",
                        rope_mode="rotate_q", bf16_kernel=json.dumps(bf16_report))
            nbytes = {"bf16": kv_bytes + q_io(B), "fp8": B * T * fp8_token_bytes(shape) + q_io(B)}
            add_pair(rec, base, times, nbytes, 4 * B * H * T * D, reports)
            for tun in FP8_DECODE_TUNING if sweep else ():
                t, timer = bench(each(partial(
                    lazy_decode, qs[i], k8, v8_keys, tables[i], q_pos, shape.inv_freq,
                    rope_mode="rotate_q", out=outs[i], k_scale=ks, v_scale=vs, **tun)
                    for i in range(n_sets)), n_sets)
                rec.add(dict(base, benchmark="decode_fp8_sweep", kv_dtype="fp8",
                             v_layout="keys_major", **tun), t, timer, nbytes["fp8"],
                        4 * B * H * T * D, bw_vs_bf16=round(
                            (nbytes["fp8"] / t) / (nbytes["bf16"] / times["bf16"][0]), 3),
                        **kernel_report())
            del k_pages, v_pages, k8, v8, v8_keys, ks, vs
            torch.cuda.empty_cache()
    for B in prefill_batches:
        for n_new in news:
            case = SharedCase(shape, B, n_new, rng, q_tokens=0)
            cached = case.T - n_new
            q, qo, q_pos, flops = prefill_inputs(shape, B, n_new, cached)
            (k8, ks), (v8, vs) = quantize_pool(case.k_pages), quantize_pool(case.v_pages)
            v8_keys = to_keys_major(v8)
            plan = plan_prefill(qo.cpu(), H, shape.HKV, DEVICE)
            o = torch.empty_like(q)
            times, reports = {}, {}
            fp8 = dict(k_scale=ks, v_scale=vs)
            for kv_dtype, pages, scales in (("bf16", (case.k_pages, case.v_pages), {}),
                                            ("fp8", (k8, v8_keys), fp8),
                                            ("fp8_dims_major", (k8, v8), fp8)):
                times[kv_dtype] = bench(partial(lazy_prefill, q, qo, q_pos, *pages, case.table,
                                                shape.inv_freq, rope_mode="rotate_q", plan=plan,
                                                out=o, **scales))
                reports[kv_dtype] = kernel_report()
            base = dict(benchmark="prefill_fp8", batch=B, new_tokens=n_new, cached_tokens=cached,
                        page_size=PAGE, case=f"B{B} +{n_new} / 10k", mode="lazy_runs",
                        rope_mode="rotate_q", kernel="runs")
            add_pair(rec, base, times, {"bf16": B * case.T * shape.token_kv_bytes + q_io(B * n_new),
                                        "fp8": B * case.T * fp8_token_bytes(shape)
                                        + q_io(B * n_new)}, flops, reports)
            del case, k8, v8, v8_keys, ks, vs
            torch.cuda.empty_cache()
    # one layer's write of a step's new tokens (decode batch 32; a 4096-token append)
    num_pages = 4096
    for n in (32, 4096):
        k = torch.randn(n, shape.HKV, D, device=DEVICE, dtype=shape.dtype)
        v = torch.randn_like(k)
        slots = torch.randperm(num_pages * PAGE, device=DEVICE)[:n]
        page, slot = slots // PAGE, slots % PAGE
        kp, vp = new_pool(shape, num_pages)
        (k8, ks), (v8, vs) = quantize_pool(kp), quantize_pool(vp)
        v8_keys = to_keys_major(v8)
        times = {"bf16": bench(partial(write_kv, kp, vp, None, None, page, slot, k, v)),
                 "fp8": bench(partial(write_kv, k8, v8_keys, ks, vs, page, slot, k, v)),
                 "fp8_dims_major": bench(partial(write_kv, k8, v8, ks, vs, page, slot, k, v))}
        base = dict(benchmark="write_fp8", new_tokens=n, page_size=PAGE, case=f"{n} tokens",
                    mode="write", rope_mode="")
        add_pair(rec, base, times, {"bf16": 2 * n * shape.token_kv_bytes,
                                    "fp8": n * shape.token_kv_bytes + n * fp8_token_bytes(shape)},
                 0)
        del kp, vp, k8, v8, v8_keys, ks, vs
        torch.cuda.empty_cache()


def check_fp8_once(shape):
    """fp8 pages: decode and prefill vs the fp64 reference over the dequantised pages (rel err)."""
    import numpy as np
    import torch

    from lazy_rag.kernels import (dequantize_rows, lazy_decode, lazy_prefill, paged_attention_ref,
                                  to_keys_major)

    rng = np.random.default_rng(2)
    case = SharedCase(shape, 2, 40, rng, n_chunks=6, per_seq=2, q_tokens=0)
    q, qo, q_pos, _ = prefill_inputs(shape, 2, 40, case.T - 40)
    (k8, ks), (v8, vs) = quantize_pool(case.k_pages), quantize_pool(case.v_pages)
    deq = dequantize_rows(k8, ks), dequantize_rows(v8, vs)
    r = paged_attention_ref(q, qo, q_pos, *deq, case.table, shape.inv_freq, "rotate_q",
                            compute_dtype=torch.float64)
    errs = {}
    last = qo[1:].long() - 1
    for layout, v in (("", v8), ("_keys_major", to_keys_major(v8))):
        o = lazy_prefill(q, qo, q_pos, k8, v, case.table, shape.inv_freq, k_scale=ks, v_scale=vs)
        errs["prefill" + layout] = ((o.double() - r).abs().max() / r.abs().max()).item()
        od = lazy_decode(q[last].contiguous(), k8, v, case.table, q_pos[last], shape.inv_freq,
                         k_scale=ks, v_scale=vs)
        errs["decode" + layout] = ((od.double() - r[last]).abs().max() / r[last].abs().max()).item()
    return {k: float(f"{e:.3g}") for k, e in errs.items()}


# --------------------------------------------------------------------------------------------

def runs_sweep_sets(gp, long):
    """The runs kernel's tuning variants (defaults: 128 rows, block_n 64, 8 warps, 3 stages),
    pruned by sm_90 compiles (ptxas -v): spill-free are 64 rows x 64 keys (4 or 8 warps) and
    128 rows x 64 keys x 8 warps; 128 keys per tile spills a little (44-224 bytes), 256 rows
    spill more (436 bytes at 64 keys, 8 warps), 4 warps at 128 rows spill ~500 bytes and 16
    warps kilobytes (none of those swept but one 256-row and the 128-key probes).
    long (+512 tokens, compute-bound): rows (block_m = rows // gp), block_n, warps, stages.
    Short (+32 tokens, every token in one 128-row tile: latency- and split-bound): block_n,
    stages, split_target (split-KV programs per SM), and 64-row tiles. One of each with
    q_rotation="row" (the query rotation without join / permute / reshape)."""
    def var(rows, bn, w, s, **kw):
        return dict(block_m=rows // gp, block_n=bn, num_warps=w, num_stages=s, **kw)

    if long:
        return [var(128, 64, 8, s) for s in (2, 3, 4)] \
            + [var(64, 64, w, s) for w in (4, 8) for s in (2, 3)] \
            + [var(128, 128, 8, s) for s in (2, 3)] + [var(64, 128, 8, 2), var(256, 64, 8, 2)] \
            + [var(128, 64, 8, 3, q_rotation="row")]
    return [var(128, bn, 8, s, split_target=sp) for bn in (64, 128) for s in (2, 3)
            for sp in (1, 2, 4)] \
        + [var(64, 64, 4, 3, split_target=sp) for sp in (1, 2)] \
        + [var(128, 64, 8, 3, split_target=2, q_rotation="row")]


def sweep(shape, rec, rng, what="all"):
    """Tuning variants, rotate_q: with what="all" decode (block_n, stages, split_target) and the
    tiles kernel's prefill (block_m, block_n, warps, stages); always the runs kernel's prefill
    (runs_sweep_sets: B1 and B16, +512 and +32)."""
    import triton

    if what == "all":
        sets = [dict(block_n=bn, num_warps=4, num_stages=st, split_target=sp)
                for bn in (128, 256) for st in (2, 3, 4) for sp in (2, 4, 8)]
        decode_cases(shape, rec, [32], [8192], tuning_sets=sets,
                     rope_modes=("rotate_q", "none"))
        psets = [dict(block_m=bm, block_n=bn, num_warps=w, num_stages=s)
                 for bm in (32, 64) for bn in (64, 128) for w in (4, 8) for s in (2, 3)]
        prefill_cases(shape, rec, [16], [512], rng, tuning_sets=psets,
                      rope_modes=("rotate_q",), kernels=("tiles",))
    gp = triton.next_power_of_2(shape.H // shape.HKV)
    prefill_cases(shape, rec, [1, 16], [512], rng, tuning_sets=runs_sweep_sets(gp, True),
                  rope_modes=("rotate_q",), kernels=("runs",))
    prefill_cases(shape, rec, [1, 16], [32], rng, tuning_sets=runs_sweep_sets(gp, False),
                  rope_modes=("rotate_q",), kernels=("runs",))
    for r in rec.records:
        r["benchmark"] += "_sweep"


def main(argv=None):
    args = parse_args(argv)
    import numpy as np
    import torch
    import triton

    from lazy_rag.bench.launches import recorded_launches
    from lazy_rag.bench.records import environment, format_table, write_records

    if not torch.cuda.is_available():
        raise SystemExit("attention_kernels.py needs a CUDA device")
    torch.manual_seed(0)
    rng = np.random.default_rng(0)
    shape = Shape()
    env = dict(environment(), triton=triton.__version__)
    env["copy_gbps"] = round(measure_copy_gbps(), 1)
    env["matmul_tflops"] = round(measure_matmul_tflops(shape), 1)
    print(f"# {env['device']}: copy {env['copy_gbps']} GB/s, {DTYPE_NAME} matmul "
          f"{env['matmul_tflops']} TFLOP/s", flush=True)
    print("# bf16 check, rel err vs fp64 reference:", check_once(shape), flush=True)
    print("# fp8 check, rel err vs fp64 reference over the dequantised pages:",
          check_fp8_once(shape), flush=True)
    global LAUNCHED
    with recorded_launches() as LAUNCHED:   # kernel_report's source
        rec = Recorder(env)
        t0 = time.time()
        if args.sweep and args.only != "fp8":     # fp8's own sweep runs inside fp8_cases
            sweep(shape, rec, rng, args.sweep)
        quick = args.quick
        if args.only == "shared":
            shared_decode_cases(shape, rec, [8, 32, 128], rng, popularities=("zipf", "uniform"),
                                tuning_sets=[{}] + SHARED_TUNING)
        if args.only in (None, "fp8"):
            fp8_cases(shape, rec, [1, 16, 32] if quick else [1, 8, 16, 32, 128],
                      [8192] if quick else [8192, 32768], [1, 16], [32, 512], rng,
                      sweep=bool(args.sweep) and args.only == "fp8")
        if args.only in (None, "decode"):
            decode_cases(shape, rec, [1, 32] if quick else [1, 8, 32, 128],
                         [8192] if quick else [2048, 8192, 32768])
            shared_decode_cases(shape, rec, [8, 32] if quick else [8, 32, 128], rng)
        if args.only in (None, "prefill"):
            prefill_cases(shape, rec, [1, 16], [32, 512], rng)
        if args.only in (None, "decode"):
            slot_pos_cases(shape, rec, [32] if quick else [8, 32], [1], rng)
        if args.only in (None, "prefill"):
            slot_pos_cases(shape, rec, [16], [512], rng)
    tag = env["device"].replace("NVIDIA ", "").replace(" ", "_").lower()
    # the fp8 or shared cases alone: a file of their own
    suffix = f"_{args.only}" if args.only in ("fp8", "shared") else ""
    path = write_records(args.out / f"kernels_{tag}{suffix}.json", rec.records)
    print(f"# {len(rec.records)} records in {time.time() - t0:.0f} s -> {path}")
    print(format_table([r for r in rec.records if not r["benchmark"].endswith("_sweep")],
                       TABLE_COLUMNS))


if __name__ == "__main__":
    main()
