"""What a one-sequence (B1) decode costs beyond reading its KV: the decode kernel (bf16 and fp8
pages, with its split merge) against an empty Triton kernel and a pure streaming read of as many
bytes, each timed as attention_kernels.py times the decode (CUDA-graph replays over input sets
cycled to defeat the L2). GPU only (issue 24: fp8 decode bandwidth within 10% of bf16's).

The read kernel streams a contiguous buffer of the decode's KV bytes with P programs (the best
of a few grids and block sizes is kept), so it is the least time any kernel needs to read those
bytes on this GPU; fp8's bytes/s over bf16's for the read alone bounds what an attention kernel
with the same fixed costs for both dtypes can show.

    python3 benchmarks/decode_floor.py [--contexts 512,8192,32768] [--out kernels_h100_decode_b1_floor]
    python3 benchmarks/decode_floor.py --sweep --contexts 8192,32768 --out kernels_h100_decode_b1_sweep

--sweep times the decode over tuning variants instead (split count past the default cap of
MAX_SPLITS, keys per tile, warps, stages; for fp8 also the register cap of its B16/B32 path) and
prints each dtype's best: whether any tuning brings fp8's bytes/s within 10% of bf16's at B1.
Each variant's output is checked against the default's (max_abs_diff).

Records: benchmarks/results/<out>.json (modes empty_kernel, decode, read_only; with --sweep,
decode_tuned, one per variant, the variant in ``tuning``).
"""
from __future__ import annotations

import argparse
import itertools
import json
import sys
from functools import partial
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

