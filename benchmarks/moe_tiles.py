"""The routed-experts kernels' launch configurations (kernels/moe.py, ``MoeTiles``) swept on a GPU:
how fast each kernel reads its experts' weights under each configuration, against the device's copy
rate. GPU only.

For one shape (default Qwen3-30B-A3B's routed experts: 128 experts, hidden 2048, moe_intermediate
768, top-8, bf16) and each ``--batch``: random weights and a seeded uniform random routing (each
token's top-k experts a uniform random k-subset), then for each kernel (``gate_up``: the gate/up
GEMMs with silu(gate) * up; ``down``: the down GEMM times the routing weight) each configuration
of a grid (block_n 32/64/128, block_k 64/128/256, num_warps 4/8, num_stages 2/3/4), the other
kernel held at the default (``MoeTiles()``). Each configuration:

- is checked against the default configuration's output (torch.allclose, rtol 1.6e-2 / atol 1e-3:
  bf16's; the output is NaN-poisoned first, so a tile left unwritten fails); a configuration that
  does not compile or launch (too much shared memory, ...) is recorded with its ``error``;
- is timed alone: a few warm-up launches, then the median of ``--reps`` (>= 20) launches, each
  between CUDA events after the L2 is emptied (a 256 MB memset, as triton.testing.do_bench does),
  so the weights come from DRAM as in a real decode step;
- gets ``weights_gb_per_s`` = the bytes of the weights the hit experts own (gate_up [2I, H] or
  down [H, I] per hit expert) / that time, beside ``copy_gb_per_s``, the device's copy rate
  measured in the run on a buffer of as many bytes (a torch copy, bytes read + written / time,
  as benchmarks/attention_kernels.py counts it), and ``fraction_of_copy``, their ratio.

Then the fastest correct configuration per (batch, kernel), the two kernels' total time with the
best configurations against the default, and the whole ``moe_experts`` call (sort, both kernels,
the sum over k) timed with the best ``MoeTiles`` against the default (records of mode
``moe_experts``). Records (one per batch, kernel, configuration; flat, ``lazy_rag.bench.records``'
format) are written after every configuration, so a run cut off keeps what it measured:
benchmarks/results/moe_tiles_<device>.json unless ``--out``.

    python benchmarks/moe_tiles.py                  # full grid, batch 1 and 32: ~3-5 min on an H200
    python benchmarks/moe_tiles.py --quick          # a smaller grid: ~1 min
    python benchmarks/moe_tiles.py --batch 32 --kernels down --experts 64 --hidden 4096 --inter 1408
"""
from __future__ import annotations

import argparse
import dataclasses
import gc
import itertools
import math
import statistics
import sys
import time
from pathlib import Path

import torch

RESULTS = Path(__file__).resolve().parent / "results"
GRID = dict(block_n=(32, 64, 128), block_k=(64, 128, 256), num_warps=(4, 8), num_stages=(2, 3, 4))
QUICK_GRID = dict(block_n=(64, 128), block_k=(64, 128, 256), num_warps=(4, 8), num_stages=(3,))
KERNELS = ("gate_up", "down")
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
RTOL, ATOL = 1.6e-2, 1e-3            # bf16's (torch.testing's rtol), atol for outputs of order 1
FLUSH_BYTES = 256 << 20              # more than any GPU's L2 (H100/H200: 50 MB)
DEVICE = "cuda"


def cuda_available() -> bool:
    return torch.cuda.is_available()


def sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def time_us(fn, reps: int, flush: torch.Tensor, warmup: int = 5) -> float:
    """Median microseconds of fn() between CUDA events, L2 emptied before each launch."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    starts = [torch.cuda.Event(enable_timing=True) for _ in range(reps)]
    ends = [torch.cuda.Event(enable_timing=True) for _ in range(reps)]
    for start, end in zip(starts, ends):
        flush.zero_()
        start.record()
        fn()
        end.record()
    torch.cuda.synchronize()
    return statistics.median(s.elapsed_time(e) for s, e in zip(starts, ends)) * 1e3


def copy_gb_per_s(nbytes: int, reps: int, flush: torch.Tensor, device: str) -> float:
    """The device's copy rate on a buffer of nbytes: bytes read + written / median time."""
    src = torch.empty(nbytes, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    t = time_us(lambda: dst.copy_(src), reps, flush)
    return 2 * nbytes / (t * 1e-6) / 1e9


def candidates(kernel: str, grid: dict) -> list:
    """The default MoeTiles, then the grid for ``kernel`` (the other kernel at its default)."""
    from lazy_rag.kernels.moe import DEFAULT_TILES

    out = [DEFAULT_TILES]
    for bn, bk, warps, stages in itertools.product(grid["block_n"], grid["block_k"], grid["num_warps"],
                                                   grid["num_stages"]):
        tiles = dataclasses.replace(DEFAULT_TILES, **{f"{kernel}_block_n": bn, f"{kernel}_block_k": bk,
                                                      f"{kernel}_num_warps": warps, f"{kernel}_num_stages": stages})
        if tiles not in out:
            out.append(tiles)
    return out


def short_error(e: BaseException) -> str:
    """The exception's type, first line and (a compile error's message ends with the cause) last line."""
    lines = [ln.strip() for ln in str(e).splitlines() if ln.strip()]
    text = " ... ".join(dict.fromkeys(lines[:1] + lines[-1:]))
    return f"{type(e).__name__}: {text}"[:300]


class Problem:
    """A shape's random expert weights (shared by every batch) and, per batch, a routing with its
    sorted pairs and the kernels' buffers."""

    def __init__(self, experts: int, hidden: int, inter: int, top_k: int, dtype, device: str, seed: int):
        self.E, self.H, self.I, self.K, self.dtype, self.device, self.seed = experts, hidden, inter, top_k, dtype, device, seed
        g = torch.Generator(device=device).manual_seed(seed)
        self.gate_up = torch.randn(experts, 2 * inter, hidden, generator=g, device=device, dtype=dtype).mul_(hidden ** -0.5)
        self.down = torch.randn(experts, hidden, inter, generator=g, device=device, dtype=dtype).mul_(inter ** -0.5)

    def route(self, batch: int) -> None:
        from lazy_rag.kernels.moe import sort_pairs_by_expert

        g = torch.Generator(device=self.device).manual_seed(self.seed * 1000 + batch)
        self.index = torch.rand(batch, self.E, generator=g, device=self.device).argsort(dim=1)[:, :self.K]
        w = torch.rand(batch, self.K, generator=g, device=self.device) + 0.1
        self.weights = (w / w.sum(-1, keepdim=True)).to(self.dtype)
        self.x = torch.randn(batch, self.H, generator=g, device=self.device, dtype=self.dtype)
        self.pair_order, self.start, self.count = sort_pairs_by_expert(self.index, self.E)
        self.hit = int((self.count > 0).sum())
        self.act = torch.empty(batch * self.K, self.I, dtype=self.dtype, device=self.device)
        self.per_pair = torch.empty(batch * self.K, self.H, dtype=torch.float32, device=self.device)
        self.act_in = None      # the down kernel's input: the default gate/up kernel's output

    def weight_bytes(self, kernel: str) -> int:
        per_expert = {"gate_up": 2 * self.I * self.H, "down": self.H * self.I,
                      "moe_experts": 3 * self.I * self.H}[kernel]
        return self.hit * per_expert * self.gate_up.element_size()

    def launcher(self, kernel: str, tiles):
        """(fn, out): fn() launches ``kernel`` ("gate_up", "down", or "moe_experts": the whole call)
        with ``tiles``; out() is its output (the buffer it writes)."""
        from lazy_rag.kernels.moe import down_proj, gate_up_silu, moe_experts

        if kernel == "gate_up":
            return (lambda: gate_up_silu(self.x, self.gate_up, self.act, self.pair_order, self.start, self.count,
                                         self.K, tiles)), lambda: self.act
        if kernel == "down":
            return (lambda: down_proj(self.act_in, self.down, self.per_pair, self.weights.reshape(-1),
                                      self.pair_order, self.start, self.count, tiles)), lambda: self.per_pair
        held = {}

        def whole():
            held["y"] = moe_experts(self.x, self.gate_up, self.down, self.index, self.weights, tiles=tiles)
        return whole, lambda: held["y"]


def graphed(fn):
    """fn captured in a CUDA graph (as a decode step runs it): its replay, or fn if capture fails."""
    try:
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            fn()
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            fn()
        return graph.replay, "cudagraph"
    except Exception as e:  # noqa: BLE001  (timed eagerly instead: host launch gaps included)
        print(f"  (CUDA graph capture failed, timed eagerly: {short_error(e)})")
        return fn, "events"


def measure(problem: Problem, kernel: str, tiles, reference, reps: int, flush) -> dict:
    """One configuration: correct (vs reference, the default's output; None: finite), max_abs_diff,
    time_us_median, timer, error, and output (None if it did not run). The output buffer is
    NaN-poisoned before the checked launch, so nothing stale or unwritten passes."""
    fn, out = problem.launcher(kernel, tiles)
    res = dict(correct=False, max_abs_diff=None, time_us_median=None, timer=None, error=None, output=None)
    try:
        if kernel != "moe_experts":
            out().fill_(float("nan"))
        fn()
        sync(problem.device)
        got = out().clone()
        res["output"] = got
        if reference is None:
            res["correct"] = bool(torch.isfinite(got).all())
        else:
            diff = (got.float() - reference.float()).abs().max().item()
            res["max_abs_diff"] = None if math.isnan(diff) else diff     # NaN: something left unwritten
            res["correct"] = bool(torch.allclose(got.float(), reference.float(), rtol=RTOL, atol=ATOL))
        timed, res["timer"] = graphed(fn) if kernel == "moe_experts" else (fn, "events")
        res["time_us_median"] = round(time_us(timed, reps, flush), 2)
    except Exception as e:  # noqa: BLE001  (a configuration that does not compile or launch: recorded)
        res["error"] = short_error(e)
        res["correct"] = False
    return res


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    ap.add_argument("--experts", type=int, default=128, help="number of routed experts E")
    ap.add_argument("--hidden", type=int, default=2048, help="hidden size H")
    ap.add_argument("--inter", type=int, default=768, help="each expert's intermediate size I (moe_intermediate)")
    ap.add_argument("--top-k", type=int, default=8, help="experts per token")
    ap.add_argument("--batch", default="1,32", help="comma-separated tokens per step")
    ap.add_argument("--dtype", default="bf16", choices=sorted(DTYPES))
    ap.add_argument("--kernels", default="gate_up,down", help="which kernels to sweep (gate_up, down)")
    ap.add_argument("--quick", action="store_true",
                    help=f"a smaller grid ({' x '.join(map(str, map(len, QUICK_GRID.values())))} per kernel; ~1 min)")
    ap.add_argument("--reps", type=int, default=None, help="timed launches per configuration (default 50, --quick 20)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", type=Path, default=None, help="records file (default benchmarks/results/moe_tiles_<device>.json)")
    args = ap.parse_args(argv)

    if not cuda_available():
        raise SystemExit("moe_tiles.py times the MoE kernels on a GPU, and this machine has no CUDA device "
                         "(torch.cuda.is_available() is False): run it on a CUDA machine.")
    device = DEVICE
    import triton
    from lazy_rag.kernels.moe import DEFAULT_TILES, MoeTiles
    from lazy_rag.kernels.reference import moe_experts_ref

    from lazy_rag.bench.records import environment, format_table, write_records

    kernels = args.kernels.split(",")
    if not set(kernels) <= set(KERNELS):
        raise SystemExit(f"--kernels: {args.kernels!r}, expected a comma-separated subset of {','.join(KERNELS)}")
    batches = [int(b) for b in args.batch.split(",")]
    grid = QUICK_GRID if args.quick else GRID
    reps = max(20, args.reps or (20 if args.quick else 50))
    dtype = DTYPES[args.dtype]
    env = dict(environment(), triton=triton.__version__)
    tag = env["device"].replace("NVIDIA ", "").replace(" ", "_").lower()
    out_path = args.out or RESULTS / f"moe_tiles_{tag}.json"
    command = "python benchmarks/moe_tiles.py " + " ".join(sys.argv[1:] if argv is None else argv)
    tile_fields = [f.name for f in dataclasses.fields(MoeTiles)]

    t0 = time.time()
    problem = Problem(args.experts, args.hidden, args.inter, args.top_k, dtype, device, args.seed)
    flush = torch.empty(FLUSH_BYTES, dtype=torch.uint8, device=device)
    shape = dict(experts=args.experts, hidden=args.hidden, inter=args.inter, top_k=args.top_k, dtype=args.dtype)
    print(f"# {env['device']}, triton {env['triton']}: E={args.experts} H={args.hidden} I={args.inter} "
          f"top_k={args.top_k} {args.dtype}; {sum(len(candidates(k, grid)) for k in kernels)} configurations "
          f"per batch, {reps} reps each -> {out_path}", flush=True)
    records, summary = [], []

    def record(batch, mode, tiles, res, copy_rate, ref_err, choice=None):
        own = tiles.of(mode) if mode in KERNELS else (None,) * 4
        nbytes = problem.weight_bytes(mode)
        t = res["time_us_median"]
        gbps = nbytes / (t * 1e-6) / 1e9 if t else None
        rec = {"benchmark": "moe_tiles", "mode": mode, "device": env["device"], **shape, "batch": batch,
               "hit_experts": problem.hit, "weight_bytes": nbytes,
               "block_n": own[0], "block_k": own[1], "num_warps": own[2], "num_stages": own[3],
               "default": tiles == DEFAULT_TILES, "choice": choice, **{f: getattr(tiles, f) for f in tile_fields},
               "time_us_median": t, "timer": res["timer"], "reps": reps, "weights_gb_per_s": None if gbps is None else round(gbps, 1),
               "copy_gb_per_s": round(copy_rate, 1), "fraction_of_copy": None if gbps is None else round(gbps / copy_rate, 3),
               "correct": res["correct"], "max_abs_diff": res["max_abs_diff"], "error": res["error"],
               "default_rel_err_vs_torch_ref": ref_err,
               **{k: env[k] for k in ("torch", "transformers", "triton", "python", "date")}, "command": command}
        records.append(rec)
        write_records(out_path, records)      # after every configuration: a run cut off keeps its records
        return rec

    for batch in batches:
        problem.route(batch)
        # the default configuration's whole call against the torch reference (fp32 products)
        fn, out = problem.launcher("moe_experts", DEFAULT_TILES)
        fn()
        ref = moe_experts_ref(problem.x, problem.gate_up, problem.down, problem.index, problem.weights)
        ref_err = round(((out().float() - ref.float()).abs().max() / ref.float().abs().max()).item(), 5)
        del fn, out, ref
        print(f"## batch {batch}: {problem.hit} of {args.experts} experts hit; default moe_experts vs the torch "
              f"reference: max rel err {ref_err}", flush=True)
        # the down kernel's input: the default gate/up kernel's output
        problem.launcher("gate_up", DEFAULT_TILES)[0]()
        problem.act_in = problem.act.clone()
        best = {}
        for kernel in kernels:
            copy_rate = copy_gb_per_s(problem.weight_bytes(kernel), reps, flush, device)
            reference = None
            batch_recs = []
            for tiles in candidates(kernel, grid):
                res = measure(problem, kernel, tiles, reference, reps, flush)
                if tiles == DEFAULT_TILES:
                    if not res["correct"] or not res["time_us_median"]:
                        raise SystemExit(f"the default configuration failed for {kernel}: "
                                         f"{res['error'] or 'non-finite output'}")
                    reference = res["output"]
                res.pop("output")
                rec = record(batch, kernel, tiles, res, copy_rate, ref_err)
                batch_recs.append(rec)
                flag = "" if rec["correct"] else f"  {rec['error'] or 'WRONG: ' + wrong(rec)}"
                print(f"  b{batch} {kernel:7s} n{rec['block_n']:<3} k{rec['block_k']:<3} w{rec['num_warps']} "
                      f"s{rec['num_stages'] or '-'}: {fmt_us(rec['time_us_median'])} us  "
                      f"{fmt_frac(rec['fraction_of_copy'])} of copy{flag}", flush=True)
            ok = [r for r in batch_recs if r["correct"] and r["time_us_median"]]
            default = batch_recs[0]
            best[kernel] = min(ok, key=lambda r: r["time_us_median"])
            shown = [default] + [r for r in sorted(ok, key=lambda r: r["time_us_median"])[:5] if r is not default]
            print(format_table(shown, ["batch", "mode", "default", "block_n", "block_k", "num_warps", "num_stages",
                                       "time_us_median", "weights_gb_per_s", "copy_gb_per_s", "fraction_of_copy",
                                       "correct"]))
            bad = [r for r in batch_recs if not r["correct"]]
            if bad:
                print(f"  {len(bad)} configurations failed or wrong: " + "; ".join(
                    f"n{r['block_n']} k{r['block_k']} w{r['num_warps']} s{r['num_stages']}: "
                    f"{r['error'] or wrong(r)}" for r in bad[:6])
                    + (" ..." if len(bad) > 6 else ""))
        # both kernels: the sum of their times, and the whole call, best tiles against the default
        best_tiles = DEFAULT_TILES
        for kernel, rec in best.items():
            best_tiles = dataclasses.replace(best_tiles, **{f"{kernel}_{f}": rec[f]
                                                            for f in ("block_n", "block_k", "num_warps", "num_stages")})
        whole = {}
        copy_rate = copy_gb_per_s(problem.weight_bytes("moe_experts"), reps, flush, device)
        for name, tiles in (("default", DEFAULT_TILES), ("best", best_tiles)):
            res = measure(problem, "moe_experts", tiles, whole.get("default_out"), reps, flush)
            whole[name] = res["time_us_median"]
            whole[name + "_out"] = res.pop("output")
            record(batch, "moe_experts", tiles, res, copy_rate, ref_err, choice=name)
            if not res["correct"]:
                print(f"  moe_experts with the {name} tiles: {res['error'] or wrong(res)}")
        default_sum = sum(next(r for r in records if r["batch"] == batch and r["mode"] == k and r["default"])
                          ["time_us_median"] for k in best)
        best_sum = sum(r["time_us_median"] for r in best.values())
        line = dict(batch=batch, kernels_default_us=round(default_sum, 1), kernels_best_us=round(best_sum, 1),
                    kernels_speedup=round(default_sum / best_sum, 3), moe_experts_default_us=whole["default"],
                    moe_experts_best_us=whole["best"],
                    moe_experts_speedup=(round(whole["default"] / whole["best"], 3)
                                         if whole["best"] and whole["default"] else None),
                    best_tiles=", ".join(f"{k}={v}" for k, v in dataclasses.asdict(best_tiles).items()
                                         if getattr(DEFAULT_TILES, k) != v) or "the default")
        summary.append((line, best))
        del whole
        gc.collect()
        if device.startswith("cuda"):
            torch.cuda.empty_cache()

    print(f"\n# {len(records)} records in {time.time() - t0:.0f} s -> {out_path}")
    for line, best in summary:
        for kernel, r in best.items():
            print(f"best b{line['batch']} {kernel}: block_n={r['block_n']} block_k={r['block_k']} "
                  f"num_warps={r['num_warps']} num_stages={r['num_stages']}: {r['time_us_median']} us, "
                  f"{r['weights_gb_per_s']} GB/s = {r['fraction_of_copy']} of copy ({r['copy_gb_per_s']} GB/s)")
    print(format_table([line for line, _ in summary],
                       ["batch", "kernels_default_us", "kernels_best_us", "kernels_speedup", "moe_experts_default_us",
                        "moe_experts_best_us", "moe_experts_speedup", "best_tiles"]))
    return 0


def wrong(r: dict) -> str:
    d = r["max_abs_diff"]
    return "outputs left unwritten (NaN)" if d is None else f"differs from the default's output, max abs diff {d:.3g}"


def fmt_us(t) -> str:
    return f"{t:8.1f}" if t else "       -"


def fmt_frac(f) -> str:
    return "   -" if f is None else f"{f:.2f}"


if __name__ == "__main__":
    sys.exit(main())
