"""fp8 KV (kernels/kv_quant.py): the quantisation rule's error bounds, the fused write, and every
kernel over float8_e4m3fn pages against its torch reference run over the DEQUANTISED pages (fp64):
decode (tiles kernel), prefill (runs kernel, and the benchmarks' tiles prefill), both rope modes, GQA 1..8, head dims 64
and 128, pages of 1 / 4 / 16 / 64 with partial last pages, split-KV merges, explicit slot
positions, log-sum-exps; and Block-Attention's copy (dequantise, rotate, quantise again).

Rows are scaled by random powers of two before quantisation (keys by 2^-2..2, values by
2^-6..6), so every key and value has a different scale: a kernel that applied a scale to the wrong
column or row, or not at all, fails. On the CPU the kernels run in the Triton interpreter (fp32 /
fp16 compute); on the GPU (tests/kernels/run_gpu.sh) in bf16 / fp16.
"""
import pytest
import torch
import triton

from _cases import CHUNKS, DTYPES, MIXED, PREFILL, TOL, Case, inv_freq_for, rel_err
from lazy_rag.bench.tiles_prefill import tiles_prefill
from lazy_rag.kernels import (FP8, copy_rotate_run, copy_rotate_run_ref, dequantize_rows,
                              keys_major, lazy_decode, lazy_prefill, paged_attention_ref,
                              plan_prefill, quantize_rows, rope_cos_sin, rotate, to_keys_major,
                              write_kv)
from lazy_rag.kernels.kv_quant import AMAX_MIN, fake_quantize

DEV = "cuda" if torch.cuda.is_available() else "cpu"
SEQS = PREFILL + [([], 6, 2)]
LAYOUTS = {"plain": dict(), "hidden": dict(hide=0.3), "compact": dict(scatter=True),
           "both": dict(hide=0.3, scatter=True, all_hidden=2)}
# the prefill kernels: lazy_prefill's runs kernel, the benchmarks' tiles prefill
PREFILL_FNS = {"runs": lazy_prefill, "tiles": tiles_prefill}


def fp8_pages(c: Case, seed: int):
    """The case's pages, each (page, head, slot) row scaled by a random power of two, quantised:
    (k8, v8, k_scale, v_scale) on the case's device and the dequantised pages (fp32)."""
    g = torch.Generator().manual_seed(seed)
    rows = c.k.shape[:-1]
    k = c.k * 2.0 ** torch.randint(-2, 2, rows, generator=g)[..., None]
    v = c.v * 2.0 ** torch.randint(-6, 7, rows, generator=g)[..., None]
    (k8, ks), (v8, vs) = quantize_rows(k), quantize_rows(v)
    dev = c.q.device
    return ((k8.to(dev), v8.to(dev), ks.to(dev), vs.to(dev)),
            (dequantize_rows(k8, ks).to(dev), dequantize_rows(v8, vs).to(dev)))


def finite_tails(v8):
    """fp8 V pages for a keys-major copy: the case's NaN page tails and hidden slots (never to be
    read by a per-key load) become the largest finite value, which a keys-major load does read
    (whole pages, v_layout.py) and must weight by 0."""
    return torch.where(torch.isnan(v8.float()), torch.tensor(448.0, device=v8.device),
                       v8.float()).to(FP8)


def _inv(c):
    return inv_freq_for("default", c.D)[0].to(c.q.device)


def _ref(c, deq, rope_mode, return_lse=False):
    return paged_attention_ref(c.q, c.qo_indptr, c.q_pos, *deq, c.table, _inv(c), rope_mode,
                               compute_dtype=torch.float64, return_lse=return_lse)


def _check_lse(lse, ref_lse, dtype):
    """-inf exactly where the reference sees no key; elsewhere within 2 TOL: an lse error is
    absolute, proportional to the scores' size (the query's rounding to the compute dtype), and
    these keys are up to twice as long as the other kernel tests'."""
    lse, ref_lse = lse.double().cpu(), ref_lse.cpu()
    empty = torch.isneginf(ref_lse)
    assert torch.equal(torch.isneginf(lse), empty)
    assert (lse - ref_lse)[~empty].abs().max().item() < 2 * TOL[dtype]


def with_dtypes(cases):
    """Each case in every dtype on the GPU; on the CPU (the interpreter is slow) in one dtype,
    alternating, so that each kernel and mode meets both fp32 and fp16 compute."""
    if DEV == "cuda":
        return [(*c, dt) for c in cases for dt in DTYPES]
    return [(*c, DTYPES[i % len(DTYPES)]) for i, c in enumerate(cases)]


# -- the quantisation rule -----------------------------------------------------------------------

