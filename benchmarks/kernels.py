"""Benchmark the lazy-RoPE attention kernels on the GPU (Llama-3.1-8B attention shape).

    python benchmarks/kernels.py [--out DIR] [--quick] [--sweep] [--diag]

--diag times leave-one-out probes and candidate variants of the decode kernel (registers,
spills, shared memory and cp.async counts of each compiled variant) instead of the tables.

Shape: 32 query heads, 8 KV heads, head dim 128, bf16, page size 64 (one KV head of a page is a
16 KiB contiguous run). Modes per case:
  lazy            lazy_decode / lazy_prefill, field `rope` = rotate_k (unrotated store, keys
                  rotated in the kernel) or rotate_q (chunk-local store, query rotated per chunk)
  no_rope         the same kernel with rope="none" on the same pages (keys taken as rotated)
  sdpa_contiguous torch SDPA decode over the same KV laid out contiguously, keys rotated
  block           Block-Attention: fused gather + re-rotate copy, then SDPA
Every case also records the copy bandwidth and bf16 matmul rate measured in the same run;
`pct_of_copy_bw` = achieved bytes/s over that copy bandwidth, `pct_of_roofline` = the larger of
bytes/copy_bw and flops/matmul_rate over the measured time.
Small cases cycle over several disjoint input sets inside one timed call so that the KV does
not sit in L2. Times are medians of CUDA-graph replays (triton.testing.do_bench_cudagraph).
Writes benchmarks/results/kernels_<device>.json (or DIR/kernels_<device>.json), prints a table.
"""
from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import platform
import sys
import time

import numpy as np
import torch
import torch.nn.functional as F
import triton
from triton.testing import do_bench, do_bench_cudagraph

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
from lazy_rag.kernels import (PageTable, block_attention_decode,  # noqa: E402
                              lazy_decode, lazy_prefill, plan_prefill)

H, HKV, D, PAGE, CHUNK = 32, 8, 128, 64, 2048
DT = torch.bfloat16
ES = 2  # bytes per element
TOKEN_KV_BYTES = 2 * HKV * D * ES  # K and V of one token, one layer: 4 KiB
L2_FLUSH_BYTES = 256 << 20


def bench(fn, reps_inner=1):
    fn()
    torch.cuda.synchronize()
    try:
        t = do_bench_cudagraph(fn, rep=60, return_mode="median")
        timer = "cudagraph"
    except Exception:  # capture failed: plain events
        t = do_bench(fn, warmup=10, rep=60, return_mode="median")
        timer = "events"
    return t * 1e3 / reps_inner, timer


def measure_copy_bw():
    x = torch.empty(1 << 30, dtype=torch.uint8, device="cuda")
    y = torch.empty_like(x)
    t = do_bench(lambda: y.copy_(x), warmup=20, rep=200, return_mode="median")
    return 2 * x.numel() / (t * 1e-3) / 1e9  # GB/s, reads + writes


def measure_matmul():
    a = torch.randn(8192, 8192, device="cuda", dtype=DT)
    b = torch.randn(8192, 8192, device="cuda", dtype=DT)
    t = do_bench(lambda: a @ b, warmup=20, rep=200, return_mode="median")
    return 2 * 8192 ** 3 / (t * 1e-3) / 1e12  # TFLOP/s


def inv_freq_llama31():
    """Llama-3.1-8B rope: theta 500000, llama3 scaling (factor 8, low 1, high 4, orig 8192)."""
    inv = 1.0 / (500000.0 ** (torch.arange(0, D, 2, dtype=torch.float32) / D))
    low_wl, high_wl = 8192 / 1.0, 8192 / 4.0
    wl = 2 * math.pi / inv
    scaled = torch.where(wl > low_wl, inv / 8.0, inv)
    smooth = (8192 / wl - 1.0) / (4.0 - 1.0)
    mid = (1 - smooth) * scaled / 8.0 + smooth * scaled
    is_mid = (wl >= high_wl) & (wl <= low_wl)
    return torch.where(is_mid, mid, scaled).cuda()


