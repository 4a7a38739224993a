"""fp8 KV: per-token scales, the quantisation rule every writer uses, and the fused
quantise-and-write of a step's new tokens into the page pool.

Format. K and V pages are float8_e4m3fn (e4m3: 4 exponent bits, 3 mantissa bits, max 448, no
infinities); each (layer, token, KV head) row of head_dim values has one float16 scale per
tensor, stored beside the pages:

    k_pages, v_pages : [num_pages, num_kv_heads, page_size, head_dim]   float8_e4m3fn
    k_scale, v_scale : [num_pages, num_kv_heads, page_size]             float16

and the row's value is ``x8.float() * scale.float()`` (exact in fp32: a 4-bit times an 11-bit
significand). Bytes per token and KV head at head_dim 128: 2 * (128 + 2) = 260 against 512 in
bf16, 50.8%.

Quantisation of a row x (``quantize_rows``, the Triton ``quant_scale`` and every kernel that
writes fp8 pages use this one rule):

    amax  = max |x_i|, clamped to [AMAX_MIN, AMAX_MAX]
    scale = fp16(amax / 448)                  (round to nearest; then used as rounded)
    x8    = e4m3(clamp(x / scale, -448, 448)) (round to nearest even)

The scale is rounded to fp16 first and the row quantised with the rounded scale, so the scale's
rounding adds no error: each element's error is e4m3's own, |x8 * scale - x| <=
2^-4 |x| for |x / scale| >= 2^-6 (e4m3's normal range) and <= 2^-10 scale below it, so per row
<= 2^-4 amax. AMAX_MIN = 448 * 2^-14 keeps the scale a normal fp16 (>= 2^-14, relative rounding
<= 2^-11): a rounded-down scale then puts the largest element at most 0.05% past 448, which the
clamp takes back (well inside e4m3's own rounding there, whose step is 32). A zero row gets
scale 2^-14 and zeros. AMAX_MAX = 448 * 65504 keeps the scale finite.

Per-token scales need no calibration and suit appends (a decode step writes one token). The
attention kernels read fp8 pages and scale in registers: the scores of key n are
(q . k8_n) * k_scale_n (RoPE is linear per token, so rotating k8 commutes with its scale), and
the values enter as (p * v_scale) @ v8 (or v8 * v_scale for fp16 compute: see
paged_attention.py).
"""
from __future__ import annotations

import torch

from .triton_import import tl, triton
from . import compiler_setup
from .page_table import interpreting

FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0
SCALE_DTYPE = torch.float16
AMAX_MIN = FP8_MAX * 2.0 ** -14      # scale >= 2^-14: a normal fp16
AMAX_MAX = FP8_MAX * 65504.0         # scale <= fp16 max
# the same constants for the Triton functions (a jitted function reads only constexpr globals)
_FP8_MAX = tl.constexpr(FP8_MAX)
_AMAX_MIN = tl.constexpr(AMAX_MIN)
_AMAX_MAX = tl.constexpr(AMAX_MAX)


def is_fp8(dtype: torch.dtype) -> bool:
    return dtype == FP8


