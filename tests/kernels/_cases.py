"""Random paged-KV cases with every awkward feature the kernels must handle."""
from __future__ import annotations

import os
import random

import torch

from lazy_rag.kernels import HIDDEN_POS, PageTable

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

    Explicit slot positions (table.slot_pos), all off by default:
      hide        about half of each sequence's chunk entries get an explicit row hiding each
                  slot with this probability (the shared page is not written); the hidden
                  tokens, recomputed (fresh K/V), go to a compact private run whose slots carry
                  their scattered positions, with a few NaN-poisoned hidden slots mixed in.
      scatter     the private tokens are stored in shuffled order with explicit positions, with
                  a few NaN-poisoned hidden slots mixed in (causal masking by explicit position).
      all_hidden  index of a sequence whose every slot is hidden (its queries return zeros).
    `tokens[b]` lists sequence b's visible keys as (page, slot, position, rot_shift): the prompt
    the table means, built independently of the table's encoding.
    `chunk_page_ids` lists the shared chunk pages (to split a table into chunk and private keys).
    """

    def __init__(self, seqs, chunk_lens, *, Hkv, G, D, page, dtype, seed=0, pos_base=0,
                 shuffle=False, hide=0.0, scatter=False, all_hidden=None, device=DEVICE):
        g = torch.Generator().manual_seed(seed)
        self.rnd = rnd = random.Random(seed)
        self.H, self.Hkv, self.D, self.page = Hkv * G, Hkv, D, page
        npg = lambda n: -(-n // page)  # noqa: E731
        explicit = bool(hide) or scatter or all_hidden is not None
        total = sum(npg(L) for L in chunk_lens) + sum(npg(p) for _, p, _ in seqs) + 3
        if explicit:   # room for each sequence's recomputed run and its hidden slots
            total += sum(npg(sum(chunk_lens[c] for c in ch) + MAX_HOLES) + npg(MAX_HOLES)
                         for ch, _, _ in seqs)
        self.alloc = iter(torch.randperm(total, generator=g).tolist())
        self.k = torch.randn(total, Hkv, page, D, generator=g)
        self.v = torch.randn(total, Hkv, page, D, generator=g)
        chunk_pages = []
        for L in chunk_lens:
            ids = [next(self.alloc) for _ in range(npg(L))]
            chunk_pages.append(ids)
            self._poison(ids[-1], L - (len(ids) - 1) * page)
        # the shared chunk pages (every other page is private to one sequence)
        self.chunk_page_ids = sorted(pid for ids in chunk_pages for pid in ids)
        table_rows, qpos, qo, self.tokens = [], [], [0], []
        for si, (chunks, n_priv, n_new) in enumerate(seqs):
            p = pos_base + rnd.randrange(0, 50)
            ent, tokens = [], []
            for c in chunks:
                L = chunk_lens[c]
                for j, pid in enumerate(chunk_pages[c]):
                    ent.append(self._chunk_entry(pid, p + j * page, min(page, L - j * page), p,
                                                 hide, tokens))
                p += L
            n_shared = len(ent)
            recomputed = [t[2] for t in tokens if t[0] is None]
            tokens = [t for t in tokens if t[0] is not None]
            ent += self._compact_run(recomputed, p, tokens)
            if scatter:
                ent += self._compact_run(list(range(p, p + n_priv)), p, tokens)
            else:
                ent += self._private_pages(n_priv, p, tokens)
            if si == all_hidden:
                for pid, *_ in ent[n_shared:]:     # private pages: never read
                    self._poison(pid, 0)
                ent = [(pid, pos, n, sh, [HIDDEN_POS] * page) for pid, pos, n, sh, _ in ent]
                tokens = []
            end = p + n_priv
            qpos += list(range(end - n_new, end))
            qo.append(qo[-1] + n_new)
            if shuffle:
                rnd.shuffle(ent)
            table_rows.append(ent)
            self.tokens.append(tokens)
        field = lambda i: [[e[i] for e in ent] for ent in table_rows]  # noqa: E731
        self.table = PageTable.from_lists(field(0), field(1), field(2), field(3), device=device,
                                          slot_pos=field(4) if explicit else None)
        self.k_pages = self.k.to(dtype).to(device)
        self.v_pages = self.v.to(dtype).to(device)
        self.q_pos = torch.tensor(qpos, dtype=torch.int32, device=device)
        self.qo_indptr = torch.tensor(qo, dtype=torch.int32, device=device)
        self.q = torch.randn(len(qpos), self.H, D, generator=g).to(dtype).to(device)
        self.dtype = dtype

    def _poison(self, pid, n_valid):
        """NaN in slots n_valid.. of a page: a kernel that reads them fails the comparison."""
        self.k[pid, :, n_valid:] = float("nan")
        self.v[pid, :, n_valid:] = float("nan")

    def _chunk_entry(self, pid, pos, n, shift, hide, tokens):
        """One shared chunk page: ordinary, or (with hide) an explicit row hiding some slots.
        tokens gets (pid, slot, position, shift) per visible slot, (None, None, position, None)
        per hidden one (to be recomputed)."""
        if not hide or self.rnd.random() < 0.5:
            tokens += [(pid, j, pos + j, shift) for j in range(n)]
            return (pid, pos, n, shift, None)
        row = []
        for j in range(n):
            if self.rnd.random() < hide:
                row.append(HIDDEN_POS)
                tokens.append((None, None, pos + j, None))
            else:
                row.append(pos + j)
                tokens.append((pid, j, pos + j, shift))
        return (pid, pos, n, shift, row + self._ignored(self.page - n))

    def _compact_run(self, positions, page_pos, tokens):
        """Private pages (rot_shift 0) holding fresh K/V of `positions` in shuffled order, with
        up to MAX_HOLES hidden, NaN-poisoned slots mixed in and a NaN tail after the last one.
        page_pos is deliberately wrong (explicit rows must be what counts)."""
        if not positions:
            return []
        slots = positions + [HIDDEN_POS] * self.rnd.randrange(0, MAX_HOLES + 1)
        self.rnd.shuffle(slots)
        ent = []
        for s in range(0, len(slots), self.page):
            pid = next(self.alloc)
            row = slots[s:s + self.page]
            for j, pos in enumerate(row):
                if pos == HIDDEN_POS:
                    self.k[pid, :, j] = float("nan")
                    self.v[pid, :, j] = float("nan")
                else:
                    tokens.append((pid, j, pos, 0))
            self._poison(pid, len(row))
            ent.append((pid, page_pos, len(row), 0, row + self._ignored(self.page - len(row))))
        return ent

    def _private_pages(self, n_priv, p, tokens):
        """Ordinary private pages (rot_shift 0) for positions p .. p + n_priv - 1."""
        ent = []
        for j in range(-(-n_priv // self.page)):
            pid = next(self.alloc)
            n = min(self.page, n_priv - j * self.page)
            self._poison(pid, n)
            tokens += [(pid, i, p + j * self.page + i, 0) for i in range(n)]
            ent.append((pid, p + j * self.page, n, 0, None))
        return ent

    def _ignored(self, n):
        """Explicit positions of slots past page_len: small, visible-looking, to be ignored."""
        return [self.rnd.randrange(0, 8) for _ in range(n)]


MAX_HOLES = 2   # hidden slots mixed into a compact run


# A mixed batch: a 1-token sequence over a 1-token chunk, a long one over many chunks, and
# chunks 0 and 2 shared by several sequences at different offsets.
CHUNKS = [37, 1, 50, 9, 64, 23]
MIXED = [([1], 1, 1), ([0, 2, 3, 4, 5], 7, 1), ([2, 0], 3, 1), ([4, 0, 2], 2, 1)]
# Prefill: 5 new tokens over a 1-token chunk, 19 over five chunks, 1 new token, 3 of 12.
PREFILL = [([1], 5, 5), ([0, 2, 3, 4, 5], 30, 19), ([2, 0], 1, 1), ([4], 12, 3)]