def new_pool(num_pages):
    k = torch.randn(num_pages, HKV, PAGE, D, device="cuda", dtype=DT)
    v = torch.randn(num_pages, HKV, PAGE, D, device="cuda", dtype=DT)
    return k, v


def seq_table(seqs, device="cuda"):
    """seqs: per sequence a list of (page_id, page_pos, page_len, rot_shift)."""
    return PageTable.from_lists([[e[0] for e in s] for s in seqs], [[e[1] for e in s] for s in seqs],
                                [[e[2] for e in s] for s in seqs], [[e[3] for e in s] for s in seqs],
                                device=device)


def rec(out, base, t_us, timer, nbytes, flops, env, **extra):
    gbps = nbytes / (t_us * 1e-6) / 1e9
    r = dict(base, time_us=round(t_us, 2), bytes=int(nbytes), flops=int(flops),
             gbps=round(gbps, 1), pct_of_copy_bw=round(100 * gbps / env["copy_gbps"], 1),
             tflops=round(flops / (t_us * 1e-6) / 1e12, 2), timer=timer, device=env["device"])
    roof = max(nbytes / (env["copy_gbps"] * 1e9), flops / (env["matmul_tflops"] * 1e12))
    r["pct_of_roofline"] = round(100 * roof / (t_us * 1e-6), 1)
    r.update(extra)
    out.append(r)
    print(f"  {r['benchmark']:<14} {r['mode']:<16} {r.get('rope', ''):<9} "
          f"{str(r.get('case', '')):<22} {t_us:9.1f} us {gbps:8.0f} GB/s "
          f"{r['pct_of_copy_bw']:6.1f}% copy {r['pct_of_roofline']:6.1f}% roof", flush=True)


