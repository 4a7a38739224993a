"""``ModelRunner``: the engine's one forward, tensors in, tensors out.

Every engine step (prefills, appends and decodes of many sequences packed into one token
batch), every chunk encode and every captured decode graph runs ``forward``: the checkpoint's
own modules layer by layer (``architecture.ModelParts``), with attention replaced by attention
over the paged pool. In each layer the new tokens' keys are rotated (at their logical position
minus their run's rot_shift) and written with their values to their pages, then attention reads
each sequence's pages through the path that computes it exactly and fastest (``StepAttention``):

- a *fresh* sequence (nothing cached: full mode, a prefix-mode miss, a chunk encoded alone)
  attends only to its own new tokens, causally: torch SDPA (flash on CUDA) over contiguous
  q/k/v, which is what a user of plain transformers gets, so ``full`` is measured at its best
  (on CUDA a step of up to 2,048 such tokens replays a captured graph instead, the Triton kernel
  over the sequence's own pages: launch-bound otherwise, ``cuda_graphs``);
- on CUDA, a long tail after reused prefix pages gathers the sequence's pages once per layer and
  runs SDPA with a lower-right causal mask (as vLLM runs flash attention over its paged prefix),
  and every other sequence goes through the Triton lazy-RoPE kernels (``rope_mode="rotate_q"``:
  the query rotated once per chunk by its position minus the chunk's start);
- on the CPU (and on CUDA for a head_dim the kernels do not take, not a multiple of 32), every
  other sequence gathers its visible keys, rotates them from their stored rotation to their
  logical positions (a pure rotation by rot_shift) and runs one SDPA call with the visibility
  mask: the same function as the kernels' torch reference, vectorised.

Each layer's keys are written rotated by the layer's own RoPE table (``ModelParts.layer_rope``:
the model's one table, but for gemma3_text's sliding layers, whose local table differs from the
global layers'), and every path rotates the layer's queries by that same table: the kernels take
it per call (``layer_options``), the torch paths take the gathered keys as stored, turned to their
logical positions by a pure rotation of the layer's own table. Sliding-window layers (gemma3_text,
gemma2, ``architecture.LayerKind``) also mask keys more than their window behind each query's
logical position, the kernels through their ``window``.

Soft-capped attention scores (gemma2, ``ModelParts.softcap``): every path caps the scores before
the mask and softmax: the torch ones (fresh, torch over the pool, APE, the question probe)
through explicit scores (``capped_attention``: SDPA cannot cap), the Triton kernels in registers
(``layer_options``). On the kernels' device fresh sequences and tails take the kernels too
(``fresh_on_kernels``): explicit fp32 scores grow as new tokens x keys.

Encodes capture the new tokens' keys before rotation: the position-free KV a chunk is stored as
(quantised to fp8 with per-token scales when the pool is fp8, like the pool's own copy).

fp8 pools: the model computes in its dtype; each layer's new K/V are quantised per token as they
are written (``PagePool.write_tokens``) and every read dequantises (the kernels in registers, the
torch paths through ``PagePool.gather``). A step's attention to its own new tokens therefore reads
them quantised, except on the fresh path, whose SDPA takes them before the write (a chunk's encode
and full mode attend to their exact K/V; what they leave in the pool is quantised).
"""
from __future__ import annotations

import contextlib
import math

import torch
import torch.nn.functional as F
from torch.nn.attention.bias import causal_lower_right

from ..architecture import ModelParts, softcap
from ..chunk_adapter import ChunkAdapters, encoding_chunks
from ..kernels import HIDDEN_POS, lazy_prefill, plan_prefill, quantize_rows, rope_cos_sin, rotate
from ..kernels.rope import apply_cos_sin
from ..chunk_kv import ChunkKV
from ..kv_int4 import KEY_GROUP, VALUE_GROUP, quantize_kv
from .cuda_graphs import AppendGraphs, DecodeAttention, DecodeGraphs
from .page_pool import PagePool
from .page_table import (attention_path, build_table, group_rows, is_decode_step, page_rows, slot_map, step_tokens,
                         table_of_rows)
from .shared_chunks import plan_shared_decode


