"""copy_rotate_run (Block-Attention's copy inside the engine pool) against its torch reference and
against rotating the source keys from scratch: odd lengths, runs starting mid-page, pages of 1."""
import pytest
import torch

from _cases import DTYPES, TOL, inv_freq_for, rel_err
from lazy_rag.kernels import apply_rope, copy_rotate_run, copy_rotate_run_ref


def dev():
    return "cuda" if torch.cuda.is_available() else "cpu"


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("n,page,first_slot,shift", [(37, 16, 5, 1000), (64, 16, 0, 7), (9, 1, 3, 131072),
                                                     (100, 64, 63, 40000)])
def test_copy_rotate_run(n, page, first_slot, shift, dtype):
    g = torch.Generator().manual_seed(n + page)
    L, P, H, D = 3, 40, 2, 64
    k = torch.randn(L, P, H, page, D, generator=g).to(dev(), dtype)
    v = torch.randn(L, P, H, page, D, generator=g).to(dev(), dtype)
    inv, _ = inv_freq_for("llama3", D)
    perm = torch.randperm(P, generator=g)
    n_src = -(-n // page)
    src = perm[:n_src].to(dev())
    dst = perm[n_src:n_src + -(-(first_slot + n) // page)].to(dev())
    k_ref, v_ref = k.clone(), v.clone()
    copy_rotate_run_ref(k_ref, v_ref, src, n, dst, first_slot, shift, inv.to(dev()))
    before = k.clone()
    copy_rotate_run(k, v, src, n, dst, first_slot, shift, inv.to(dev()))
    assert rel_err(k, k_ref) < TOL[dtype] and torch.equal(v, v_ref)
    # semantics: keys stored rotated at chunk-local j, shifted, equal rotating at (shift + j)
    # from the unrotated keys (derotate the source first)
    j = torch.arange(n, device=dev())
    src_k = before[:, src.long()].transpose(2, 3).reshape(L, -1, H, D)[:, :n]
    raw = apply_rope(src_k.double(), -j, inv.to(dev()))
    want = apply_rope(raw, shift + j, inv.to(dev()))
    slots = torch.arange(first_slot, first_slot + n, device=dev())
    got = k[:, dst.long()[slots // page], :, slots % page].permute(1, 0, 2, 3)
    # (fp32 angles: at position p the angle itself is off by up to ~p * 2^-24 rad, as in HF's own
    # fp32 RoPE at that position)
    assert rel_err(got.double(), want) < max(TOL[dtype], 4 * (shift + n) * 2 ** -24)
    # nothing outside the destination slots changed
    touched = torch.zeros(P, page, dtype=torch.bool, device=dev())
    touched[dst.long()[slots // page], slots % page] = True
    assert torch.equal(k.permute(1, 3, 0, 2, 4)[~touched], before.permute(1, 3, 0, 2, 4)[~touched])