def _rows():
    """Rows of every kind: ordinary, outlier channels, huge (past fp16 and past AMAX_MAX),
    tiny (below AMAX_MIN), zero, one non-zero element."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(64, 128, generator=g) * 2.0 ** torch.randint(-20, 21, (64, 1), generator=g)
    x[1, 7] = 300.0                      # an outlier channel
    x[2] = torch.randn(128, generator=g) * 1e6
    x[3] = torch.randn(128, generator=g) * 1e-9
    x[4] = 0.0
    x[5] = 0.0
    x[5, 3] = -2.5
    return x


def test_round_trip_error_bounds():
    """Per element |x8 * s - x| <= 2^-4 |x| in e4m3's normal range (|x / s| >= 2^-6) and
    <= 2^-10 s below it, so per row <= 2^-4 max|x|; zero rows give zeros; the scale is a
    normal fp16 and no row saturates (the largest element maps to 448 within the clamp)."""
    x = _rows()
    x8, s = quantize_rows(x)
    assert x8.dtype == FP8 and s.dtype == torch.float16 and s.shape == x.shape[:-1]
    sf = s.float()
    assert (sf >= 2.0 ** -14).all() and torch.isfinite(sf).all()
    err = (dequantize_rows(x8, s) - x).abs()
    normal = (x / sf[:, None]).abs() >= 2.0 ** -6
    assert (err[normal] <= 2.0 ** -4 * x.abs()[normal]).all()
    assert (err[~normal] <= 2.0 ** -10 * sf[:, None].expand_as(x)[~normal]).all()
    amax = x.abs().amax(-1)
    rel = err.amax(-1) / amax.clamp_min(1e-30)
    assert (rel[amax >= AMAX_MIN] <= 2.0 ** -4).all()
    assert torch.equal(dequantize_rows(x8[4], s[4]), torch.zeros(128))
    # one element: it maps to 448 within the scale's fp16 rounding (2^-11), the rest to zero
    assert abs(dequantize_rows(x8[5], s[5])[3] + 2.5) <= 2.5 * 2.0 ** -11
    assert (dequantize_rows(x8[5], s[5]).count_nonzero() == 1)
    # the largest element of an ordinary row lands at (or within rounding of) 448
    big = (x8.float().abs().amax(-1))[amax >= AMAX_MIN]
    assert (big >= 416).all() and (big <= 448).all()
    # bf16 input: the same rule on the same values
    xb = x.bfloat16()
    assert torch.equal(quantize_rows(xb)[1], quantize_rows(xb.float())[1])


def test_saturation_past_the_largest_scale():
    """A row past AMAX_MAX (fp16's largest scale times 448) saturates at +-448 * 65504 instead
    of turning into NaN or infinity."""
    x = torch.tensor([[1e12, -1e12, 1.0, 0.0]])
    y = dequantize_rows(*quantize_rows(x))
    assert torch.isfinite(y).all() and y[0, 0] == 448 * 65504 and y[0, 1] == -448 * 65504


@pytest.mark.parametrize("D", [64, 96])
def test_write_kv_kernel_equals_the_torch_rule(D):
    """The fused quantise-and-write (one program per token and KV head) writes the same bytes
    and scales as the torch rule, to scattered (page, slot)s, leaving every other slot alone."""
    g = torch.Generator().manual_seed(D)
    P, H, page, n = 6, 3, 4, 9
    k = torch.randn(n, H, D, generator=g) * 2.0 ** torch.randint(-8, 9, (n, H, 1), generator=g)
    v = torch.randn(n, H, D, generator=g) * 2.0 ** torch.randint(-8, 9, (n, H, 1), generator=g)
    k[2, 1] = 0.0
    v[3, 0] = 1e7
    flat = torch.randperm(P * page, generator=g)[:n]
    pg, sl = (flat // page).to(DEV), (flat % page).to(DEV)
    pools = []
    for kernel in (True, False):
        kp = torch.zeros(P, H, page, D, dtype=FP8, device=DEV)
        vp = torch.zeros_like(kp)
        ks = torch.full((P, H, page), 7.0, dtype=torch.float16, device=DEV)
        vs = ks.clone()
        write_kv(kp, vp, ks, vs, pg, sl, k.to(DEV), v.to(DEV), use_kernel=kernel)
        pools.append([t.cpu() for t in (kp.view(torch.uint8), vp.view(torch.uint8), ks, vs)])
    for a, b in zip(*pools):
        assert torch.equal(a, b)
    kp, _, ks, _ = pools[0]
    assert torch.equal(dequantize_rows(kp.view(FP8)[flat // page, :, flat % page],
                                       ks[flat // page, :, flat % page]),
                       fake_quantize(k))
    untouched = torch.ones(P * page, dtype=torch.bool)
    untouched[flat] = False
    assert (ks.permute(0, 2, 1).reshape(P * page, H)[untouched] == 7.0).all()


def test_double_rounding_of_placed_keys():
    """Keys are stored unrotated (host tier, disk) and rotated into the pool at chunk-local
    positions: an fp8 key placed from a tier is rounded twice, Q(rot(DQ(Q(k)))), against once,
    Q(rot(k)), for a key written by the forward. Measured on keys with outlier channels: the
    second rounding adds about one more e4m3 rounding, the per-row error staying <= 2^-3 of the
    row's largest element (two roundings of <= 2^-4 each, rotation being an isometry per pair)."""
    g = torch.Generator().manual_seed(3)
    n, H, D = 512, 2, 128
    k = torch.randn(n, H, D, generator=g)
    k[..., 5] *= 20.0                                  # outlier channels, as real keys have
    k[..., 70] *= 8.0
    pos = torch.arange(n)
    inv = inv_freq_for("default", D)[0]
    c, s = rope_cos_sin(pos, inv)
    exact = rotate(k.double(), c[:, None].double(), s[:, None].double())
    once = fake_quantize(rotate(k, c[:, None], s[:, None]))
    twice = fake_quantize(rotate(fake_quantize(k), c[:, None], s[:, None]))
    amax = exact.abs().amax(-1)
    e1 = ((once - exact).abs().amax(-1) / amax)
    e2 = ((twice - exact).abs().amax(-1) / amax)
    rms1 = ((once - exact).pow(2).mean() / exact.pow(2).mean()).sqrt().item()
    rms2 = ((twice - exact).pow(2).mean() / exact.pow(2).mean()).sqrt().item()
    print(f"\nper-row max error / amax: single {e1.mean():.4f} mean {e1.max():.4f} max; "
          f"double {e2.mean():.4f} mean {e2.max():.4f} max; relative rms single {rms1:.4f} "
          f"double {rms2:.4f} (ratio {rms2 / rms1:.2f})")
    assert e1.max() <= 2.0 ** -4 and e2.max() <= 2.0 ** -3
    assert rms2 < 1.6 * rms1


# -- attention kernels over fp8 pages ----------------------------------------------------------

# (G, D, page, rope_mode, num_splits, shuffle): GQA 1..8, head dims 64 / 128, pages 1 / 4 / 16
# (partial last pages everywhere: chunk lengths 37, 1, 50, 9, 64, 23), forced split merges.
DECODE = [(1, 64, 4, "rotate_q", None, False), (3, 64, 16, "none", 3, False),
          (4, 128, 4, "none", 1, True), (7, 64, 1, "rotate_q", 64, True),
          (8, 128, 16, "rotate_q", 2, False), (2, 64, 16, "none", 1, True),
          (4, 128, 16, "rotate_q", 1, False)]


@pytest.mark.parametrize("G,D,page,rope_mode,splits,shuffle,dtype", with_dtypes(DECODE))
def test_decode_fp8(G, D, page, rope_mode, splits, shuffle, dtype):
    c = Case(MIXED, CHUNKS, Hkv=2, G=G, D=D, page=page, dtype=dtype, seed=G * 5 + page,
             shuffle=shuffle)
    (k8, v8, ks, vs), deq = fp8_pages(c, seed=G)
    out, lse = lazy_decode(c.q, k8, v8, c.table, c.q_pos, _inv(c), rope_mode=rope_mode,
                           num_splits=splits, out=torch.full_like(c.q, float("nan")),
                           return_lse=True, k_scale=ks, v_scale=vs)
    ref, ref_lse = _ref(c, deq, rope_mode, return_lse=True)
    assert rel_err(out, ref) < TOL[dtype]
    _check_lse(lse, ref_lse, dtype)


# (G, D, page, rope_mode, kernel, block_n, block_m, num_splits, layout)
PREFILL_CASES = [
    (1, 64, 4, "rotate_q", "runs", 32, 8, 1, "plain"),       # runs shorter than 8-page tiles
    (4, 128, 16, "rotate_q", "runs", 16, 8, 3, "hidden"),    # one page per tile, split merge
    (8, 64, 1, "none", "runs", 32, 4, None, "compact"),      # 32 1-token pages per tile
    (3, 64, 64, "rotate_q", "runs", 128, 8, 2, "both"),      # a chunk per partial page, hidden
    (2, 128, 16, "none", "tiles", 32, 8, 2, "plain"),        # the tiles kernel without RoPE
    (5, 64, 16, "rotate_q", "tiles", 32, 16, 1, "hidden"),   # two shifts per tile (while loop)
]


@pytest.mark.parametrize("G,D,page,rope_mode,kernel,block_n,block_m,splits,layout,dtype",
                         with_dtypes(PREFILL_CASES))
def test_prefill_fp8(G, D, page, rope_mode, kernel, block_n, block_m, splits, layout, dtype):
    c = Case(SEQS, CHUNKS, Hkv=2, G=G, D=D, page=page, dtype=dtype, seed=G * 3 + page,
             pos_base=64, **LAYOUTS[layout])
    (k8, v8, ks, vs), deq = fp8_pages(c, seed=G + 1)
    plan = plan_prefill(c.qo_indptr.cpu(), c.H, c.Hkv, c.q.device, block_m=block_m)
    out, lse = PREFILL_FNS[kernel](c.q, c.qo_indptr, c.q_pos, k8, v8, c.table, _inv(c),
                                   rope_mode=rope_mode, plan=plan, block_n=block_n,
                                   num_splits=splits, out=torch.full_like(c.q, float("nan")),
                            return_lse=True, k_scale=ks, v_scale=vs)
    ref, ref_lse = _ref(c, deq, rope_mode, return_lse=True)
    assert rel_err(out, ref) < TOL[dtype]
    _check_lse(lse, ref_lse, dtype)


def test_reference_path_dequantises(monkeypatch):
    """Without Triton (CPU, interpreter off) lazy_decode / lazy_prefill run the torch reference,
    which dequantises fp8 pages first: equal to the reference over the dequantised pages."""
    import lazy_rag.kernels.decode as decode_module
    import lazy_rag.kernels.prefill as prefill_module
    c = Case(SEQS, CHUNKS, Hkv=2, G=2, D=64, page=4, dtype=torch.float32, seed=9, device="cpu")
    (k8, v8, ks, vs), deq = fp8_pages(c, seed=9)
    monkeypatch.setattr(prefill_module, "use_triton", lambda t: False)
    monkeypatch.setattr(decode_module, "use_triton", lambda t: False)
    out = lazy_prefill(c.q, c.qo_indptr, c.q_pos, k8, v8, c.table, _inv(c), k_scale=ks,
                       v_scale=vs)
    want = paged_attention_ref(c.q, c.qo_indptr, c.q_pos, *deq, c.table, _inv(c))
    assert torch.equal(out, want)


def test_scales_are_checked():
    c = Case(MIXED, CHUNKS, Hkv=2, G=2, D=64, page=4, dtype=DTYPES[0], seed=1)
    (k8, v8, ks, vs), _ = fp8_pages(c, seed=1)
    with pytest.raises(ValueError, match="scales"):
        lazy_decode(c.q, k8, v8, c.table, c.q_pos, _inv(c))
    with pytest.raises(ValueError, match="scales"):
        lazy_decode(c.q, k8, v8, c.table, c.q_pos, _inv(c), k_scale=ks[:, :, :2], v_scale=vs)
    with pytest.raises(ValueError, match="float8"):
        lazy_decode(c.q, c.k_pages, c.v_pages, c.table, c.q_pos, _inv(c), k_scale=ks,
                    v_scale=vs)


# -- Block-Attention's copy ----------------------------------------------------------------------

@pytest.mark.parametrize("n,page,first_slot,shift", [(37, 16, 5, 1000), (9, 1, 3, 131072),
                                                     (100, 64, 63, 40000)])
def test_copy_rotate_run_fp8(n, page, first_slot, shift):
    """Keys dequantised, rotated by `shift` in fp32 and quantised again: within one rounding of
    the exact rotation of the dequantised source (<= 2^-4 of the row's largest element, plus
    the fp32 angle's own error at large shifts); the kernel agrees with the torch reference to
    one e4m3 step; values and their scales copied bit for bit; nothing else written."""
    g = torch.Generator().manual_seed(n + page)
    L, P, H, D = 2, 40, 2, 64
    x = torch.randn(2, L, P, H, page, D, generator=g)
    x = x * 2.0 ** torch.randint(-6, 7, x.shape[:-1], generator=g)[..., None]
    (k8, ks), (v8, vs) = quantize_rows(x[0]), quantize_rows(x[1])
    inv, _ = inv_freq_for("llama3", D)
    perm = torch.randperm(P, generator=g)
    n_src = -(-n // page)
    src, dst = perm[:n_src], perm[n_src:n_src + -(-(first_slot + n) // page)]
    results = []
    for kernel in (True, False):
        t = [a.clone().to(DEV) for a in (k8, v8, ks, vs)]
        fn = copy_rotate_run if kernel else copy_rotate_run_ref
        fn(t[0], t[1], src.to(DEV), n, dst.to(DEV), first_slot, shift, inv.to(DEV),
           k_scale=t[2], v_scale=t[3])
        results.append([a.cpu() for a in t])
    slots = torch.arange(first_slot, first_slot + n)
    dpage, doff = dst[slots // page], slots % page
    spage, soff = src[torch.arange(n) // page], torch.arange(n) % page
    for k_out, v_out, ks_out, vs_out in results:
        got = dequantize_rows(k_out[:, dpage, :, doff], ks_out[:, dpage, :, doff])  # [n, L, H, D]
        source = dequantize_rows(k8[:, spage, :, soff], ks[:, spage, :, soff]).double()
        c, s = rope_cos_sin(torch.tensor(float(shift)).double(), inv.double())
        want = rotate(source, c, s)
        rel = (got - want).abs().amax(-1) / want.abs().amax(-1)
        assert rel.max() <= 2.0 ** -4 + 4 * shift * 2.0 ** -24, rel.max()
        assert torch.equal(v_out.view(torch.uint8)[:, dpage, :, doff],
                           v8.view(torch.uint8)[:, spage, :, soff])
        assert torch.equal(vs_out[:, dpage, :, doff], vs[:, spage, :, soff])
        touched = torch.zeros(P, page, dtype=torch.bool)
        touched[dpage, doff] = True
        for out, before in ((k_out.view(torch.uint8), k8.view(torch.uint8)), (ks_out, ks)):
            perm = (1, 3, 0, 2, 4)[:out.dim()]      # [P, page, ...]
            assert torch.equal(out.permute(*perm)[~touched], before.permute(*perm)[~touched])
    (k_a, _, ks_a, _), (k_b, _, ks_b, _) = results
    a = dequantize_rows(k_a[:, dpage, :, doff], ks_a[:, dpage, :, doff])
    b = dequantize_rows(k_b[:, dpage, :, doff], ks_b[:, dpage, :, doff])
    assert ((a - b).abs().amax(-1) <= 2.0 ** -3 * b.abs().amax(-1) + 1e-30).all()


@pytest.mark.parametrize("dtype", DTYPES)
def test_value_scales_across_fp16s_range(dtype):
    """fp8 values whose per-token scales span fp16's range: value rows scaled from 2^-20 (below
    AMAX_MIN: the scale clamps and the row falls into e4m3's subnormals) to 2^12, and a whole
    sequence of small values (every scale clamped at AMAX_MIN), keep each output row within
    tolerance of that row's own size, in decode and both prefill kernels (the other tests
    measure against the largest output, which would hide a small row's error). The small rows
    stay normal fp16 outputs: an output below 2^-14 is rounded to fp16's subnormal grid
    whatever the kernel does."""
    c = Case(MIXED, CHUNKS, Hkv=2, G=4, D=64, page=16, dtype=dtype, seed=11)
    g = torch.Generator().manual_seed(5)
    rows = c.v.shape[:-1]
    v = c.v * 2.0 ** torch.randint(-20, 13, rows, generator=g)[..., None]
    ip, qo = c.table.indptr.tolist(), c.qo_indptr.tolist()
    small = c.table.page_ids[ip[2]:ip[3]].cpu().long()   # sequence 2 (and its chunks): small
    v[small] = c.v[small] * 2.0 ** -10
    (k8, ks), (v8, vs) = quantize_rows(c.k), quantize_rows(v)
    dev = c.q.device
    k8, ks, v8, vs = k8.to(dev), ks.to(dev), v8.to(dev), vs.to(dev)
    deq = (dequantize_rows(k8, ks).to(dev), dequantize_rows(v8, vs).to(dev))
    ref = _ref(c, deq, "rotate_q").double().cpu()
    outs = {"decode": lazy_decode(c.q, k8, v8, c.table, c.q_pos, _inv(c), rope_mode="rotate_q",
                                  num_splits=2, k_scale=ks, v_scale=vs)}
    for kernel, prefill in PREFILL_FNS.items():
        outs[kernel] = prefill(c.q, c.qo_indptr, c.q_pos, k8, v8, c.table, _inv(c),
                               rope_mode="rotate_q", k_scale=ks, v_scale=vs)
    size = ref.abs().amax(-1)
    assert (size[qo[2]:qo[3]] < 2.0 ** -7).all()
    for name, out in outs.items():
        assert torch.isfinite(out).all(), name
        err = (out.double().cpu() - ref).abs().amax(-1) / size.clamp_min(1e-300)
        assert err.max().item() < 2 * TOL[dtype], (name, err.max().item())


# -- the fp16 QK dot over fp8 keys (QK_F16, paged_attention.qk_f16_scale) -----------------------

@pytest.mark.parametrize("q_exp", [0, 24, -30])
@pytest.mark.parametrize("rope_mode,kernel", [("rotate_q", "decode"), ("none", "decode"),
                                              ("rotate_q", "runs"), ("none", "runs")])
def test_qk_f16_guard(q_exp, rope_mode, kernel):
    """With bf16 compute the kernels take the QK dot over fp8 keys in fp16, the query times a
    power of two that puts its tile's bound in [2^13, 2^14). Forced here with fp32 compute (the
    interpreter has no bf16): within fp16's tolerance of the reference, for queries 2^24 times
    larger (past fp16's range unguarded: 65504 ~ 2^16) and 2^-30 times smaller (below fp16's
    subnormals) than the other tests'."""
    c = Case(SEQS if kernel == "runs" else MIXED, CHUNKS, Hkv=2, G=4, D=64, page=16,
             dtype=torch.float32, seed=11, pos_base=64 if kernel == "runs" else 0)
    (k8, v8, ks, vs), deq = fp8_pages(c, seed=5)
    c.q = c.q * 2.0 ** q_exp
    if kernel == "decode":
        out = lazy_decode(c.q, k8, v8, c.table, c.q_pos, _inv(c), rope_mode=rope_mode,
                          num_splits=2, k_scale=ks, v_scale=vs, qk_f16="force")
    else:
        plan = plan_prefill(c.qo_indptr.cpu(), c.H, c.Hkv, c.q.device, block_m=8)
        out = lazy_prefill(c.q, c.qo_indptr, c.q_pos, k8, v8, c.table, _inv(c),
                           rope_mode=rope_mode, plan=plan, block_n=32, k_scale=ks, v_scale=vs,
                           qk_f16="force")
    ref = _ref(c, deq, rope_mode)
    assert torch.isfinite(out).all()
    assert rel_err(out, ref) < TOL[torch.float16]


# -- V pages keys-major (kernels/v_layout.py: the fp8 pool's layout) ----------------------------

# a subset of the cases above: decode with splits and both rope modes that read V the same way;
# the runs kernel with one page per tile (scalar page id), several per tile, explicit positions
# and hidden slots; the tiles kernel's prefill
KEYS_MAJOR_CASES = [
    ("decode", (4, 128, 16, "rotate_q", 2, True)),
    ("decode", (3, 64, 4, "none", None, False)),
    ("prefill", (4, 128, 16, "rotate_q", "runs", 16, 8, 3, "hidden")),
    ("prefill", (1, 64, 4, "rotate_q", "runs", 32, 8, 1, "plain")),
    ("prefill", (3, 64, 64, "rotate_q", "runs", 128, 8, 2, "both")),
    ("prefill", (5, 64, 16, "rotate_q", "tiles", 32, 16, 1, "hidden")),
]


@pytest.mark.parametrize("kind,args", KEYS_MAJOR_CASES)
def test_keys_major_v_pages(kind, args):
    """The same fp8 pages with V laid out keys-major give the reference's result and, on the
    CPU, bit for bit the dims-major result. The keys-major load reads every slot of a listed
    page (masked per page, v_layout.py): the case's page tails and hidden slots hold random
    finite values, which must contribute nothing."""
    dtype = DTYPES[len(args) % len(DTYPES)]
    if kind == "decode":
        G, D, page, rope_mode, splits, shuffle = args
        c = Case(MIXED, CHUNKS, Hkv=2, G=G, D=D, page=page, dtype=dtype, seed=G * 5 + page,
                 shuffle=shuffle)
    else:
        G, D, page, rope_mode, kernel, block_n, block_m, splits, layout = args
        c = Case(SEQS, CHUNKS, Hkv=2, G=G, D=D, page=page, dtype=dtype, seed=G * 3 + page,
                 pos_base=64, **LAYOUTS[layout])
    (k8, v8, ks, vs), deq = fp8_pages(c, seed=G + 2)
    v8 = finite_tails(v8)
    v_keys = to_keys_major(v8)
    assert keys_major(v_keys) and torch.equal(v_keys.view(torch.uint8), v8.view(torch.uint8))
    outs = []
    for v in (v8, v_keys):
        if kind == "decode":
            outs.append(lazy_decode(c.q, k8, v, c.table, c.q_pos, _inv(c), rope_mode=rope_mode,
                                    num_splits=splits, k_scale=ks, v_scale=vs))
        else:
            plan = plan_prefill(c.qo_indptr.cpu(), c.H, c.Hkv, c.q.device, block_m=block_m)
            outs.append(PREFILL_FNS[kernel](c.q, c.qo_indptr, c.q_pos, k8, v, c.table, _inv(c),
                                            rope_mode=rope_mode, plan=plan, block_n=block_n,
                                            num_splits=splits, k_scale=ks, v_scale=vs))
    ref = _ref(c, deq, rope_mode)
    assert rel_err(outs[1], ref) < TOL[dtype]
    if DEV == "cpu":
        assert torch.equal(outs[0], outs[1])


def test_keys_major_writers():
    """write_kv (fused kernel and torch rule) and copy_rotate_run write keys-major V pages with
    the same values as dims-major ones."""
    g = torch.Generator().manual_seed(11)
    L, P, H, page, D, n = 2, 8, 2, 16, 64, 21
    x = torch.randn(2, L, P, H, page, D, generator=g)
    (k8, ks), (v8, vs) = quantize_rows(x[0]), quantize_rows(x[1])
    new = torch.randn(2, n, H, D, generator=g)
    flat = torch.randperm(P * page, generator=g)[:n]
    pg, sl = (flat // page).to(DEV), (flat % page).to(DEV)
    inv = inv_freq_for("default", D)[0].to(DEV)
    results = []
    for keys in (False, True):
        for kernel in (True, False):
            t = [a.clone().to(DEV) for a in (k8, v8, ks, vs)]
            if keys:
                t[1] = to_keys_major(t[1])
            write_kv(t[0][0], t[1][0], t[2][0], t[3][0], pg, sl, new[0].to(DEV),
                     new[1].to(DEV), use_kernel=kernel)
            fn = copy_rotate_run if kernel else copy_rotate_run_ref
            fn(t[0], t[1], torch.tensor([3, 5], device=DEV), 2 * page - 3,
               torch.tensor([6, 1, 7], device=DEV), 4, 77, inv, k_scale=t[2], v_scale=t[3])
            assert keys_major(t[1]) == keys
            results.append([a.contiguous().view(torch.uint8).cpu() if a.dtype == FP8 else a.cpu()
                            for a in t])
    for r in results[1:]:
        for a, b in zip(results[0], r):
            assert torch.equal(a, b)


def test_pool_v_layout():
    """An fp8 pool holds V keys-major, zero-filled where the Triton kernels run (they read whole
    pages: CUDA, or the interpreter, as here on the CPU); other pools keep V dims-major."""
    from lazy_rag.engine.page_pool import PagePool
    fp8 = PagePool(2, 3, 2, 4, 32, dtype=FP8, device=DEV)
    assert keys_major(fp8.v) and not keys_major(fp8.k)
    assert (fp8.v.view(torch.uint8) == 0).all()
    assert not keys_major(PagePool(2, 3, 2, 4, 32).v)


# -- fp8 decode's launch: capped registers and whole waves of programs ---------------------------

def test_wave_splits_fill_whole_waves():
    """wave_splits picks the split count whose programs fill whole waves: B32 / B16 x 8k of the 8B
    shape (8 KV heads, 64 tiles of 128 keys) on 132 SMs x 3 programs: 3 splits (768 programs in
    two full waves, 384 in one), where the programs-per-SM target would take 2 (512 programs,
    1.3 waves) or 3; a single sequence spreads over every slot it can fill; the count never
    exceeds the tiles or 64, and whole waves beat a partial one of the same size."""
    from lazy_rag.kernels.paged_attention import split_count, wave_splits
    slots = 3 * 132
    assert wave_splits(32 * 8, 64, slots) == 3
    assert wave_splits(16 * 8, 64, slots) == 3
    assert wave_splits(8, 64, slots) == 32             # 256 programs of 2 tiles: one wave
    assert wave_splits(8, 5, slots) == 5               # no more splits than tiles
    s = wave_splits(1, 1000, slots)                    # nor more than 64: 16 tiles each,
    assert s <= 64 and triton.cdiv(1000, s) == 16      # the fewest that 64 splits allow
    assert wave_splits(slots, 64, slots) == 1          # one full wave already
    # split_count with per_sm takes it (and still leaves no split empty)
    dev = torch.device("cpu")                          # 4 "SMs" off the GPU
    n, tiles = 6, 40
    splits, per = split_count(dev, n, tiles, None, 2.0, per_sm=3)
    assert splits == triton.cdiv(tiles, per) and (splits - 1) * per < tiles
    assert (splits, per) == split_count(dev, n, tiles, wave_splits(n, tiles, 12), 2.0)


def test_fp8_decode_occupancy_rule():
    """Capped registers and whole waves only where they pay: fp8, decode rows, 4 warps,
    keys-major V, on the GPU, more programs than one wave of two per SM (B16 x 8k of the 8B
    shape: 128 programs x 3 splits on 132 SMs), not a single sequence's 32 splits of 8 heads."""
    from lazy_rag.kernels.paged_attention import fp8_decode_occupancy as occ
    assert occ(True, 16, False, None, True, 384, 132)
    assert not occ(True, 16, False, None, True, 256, 132)      # B1: one wave already
    assert not occ(False, 16, False, None, True, 384, 132)     # bf16 pages
    assert not occ(True, 128, False, None, True, 384, 132)     # prefill rows
    assert not occ(True, 16, True, None, True, 384, 132)       # the interpreter
    assert not occ(True, 16, False, 8, True, 384, 132)         # a caller's warps
    assert not occ(True, 16, False, None, False, 384, 132)     # dims-major V


def test_fp8_decode_stages_rule():
    """Two K/V buffers (FP8_DECODE_STAGES) where three programs' fit an SM's shared memory, a
    caller's num_stages kept, the default elsewhere (off the GPU, smaller SMs)."""
    from lazy_rag.kernels import paged_attention as pa
    hopper = 228 * 1024
    assert pa.fp8_decode_stages(None, hopper) == pa.FP8_DECODE_STAGES
    assert pa.fp8_decode_stages(3, hopper) == 3
    assert pa.fp8_decode_stages(None, 100 * 1024) is None
    assert pa.fp8_decode_stages(None, pa._smem_per_sm(torch.device("cpu"))) is None


def test_query_reloaded_where_registers_are_short():
    """RELOAD_Q (paged_attention.reload_query): rotate_q decode, bf16 pages or fp8 under a
    register cap; not an uncapped fp8 launch, prefill tiles or the other RoPE modes."""
    from lazy_rag.kernels.page_table import ROPE_MODES
    from lazy_rag.kernels.paged_attention import reload_query
    rq = ROPE_MODES["rotate_q"]
    assert reload_query(rq, 16, False, None) and reload_query(rq, 16, True, 168)
    assert not reload_query(rq, 16, True, None)                 # B1: one wave, uncapped
    assert not reload_query(rq, 128, False, None)               # prefill tiles
    assert not reload_query(ROPE_MODES["none"], 16, False, None)
    assert not reload_query(ROPE_MODES["none"], 16, True, 168)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("G", [4, 8])
def test_fp8_decode_two_pages_per_tile(G, dtype):
    """fp8 rotate_q decode over tiles of two pages (32 keys over pages of 16; the GPU's 128 over
    64) with V keys-major, so K and V tiles are loaded per page: the two row groups (MULTI_SHIFT
    4) score tiles that hold two chunks, and the K tails (NaN here) are read and masked; with
    16-bit compute the value scales fold into the scores (FOLD_V), their pages loaded two tiles
    ahead."""
    c = Case(MIXED, CHUNKS, Hkv=2, G=G, D=128, page=16, dtype=dtype, seed=G)
    (k8, v8, ks, vs), deq = fp8_pages(c, seed=G)
    assert torch.isnan(k8.float()).any()
    out = lazy_decode(c.q, k8, to_keys_major(finite_tails(v8)), c.table, c.q_pos, _inv(c),
                      rope_mode="rotate_q", k_scale=ks, v_scale=vs, block_n=32, num_splits=2)
    assert rel_err(out, _ref(c, deq, "rotate_q")) < TOL[dtype]


def test_fp8_decode_under_capped_registers():
    """fp8 decode compiled at FP8_DECODE_MAXNREG (what large decode batches take: with
    FP8_DECODE_STAGES on Hopper) and at a caller's own cap equals the reference; on the GPU the
    cap holds."""
    from lazy_rag.bench.launches import recorded_launches
    from lazy_rag.kernels import paged_attention as pa
    c = Case(MIXED, CHUNKS, Hkv=2, G=4, D=128, page=64, dtype=DTYPES[0], seed=2)
    (k8, v8, ks, vs), deq = fp8_pages(c, seed=2)
    v8 = to_keys_major(finite_tails(v8))     # the layout that takes the cap
    ref = _ref(c, deq, "rotate_q")
    for cap, stages in ((pa.FP8_DECODE_MAXNREG, None), (pa.FP8_DECODE_MAXNREG,
                                                         pa.FP8_DECODE_STAGES), (128, None)):
        with recorded_launches() as launched:
            out = lazy_decode(c.q, k8, v8, c.table, c.q_pos, _inv(c), rope_mode="rotate_q",
                              k_scale=ks, v_scale=vs, maxnreg=cap, num_splits=2,
                              num_stages=stages)
        assert rel_err(out, ref) < TOL[DTYPES[0]]
        if DEV == "cuda":
            assert launched.last.n_regs <= cap
            if stages:
                assert launched.last.metadata.num_stages == stages
