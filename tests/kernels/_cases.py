"""Random paged-KV cases with every awkward feature the kernels must handle."""
from __future__ import annotations

import os
import random

import torch

from lazy_rag.kernels import PageTable

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
# CPU interpreter: fp32/fp16 (bf16 arithmetic is broken there). GPU: bf16/fp16.
DTYPES = ([torch.bfloat16, torch.float16] if DEVICE == "cuda" else [torch.float32, torch.float16])
if os.environ.get("LAZY_RAG_TEST_DTYPES"):
    DTYPES = [getattr(torch, n) for n in os.environ["LAZY_RAG_TEST_DTYPES"].split(",")]
TOL = {torch.float32: 1e-4, torch.float16: 1e-3, torch.bfloat16: 1e-2}


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    out, ref = out.double().cpu(), ref.double().cpu()
    if not torch.isfinite(out).all():
        return float("inf")
    return ((out - ref).abs().max() / ref.abs().max().clamp_min(1e-30)).item()


def inv_freq_for(kind: str, head_dim: int):
    """(inv_freq, attention_scaling) for a RoPE scaling type, via transformers when it can."""
    if kind == "default":
        theta = 10000.0
        return 1.0 / theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim), 1.0
    from transformers import LlamaConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
    rp = {
        "linear": dict(rope_type="linear", rope_theta=10000.0, factor=4.0),
        "llama3": dict(rope_type="llama3", rope_theta=500000.0, factor=8.0, low_freq_factor=1.0,
                       high_freq_factor=4.0, original_max_position_embeddings=8192),
        "yarn": dict(rope_type="yarn", rope_theta=10000.0, factor=4.0,
                     original_max_position_embeddings=2048),
    }[kind]
    cfg = LlamaConfig(hidden_size=head_dim * 4, num_attention_heads=4, head_dim=head_dim,
                      rope_parameters=rp, max_position_embeddings=8192)
    inv, scale = ROPE_INIT_FUNCTIONS[kind](cfg, "cpu")
    return inv.float(), float(scale)


class Case:
    """A pool, a batch of sequences over shared chunks, and their new tokens.

    seqs: list of (chunk indices, n_private, n_new): the sequence is its chunks in that order,
    then n_private private tokens (template + question + new tokens) of which the last n_new are
    the queries. Chunks are reused by several sequences at different offsets; chunk pages are
    allocated out of order; the tail of a partly filled page is NaN (must never be read).
    """

    def __init__(self, seqs, chunk_lens, *, Hkv, G, D, page, dtype, seed=0, pos_base=0,
                 shuffle=False, device=DEVICE):
        g = torch.Generator().manual_seed(seed)
        rnd = random.Random(seed)
        self.H, self.Hkv, self.D, self.page = Hkv * G, Hkv, D, page
        npg = lambda n: -(-n // page)  # noqa: E731
        total = sum(npg(L) for L in chunk_lens) + sum(npg(p) for _, p, _ in seqs) + 3
        perm = torch.randperm(total, generator=g).tolist()
        alloc = iter(perm)
        k = torch.randn(total, Hkv, page, D, generator=g)
        v = torch.randn(total, Hkv, page, D, generator=g)
        chunk_pages = []
        for L in chunk_lens:
            ids = [next(alloc) for _ in range(npg(L))]
            chunk_pages.append(ids)
            tail = L - (len(ids) - 1) * page
            k[ids[-1], :, tail:] = float("nan")
            v[ids[-1], :, tail:] = float("nan")
        ids_l, pos_l, len_l, sh_l, qpos, qo = [], [], [], [], [], [0]
        for si, (chunks, n_priv, n_new) in enumerate(seqs):
            base = pos_base + rnd.randrange(0, 50)
            p = base
            ent = []
            for c in chunks:
                L = chunk_lens[c]
                for j, pid in enumerate(chunk_pages[c]):
                    ent.append((pid, p + j * page, min(page, L - j * page), p))
                p += L
            priv = [next(alloc) for _ in range(npg(n_priv))]
            for j, pid in enumerate(priv):
                n = min(page, n_priv - j * page)
                ent.append((pid, p + j * page, n, 0))
                if n < page:
                    k[pid, :, n:] = float("nan")
                    v[pid, :, n:] = float("nan")
            end = p + n_priv
            qpos += list(range(end - n_new, end))
            qo.append(qo[-1] + n_new)
            if shuffle:
                rnd.shuffle(ent)
            ids_l.append([x[0] for x in ent])
            pos_l.append([x[1] for x in ent])
            len_l.append([x[2] for x in ent])
            sh_l.append([x[3] for x in ent])
        self.table = PageTable.from_lists(ids_l, pos_l, len_l, sh_l, device=device)
        self.k_pages = k.to(dtype).to(device)
        self.v_pages = v.to(dtype).to(device)
        self.q_pos = torch.tensor(qpos, dtype=torch.int32, device=device)
        self.qo_indptr = torch.tensor(qo, dtype=torch.int32, device=device)
        self.q = torch.randn(len(qpos), self.H, D, generator=g).to(dtype).to(device)
        self.dtype = dtype


# A mixed batch: a 1-token sequence over a 1-token chunk, a long one over many chunks, and
# chunks 0 and 2 shared by several sequences at different offsets.
CHUNKS = [37, 1, 50, 9, 64, 23]
MIXED = [([1], 1, 1), ([0, 2, 3, 4, 5], 7, 1), ([2, 0], 3, 1), ([4, 0, 2], 2, 1)]
