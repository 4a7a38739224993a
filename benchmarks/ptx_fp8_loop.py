"""Offline sm_90 compile of the attention kernels' benchmark configurations, bf16 and fp8 pages:
instruction counts of the KV loop (PTX and SASS), registers and spills. No GPU needed.

    python3 benchmarks/ptx_fp8_loop.py [--dump DIR] [--arch 90] [--only decode|prefill|tiles]
        [--v-dims-major] [--rope-mode rotate_q|none]

The launchers (paged_attention.launch, prefill_runs.launch_runs) are called on small CPU tensors
of the benchmark's shape (Llama-3.1-8B attention: H 32, Hkv 8, d 128, page 64; the strides, and so
Triton's specialisation, are those of the GPU run) with the JIT's `run` replaced by an offline
compile for GPUTarget("cuda", ARCH, 64): the launch's own arguments go through Triton's own
binder (same signature, constexprs and divisibility attributes as a real launch), and the SM
count and shared memory per SM are the H100 SXM's, so that the split-KV choice and the fp8
decode's stages are the GPU's. Cases: decode (tiles kernel) at B32 and B1 x 8k and at B32 over
a table with explicit slot positions (rows -1); prefill through the runs kernel; `tiles`, a
prefill through the tiles kernel (lazy_rag.bench.tiles_prefill's launch). Compile with the GPU machine's Triton
(a wheel installed into a folder put first on PYTHONPATH) to see the code it runs.

Counts: per kernel, over the whole PTX and over the software-pipelined KV loop body (the PTX
basic blocks between the loop's label and its backward branch that hold an MMA; the largest such
loop when several), and from the SASS (ptxas of the Triton wheel, cuobjdump): total and loop
instructions by class (conversions, byte permutes, shifts / LOP3, wgmma, shared loads / stores).
--dump DIR writes each kernel's .ptx / .sass / .ttgir there. A hash of each kernel's PTX code
(debug info, line directives and debug labels left out) is printed so that a change of the bf16
kernels shows (the fp8 work must leave them identical; a hash can change with register names
alone: compare the dumped SASS). Loops are found by their MMA (mma.sync in decode's 16-row
tiles, wgmma in prefill); a loop the parser misses reads 0.
"""
from __future__ import annotations

import argparse
import collections
import hashlib
import os
import re
import subprocess
import tempfile

os.environ.pop("TRITON_INTERPRET", None)
os.environ.setdefault("TRITON_DEFAULT_FP_FUSION", "1")     # the GPU runs' default

import torch  # noqa: E402
import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource, make_backend  # noqa: E402
from triton.runtime.jit import create_function_from_signature  # noqa: E402

from lazy_rag.kernels import PageTable, paged_attention, prefill_runs  # noqa: E402
from lazy_rag.kernels.kv_quant import quantize_rows  # noqa: E402
from lazy_rag.kernels.v_layout import to_keys_major  # noqa: E402

H, HKV, D, PAGE = 32, 8, 128, 64
V_KEYS_MAJOR = True     # fp8 V pages as the pool lays them out; --v-dims-major: the layout before
ROPE_MODE = "rotate_q"  # the decode and tiles cases' (--rope-mode: "none" compiles the bound
                        # without RoPE)
NUM_SMS = 132
SMEM_PER_SM = 228 * 1024     # H100 SXM: the fp8 decode's num_stages depend on it


def offline_compiler(arch: int, results: dict, name: str):
    """A replacement for JITFunction.run: bind the launch's arguments as Triton does, compile
    for the target, store the CompiledKernel under results[name]."""
    target = GPUTarget("cuda", arch, 64)
    backend = make_backend(target)

    def run(self, *args, grid, warmup, **kwargs):
        binder = create_function_from_signature(self.signature, self.params, backend)
        bound_args, specialization, options = binder(*args, **kwargs)
        options, signature, constexprs, attrs = self._pack_args(backend, kwargs, bound_args,
                                                                specialization, options)
        src = ASTSource(self, signature, constexprs, attrs)
        results[name] = triton.compile(src, target=target, options=options.__dict__)
        return results[name]
    return run