GRIDS = (132, 264, 528, 1056)
BLOCKS = (1024, 2048)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    ap.add_argument("--contexts", default="512,8192,32768")
    ap.add_argument("--out", default="decode_floor")
    ap.add_argument("--sweep", action="store_true", help="tuning variants of the decode instead of the floor")
    ap.add_argument("--results-dir", default=str(ROOT / "benchmarks" / "results"))
    args = ap.parse_args(argv)

    import torch
    import triton
    import triton.language as tl

    import attention_kernels as A
    from lazy_rag.bench.records import environment, format_table, write_records

    if not torch.cuda.is_available():
        raise SystemExit("decode_floor.py times GPU kernels: run it on a CUDA machine")

    @triton.jit
    def empty_kernel(X):
        pass

    @triton.jit
    def read_kernel(X, OUT, span, BLOCK: tl.constexpr):
        pid = tl.program_id(0)
        base = pid.to(tl.int64) * span
        acc = tl.zeros([BLOCK], dtype=tl.int32)
        for off in range(0, span, BLOCK):
            acc ^= tl.load(X + base + off + tl.arange(0, BLOCK))
        tl.store(OUT + pid, tl.sum(acc))

    shape = A.Shape()
    env = {**environment(), "triton": triton.__version__, "batch": 1, "page_size": A.PAGE,
           "shape": f"llama-3.1-8b attention ({shape.H} q heads, {shape.HKV} kv heads, d {shape.D}), one layer"}
    out_path = Path(args.results_dir) / f"{args.out}.json"
    records = []
    if args.sweep:
        return sweep(args, env, out_path)
    x = torch.zeros(1, device="cuda")
    for grid in (1, 264, 1056):
        t, timer = A.bench(lambda grid=grid: empty_kernel[(grid,)](x))
        records.append({"benchmark": "decode_b1_floor", "mode": "empty_kernel", **env, "programs": grid,
                        "time_us": round(t, 2), "timer": timer})
    for T, kv_dtype, n_sets, nbytes, decode in b1_decodes(shape, args.contexts):
        t, timer = A.bench(A.each(partial(decode, i) for i in range(n_sets)), n_sets)
        case = {"benchmark": "decode_b1_floor", **env, "kv_dtype": kv_dtype, "context": T, "n_sets": n_sets}
        records.append({**case, "mode": "decode", "bytes": nbytes, "time_us": round(t, 2),
                        "gbps": round(nbytes / t / 1e3, 1), "timer": timer})
        # a pure read of as many bytes
        words = nbytes // 4
        bufs = [torch.zeros(words + max(GRIDS) * max(BLOCKS), dtype=torch.int32, device="cuda")
                for _ in range(n_sets)]
        sink = torch.empty(max(GRIDS), dtype=torch.int32, device="cuda")
        best = None
        for programs in GRIDS:
            for block in BLOCKS:
                span = -(-words // programs // block) * block   # whole blocks: a few bytes past nbytes
                t, timer = A.bench(A.each(partial(read_kernel[(programs,)], bufs[i], sink, span, BLOCK=block)
                                          for i in range(n_sets)), n_sets)
                if best is None or t < best[0]:
                    best = (t, timer, programs, block, span * programs * 4)
        t, timer, programs, block, read = best
        records.append({**case, "mode": "read_only", "bytes": read, "time_us": round(t, 2), "programs": programs,
                        "block": block, "gbps": round(read / t / 1e3, 1), "timer": timer})
        write_records(out_path, records)
    print(format_table(records, ["mode", "kv_dtype", "context", "programs", "bytes", "time_us", "gbps"]))
    print(f"-> {out_path}")
    return 0


def b1_decodes(shape, contexts: str):
    """Per context (comma-separated) and KV dtype (bf16, then fp8 pages with keys-major values), a
    one-sequence decode over attention_kernels.py's inputs: (context, kv_dtype, n_sets, bytes
    read, decode), decode(i, into=True, **tuning) running input set i (into its own output)."""
    import torch

    import attention_kernels as A
    from lazy_rag.kernels import lazy_decode, to_keys_major

    for T in (int(c) for c in contexts.split(",")):
        kv_bytes, n_sets, k_pages, v_pages, tables, qs, q_pos = A.decode_inputs(shape, 1, T)
        (k8, ks), (v8, vs) = A.quantize_pool(k_pages), A.quantize_pool(v_pages)
        outs = [torch.empty(1, shape.H, shape.D, device="cuda", dtype=shape.dtype) for _ in range(n_sets)]
        for kv_dtype, pages, scales, nbytes in (
                ("bf16", (k_pages, v_pages), {}, kv_bytes),
                ("fp8", (k8, to_keys_major(v8)), dict(k_scale=ks, v_scale=vs), T * A.fp8_token_bytes(shape))):
            def decode(i, into=True, pages=pages, scales=scales, outs=outs, **tuning):
                return lazy_decode(qs[i], *pages, tables[i], q_pos, shape.inv_freq, rope_mode="rotate_q",
                                   out=outs[i] if into else None, **scales, **tuning)

            yield T, kv_dtype, n_sets, nbytes, decode
        del k_pages, v_pages, k8, v8, outs
        torch.cuda.empty_cache()


def sweep_variants(kv_dtype: str) -> list[dict]:
    """The default ({}) and the variants swept: split count, keys per tile, warps, stages; for
    fp8 also FP8_DECODE_MAXNREG with up to five stages (the B16/B32 path's settings)."""
    from lazy_rag.kernels.paged_attention import FP8_DECODE_MAXNREG

    out = [{}] + [dict(num_splits=sp, block_n=bn, num_warps=w, num_stages=st)
                  for sp, bn, w, st in itertools.product((16, 32, 64, 128, 256), (64, 128), (4, 8), (2, 3, 4))]
    if kv_dtype == "fp8":
        out += [dict(num_splits=sp, block_n=bn, num_warps=4, num_stages=st, maxnreg=FP8_DECODE_MAXNREG)
                for sp, bn, st in itertools.product((32, 64, 128, 256), (64, 128), (3, 4, 5))]
    return out


def sweep(args, env: dict, out_path: Path) -> int:
    import attention_kernels as A
    from lazy_rag.bench.records import format_table, write_records
    from lazy_rag.kernels import paged_attention

    paged_attention.MAX_SPLITS = 256   # the cap lifted: does a B1 decode want more programs?
    records = []
    for T, kv_dtype, n_sets, nbytes, decode in b1_decodes(A.Shape(), args.contexts):
        default = decode(0, into=False).float()
        for tun in sweep_variants(kv_dtype):
            diff = (decode(0, into=False, **tun).float() - default).abs().max()
            t, timer = A.bench(A.each(partial(decode, i, **tun) for i in range(n_sets)), n_sets)
            records.append({"benchmark": "decode_b1_sweep", "mode": "decode_tuned", **env, "kv_dtype": kv_dtype,
                            "context": T, "n_sets": n_sets, "tuning": json.dumps(tun), "bytes": nbytes,
                            "time_us": round(t, 2), "gbps": round(nbytes / t / 1e3, 1), "timer": timer,
                            "max_abs_diff": float(diff)})
        write_records(out_path, records)
    best = []
    for T in sorted({r["context"] for r in records}):
        pick = {}
        for d in ("bf16", "fp8"):
            rs = [r for r in records if r["context"] == T and r["kv_dtype"] == d]
            pick[d] = (min(rs, key=lambda r: r["time_us"]), next(r for r in rs if r["tuning"] == "{}"))
        for d, (b, dflt) in pick.items():
            best.append({"kv_dtype": d, "context": T, "default_us": dflt["time_us"], "best_us": b["time_us"],
                         "best_gbps": b["gbps"], "best_tuning": b["tuning"],
                         "fp8_over_bf16_best": round(pick["fp8"][0]["gbps"] / pick["bf16"][0]["gbps"], 3)})
    print(format_table(best, ["kv_dtype", "context", "default_us", "best_us", "best_gbps", "fp8_over_bf16_best",
                              "best_tuning"]))
    print(f"-> {out_path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
