"""shared_chunk_decode: each shared chunk read once for all the sequences that hold it.

Against the fp64 reference over the same attention written as one ordinary page table per
sequence (its private entries, then each of its chunks' pages at that sequence's offset), built
here from the case's own description, not by the code under test: random sharing patterns
(chunks held by 1 .. all sequences, several work tiles per chunk, split chunks), chunk lengths
that leave partial last pages (their tails NaN: never read), GQA 1-8, head dim 64 / 128, chunks
that stay in the private table beside shared ones, rot_shifts that are not the chunk's position
(a chunk encoded after a shared prefix), padding tiles and pairs (the captured graphs' buckets),
and fp8 pages.
"""
import random

import pytest
import torch

from _cases import DEVICE, DTYPES, TOL, inv_freq_for, rel_err
from lazy_rag.kernels import PageTable, paged_attention_ref, quantize_rows, to_keys_major
from lazy_rag.kernels.shared_chunks import SharedChunks, shared_chunk_decode


class SharingCase:
    """B sequences over n_chunks chunks: sequence b holds chunks (in a random order, at
    consecutive offsets after a random start), then n_private private tokens, the last of which is
    its decode query. Chunks held by at least `min_share` sequences go to the shared part, the
    rest stay in the sequence's private table."""

    def __init__(self, *, B, n_chunks, G, D, page, dtype, seed, pairs_per_tile=4, min_share=2,
                 prefix=0, fp8=False, pad_tiles=0, pad_pairs=0, own_pairs=False):
        rnd = random.Random(seed)
        g = torch.Generator().manual_seed(seed)
        Hkv = 2
        self.H, self.D, self.page = Hkv * G, D, page
        chunk_len = [rnd.randint(1, 4 * page) for _ in range(n_chunks)]
        held = [rnd.sample(range(n_chunks), rnd.randint(1, min(4, n_chunks))) for _ in range(B)]
        held[0] = list(range(n_chunks))           # one sequence holds every chunk,
        for h in held[1:]:                        # every sequence holds chunk 0 (somewhere)
            if 0 not in h:
                h.insert(rnd.randint(0, len(h)), 0)
        n_private = [rnd.randint(1, 2 * page) for _ in range(B)]
        npg = lambda n: -(-n // page)  # noqa: E731
        total = sum(npg(n) for n in chunk_len) + sum(npg(n) for n in n_private) + 2
        alloc = iter(torch.randperm(total, generator=g).tolist())
        k = torch.randn(total, Hkv, page, D, generator=g)
        v = torch.randn(total, Hkv, page, D, generator=g)
        chunk_pages = [[next(alloc) for _ in range(npg(n))] for n in chunk_len]
        for pages, n in zip(chunk_pages, chunk_len):      # a partial last page's tail is never read
            if n % page:
                k[pages[-1], :, n % page:] = float("nan")
                v[pages[-1], :, n % page:] = float("nan")
        holders = [sum(c in h for h in held) for c in range(n_chunks)]
        shared = [holders[c] >= min_share for c in range(n_chunks)]
        priv = {f: [] for f in ("ids", "pos", "len", "rot")}
        full = {f: [] for f in ("ids", "pos", "len", "rot")}
        pairs, q_pos = [], []
        own_chunks = []          # own_pairs: each sequence's own pages as a chunk of its own
        for b in range(B):
            rows = {f: [] for f in priv}
            whole = {f: [] for f in full}
            pos = rnd.randint(0, 50)
            for c in held[b]:
                shift = pos - prefix     # keys stored rotated at their chunk-local position + prefix
                for j, pg in enumerate(chunk_pages[c]):
                    entry = (pg, pos + j * page, min(page, chunk_len[c] - j * page), shift)
                    for f, x in zip(whole, entry):
                        whole[f].append(x)
                    if not shared[c]:
                        for f, x in zip(rows, entry):
                            rows[f].append(x)
                if shared[c]:
                    pairs.append((b, c, shift, pos))
                pos += chunk_len[c] + rnd.randint(0, 3)       # gaps are allowed
            own = [next(alloc) for _ in range(npg(n_private[b]))]
            if own_pairs:
                own_chunks.append((own, n_private[b]))
                pairs.append((b, n_chunks + b, 0, pos))
            for j, pg in enumerate(own):
                entry = (pg, pos + j * page, min(page, n_private[b] - j * page), 0)
                if not own_pairs:
                    for f, x in zip(rows, entry):
                        rows[f].append(x)
                for f, x in zip(whole, entry):
                    whole[f].append(x)
            if n_private[b] % page:
                k[own[-1], :, n_private[b] % page:] = float("nan")
                v[own[-1], :, n_private[b] % page:] = float("nan")
            q_pos.append(pos + n_private[b] - 1)
            for f in priv:
                priv[f].append(rows[f])
                full[f].append(whole[f])
        rnd.shuffle(pairs)
        used = sorted({c for _, c, _, _ in pairs})
        index = {c: i for i, c in enumerate(used)}
        every = [(p, n) for p, n in zip(chunk_pages, chunk_len)] + own_chunks
        self.shared = SharedChunks.from_pairs([every[c] for c in used],
                                              [(b, index[c], s, p) for b, c, s, p in pairs], B, pairs_per_tile,
                                              device=DEVICE)
        if pad_tiles or pad_pairs:
            self.shared = _padded(self.shared, pad_tiles, pad_pairs)
        self.private = (None if own_pairs else
                        PageTable.from_lists(priv["ids"], priv["pos"], priv["len"], priv["rot"], device=DEVICE))
        self.union = PageTable.from_lists(full["ids"], full["pos"], full["len"], full["rot"], device=DEVICE)
        self.q_pos = torch.tensor(q_pos, dtype=torch.int32, device=DEVICE)
        self.q = torch.randn(B, self.H, D, generator=g).to(dtype).to(DEVICE)
        self.k_scale = self.v_scale = None
        if fp8:
            k8, ks = quantize_rows(torch.nan_to_num(k, nan=0.0))
            v8, vs = quantize_rows(torch.nan_to_num(v, nan=0.0))
            self.k_pages, self.v_pages = k8.to(DEVICE), v8.to(DEVICE)
            self.k_scale, self.v_scale = ks.to(DEVICE), vs.to(DEVICE)
        else:
            self.k_pages, self.v_pages = k.to(dtype).to(DEVICE), v.to(dtype).to(DEVICE)
        self.inv, self.scaling = inv_freq_for("llama3" if D == 128 else "default", D)
        self.inv = self.inv.to(DEVICE)
        self.holders = holders

    def run(self, **kw):
        return shared_chunk_decode(self.q, self.k_pages, self.v_pages, self.private, self.shared, self.q_pos,
                                   self.inv, attention_scaling=self.scaling, k_scale=self.k_scale,
                                   v_scale=self.v_scale, **kw)

    def reference(self):
        B = self.q.shape[0]
        return paged_attention_ref(self.q, torch.arange(B + 1, dtype=torch.int32, device=DEVICE), self.q_pos,
                                   self.k_pages, self.v_pages, self.union, self.inv, "rotate_q", self.scaling,
                                   compute_dtype=torch.float64, k_scale=self.k_scale, v_scale=self.v_scale)


def _padded(s: SharedChunks, tiles: int, pairs: int) -> SharedChunks:
    """Padding as the captured graphs add it: tiles with no pairs, pairs no sequence lists."""
    z = lambda t, n: torch.cat([t, torch.zeros(n, dtype=t.dtype, device=t.device)])  # noqa: E731
    return SharedChunks(s.chunk_indptr, s.chunk_pages, s.chunk_len, z(s.tile_chunk, tiles), z(s.tile_pair0, tiles),
                        z(s.tile_pairs, tiles), z(s.pair_seq, pairs), z(s.pair_shift, pairs), z(s.pair_pos, pairs),
                        s.seq_indptr, s.seq_pairs, s.max_chunk_pages, s.pairs_per_tile)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("G,D,page,ppt,seed", [
    (1, 64, 16, 3, 0), (2, 64, 16, 1, 1), (3, 128, 16, 2, 2), (4, 128, 64, 4, 3), (8, 64, 16, 2, 4),
    (4, 64, 16, 16, 5),
])
def test_matches_reference(G, D, page, ppt, seed, dtype):
    c = SharingCase(B=5, n_chunks=4, G=G, D=D, page=page, dtype=dtype, seed=seed, pairs_per_tile=ppt,
                    prefix=seed % 2 * 7)
    assert max(c.holders) == 5 and c.shared.num_pairs > 0    # shared by all, and by some
    assert rel_err(c.run(), c.reference()) < TOL[dtype]


@pytest.mark.parametrize("splits", [1, 3])
def test_split_chunks_and_padding(splits):
    dtype = DTYPES[0]
    c = SharingCase(B=6, n_chunks=3, G=2, D=64, page=16, dtype=dtype, seed=7, pairs_per_tile=2, pad_tiles=3,
                    pad_pairs=5)
    assert rel_err(c.run(num_splits=splits), c.reference()) < TOL[dtype]


def test_every_chunk_private_or_every_chunk_shared():
    dtype = DTYPES[0]
    alone = SharingCase(B=3, n_chunks=3, G=2, D=64, page=16, dtype=dtype, seed=8, min_share=99)
    assert alone.shared.num_pairs == 0
    assert rel_err(alone.run(), alone.reference()) < TOL[dtype]
    together = SharingCase(B=3, n_chunks=3, G=2, D=64, page=16, dtype=dtype, seed=9, min_share=1)
    assert together.shared.num_pairs == sum(together.holders)
    assert rel_err(together.run(), together.reference()) < TOL[dtype]


def test_no_private_part():
    """A decode step's own pages as pairs too (private=None): every key precedes the query."""
    dtype = DTYPES[0]
    c = SharingCase(B=4, n_chunks=3, G=4, D=64, page=16, dtype=dtype, seed=14, own_pairs=True, min_share=1,
                    pairs_per_tile=2)
    assert c.private is None
    assert rel_err(c.run(), c.reference()) < TOL[dtype]


@pytest.mark.parametrize("dtype", [DTYPES[-1], DTYPES[0]])
def test_fp8_pages(dtype):
    """fp8 pages, V dims-major and keys-major (the fp8 pool's layout: kernels/v_layout.py), the
    two agreeing bit for bit on the CPU. fp16 scales V tiles in registers; the other dtype
    scales P's columns."""
    c = SharingCase(B=4, n_chunks=3, G=4, D=64, page=16, dtype=dtype, seed=11, fp8=True)
    out = c.run()
    assert rel_err(out, c.reference()) < max(2e-3, TOL[dtype])
    c.v_pages = to_keys_major(c.v_pages)
    keys = c.run()
    assert rel_err(keys, c.reference()) < max(2e-3, TOL[dtype])
    if DEVICE == "cpu":
        assert torch.equal(out, keys)


def test_writes_into_out_and_leaves_inputs():
    dtype = DTYPES[0]
    c = SharingCase(B=3, n_chunks=2, G=2, D=64, page=16, dtype=dtype, seed=12)
    q0 = c.q.clone()
    out = torch.full_like(c.q, float("nan"))
    res = c.run(out=out)
    assert res.data_ptr() == out.data_ptr() and torch.isfinite(out).all()
    assert torch.equal(c.q, q0)


def test_union_table_is_the_per_sequence_table():
    """The CPU fallback reads SharedChunks.union_table: the same prompt as the case's own table
    (same keys at the same positions with the same rotation), entry order aside."""
    c = SharingCase(B=4, n_chunks=3, G=2, D=64, page=16, dtype=torch.float32, seed=13)
    u = c.shared.union_table(c.private, c.page)

    def entries(t, b):
        a, e = int(t.indptr[b]), int(t.indptr[b + 1])
        return sorted(zip(*(getattr(t, f)[a:e].tolist() for f in ("page_ids", "page_pos", "page_len", "rot_shift"))))
    for b in range(4):
        assert entries(u, b) == entries(c.union, b)