def table(batch: int, pages_per_seq: int, tokens_last: int, chunk_pages: int = 32,
          slot_rows: bool = False):
    """batch sequences of pages_per_seq pages (rot_shift per chunk of chunk_pages pages);
    slot_rows: with explicit slot positions, every entry's row -1 (the kernel's HAS_SLOT_POS
    path, as the attention benchmark's decode_slot_pos "rows_-1" case)."""
    ids, pos, ln, rs = [], [], [], []
    for b in range(batch):
        ids.append([b * pages_per_seq + i for i in range(pages_per_seq)])
        pos.append([i * PAGE for i in range(pages_per_seq)])
        ln.append([PAGE] * (pages_per_seq - 1) + [tokens_last])
        rs.append([(i // chunk_pages) * chunk_pages * PAGE for i in range(pages_per_seq)])
    sp = [[None] * pages_per_seq for _ in range(batch)] if slot_rows else None
    return PageTable.from_lists(ids, pos, ln, rs, slot_pos=sp)


def pool(num_pages: int, fp8: bool):
    kp = torch.zeros(num_pages, HKV, PAGE, D, dtype=torch.bfloat16)
    vp = torch.zeros_like(kp)
    if not fp8:
        return kp, vp, {}
    (k8, ks), (v8, vs) = quantize_rows(kp), quantize_rows(vp)
    if V_KEYS_MAJOR:    # the engine's fp8 pool layout (kernels/v_layout.py)
        v8 = to_keys_major(v8)
    return k8, v8, dict(k_scale=ks, v_scale=vs)


def decode(batch: int, ctx: int, fp8: bool, slot_rows: bool = False):
    pps = ctx // PAGE
    t = table(batch, pps, PAGE, slot_rows=slot_rows)
    k, v, sc = pool(batch * pps, fp8)
    q = torch.zeros(batch, H, D, dtype=torch.bfloat16)
    ar = torch.arange(batch + 1, dtype=torch.int32)
    inv = torch.ones(D // 2)
    paged_attention.launch(q, ar, torch.full((batch,), ctx - 1, dtype=torch.int32), k, v, t, inv,
                           rope_mode=ROPE_MODE, attention_scaling=1.0, sm_scale=None,
                           tile_seq=ar[:batch], tile_q0=ar[:batch], block_m=1,
                           max_tiles_hint=t.max_pages, num_splits=None, out=None, **sc)


def prefill(batch: int, new: int, cached: int, fp8: bool, kernel: str = "runs"):
    """A prefill of `new` tokens over `cached` per sequence through the runs kernel (rotate_q),
    or, with kernel="tiles", through the tiles kernel (ROPE_MODE) as tiles_prefill plans it."""
    from lazy_rag.bench.tiles_prefill import tiles_block_m
    from lazy_rag.kernels.prefill import default_block_m, plan_prefill
    total = cached + new
    pps = -(-total // PAGE)
    t = table(batch, pps, total - (pps - 1) * PAGE)
    k, v, sc = pool(batch * pps, fp8)
    qo = torch.arange(0, (batch + 1) * new, new, dtype=torch.int32)
    q = torch.zeros(batch * new, H, D, dtype=torch.bfloat16)
    q_pos = torch.arange(cached, total, dtype=torch.int32).repeat(batch)
    # the GPU's plan (rows per tile from the SM count)
    block_m = (tiles_block_m(new, H, HKV, "cuda") if kernel == "tiles"
               else default_block_m(new, H, HKV, "cuda", total=batch * new))
    plan = plan_prefill(qo, H, HKV, "cpu", block_m=block_m)
    if kernel == "tiles":
        paged_attention.launch(q, qo, q_pos, k, v, t, torch.ones(D // 2), rope_mode=ROPE_MODE,
                               attention_scaling=1.0, sm_scale=None, tile_seq=plan.tile_seq,
                               tile_q0=plan.tile_q0, block_m=plan.block_m,
                               max_tiles_hint=t.max_pages, num_splits=None, out=None,
                               split_target=plan.split_target, **sc)
        return
    prefill_runs.launch_runs(q, qo, q_pos, k, v, t, torch.ones(D // 2), rope_mode="rotate_q",
                             attention_scaling=1.0, sm_scale=None, tile_seq=plan.tile_seq,
                             tile_q0=plan.tile_q0, block_m=plan.block_m,
                             max_tiles_hint=t.max_pages, num_splits=None, out=None,
                             split_target=plan.split_target, **sc)


CASES = {
    "decode B32x8k": ("decode", lambda fp8: decode(32, 8192, fp8)),
    "decode B1x8k": ("decode", lambda fp8: decode(1, 8192, fp8)),
    "decode B32x8k rows_-1": ("decode", lambda fp8: decode(32, 8192, fp8, slot_rows=True)),
    "runs B1+32": ("prefill", lambda fp8: prefill(1, 32, 10240, fp8)),
    "runs B1+512": ("prefill", lambda fp8: prefill(1, 512, 10240, fp8)),
    "runs B16+32": ("prefill", lambda fp8: prefill(16, 32, 10240, fp8)),
    "runs B16+512": ("prefill", lambda fp8: prefill(16, 512, 10240, fp8)),
    "tiles B16+512": ("tiles", lambda fp8: prefill(16, 512, 10240, fp8, "tiles")),
}

PTX_CLASSES = {
    "cvt": re.compile(r"^\s*cvt\."),
    "cvt.e4m3": re.compile(r"^\s*cvt\.\S*e4m3"),
    "prmt": re.compile(r"^\s*prmt\."),
    "shift/lop": re.compile(r"^\s*(shl|shr|and|or|lop3)\.b"),
    "mul.f32": re.compile(r"^\s*(mul|fma)\.\S*f32"),
    "mma": re.compile(r"^\s*(wgmma\.mma_async|mma\.sync)"),
    "ld.shared": re.compile(r"^\s*ld\.shared"),
    "ld.shared.b8": re.compile(r"^\s*ld\.shared\.(b8|u8)"),
    "ldmatrix": re.compile(r"^\s*ldmatrix"),
    "st.shared": re.compile(r"^\s*st\.shared"),
    "cp.async": re.compile(r"^\s*cp\.async"),
}
SASS_CLASSES = {
    "F2F/F2FP/I2F": re.compile(r"\b(F2F|F2FP|I2F|F2I|HADD2\.F32)\b"),
    "PRMT": re.compile(r"\bPRMT\b"),
    "SHF/LOP3/SHL": re.compile(r"\b(SHF|LOP3|SHL|SHR|IMAD\.SHL)\b"),
    "HMMA/HGMMA": re.compile(r"\bH[G]?MMA\b"),
    "LDS/LDSM": re.compile(r"\b(LDS|LDSM)(\.\S+)?\s"),
    "LDS.U8": re.compile(r"\bLDS\.(U8|S8)\b"),
    "STS/STSM": re.compile(r"\b(STS|STSM)(\.\S+)?\s"),
    "LDL/STL": re.compile(r"\b(LDL|STL)\b"),
}


def ptx_loops(ptx: str) -> list[list[str]]:
    """Bodies of the PTX loops that hold a wgmma: the lines between a label and a later
    branch back to it (innermost first)."""
    lines = ptx.splitlines()
    labels = {}
    loops = []
    for i, line in enumerate(lines):
        m = re.match(r"^\s*\$?(L__BB\w+):", line)
        if m:
            labels[m.group(1)] = i
        m = re.search(r"\bbra(?:\.uni)?\s+\$?(L__BB\w+);", line)
        if m and m.group(1) in labels and labels[m.group(1)] < i:
            body = lines[labels[m.group(1)]:i + 1]
            if any(re.search(r"\b(wgmma\.mma_async|mma\.sync)", x) for x in body):
                loops.append(body)
    return loops


def sass_loops(sass: str) -> list[list[str]]:
    """The SASS loops holding an HGMMA: lines from a branch target to a backward BRA to it."""
    lines = [x for x in sass.splitlines() if re.search(r"/\*[0-9a-f]{4}\*/", x)]
    addr = {}
    loops = []
    for i, line in enumerate(lines):
        m = re.search(r"/\*([0-9a-f]{4,})\*/", line)
        if m:
            addr[int(m.group(1), 16)] = i
        m = re.search(r"\bBRA\b.*?(?:`\(\.L_x_\d+\)|0x([0-9a-f]+))", line)
        if m and m.group(1):
            tgt = int(m.group(1), 16)
            if tgt in addr and addr[tgt] < i:
                body = lines[addr[tgt]:i + 1]
                if any(re.search(r"\bH[G]?MMA\b", x) for x in body):
                    loops.append(body)
    return loops


def code_hash(ptx: str) -> str:
    """Hash of the PTX's code: without the debug sections, .loc / .file lines, comments and the
    debug scopes' $L__tmp labels, which change with source line numbers and inlined helpers only."""
    code = ptx.split("\t.section\t.debug")[0]
    keep = [x.split("//")[0].rstrip() for x in code.splitlines()
            if not re.match(r"^\s*\.(loc|file)\b", x) and not re.match(r"^\$L__tmp\d+:$", x)]
    return hashlib.sha1("\n".join(k for k in keep if k).encode()).hexdigest()[:10]


def sass_of(kernel) -> str:
    cubin = kernel.asm.get("cubin")
    bin_dir = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin")
    tool = os.path.join(bin_dir, "cuobjdump")
    with tempfile.NamedTemporaryFile(suffix=".cubin", delete=False) as f:
        f.write(cubin)
    try:
        return subprocess.run([tool, "-sass", f.name], capture_output=True, text=True,
                              check=True).stdout
    finally:
        os.unlink(f.name)


def count(lines, classes):
    c = collections.Counter()
    for line in lines:
        for k, rx in classes.items():
            if rx.search(line):
                c[k] += 1
    return c


def n_instr_sass(lines):
    return sum(1 for x in lines if re.search(r"/\*[0-9a-f]{4,}\*/\s+[@A-Z]", x))


def n_instr_ptx(lines):
    return sum(1 for x in lines if re.match(r"^\s*[@a-z]", x) and not x.strip().startswith("//")
               and not x.strip().endswith(":") and not x.strip().startswith("."))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--dump", default=None)
    ap.add_argument("--arch", type=int, default=90)
    ap.add_argument("--only", choices=("decode", "prefill", "tiles"), default=None)
    ap.add_argument("--cases", default=None, help="comma-separated case names (substring match)")
    ap.add_argument("--dtypes", default="bf16,fp8")
    ap.add_argument("--v-dims-major", action="store_true",
                    help="fp8 V pages dims-major (the layout before the pool's keys-major one)")
    ap.add_argument("--rope-mode", default="rotate_q", choices=("rotate_q", "none"),
                    help="the decode and tiles cases' rope mode")
    args = ap.parse_args()
    global V_KEYS_MAJOR, ROPE_MODE
    V_KEYS_MAJOR = not args.v_dims_major
    ROPE_MODE = args.rope_mode
    paged_attention._num_sms = lambda device: NUM_SMS
    paged_attention._smem_per_sm = lambda device: SMEM_PER_SM
    # the split merge is not compiled (not the subject; a launch would need a driver)
    paged_attention.merge_splits = prefill_runs.merge_splits = lambda *a, **k: None
    results = {}
    rows = []
    for case, (kind, fn) in CASES.items():
        if args.only and kind != args.only:
            continue
        if args.cases and not any(s in case for s in args.cases.split(",")):
            continue
        for dt in args.dtypes.split(","):
            name = f"{case} {dt}"
            jit = (paged_attention._paged_attn_kernel if kind in ("decode", "tiles")
                   else prefill_runs._prefill_runs_kernel)
            jit.run = offline_compiler(args.arch, results, name).__get__(jit)
            try:
                fn(dt == "fp8")
            finally:
                del jit.run
            k = results[name]
            ptx = k.asm["ptx"]
            sass = sass_of(k)
            loops = ptx_loops(ptx)
            body = max(loops, key=len) if loops else []
            sl = sass_loops(sass)
            sbody = max(sl, key=len) if sl else []
            pc = count(body, PTX_CLASSES)
            sc = count(sbody, SASS_CLASSES)
            md = k.metadata
            regs, spills = ptxas_usage(k, args.arch)
            rows.append(dict(
                name=name, warps=md.num_warps, stages=md.num_stages, regs=regs, stack=spills,
                smem=md.shared, ptx_hash=code_hash(ptx),
                ptx_loop=n_instr_ptx(body), sass_loop=n_instr_sass(sbody),
                sass_total=n_instr_sass(sass.splitlines()),
                **{f"p:{c}": pc[c] for c in PTX_CLASSES}, **{f"s:{c}": sc[c] for c in SASS_CLASSES}))
            if args.dump:
                os.makedirs(args.dump, exist_ok=True)
                base = os.path.join(args.dump, name.replace(" ", "_").replace("+", "p"))
                for ext, text in (("ptx", ptx), ("sass", sass), ("ttgir", k.asm["ttgir"])):
                    with open(f"{base}.{ext}", "w") as f:
                        f.write(text)
            print(fmt(rows[-1], header=len(rows) == 1), flush=True)


def ptxas_usage(kernel, arch):
    """(registers, stack bytes: spills) of the compiled cubin (cuobjdump -res-usage)."""
    bin_dir = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin")
    with tempfile.NamedTemporaryFile(suffix=".cubin", delete=False) as f:
        f.write(kernel.asm["cubin"])
    try:
        out = subprocess.run([os.path.join(bin_dir, "cuobjdump"), "-res-usage", f.name],
                             capture_output=True, text=True, check=True).stdout
    finally:
        os.unlink(f.name)
    regs = re.search(r"REG:(\d+)", out)
    stack = re.search(r"STACK:(\d+)", out)
    return int(regs.group(1)) if regs else None, int(stack.group(1)) if stack else None


COLS = ["name", "warps", "stages", "regs", "stack", "smem", "ptx_hash", "ptx_loop", "sass_loop",
        "sass_total"] + [f"p:{c}" for c in PTX_CLASSES] + [f"s:{c}" for c in SASS_CLASSES]


def fmt(row, header=False):
    widths = {c: max(len(c), 7) for c in COLS}
    widths["name"] = 22
    out = ""
    if header:
        out = " ".join(c.rjust(widths[c]) if c != "name" else c.ljust(widths[c]) for c in COLS)
        out += "\n"
    return out + " ".join(str(row[c]).rjust(widths[c]) if c != "name" else
                          str(row[c]).ljust(widths[c]) for c in COLS)


if __name__ == "__main__":
    main()