def quantize_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [..., D] (any float dtype) -> (x8 [..., D] float8_e4m3fn, scale [...] float16), one
    scale per row (the module docstring's rule)."""
    xf = x.float()
    amax = xf.abs().amax(-1).clamp(AMAX_MIN, AMAX_MAX)
    scale = (amax / FP8_MAX).to(SCALE_DTYPE)
    x8 = (xf / scale.float()[..., None]).clamp(-FP8_MAX, FP8_MAX).to(FP8)
    return x8, scale


def dequantize_rows(x8: torch.Tensor, scale: torch.Tensor,
                    dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """x8 [..., D] float8, scale [...] -> x8 * scale in ``dtype`` (exact in fp32)."""
    return (x8.float() * scale.float()[..., None]).to(dtype)


def fake_quantize(x: torch.Tensor) -> torch.Tensor:
    """dequantize_rows(quantize_rows(x)) in x's dtype: what an fp8 pool holds for x."""
    return dequantize_rows(*quantize_rows(x), dtype=x.dtype)


def check_scales(pages: torch.Tensor, scale: torch.Tensor | None, what: str) -> None:
    """An fp8 page tensor needs its scale tensor [num_pages, Hkv, page] with a unit stride
    along slots; other page dtypes take none."""
    if not is_fp8(pages.dtype):
        if scale is not None:
            raise ValueError(f"{what}: scales are for float8_e4m3fn pages, got {pages.dtype} pages")
        return
    if scale is None:
        raise ValueError(f"{what}: float8_e4m3fn pages need their per-token scales")
    if tuple(scale.shape) != tuple(pages.shape[:-1]) or scale.stride(-1) != 1:
        raise ValueError(f"{what}: scales must be [{', '.join(map(str, pages.shape[:-1]))}] with a "
                         f"unit stride along slots, got {tuple(scale.shape)} strides {scale.stride()}")


# ----------------------------------------------------------------------------------------------
# Triton side
# ----------------------------------------------------------------------------------------------

@triton.jit
def quant_scale(amax):
    """The fp32 value of the fp16 scale for rows whose max |x| is amax (fp32, any shape)."""
    a = tl.minimum(tl.maximum(amax, _AMAX_MIN), _AMAX_MAX)
    return tl.div_rn(a, _FP8_MAX).to(tl.float16).to(tl.float32)   # correctly rounded, as torch


@triton.jit
def quantize(x, scale, SOFT_ROUND: tl.constexpr):
    """fp32 x (any shape) over a broadcastable fp32 scale -> e4m3 (correctly rounded division,
    as torch's, then clamp and round to nearest even).
    SOFT_ROUND (the CPU interpreter): Triton's interpreter casts fp32 to fp8 by truncating the
    significand and adding the cut-off bit without carrying into the exponent (31.7 -> 16), so
    round to e4m3's grid first (step 2^(max(e, -6) - 3) for |y| in [2^e, 2^(e+1)), ties to
    even through the 1.5 * 2^23 trick), after which its cast is exact (checked for all 256
    codes)."""
    y = tl.div_rn(x, scale)
    y = tl.minimum(tl.maximum(y, -_FP8_MAX), _FP8_MAX)
    if SOFT_ROUND:
        e = ((y.to(tl.int32, bitcast=True) >> 23) & 0xFF) - 127
        step = ((tl.maximum(e, -6) + 124) << 23).to(tl.float32, bitcast=True)
        t = y / step                               # exact: a power of two, |t| < 16
        y = ((t + 12582912.0) - 12582912.0) * step
    return y.to(tl.float8e4nv, fp_downcast_rounding="rtne")


@triton.jit
def _write_kv_kernel(K, V, stride_kt, stride_kh, stride_vt, stride_vh,
                     KP, VP, stride_pp, stride_ph, stride_pt,
                     stride_vpp, stride_vph, stride_vpt, stride_vpd,
                     KS, VS, stride_sp, stride_sh,
                     PAGE_OF, SLOT_OF, D: tl.constexpr, DP: tl.constexpr,
                     SOFT_FP8: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)     # new token
    h = tl.program_id(1)                  # KV head
    page = tl.load(PAGE_OF + t).to(tl.int64)
    slot = tl.load(SLOT_OF + t).to(tl.int64)
    d = tl.arange(0, DP)
    ok = d < D
    dst = page * stride_pp + h * stride_ph + slot * stride_pt + d
    s_off = page * stride_sp + h * stride_sh + slot
    k = tl.load(K + t * stride_kt + h * stride_kh + d, mask=ok, other=0.0).to(tl.float32)
    ks = quant_scale(tl.max(tl.abs(k), axis=0))
    tl.store(KP + dst, quantize(k, ks, SOFT_FP8), mask=ok)
    tl.store(KS + s_off, ks.to(tl.float16))
    v = tl.load(V + t * stride_vt + h * stride_vh + d, mask=ok, other=0.0).to(tl.float32)
    vs = quant_scale(tl.max(tl.abs(v), axis=0))
    v_dst = page * stride_vpp + h * stride_vph + slot * stride_vpt + d * stride_vpd
    tl.store(VP + v_dst, quantize(v, vs, SOFT_FP8), mask=ok)
    tl.store(VS + s_off, vs.to(tl.float16))


def write_kv(k_pages: torch.Tensor, v_pages: torch.Tensor, k_scale: torch.Tensor | None,
             v_scale: torch.Tensor | None, page: torch.Tensor, slot: torch.Tensor,
             k: torch.Tensor, v: torch.Tensor, use_kernel: bool | None = None) -> None:
    """Write new tokens' K/V [n, Hkv, D] to (page [n], slot [n]) of one layer's pages
    [P, Hkv, page_size, D]; fp8 pages are quantised per token with their scales written to
    k_scale / v_scale [P, Hkv, page_size]. No host sync (CUDA-graph capturable).
    use_kernel: the fused Triton kernel (one program per token and KV head) for fp8 pages;
    None: on CUDA tensors. Other page dtypes: a plain indexed store."""
    if not is_fp8(k_pages.dtype):
        k_pages[page, :, slot] = k.to(k_pages.dtype)
        v_pages[page, :, slot] = v.to(v_pages.dtype)
        return
    if use_kernel is None:
        use_kernel = k.is_cuda
    if not use_kernel:
        k8, ks = quantize_rows(k)
        v8, vs = quantize_rows(v)
        # through uint8 views: indexed stores of float8 are not implemented on every device
        k_pages.view(torch.uint8)[page, :, slot] = k8.view(torch.uint8)
        v_pages.view(torch.uint8)[page, :, slot] = v8.view(torch.uint8)
        k_scale[page, :, slot] = ks
        v_scale[page, :, slot] = vs
        return
    n, H, D = k.shape
    if n == 0:
        return
    assert k.stride(-1) == 1 and v.stride(-1) == 1 and k_pages.stride(-1) == 1
    assert k_scale.stride() == v_scale.stride()   # V pages: either layout (v_layout.py)
    soft = interpreting() and not k.is_cuda
    if k.is_cuda:
        compiler_setup.wait()
    meta = {} if soft else {"num_warps": 1}
    _write_kv_kernel[(n, H)](k, v, k.stride(0), k.stride(1), v.stride(0), v.stride(1),
                             k_pages, v_pages, k_pages.stride(0), k_pages.stride(1),
                             k_pages.stride(2), *v_pages.stride(), k_scale, v_scale,
                             k_scale.stride(0),
                             k_scale.stride(1), page, slot, D=D, DP=triton.next_power_of_2(D),
                             SOFT_FP8=soft, **meta)