class ModelRunner:
    def __init__(self, parts: ModelParts, pool: PagePool, cuda_graphs: bool = True, max_graph_batch: int = 256,
                 max_graph_tokens: int = 4096, shared_chunks: str = "auto"):
        self.parts, self.pool = parts, pool
        # a tensor-parallel rank's group (``rank_group.RankGroup``): forwards check lockstep
        # and the recovery selectors' scores, sums over this rank's heads, are summed over all ranks
        self.group = getattr(parts, "group", None)
        self.shared_chunks = shared_chunks   # EngineConfig.shared_chunks (decode steps on the kernels)
        self.shared_decode_steps = 0         # eager decode steps that read shared chunks once
        # each layer's keyword arguments for the kernels: the RoPE table its keys are stored
        # rotated by (one device copy per table), its scores' soft-cap and its window
        # (architecture.LayerKind; None where off, the kernels' defaults)
        freqs = {id(t): t.inv_freq.to(pool.device) for t in parts.layer_rope}
        self.layer_options = [dict(inv_freq=freqs[id(t)], attention_scaling=t.attention_scaling, softcap=parts.softcap,
                                   window=parts.kinds[k].window) for t, k in zip(parts.layer_rope, parts.layer_kind)]
        # the Triton kernels: CUDA tensors and a head_dim multiple of 32 (their tiling)
        self.use_kernels = pool.device.type == "cuda" and parts.shape.head_dim % 32 == 0
        # soft-capped scores: fresh sequences and tails on the kernels as well, since SDPA cannot
        # cap and capped_attention's explicit fp32 scores take new tokens x keys x heads (2 GB a
        # layer for one 8k-token prompt with Gemma-2-2B's 8 heads)
        self.fresh_on_kernels = self.use_kernels and parts.softcap is not None
        self.graphs = self.append_graphs = None
        self.graph_mempool = None   # one memory pool for every captured graph (they never run at once)
        if cuda_graphs and self.use_kernels:
            self.graphs = DecodeGraphs(self, max_graph_batch, shared_chunks=shared_chunks)
            if max_graph_tokens > 0:
                self.append_graphs = AppendGraphs(self, max_graph_batch, max_tokens=max_graph_tokens)

    # -- the one layer loop -----------------------------------------------------------------------
    def forward(self, ids, pos, write_page, write_slot, attention, *, key_pos=None, logits_rows=None,
                capture: bool | int | tuple = False, num_layers: int | None = None, virtual: bool = True,
                sums: tuple[int, int] | None = None):
        """Run the new tokens ``ids`` at logical positions ``pos`` ([n] on the device) through the
        layers. Their KV goes to (``write_page``, ``write_slot``) (None: nowhere, a pass that
        leaves the pool alone), keys rotated at ``key_pos`` (default ``pos``).
        ``attention(layer, q, k, v)`` -> [n, H, D] with q unrotated and k rotated at ``key_pos`` by the
        layer's own RoPE table, as written to the pool.
        ``num_layers``: stop after that many layers. ``virtual=False``: no id is a chunk wrapper's
        slot (decode steps; a captured graph must not read the wrapper table). ``capture``: keep the
        unrotated K and V of every token (True) or of the first ``capture`` tokens (an int), or
        write them into given (K, V) buffers [layers, m, Hkv, D] (the first m tokens).
        Returns (fp32 logits of ``logits_rows`` or None, captured unrotated K and V
        [layers, captured, Hkv, D] or None). No host syncs and no
        allocation that depends on values: a decode step through it can be captured in a graph.
        ``sums``: the sums of ``ids`` and ``pos``, where the caller has them on the host (a
        tensor-parallel rank's lockstep check then reads nothing back from the GPU)."""
        p, shp = self.parts, self.parts.shape
        n = ids.shape[0]
        depth = len(p.layers) if num_layers is None else num_layers
        # (not inside a CUDA graph's capture: a replay runs no host code; ``check_replay`` checks it).
        # On CUDA only started here, compared before the output is read: ``settle`` in ``run``,
        # ``_check_lockstep_before_reading`` elsewhere
        if self.group is not None and not (ids.is_cuda and torch.cuda.is_current_stream_capturing()):
            ids_sum, pos_sum = sums if sums is not None else (int(ids.sum()), int(pos.sum()))
            self.group.check_lockstep([n, depth, ids_sum, pos_sum], "a forward")
        kp = pos if key_pos is None else key_pos
        # each layer kind's key rotation, by its own table (architecture.LayerKind)
        kcs = [kind.rope.cos_sin(kp, p.dtype) for kind in p.kinds]
        caught = capture if isinstance(capture, tuple) else None
        m = caught[0].shape[1] if caught else n if capture is True else int(capture)
        if m and caught is None:
            caught = (torch.empty(depth, m, shp.num_kv_heads, shp.head_dim, dtype=p.dtype, device=ids.device),
                      torch.empty(depth, m, shp.num_kv_heads, shp.head_dim, dtype=p.dtype, device=ids.device))
        x = p.embed_scale(p.embed_ids(ids, virtual))
        # the family's layer around attention (architecture.LayerFamily): norms, projections,
        # multipliers and residuals are the checkpoint's own modules in its own order
        for i, layer in enumerate(p.layers[:depth]):
            q, k, v = p.project_qkv(layer, p.attention_in(layer, x))
            if m:
                caught[0][i], caught[1][i] = k[:m], v[:m]
            k = apply_cos_sin(k, *kcs[p.layer_kind[i]])
            if write_page is not None:
                self.pool.write_tokens(i, write_page, write_slot, k, v)
            o = attention(i, q, k, v)
            x = p.attention_residual(layer, x, o.reshape(n, shp.num_heads * shp.head_dim))
            x = p.mlp_residual(layer, x)
        logits = None if logits_rows is None else p.logits(x[logits_rows])
        return logits, caught

    def paged_prefill(self, i: int, q, qo, q_pos, table, plan, **options):
        """Layer ``i``'s attention of the new tokens q [n, H, D] (unrotated) over their page table,
        through the Triton prefill kernel (every step's paged sequences, APE's groups, the captured
        append steps). ``options``: ``sm_scale`` (default the model's), ``softcap`` (default the
        layer's), ``out``, ``return_lse``."""
        options = {"sm_scale": self.parts.scaling, **self.layer_options[i], **options}
        return lazy_prefill(q, qo, q_pos, self.pool.k[i], self.pool.v[i], table, rope_mode="rotate_q", plan=plan,
                            **self.pool.scales(i), **options)

    def check_replay(self, packed: torch.Tensor) -> None:
        """Before a CUDA graph's replay (which runs no ``forward`` on the host, so no lockstep
        check): a tensor-parallel rank compares the graph's packed inputs (on the host) with the
        other ranks'. The same four values as ``forward``'s, so that a rank replaying a graph and
        one running the step eagerly fail the check instead of hanging in different collectives."""
        if self.group is not None:
            self.group.check_lockstep([packed.numel(), -1, int(packed.sum()), 0], "a CUDA graph's replay")

    # -- steps and encodes ------------------------------------------------------------------------
    @torch.inference_mode()
    def run(self, seqs) -> torch.Tensor:
        """Compute every sequence's ``compute_pos`` tokens; returns fp32 logits [len(seqs), vocab]
        of each sequence's last new token (after a CUDA-graph step, a view of the graph's output
        buffer: valid until the next ``run``). A sequence's ``encode_jobs`` (chunks it encodes in
        its prefill, ``kv_planner``) run in the same forward ahead of every sequence's tokens, so
        each layer writes their KV before anyone attends to it; their captured KV is left in the
        sequence's ``encoded_kv``. A tensor-parallel rank on CUDA returns once the step has
        finished on every rank (``RankGroup.settle``)."""
        logits = self._step(seqs)
        if self.group is not None:
            self.group.settle()
        return logits

    def _step(self, seqs) -> torch.Tensor:
        jobs = [j for s in seqs for j in getattr(s, "encode_jobs", ())]
        scoring = any(s.score_rows for s in seqs)  # rows beyond the last: eager, outside any graph
        if not jobs and not scoring:
            if self.graphs is not None and is_decode_step(seqs):
                out = self.graphs.run(seqs)
                if out is not None:
                    return out
            if self.append_graphs is not None:
                out = self.append_graphs.run(seqs)
                if out is not None:
                    return out
        elif self.append_graphs is not None and not scoring and not any(self.encode_leaves_graph(j.tokens) for j in jobs):
            # a cold request's step (its missing chunks encoded in its prefill) from a graph too:
            # eager, a launch-bound shape pays more in kernel launches than `full` pays to
            # re-encode the same tokens.
            out = self.append_graphs.run_encoding(jobs, seqs)
            if out is not None:
                logits, caught, spans = out
                self._keep_encoded(seqs, caught, spans)
                return logits
        batch = self._pack(jobs + seqs)
        # each sequence's rows: its last new token's, or its last score_rows (teacher-forced scoring)
        counts = [max(1, s.score_rows) for s in seqs]
        rows = [r for (_, b), n in zip(batch.spans[len(jobs):], counts) for r in range(b - n, b)]
        encoded = batch.spans[len(jobs) - 1][1] if jobs else 0
        # pack_fresh: the chunks join the sequences' kernel launch (one per layer), not one SDPA each
        with self._adapters_on(jobs, batch):
            logits, caught = self.forward(batch.ids, batch.pos, batch.write_page, batch.write_slot,
                                          StepAttention(self, jobs + seqs, batch, pack_fresh=bool(jobs)),
                                          key_pos=batch.key_pos, logits_rows=torch.tensor(rows, device=self.pool.device),
                                          capture=encoded, sums=batch.sums)
        if jobs:
            self._keep_encoded(seqs, caught, batch.spans[:len(jobs)])
        if scoring:
            parts = logits.split(counts)
            for s, part in zip(seqs, parts):
                if s.score_rows:
                    s.scored_logits = part
            logits = torch.stack([part[-1] for part in parts])
        return logits

    def encode_leaves_graph(self, token_ids) -> bool:
        """Would encoding this chunk in a request's step run that step eagerly, where it would
        otherwise replay a captured graph? So for a chunk encoded with a chunk adapter: adapters
        gate per token through hooks, outside any graph. The read-or-encode chooser then counts an
        eager forward's fixed cost against encoding it (``kv_planner``)."""
        if self.append_graphs is None:
            return False  # every step is eager: encoding it changes nothing
        adapters = ChunkAdapters.find(self.parts.model)
        return adapters is not None and adapters.column_of(token_ids) is not None

    def _keep_encoded(self, seqs, caught, spans) -> None:
        """Each sequence's ``encoded_kv``: its encode jobs' KV, copied out of the step's captured
        K/V (``caught``, rows ``spans`` in job order)."""
        kvs = iter(self._chunk_kvs(*caught, spans, to_host=False))
        for s in seqs:
            s.encoded_kv = [next(kvs) for _ in getattr(s, "encode_jobs", ())]

    @torch.inference_mode()
    def encode(self, jobs, to_host: bool = False, quantize: str | None = None, host_alloc=None) -> list[ChunkKV]:
        """Encode chunks (``sequence.EncodeJob``) into their pool pages in one forward; returns each
        chunk's captured unrotated KV, in the pool's format (fp8 with per-token scales for an fp8
        pool, or with ``quantize``). ``to_host``: the KV on the host, each chunk's tensors
        contiguous views of one copy of the whole batch (``chunk_major_on_host``: an index build,
        one DMA into pinned memory per tensor instead of a copy and a pin per chunk, which made the
        8B build's encode 2-3x slower than its forward).
        ``quantize``: "fp8" or "int4" whatever the pool (a quantised store's build: quantised
        here on the device, a half or a quarter of the bytes to copy, instead of on the host's
        writer threads, where int4's range search held an 8B build to 769 tokens/s on the H200
        machine against its encode's 36,900). ``host_alloc(shape,
        dtype)``: where the host copies go (an index build's reused pinned buffers,
        ``pinned_staging``), instead of fresh pinned memory per tensor."""
        batch = self._pack(jobs)
        with self._adapters_on(jobs, batch):
            _, caught = self.forward(batch.ids, batch.pos, batch.write_page, batch.write_slot,
                                     StepAttention(self, jobs, batch, pack_fresh=True, encode_batch=True),
                                     key_pos=batch.key_pos,
                                     capture=True, sums=batch.sums)
        self._check_lockstep_before_reading()
        return self._chunk_kvs(*caught, batch.spans, to_host, quantize, host_alloc)

    def _check_lockstep_before_reading(self) -> None:
        """Before a forward's output is read outside ``run`` (which settles): a tensor-parallel
        rank's lockstep checks left to compare after the forward was enqueued
        (``RankGroup.check_lockstep``) must pass, or the read could wait on a forward out of
        lockstep hung on the GPU, or return what it computed."""
        if self.group is not None:
            self.group.check_pending_lockstep()

    def _adapters_on(self, jobs, batch: "PackedBatch"):
        """The chunk adapters (chunk_adapter.py) on for the encode jobs' tokens (the first spans
        of ``batch``), each job's by its wrapper slots; off for every other token."""
        if not jobs:
            return contextlib.nullcontext()
        spans = [(a, b, job.tokens) for job, (a, b) in zip(jobs, batch.spans)]
        return encoding_chunks(self.parts.model, spans, int(batch.ids.shape[0]), batch.ids.device)

    def _chunk_kvs(self, k, v, spans, to_host: bool, quantize: str | None = None, host_alloc=None) -> list[ChunkKV]:
        """Each span's ChunkKV from captured K/V [layers, n, Hkv, D], in the pool's format or in
        ``quantize``'s ("fp8", "int4")."""
        if quantize == "int4":
            return [int4_chunk_kv(k[:, a:b], v[:, a:b], to_host, host_alloc) for a, b in spans]
        if quantize not in (None, "fp8"):
            raise ValueError(f"quantize={quantize!r}: choose 'fp8', 'int4' or None")
        quantize = quantize == "fp8" or self.pool.quantized
        tensors = (k, v) if not quantize else (*quantize_rows(k), *quantize_rows(v))
        if quantize:  # (k8, k_scale, v8, v_scale) -> ChunkKV's order
            tensors = (tensors[0], tensors[2], tensors[1], tensors[3])
        if to_host:
            return chunk_major_on_host(tensors, spans, host_alloc)
        return [ChunkKV(*(t[:, a:b].clone() for t in tensors)) for a, b in spans]

    # -- choosing the chunk tokens to recompute (Recovery.select) -----------------------------------
    @torch.inference_mode()
    def question_attention(self, seq, candidates: list[int]) -> torch.Tensor:
        """ProphetKV's score of each candidate position: the softmax attention the question (the
        new tokens after the last chunk) pays it over the reused KV, averaged over every layer,
        head and question token. Runs the sequence's pending prefill once as it is (its KV is
        written again by the real prefill)."""
        batch = self._pack([seq])
        last_chunk_end = max((span.end for span in seq.layout.spans), default=0)
        rows = [r for r, p in enumerate(seq.compute_pos) if p >= last_chunk_end]
        probe = QuestionProbe(self, seq, rows, batch, candidates)
        self.forward(batch.ids, batch.pos, batch.write_page, batch.write_slot,
                     StepAttention(self, [seq], batch, probe=probe), key_pos=batch.key_pos, sums=batch.sums)
        self._check_lockstep_before_reading()
        scores = probe.scores()
        if self.group is not None:   # the mean over this rank's heads -> over every head
            scores = self.group.all_reduce(scores) / self.group.size
        return scores

    @torch.inference_mode()
    def kv_deviation(self, seq, candidates: list[int], layer: int) -> torch.Tensor:
        """CacheBlend's score of each candidate position: how far the K and V it reads from
        cache at ``layer`` are from those of a full causal pass over the whole prompt (run through
        ``layer + 1`` layers only, writing nothing)."""
        dev, dt = self.pool.device, self.parts.dtype
        layer = min(layer, self.parts.shape.num_layers - 1)
        prompt = seq.prompt
        pos = torch.arange(len(prompt), device=dev)
        full = FreshCausal(self, pos)
        _, (k, v) = self.forward(torch.tensor(prompt, device=dev), pos, None, None, full, capture=True,
                                 num_layers=layer + 1, sums=(sum(prompt), len(prompt) * (len(prompt) - 1) // 2))
        self._check_lockstep_before_reading()
        where = slot_map(seq, self.pool.page_size, candidates)
        page = torch.tensor([where[p][0] for p in candidates], device=dev)
        slot = torch.tensor([where[p][1] for p in candidates], device=dev)
        shift = torch.tensor([where[p][2] for p in candidates], device=dev)
        cand = torch.tensor(candidates, device=dev)
        cos, sin = self.parts.layer_rope[layer].cos_sin(cand - shift, dt)   # the cached key's rotation
        fresh_k = apply_cos_sin(k[layer, cand], cos, sin).float()
        cached_k, cached_v = (x.float() for x in self.pool.gather(layer, page, slot))
        sums = torch.stack([(fresh_k - cached_k).pow(2).sum((-1, -2)), cached_k.pow(2).sum((-1, -2)),
                            (v[layer, cand].float() - cached_v).pow(2).sum((-1, -2)), cached_v.pow(2).sum((-1, -2))])
        if self.group is not None:   # sums over this rank's KV heads -> over every head
            sums = self.group.all_reduce(sums)
        return (sums[0] / sums[1].clamp_min(1e-12) + sums[2] / sums[3].clamp_min(1e-12)).cpu()

    def _pack(self, seqs) -> "PackedBatch":
        tok = step_tokens(seqs, self.pool.page_size)
        t = lambda x: torch.tensor(x, device=self.pool.device)  # noqa: E731
        shifted = tok.key_pos != tok.pos
        # the sums only a tensor-parallel rank's lockstep check reads
        sums = (sum(tok.ids), sum(tok.pos)) if self.group is not None else None
        return PackedBatch(t(tok.ids), t(tok.pos), t(tok.pages), t(tok.slots), t(tok.key_pos) if shifted else None,
                           tok.spans, sums)


def chunk_major_on_host(tensors, spans, host_alloc=None) -> list[ChunkKV]:
    """Each span's ChunkKV on the host from layer-major batch tensors [layers, tokens, ...], every
    tensor of it contiguous: the spans are laid out one after the other on the device (one copy
    each), then each tensor goes to the host in one copy (into pinned memory from CUDA: one DMA per
    tensor instead of a copy and a pin per chunk). An index build's writer then hands the store
    views it writes as they are; a chunk's slice of a layer-major batch is not contiguous, and the
    store's copy of it (2 GB per batch of the 8B shape, on the host's prepare threads, into freshly
    faulted memory on a build's first batch) was the writer's largest cost after the disk itself
    (BENCHMARKS.md, "The encode alone"). ``host_alloc(shape, dtype)``: the pinned host
    tensor each one goes to (default: fresh pinned memory)."""
    out = [[] for _ in spans]
    for t in tensors:
        layers, rest = t.shape[0], tuple(t.shape[2:])
        per_token = math.prod(rest)
        flat = torch.empty(layers * per_token * sum(b - a for a, b in spans), dtype=t.dtype, device=t.device)
        at, places = 0, []
        for a, b in spans:
            shape = (layers, b - a, *rest)
            n = math.prod(shape)
            flat[at:at + n].view(shape).copy_(t[:, a:b])
            places.append((at, n, shape))
            at += n
        flat = host_copy(flat, host_alloc)
        for parts, (at, n, shape) in zip(out, places):
            parts.append(flat[at:at + n].view(shape))
    return [ChunkKV(*parts) for parts in out]


def int4_chunk_kv(k, v, to_host: bool, host_alloc=None) -> ChunkKV:
    """A chunk's int4 KV (``kv_int4``: its key groups start at the chunk's first token, so each
    chunk is quantised alone), quantised where ``k`` and ``v`` are; ``to_host``: each tensor then
    copied to the host (into ``host_alloc(shape, dtype)``'s memory where given, else pinned
    memory from a CUDA device)."""
    tensors = quantize_kv(k, v)
    if to_host:
        tensors = {name: host_copy(t, host_alloc) for name, t in tensors.items()}
    return ChunkKV.from_tensors(tensors, (KEY_GROUP, VALUE_GROUP))


def host_copy(t: torch.Tensor, host_alloc=None) -> torch.Tensor:
    """A CUDA tensor copied to the host, into ``host_alloc(shape, dtype)``'s memory where given,
    else fresh pinned memory; a host tensor as it is."""
    if t.device.type != "cuda":
        return t
    host = host_alloc(t.shape, t.dtype) if host_alloc is not None else torch.empty(t.shape, dtype=t.dtype,
                                                                                    pin_memory=True)
    return host.copy_(t)


class PackedBatch:
    """The new tokens of a step, packed: ids, positions, KV write targets, rows per sequence, and
    under tensor parallelism the sums of the ids and positions (computed on the host:
    ``ModelRunner.forward``'s ``sums``; None otherwise)."""

    def __init__(self, ids, pos, write_page, write_slot, key_pos, spans, sums):
        self.ids, self.pos, self.write_page, self.write_slot, self.key_pos = ids, pos, write_page, write_slot, key_pos
        self.spans, self.sums = spans, sums


class StepAttention:
    """Attention of one step's packed new tokens, each sequence through its exact fastest path
    (see the module docstring). Everything that does not depend on the layer (page tables,
    masks, gather indices, query rotations) is prepared once here, then ``__call__`` runs per layer."""

    def __init__(self, runner: ModelRunner, seqs, batch: PackedBatch, probe=None, pack_fresh: bool = False,
                 encode_batch: bool = False):
        # encode_batch: an index build's encode (ModelRunner.encode): the kernel's tiles and split
        # count of a full build batch whatever this one's size (plan_prefill's ``encode``)
        # pack_fresh: sequences without history (and tails) on the Triton kernel as well, all in one
        # launch per layer, when there are several: an index build's encode of many short chunks,
        # where one SDPA call per chunk per layer leaves the GPU waiting on Python (7x slower at 256
        # tokens per chunk on an H100). One long fresh prompt keeps SDPA's flash kernel.
        encodes = pack_fresh     # a forward with chunk encodes in it is never a decode step
        pack_fresh = (pack_fresh and runner.use_kernels and len(seqs) > 1) or runner.fresh_on_kernels
        self.runner, self.probe = runner, probe
        p, pool = runner.parts, runner.pool
        self.scaling, self.softcap, self.shape = p.scaling, p.softcap, p.shape
        dev, ps = pool.device, pool.page_size
        kernels = runner.use_kernels
        self.fresh, self.tails, self.torch_paths, self.paged, self.ape = [], [], [], None, []
        self.shared = self._shared_decode(seqs, batch) if probe is None and not encodes else None
        if self.shared is not None:
            runner.shared_decode_steps += 1
            return
        # each layer kind's query rotation, for the paths that take rotated q
        self.qcs = [kind.rope.cos_sin(batch.pos, p.dtype) for kind in p.kinds]
        self.kind_of, self.windows = p.layer_kind, [kind.window for kind in p.kinds]
        paged, ape = [], []
        for j, seq in enumerate(seqs):
            a, b = batch.spans[j]
            path, history = attention_path(seq, kernels, ps)
            if pack_fresh and path in ("fresh", "tail"):
                path = "paged"
            if path == "fresh":
                self.fresh.append((a, b))
            elif path == "tail":
                self.tails.append((a, b, torch.tensor(history, device=dev), seq.num_tokens))
            elif path == "ape":
                ape.append(j)
            elif path == "paged":
                paged.append(j)
            else:
                self.torch_paths.append((a, b, TorchSequenceKeys(seq, ps, batch.pos[a:b], p)))
        self.paged = None
        if paged:
            qo = [0]
            for j in paged:
                a, b = batch.spans[j]
                qo.append(qo[-1] + b - a)
            rows = None
            if len(paged) < len(seqs):
                rows = torch.tensor([r for j in paged for r in range(*batch.spans[j])], device=dev)
            q_pos = (batch.pos if rows is None else batch.pos[rows]).to(torch.int32)
            self.paged = (rows, torch.tensor(qo, dtype=torch.int32, device=dev), q_pos,
                          build_table([seqs[j] for j in paged], ps, dev),
                          plan_prefill(qo, self.shape.num_heads, self.shape.num_kv_heads, dev,
                                       dtype=p.dtype, encode=encode_batch, head_dim=self.shape.head_dim))
        self.ape = [ApeKernelGroups(runner, seqs[j], batch.spans[j], batch.pos) for j in ape]

    def _shared_decode(self, seqs, batch: PackedBatch) -> DecodeAttention | None:
        """A decode step of sequences that share chunks, on the kernels: the shared-chunk decode
        (``shared_chunks.py``), as the captured graphs run it; None otherwise."""
        r = self.runner
        if not (r.use_kernels and r.shared_chunks != "off" and is_decode_step(seqs)):
            return None
        if any(attention_path(s, True, r.pool.page_size)[0] != "paged" for s in seqs):
            return None
        plan = plan_shared_decode(seqs, r.pool.page_size, r.shared_chunks, self.shape.num_heads,
                                  self.shape.num_kv_heads)
        if plan is None:
            return None
        table, shared = plan.tensors(r.pool.device, len(seqs))
        return DecodeAttention(r, table, batch.pos.to(torch.int32), shared)

    def __call__(self, i: int, q, k_stored, v):
        pool = self.runner.pool
        if self.shared is not None:
            return self.shared(i, q, k_stored, v)
        kind = self.kind_of[i]
        cos, sin = self.qcs[kind]
        window = self.windows[kind]
        if self.probe is not None:
            self.probe.record(i, q, cos, sin)
        if self.paged is not None and self.paged[0] is None:  # every sequence takes the kernels
            return self._paged(i, q)
        o = torch.empty_like(q)
        if self.paged is not None:
            o[self.paged[0]] = self._paged(i, q[self.paged[0]])
        for groups in self.ape:
            a, b = groups.span
            o[a:b] = groups.attend(i, q[a:b])
        for a, b in self.fresh:   # k: the layer's own rotation (ModelRunner.forward)
            o[a:b] = causal_sdpa(apply_cos_sin(q[a:b], cos[a:b], sin[a:b]), k_stored[a:b], v[a:b],
                                 self.scaling, window, self.softcap)
        for a, b, pages, T in self.tails:   # CUDA only: the layer's keys as stored (its own rotation)
            kk, vv = pool.run_tokens(i, pages, T)
            o[a:b] = causal_sdpa(apply_cos_sin(q[a:b], cos[a:b], sin[a:b]), kk.to(q.dtype),
                                 vv.to(q.dtype), self.scaling, window, self.softcap)
        for a, b, keys in self.torch_paths:
            o[a:b] = keys.attend(pool, i, apply_cos_sin(q[a:b], cos[a:b], sin[a:b]), self.scaling, self.softcap)
        return o

    def _paged(self, i, q):
        _, qo, q_pos, table, plan = self.paged
        return self.runner.paged_prefill(i, q, qo, q_pos, table, plan)


class ApeKernelGroups:
    """APE on the Triton kernels for one sequence: its keys split into the chunks' group and the
    rest (two page tables over the same pages; a page that mixes both hides the other group's
    slots through explicit positions), each attended with its log-sum-exp, the chunk group at
    sm_scale / T with log-sum-exp T * lse + ln S, merged. A soft-cap c (gemma2) caps the scores
    before the division by T, as ``ape_attention``: cap(s) / T is the cap c / T of s / T."""

    def __init__(self, runner: ModelRunner, seq, span, pos):
        dev, ps = runner.pool.device, runner.pool.page_size
        self.runner, self.span = runner, span
        a, b = span
        rows = page_rows(seq, ps)
        chunk = [False] * seq.num_tokens
        for s in seq.layout.spans:
            chunk[s.start:s.end] = [True] * (s.end - s.start)
        self.tables = [table_of_rows([group_rows(rows, ps, lambda p, want=want: chunk[p] == want)], dev)
                       for want in (True, False)]
        self.qo = torch.tensor([0, b - a], dtype=torch.int32, device=dev)
        self.q_pos = pos[a:b].to(torch.int32)
        shp = runner.parts.shape
        self.plan = plan_prefill([0, b - a], shp.num_heads, shp.num_kv_heads, dev, dtype=runner.parts.dtype,
                                 head_dim=shp.head_dim)
        self.temperature, self.log_scale = seq.recovery.ape_temperature, math.log(seq.recovery.ape_scale)

    def attend(self, i: int, q):
        r, scaling, cap = self.runner, self.runner.parts.scaling, self.runner.parts.softcap
        parts = []
        for table, t, ls in zip(self.tables, (self.temperature, 1.0), (self.log_scale, 0.0)):
            out = torch.empty(q.shape, dtype=torch.float32, device=q.device)  # merged before rounding
            o, lse = r.paged_prefill(i, q, self.qo, self.q_pos, table, self.plan, sm_scale=scaling / t, out=out,
                                     return_lse=True, softcap=None if cap is None else cap / t)
            parts.append((t * lse + ls, o))
        return merge_by_lse(parts).to(q.dtype)


class FreshCausal:
    """Plain causal attention over the given new tokens only (a pass that ignores the pool)."""

    def __init__(self, runner: ModelRunner, pos):
        p = runner.parts
        self.qcs = [kind.rope.cos_sin(pos, p.dtype) for kind in p.kinds]
        self.kind_of, self.windows = p.layer_kind, [kind.window for kind in p.kinds]
        self.scaling, self.softcap = p.scaling, p.softcap

    def __call__(self, i: int, q, k, v):
        kind = self.kind_of[i]
        return causal_sdpa(apply_cos_sin(q, *self.qcs[kind]), k, v, self.scaling, self.windows[kind], self.softcap)


class QuestionProbe:
    """Per layer, the softmax attention of the question rows to the candidate keys (torch, on the
    sequence's own pool pages), accumulated; called by ``StepAttention`` before attention runs
    (the new tokens' keys are already written)."""

    def __init__(self, runner: ModelRunner, seq, rows: list[int], batch: PackedBatch, candidates: list[int]):
        dev = runner.pool.device
        self.runner = runner
        self.rows = torch.tensor(rows, device=dev)
        self.keys = TorchSequenceKeys(seq, runner.pool.page_size, batch.pos[self.rows], runner.parts)
        index = {int(p): j for j, p in enumerate(self.keys.kpos.tolist())}
        self.columns = torch.tensor([index[p] for p in candidates], device=dev)
        self.total = torch.zeros(len(candidates), dtype=torch.float64, device=dev)
        self.layers = 0

    def record(self, i: int, q, cos, sin):
        pool = self.runner.pool
        qr = apply_cos_sin(q[self.rows], cos[self.rows], sin[self.rows]).float()          # [n, H, D]
        k = self.keys.logical_keys(pool, i)[0].float()                                       # [m, Hkv, D]
        k = k.repeat_interleave(qr.shape[1] // k.shape[1], dim=1)
        scores = softcap(torch.einsum("nhd,mhd->hnm", qr, k) * self.runner.parts.scaling, self.runner.parts.softcap)
        scores = scores.masked_fill(~self.keys.visible_at(i)[None], float("-inf"))
        probs = torch.softmax(scores, dim=-1)
        self.total += probs[:, :, self.columns].mean((0, 1)).double()
        self.layers += 1

    def scores(self) -> torch.Tensor:
        return (self.total / max(self.layers, 1)).cpu()


class TorchSequenceKeys:
    """One sequence's keys for torch attention: which pool slots it reads, the pure rotation that
    takes each stored key (rotated at position - rot_shift by its layer's own table) to its
    logical position, and which key each query may see. Hidden slots are simply not gathered.
    Per layer kind (``parts.kinds``, ``architecture.LayerKind``): that rotation in the kind's table
    and the visibility within its window."""

    def __init__(self, seq, page_size: int, q_pos: torch.Tensor, parts):
        ids, ppos, plen, shift, slots = page_rows(seq, page_size)
        dev = q_pos.device
        t = lambda x: torch.tensor(x, dtype=torch.long, device=dev)  # noqa: E731
        plen_t = t(plen)
        entry = torch.repeat_interleave(torch.arange(len(ids), device=dev), plen_t)   # key -> page entry
        off = torch.arange(entry.numel(), device=dev) - (torch.cumsum(plen_t, 0) - plen_t)[entry]
        kpos = t(ppos)[entry] + off
        if slots is not None:
            explicit = [e if e is not None else [ppos[k] + j for j in range(page_size)] for k, e in enumerate(slots)]
            kpos = t(explicit)[entry, off]
            keep = kpos != HIDDEN_POS
            entry, off, kpos = entry[keep], off[keep], kpos[keep]
        self.page, self.off, self.kpos = t(ids)[entry], off, kpos
        self.rotated = any(shift)  # else every key is stored at its logical rotation (block, prefix)
        kshift = t(shift)[entry]
        visible = kpos[None, :] <= q_pos[:, None]
        self.kind_of = parts.layer_kind
        self.shifts, self.visibles = [], []
        for kind in parts.kinds:
            cos, sin = rope_cos_sin(kshift, kind.rope.inv_freq, 1.0)
            self.shifts.append((cos[:, None], sin[:, None]))   # over heads
            w = kind.window
            self.visibles.append(visible if w is None else visible & (q_pos[:, None] - kpos[None, :] < w))
        rec = getattr(seq, "recovery", None)
        self.ape = (rec.ape_temperature, rec.ape_scale) if rec is not None and rec.ape else None
        if self.ape:
            self.in_chunk = torch.zeros_like(kpos, dtype=torch.bool)
            for span in seq.layout.spans:
                self.in_chunk |= (kpos >= span.start) & (kpos < span.end)

    def visible_at(self, layer: int) -> torch.Tensor:
        """bool [n, m]: which gathered key each query sees in ``layer`` (its kind's window)."""
        return self.visibles[self.kind_of[layer]]

    def logical_keys(self, pool, layer: int):
        """(the gathered keys rotated at their logical positions by ``layer``'s own table, fp32
        [m, Hkv, D], their values [m, Hkv, D] as gathered) from ``layer`` of the pool."""
        keys, values = pool.gather(layer, self.page, self.off)
        if not self.rotated:
            return keys.float(), values
        return rotate(keys, *self.shifts[self.kind_of[layer]]), values

    def attend(self, pool, layer: int, q_rot, scaling: float, cap: float | None = None):
        """q_rot [n, H, D] rotated at its positions -> [n, H, D]; ``cap``: the scores' soft-cap (gemma2)."""
        k, v = self.logical_keys(pool, layer)
        k, v = k.to(q_rot.dtype), v.to(q_rot.dtype)   # [m, Hkv, D]
        visible = self.visible_at(layer)
        if self.ape:
            return ape_attention(q_rot, k, v, visible, self.in_chunk, scaling, *self.ape, cap=cap)
        if cap is not None:
            return capped_attention(q_rot, k, v, visible, scaling, cap)
        o = F.scaled_dot_product_attention(q_rot.transpose(0, 1)[None], k.transpose(0, 1)[None],
                                           v.transpose(0, 1)[None], attn_mask=visible, scale=scaling,
                                           enable_gqa=q_rot.shape[1] != k.shape[1])
        return o[0].transpose(0, 1)


def ape_attention(q, k, v, visible, in_chunk, scaling: float, temperature: float, scale: float,
                  cap: float | None = None):
    """APE over one sequence's keys: the chunk tokens' group gets softmax(s / T) inside and the
    log-sum-exp T * logsumexp(s / T) + ln S; the other keys' group is plain; the two are merged
    by log-sum-exp. q [n, H, D] and k [m, Hkv, D] rotated, visible [n, m], in_chunk [m]; ``cap``:
    the scores s soft-capped first (gemma2), as the model computes them."""
    s, vv = fp32_scores(q, k, v, scaling, cap)
    parts = []
    for group, t, log_s in ((in_chunk, temperature, math.log(scale)), (~in_chunk, 1.0, 0.0)):
        sg = (s / t).masked_fill(~(visible & group[None, :])[None], float("-inf"))
        lse = torch.logsumexp(sg, dim=-1)                                  # [H, n]
        p = torch.exp(sg - lse[..., None]).nan_to_num(0.0)                # rows without keys -> 0
        parts.append((t * lse.T + log_s, torch.einsum("hnm,mhd->nhd", p, vv)))
    return merge_by_lse(parts).to(q.dtype)


def merge_by_lse(parts):
    """Attention over disjoint key groups from each group's output o [n, H, D] and log-sum-exp
    lse [n, H]: sum_g exp(lse_g - m) o_g / sum_g exp(lse_g - m) (a group without keys has
    lse -inf and weight 0; every query sees at least itself, so some group has keys)."""
    top = torch.stack([lse for lse, _ in parts]).amax(0).nan_to_num(0.0, neginf=0.0)
    weights = [torch.exp(lse - top)[..., None] for lse, _ in parts]
    return sum(w * o for w, (_, o) in zip(weights, parts)) / sum(weights)


def fp32_scores(q, k, v, scaling: float, cap: float | None = None):
    """(scores [H, n, m] of q [n, H, D] against k [m, Hkv, D], soft-capped by ``cap`` where given,
    and v as [m, H, D]), in fp32, KV heads repeated for GQA."""
    g = q.shape[1] // k.shape[1]
    kk, vv = k.repeat_interleave(g, dim=1).float(), v.repeat_interleave(g, dim=1).float()
    return softcap(torch.einsum("nhd,mhd->hnm", q.float(), kk) * scaling, cap), vv


def capped_attention(q, k, v, visible, scaling: float, cap: float):
    """Softmax attention with soft-capped scores (gemma2), which torch's SDPA cannot compute:
    s = tanh(q.k * scaling / cap) * cap, masked by ``visible`` [n, m], softmax in fp32. q [n, H, D],
    k/v [m, Hkv, D] rotated -> [n, H, D] in q's dtype."""
    s, vv = fp32_scores(q, k, v, scaling, cap)
    p = torch.softmax(s.masked_fill(~visible[None], float("-inf")), dim=-1)
    return torch.einsum("hnm,mhd->nhd", p, vv).to(q.dtype)


def causal_sdpa(q, k, v, scaling: float, window: int | None = None, cap: float | None = None):
    """q [n, H, D], k/v [m, Hkv, D] (rotated, m >= n: q are the last n of m consecutive
    positions) -> [n, H, D]; KV heads repeated for GQA so the flash kernel applies. ``window``:
    each query sees only the last ``window`` positions up to its own (a sliding layer); ``cap``:
    the scores' soft-cap (gemma2), through ``capped_attention``."""
    if cap is not None:
        n, m = q.shape[0], k.shape[0]
        behind = torch.arange(m - n, m, device=q.device)[:, None] - torch.arange(m, device=q.device)[None, :]
        visible = (behind >= 0) & (behind < (m if window is None else window))
        return capped_attention(q, k, v, visible, scaling, cap)
    g = q.shape[1] // k.shape[1]
    if g > 1:
        k, v = k.repeat_interleave(g, dim=1), v.repeat_interleave(g, dim=1)
    n, m = q.shape[0], k.shape[0]
    # lower-right causal when the queries are a tail (torch's is_causal is upper-left)
    mask = None if n == m else causal_lower_right(n, m)
    if window is not None and window < m:
        behind = torch.arange(m - n, m, device=q.device)[:, None] - torch.arange(m, device=q.device)[None, :]
        mask = (behind >= 0) & (behind < window)
    # 4-D [1, H, n, D]: the flash backend takes only batched 4-D inputs (3-D ones fall back to
    # the math backend, which materialises the n x n scores)
    o = F.scaled_dot_product_attention(q.transpose(0, 1)[None], k.transpose(0, 1)[None], v.transpose(0, 1)[None],
                                       attn_mask=mask, is_causal=mask is None, scale=scaling)
    return o[0].transpose(0, 1)
