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


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_copy_rotate_run_rotates_each_layer_by_its_own_frequencies(dtype):
    """inv_freq [L, D/2] (a model whose layers have different RoPE tables, Gemma 3's sliding and
    global layers): each layer's keys rotated by its own row, as copying that layer alone with it;
    another layer's row would be far off."""
    g = torch.Generator().manual_seed(5)
    L, P, H, page, D, n, first_slot, shift = 3, 8, 2, 16, 64, 37, 5, 1000
    k = torch.randn(L, P, H, page, D, generator=g).to(dev(), dtype)
    v = torch.randn(L, P, H, page, D, generator=g).to(dev(), dtype)
    inv = torch.stack([inv_freq_for(kind, D)[0] for kind in ("default", "linear", "llama3")]).to(dev())
    src, dst = torch.tensor([6, 0, 3], device=dev()), torch.tensor([1, 7, 4], device=dev())

    def copied(layers, freqs, fn=copy_rotate_run_ref):
        kk, vv = k[layers].clone(), v[layers].clone()
        fn(kk, vv, src, n, dst, first_slot, shift, freqs)
        return kk, vv

    for fn in (copy_rotate_run, copy_rotate_run_ref):
        got_k, got_v = copied(slice(None), inv, fn)
        for layer in range(L):
            want_k, want_v = copied(slice(layer, layer + 1), inv[layer])
            assert rel_err(got_k[layer], want_k[0]) < TOL[dtype] and torch.equal(got_v[layer], want_v[0])
            other = copied(slice(layer, layer + 1), inv[(layer + 1) % L])[0]
            assert rel_err(got_k[layer], other[0]) > 0.1