def decode_inputs(B: int, T: int, chunk: int):
    """Decode inputs on paged, permuted KV: B sequences of T tokens each, in enough independent
    sets (pages, tables, queries) that cycling through them defeats the L2 cache; rot_shift groups
    of `chunk` tokens (rotate_q). Returns kv_bytes, n_sets, k_pages, v_pages, tables, qs, q_pos."""
    kv_bytes = B * T * TOKEN_KV_BYTES
    n_sets = max(1, min(8, -(-L2_FLUSH_BYTES // kv_bytes)))
    ppseq = T // PAGE
    total = B * ppseq * n_sets
    k_pages, v_pages = new_pool(total)
    perm = torch.randperm(total).tolist()
    tables, qs = [], []
    for s in range(n_sets):
        seqs = []
        for b in range(B):
            base = (s * B + b) * ppseq
            seqs.append([(perm[base + j], j * PAGE, PAGE, (j * PAGE // chunk) * chunk)
                         for j in range(ppseq)])
        tables.append(seq_table(seqs))
        qs.append(torch.randn(B, H, D, device="cuda", dtype=DT))
    q_pos = torch.full((B,), T - 1, dtype=torch.int32, device="cuda")
    return kv_bytes, n_sets, k_pages, v_pages, tables, qs, q_pos


def decode_sweep(env, out, batches, ctxs, inv, tuning_sets=None,
                 ropes=("rotate_k", "rotate_q", "none")):
    for B in batches:
        for T in ctxs:
            kv_bytes, n_sets, k_pages, v_pages, tables, qs, q_pos = decode_inputs(B, T, CHUNK)
            nbytes = kv_bytes + 2 * B * H * D * ES
            flops = 4 * B * H * T * D
            base = dict(benchmark="decode", batch=B, context=T, page_size=PAGE, n_sets=n_sets,
                        case=f"B{B} x {T // 1024}k")
            outs = [torch.empty(B, H, D, device="cuda", dtype=DT) for _ in range(n_sets)]
            for rope in ropes:
                for tun in (tuning_sets or [{}]):
                    fn = lambda: [lazy_decode(qs[i], k_pages, v_pages, tables[i], q_pos, inv,  # noqa
                                              rope=rope, out=outs[i], **tun)
                                  for i in range(n_sets)]
                    t, timer = bench(fn, n_sets)
                    mode = "no_rope" if rope == "none" else "lazy"
                    rec(out, dict(base, mode=mode, rope=rope if rope != "none" else "",
                                  tuning=json.dumps(tun)), t, timer, nbytes, flops, env)
            if tuning_sets:
                del k_pages, v_pages
                continue
            # Contiguous KV, keys rotated, torch SDPA (the bar).
            kc = [torch.randn(B, HKV, T, D, device="cuda", dtype=DT) for _ in range(n_sets)]
            vc = [torch.randn(B, HKV, T, D, device="cuda", dtype=DT) for _ in range(n_sets)]
            q4 = [q[:, :, None, :] for q in qs]
            fn = lambda: [F.scaled_dot_product_attention(q4[i], kc[i], vc[i], enable_gqa=True)  # noqa
                          for i in range(n_sets)]
            t, timer = bench(fn, n_sets)
            rec(out, dict(base, mode="sdpa_contiguous", rope=""), t, timer, nbytes, flops, env)
            del kc, vc
            # Block-Attention: gather + re-rotate into a per-request copy, then SDPA.
            fn = lambda: [block_attention_decode(qs[i], k_pages, v_pages, tables[i], q_pos, inv,  # noqa
                                                 source="rotate_k", max_len=T, equal_lengths=True)
                          for i in range(n_sets)]
            t, timer = bench(fn, n_sets)
            rec(out, dict(base, mode="block", rope="rotate_k"), t, timer, 3 * kv_bytes, flops, env,
                note="bytes = KV read + copy written + copy read by SDPA")
            del k_pages, v_pages
            torch.cuda.empty_cache()


def zipf_chunks(rng, n_chunks, k, a=2.1):
    w = 1.0 / np.arange(1, n_chunks + 1) ** a
    return rng.choice(n_chunks, size=k, replace=False, p=w / w.sum()).tolist()


def shared_setup(B, n_new, rng, n_chunks=100, per_seq=5, q_tokens=32):
    """Pool of n_chunks chunks of 2048 tokens; each sequence = 5 Zipf(2.1) chunks + q_tokens
    private tokens (+ n_new new ones for prefill). Returns pool, table, chunk lists."""
    cp = CHUNK // PAGE
    n_priv_tok = q_tokens + n_new
    n_priv = -(-n_priv_tok // PAGE)
    total = n_chunks * cp + B * n_priv
    k_pages, v_pages = new_pool(total)
    perm = torch.randperm(total).tolist()
    seqs, picks = [], []
    for b in range(B):
        chunks = zipf_chunks(rng, n_chunks, per_seq)
        picks.append(chunks)
        ent, p = [], 0
        for c in chunks:
            ent += [(perm[c * cp + j], p + j * PAGE, PAGE, p) for j in range(cp)]
            p += CHUNK
        base = n_chunks * cp + b * n_priv
        for j in range(n_priv):
            ent.append((perm[base + j], p + j * PAGE, min(PAGE, n_priv_tok - j * PAGE), 0))
        seqs.append(ent)
    return k_pages, v_pages, seq_table(seqs), picks, per_seq * CHUNK + n_priv_tok


def shared_decode(env, out, batches, inv, rng):
    for B in batches:
        k_pages, v_pages, table, picks, T = shared_setup(B, 1, rng)
        q = torch.randn(B, H, D, device="cuda", dtype=DT)
        q_pos = torch.full((B,), T - 1, dtype=torch.int32, device="cuda")
        uniq = len({c for p in picks for c in p})
        nbytes = B * T * TOKEN_KV_BYTES
        flops = 4 * B * H * T * D
        base = dict(benchmark="decode_shared", batch=B, context=T, page_size=PAGE,
                    unique_chunks=uniq, unique_bytes=uniq * CHUNK * TOKEN_KV_BYTES,
                    case=f"B{B} 5/100 zipf2.1")
        o = torch.empty_like(q)
        for rope in ["rotate_k", "rotate_q"]:
            t, timer = bench(lambda: lazy_decode(q, k_pages, v_pages, table, q_pos, inv, rope=rope,
                                                 out=o))
            rec(out, dict(base, mode="lazy", rope=rope), t, timer, nbytes, flops, env)
        t, timer = bench(lambda: lazy_decode(q, k_pages, v_pages, table, q_pos, inv, rope="none",
                                             out=o))
        rec(out, dict(base, mode="no_rope", rope=""), t, timer, nbytes, flops, env)
        t, timer = bench(lambda: block_attention_decode(q, k_pages, v_pages, table, q_pos, inv,
                                                        source="rotate_k", max_len=T,
                                                        equal_lengths=True))
        rec(out, dict(base, mode="block", rope="rotate_k"), t, timer, 3 * nbytes, flops, env,
            note="bytes = KV read + copy written + copy read by SDPA")
        del k_pages, v_pages
        torch.cuda.empty_cache()


def prefill_cases(env, out, batches, news, inv, rng, tuning_sets=None,
                  ropes=("rotate_k", "rotate_q", "none")):
    for B in batches:
        for n_new in news:
            k_pages, v_pages, table, picks, T = shared_setup(B, n_new, rng, q_tokens=0)
            cached = T - n_new
            q = torch.randn(B * n_new, H, D, device="cuda", dtype=DT)
            qo = torch.arange(0, B * n_new + 1, n_new, dtype=torch.int32, device="cuda")
            q_pos = (cached + torch.arange(n_new, dtype=torch.int32, device="cuda")).repeat(B)
            # causal over new tokens: query i sees cached + i + 1 keys
            vis = B * (n_new * cached + n_new * (n_new + 1) // 2)
            flops = 4 * H * D * vis
            nbytes = B * T * TOKEN_KV_BYTES + 2 * q.numel() * ES
            base = dict(benchmark="prefill", batch=B, new_tokens=n_new, cached_tokens=cached,
                        page_size=PAGE, case=f"B{B} +{n_new} / 10k")
            o = torch.empty_like(q)
            for rope in ropes:
                for tun in (tuning_sets or [{}]):
                    tun = dict(tun)
                    bm = tun.pop("block_m", None)
                    plan = plan_prefill(qo.cpu(), H, HKV, "cuda", block_m=bm)
                    try:
                        t, timer = bench(lambda: lazy_prefill(  # noqa: B023
                            q, qo, q_pos, k_pages, v_pages, table, inv, rope=rope, plan=plan,
                            out=o, **tun))
                    except Exception as exc:  # noqa: BLE001  (e.g. OutOfResources of a variant)
                        print(f"  prefill {rope} {tun}: {type(exc).__name__}", flush=True)
                        continue
                    rec(out, dict(base, mode="no_rope" if rope == "none" else "lazy",
                                  rope=rope if rope != "none" else "",
                                  tuning=json.dumps(dict(tun, block_m=plan.block_m))),
                        t, timer, nbytes, flops, env)
            del k_pages, v_pages
            torch.cuda.empty_cache()


def check_once(inv):
    """One bf16 correctness check on benchmark-shaped inputs (decode + prefill vs reference)."""
    from lazy_rag.kernels import paged_attention_ref
    rng = np.random.default_rng(1)
    k_pages, v_pages, table, _, T = shared_setup(2, 40, rng, n_chunks=6, per_seq=2, q_tokens=0)
    q = torch.randn(80, H, D, device="cuda", dtype=DT)
    qo = torch.tensor([0, 40, 80], dtype=torch.int32, device="cuda")
    q_pos = (T - 40 + torch.arange(40, dtype=torch.int32, device="cuda")).repeat(2)
    errs = {}
    for rope in ["rotate_k", "rotate_q"]:
        o = lazy_prefill(q, qo, q_pos, k_pages, v_pages, table, inv, rope=rope)
        r = paged_attention_ref(q, qo, q_pos, k_pages, v_pages, table, inv, rope)
        errs[rope] = ((o.float() - r.float()).abs().max() / r.float().abs().max()).item()
    return errs


def kernel_report():
    """Registers, spills, shared memory and pipelining markers of the last attention launch."""
    from lazy_rag.kernels import paged_attention as pa
    k = pa.LAST_KERNEL
    if k is None:
        return {}
    rep = dict(regs=getattr(k, "n_regs", None), spills=getattr(k, "n_spills", None),
               smem=getattr(k.metadata, "shared", None))
    try:
        ptx = k.asm["ptx"]
        rep["cp_async"] = ptx.count("cp.async.cg") + ptx.count("cp.async.ca")
        rep["ld_local"] = ptx.count("ld.local")
        rep["ld_global"] = ptx.count("ld.global")
        rep["mma"] = ptx.count("mma.sync")
        rep["wgmma"] = ptx.count("wgmma.mma_async")
    except Exception as exc:  # noqa: BLE001
        rep["asm_error"] = str(exc)[:80]
    return rep


def cos_sin_table(n_pos, inv, scale=1.0, dtype=torch.float32):
    """[n_pos, D] table: cos | sin halves at positions 0..n_pos-1 (the reference's fp32 math)."""
    from lazy_rag.kernels import rope_cos_sin
    c, s = rope_cos_sin(torch.arange(n_pos, device=inv.device), inv, scale)
    return torch.cat([c, s], -1).to(dtype).contiguous()


def diag_check(inv, variants):
    """bf16 check of every variant vs the fp64 reference on pages whose tiles straddle shifts."""
    from lazy_rag.kernels import paged_attention_ref
    B, T = 4, 4096 + 37
    npg = -(-T // PAGE)
    k_pages, v_pages = new_pool(B * npg)
    perm = torch.randperm(B * npg).tolist()
    seqs = []
    for b in range(B):
        ent = []
        for j in range(npg):
            ln = min(PAGE, T - j * PAGE)
            shift = 100 * b + j * PAGE if j % 3 else 0   # chunk boundaries inside tiles
            ent.append((perm[b * npg + j], 100 * b + j * PAGE, ln, shift))
        seqs.append(ent)
    table = seq_table(seqs)
    q = torch.randn(B, H, D, device="cuda", dtype=DT)
    q_pos = torch.tensor([100 * b + T - 1 - 5 * b for b in range(B)], dtype=torch.int32,
                         device="cuda")
    qo = torch.arange(B + 1, dtype=torch.int32, device="cuda")
    tabs = {"f32": cos_sin_table(T + 400, inv), "bf16": cos_sin_table(T + 400, inv,
                                                                       dtype=torch.bfloat16)}
    refs = {r: paged_attention_ref(q, qo, q_pos, k_pages, v_pages, table, inv, r,
                                   compute_dtype=torch.float64) for r in ("rotate_k", "rotate_q")}
    res = {}
    for name, rope, tun in variants:
        if rope not in refs or tun.get("diag"):
            continue
        tun = dict(tun)
        if "table" in tun:
            tun["cos_sin_table"] = tabs[tun.pop("table")]
        try:
            o = lazy_decode(q, k_pages, v_pages, table, q_pos, inv, rope=rope, **tun)
            r = refs[rope]
            res[name] = ((o.double() - r).abs().max() / r.abs().max()).item()
        except Exception as exc:  # noqa: BLE001
            res[name] = f"ERR {type(exc).__name__}: {str(exc)[:120]}"
    return res


def diag(env, out, inv, cases, variants, chunk=CHUNK):
    """Time leave-one-out and candidate variants of the decode kernel on paged, permuted KV.
    chunk: tokens per rot_shift group (rotate_q); not a multiple of 2 pages -> tiles straddle."""
    for B, T in cases:
        kv_bytes, n_sets, k_pages, v_pages, tables, qs, q_pos = decode_inputs(B, T, chunk)
        tabs = {"f32": cos_sin_table(T, inv), "bf16": cos_sin_table(T, inv, dtype=torch.bfloat16)}
        nbytes = kv_bytes + 2 * B * H * D * ES
        flops = 4 * B * H * T * D
        outs = [torch.empty(B, H, D, device="cuda", dtype=DT) for _ in range(n_sets)]
        base = dict(benchmark="decode_diag", batch=B, context=T, chunk=chunk,
                    case=f"B{B} x {T // 1024}k" + ("" if chunk == CHUNK else f" c{chunk}"))
        for name, rope, tun in variants:
            kw = dict(tun)
            if "table" in kw:
                kw["cos_sin_table"] = tabs[kw.pop("table")]
            fn = lambda: [lazy_decode(qs[i], k_pages, v_pages, tables[i], q_pos, inv,  # noqa
                                      rope=rope, out=outs[i], **kw) for i in range(n_sets)]
            try:
                t, timer = bench(fn, n_sets)
            except Exception as exc:  # noqa: BLE001
                print(f"  {name}: ERR {type(exc).__name__} {str(exc)[:100]}", flush=True)
                continue
            rec(out, dict(base, mode=name, rope=rope, tuning=json.dumps(tun)), t, timer, nbytes,
                flops, env, **kernel_report())
            r = out[-1]
            print(f"      {name}: regs {r.get('regs')} spills {r.get('spills')} smem "
                  f"{r.get('smem')} cp.async {r.get('cp_async')} ld.local {r.get('ld_local')} "
                  f"mma {r.get('mma')}", flush=True)
        if (B, T) == cases[0] and chunk == CHUNK:
            kc = [torch.randn(B, HKV, T, D, device="cuda", dtype=DT) for _ in range(n_sets)]
            vc = [torch.randn(B, HKV, T, D, device="cuda", dtype=DT) for _ in range(n_sets)]
            q4 = [q[:, :, None, :] for q in qs]
            fn = lambda: [F.scaled_dot_product_attention(q4[i], kc[i], vc[i], enable_gqa=True)  # noqa
                          for i in range(n_sets)]
            t, timer = bench(fn, n_sets)
            rec(out, dict(base, mode="sdpa_contiguous", rope=""), t, timer, nbytes, flops, env)
            del kc, vc
        del k_pages, v_pages
        torch.cuda.empty_cache()


DIAG_VARIANTS = [
    ("none", "none", {}),
    ("none_bn64_s4", "none", dict(block_n=64, num_stages=4)),
    ("none_w8", "none", dict(num_warps=8)),
    ("rk", "rotate_k", {}),
    ("rk_notrig", "rotate_k", dict(diag=1)),
    ("rk_roundtrip", "rotate_k", dict(diag=2)),
    ("rk_tab32", "rotate_k", dict(table="f32")),
    ("rk_tab16", "rotate_k", dict(table="bf16")),
    ("rk_w8", "rotate_k", dict(num_warps=8)),
    ("rk_w8_s2", "rotate_k", dict(num_warps=8, num_stages=2)),
    ("rk_notrig_w8", "rotate_k", dict(diag=1, num_warps=8)),
    ("rk_roundtrip_w8", "rotate_k", dict(diag=2, num_warps=8)),
    ("rk_tab32_w8", "rotate_k", dict(table="f32", num_warps=8)),
    ("rk_bn64_s3", "rotate_k", dict(block_n=64, num_stages=3)),
    ("rk_bn64_s4", "rotate_k", dict(block_n=64, num_stages=4)),
    ("rk_bn64_w8_s4", "rotate_k", dict(block_n=64, num_warps=8, num_stages=4)),
    ("rk_hg2_bn64_s3", "rotate_k", dict(heads_per_program=2, block_n=64, num_stages=3)),
    ("rk_hg2_bn64_w8_s3", "rotate_k", dict(heads_per_program=2, block_n=64, num_warps=8,
                                           num_stages=3)),
    ("rk_hg4_bn64_s2", "rotate_k", dict(heads_per_program=4, block_n=64, num_stages=2)),
    ("rk_hg4_bn64_w8_s2", "rotate_k", dict(heads_per_program=4, block_n=64, num_warps=8,
                                           num_stages=2)),
    ("rk_hg2_bn128_w8_s2", "rotate_k", dict(heads_per_program=2, num_warps=8, num_stages=2)),
    ("rq_while", "rotate_q", dict(multi_shift=2)),
    ("rq_static", "rotate_q", dict(multi_shift=1)),
    ("rq_if", "rotate_q", {}),
    ("rq_if_nocache", "rotate_q", dict(qrot_cache=False)),
    ("rq_if_s2", "rotate_q", dict(num_stages=2)),
    ("rq_if_s4", "rotate_q", dict(num_stages=4)),
    ("rq_if_sp3", "rotate_q", dict(split_target=3.0)),
    ("rk_hg2_bn128_s2", "rotate_k", dict(heads_per_program=2, num_stages=2)),
    ("rk_hg2_tab16_s2", "rotate_k", dict(heads_per_program=2, num_stages=2, table="bf16")),
    ("rk_s2", "rotate_k", dict(num_stages=2)),
    ("rq_noshift", "rotate_q", dict(multi_shift=0)),
    ("rq_static_w8", "rotate_q", dict(num_warps=8)),
    ("rq_bn64_s3", "rotate_q", dict(block_n=64, num_stages=3)),
    ("rq_bn64_s4", "rotate_q", dict(block_n=64, num_stages=4)),
]
DIAG2 = ["none", "rk", "rk_notrig", "rk_tab16", "rk_s2", "rk_hg2_bn128_s2", "rk_hg2_tab16_s2",
         "rq_while", "rq_static", "rq_noshift", "rq_if", "rq_if_nocache", "rq_if_s2", "rq_if_s4",
         "rq_if_sp3"]
DIAG2_SHORT = ["none", "rk", "rq_static", "rq_if", "rq_if_nocache"]
DIAG_SHORT = ["none", "rk", "rk_notrig", "rk_roundtrip", "rk_tab32", "rk_w8", "rk_bn64_w8_s4",
              "rk_hg2_bn64_w8_s3", "rk_hg4_bn64_w8_s2", "rq_while", "rq_static", "rq_bn64_s4"]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "results"))
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--sweep", action="store_true", help="also time a few tuning variants")
    ap.add_argument("--sweep-only", action="store_true")
    ap.add_argument("--diag", action="store_true",
                    help="time leave-one-out / candidate variants of the decode kernel only")
    args = ap.parse_args()
    torch.manual_seed(0)
    rng = np.random.default_rng(0)
    name = torch.cuda.get_device_name()
    env = dict(device=name, torch=torch.__version__, triton=triton.__version__,
               python=platform.python_version(),
               date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"))
    env["copy_gbps"] = round(measure_copy_bw(), 1)
    env["matmul_tflops"] = round(measure_matmul(), 1)
    print(f"# {name}: copy {env['copy_gbps']} GB/s, bf16 matmul {env['matmul_tflops']} TFLOP/s",
          flush=True)
    inv = inv_freq_llama31()
    print("# bf16 check rel err:", check_once(inv), flush=True)
    records = []
    t0 = time.time()
    if args.diag:
        print("# variant check (bf16 rel err vs fp64 ref):", flush=True)
        for k_, v_ in diag_check(inv, DIAG_VARIANTS).items():
            print(f"   {k_}: {v_}", flush=True)
        first = [v for v in DIAG_VARIANTS if v[0] in DIAG2]
        diag(env, records, inv, [(32, 8192)], first)
        short = [v for v in DIAG_VARIANTS if v[0] in DIAG2_SHORT]
        diag(env, records, inv, [(32, 8192)], short, chunk=31 * PAGE)  # every chunk straddles
        diag(env, records, inv, [(128, 8192), (32, 32768)], short)
        psets = [dict(multi_shift=m) for m in (2, 3)]
        prefill_cases(env, records, [1, 16], [32, 512], inv, np.random.default_rng(0),
                      tuning_sets=psets, ropes=("rotate_q",))
        prefill_cases(env, records, [16], [512], inv, np.random.default_rng(0),
                      ropes=("rotate_k", "none"))
        os.makedirs(args.out, exist_ok=True)
        for r in records:
            r.update({k: env[k] for k in ("torch", "triton", "copy_gbps", "matmul_tflops",
                                          "date")})
        json.dump(records, open(os.path.join(args.out, "diag.json"), "w"), indent=1)
        print(f"# diag done in {time.time() - t0:.0f} s")
        for r in records:
            print(f"{r['case']:<16} {r['mode']:<16} {r.get('rope', ''):<9} {r['time_us']:9.1f} us "
                  f"{r['gbps']:7.0f} GB/s regs {r.get('regs')} spills {r.get('spills')} "
                  f"smem {r.get('smem')} {r.get('tuning', '')}")
        return
    if args.sweep:
        sets = [dict(block_n=bn, num_warps=4, num_stages=st, split_target=sp)
                for bn in (128, 256) for st in (2, 3, 4) for sp in (2, 4, 8)]
        decode_sweep(env, records, [32], [8192], inv, tuning_sets=sets,
                     ropes=("rotate_k", "none"))
        sets = [dict(block_n=128, num_warps=4, num_stages=st, split_target=sp, qrot_cache=qc)
                for st in (2, 3) for sp in (2, 4) for qc in (True, False)]
        decode_sweep(env, records, [32], [8192], inv, tuning_sets=sets, ropes=("rotate_q",))
        psets = [dict(block_m=bm, block_n=bn, num_warps=w, num_stages=s)
                 for bm in (32, 64) for bn in (64, 128) for w in (4, 8) for s in (2, 3)]
        prefill_cases(env, records, [16], [512], inv, rng, tuning_sets=psets,
                      ropes=("rotate_k",))
        for r in records:
            r["benchmark"] += "_sweep"
        if args.sweep_only:
            os.makedirs(args.out, exist_ok=True)
            json.dump(records, open(os.path.join(args.out, "sweep.json"), "w"), indent=1)
            for r in records:
                print(r["benchmark"], r["rope"], r["tuning"], r["time_us"], r["gbps"],
                      r["pct_of_roofline"])
            return
    batches = [1, 32] if args.quick else [1, 8, 32, 128]
    ctxs = [8192] if args.quick else [2048, 8192, 32768]
    decode_sweep(env, records, batches, ctxs, inv)
    shared_decode(env, records, [8, 32] if args.quick else [8, 32, 128], inv, rng)
    prefill_cases(env, records, [1, 16], [32, 512], inv, rng)
    if not args.quick:   # probe: rotate_q prefill with the decode's two-page shift branch
        n0 = len(records)
        prefill_cases(env, records, [1, 16], [32, 512], inv, rng,
                      tuning_sets=[dict(multi_shift=3)], ropes=("rotate_q",))
        for r in records[n0:]:
            r["benchmark"] = "prefill_sweep"
    for r in records:
        r.update({k: env[k] for k in ("torch", "triton", "copy_gbps", "matmul_tflops", "date")})
    tag = name.replace("NVIDIA ", "").replace(" ", "_").lower()
    os.makedirs(args.out, exist_ok=True)
    path = os.path.join(args.out, f"kernels_{tag}.json")
    with open(path, "w") as f:
        json.dump(records, f, indent=1)
    print(f"# {len(records)} records in {time.time() - t0:.0f} s -> {path}")
    print_table(records, env)


def print_table(records, env):
    print(f"\n## {env['device']} (copy {env['copy_gbps']} GB/s, matmul {env['matmul_tflops']} "
          f"TFLOP/s), torch {env['torch']}, triton {env['triton']}")
    print("| benchmark | case | mode | rope | time us | GB/s | % copy bw | TFLOP/s | % roofline |")
    print("|---|---|---|---|---:|---:|---:|---:|---:|")
    for r in records:
        if r["benchmark"].endswith("_sweep"):
            continue
        print(f"| {r['benchmark']} | {r['case']} | {r['mode']} | {r.get('rope', '')} | "
              f"{r['time_us']} | {r['gbps']} | {r['pct_of_copy_bw']} | {r['tflops']} | "
              f"{r['pct_of_roofline']} |")


if __name__ == "__main__":
    main()
