"""From a sequence's runs to the kernels' page table (``lazy_rag.kernels.PageTable``): which
pages it attends to, at which logical positions, with which key rotation, and where each new
token's KV is written. Shared by the eager forward and the captured decode graphs."""
from __future__ import annotations

from dataclasses import dataclass

from ..kernels import HIDDEN_POS, PageTable


def page_rows(seq, page_size: int):
    """(page_ids, page_pos, page_len, rot_shift, slot_pos) of every page the sequence attends to.

    ``slot_pos`` is None when every page's slot j holds position page_pos + j (the common case),
    else one entry per page: None, or the explicit positions of its slots where some are hidden
    from this sequence (``HIDDEN_POS``). A page whose every valid slot is hidden is left out."""
    return runs_rows(seq.cached_runs + seq.private_runs, page_size)


def runs_rows(runs, page_size: int):
    """``page_rows`` of some of a sequence's runs (the shared-chunk decode keeps the grouped ones out)."""
    ids, pos, lens, shift, slots = [], [], [], [], []
    any_explicit = False
    for run in runs:
        if run.positions is None and not run.hidden:
            # the common run (a whole chunk, a request's own tokens): its entries in bulk, no
            # per-page Python work (a 32-request step of the paper's workload has ~5k entries)
            n_pages = -(-run.length // page_size)
            ids += run.pages[:n_pages]
            pos += range(run.pos, run.pos + run.length, page_size)
            lens += [page_size] * (n_pages - 1) + [run.length - (n_pages - 1) * page_size] if n_pages else []
            shift += [run.rot_shift] * n_pages
            slots += [None] * n_pages
            continue
        for i, page in enumerate(run.pages):
            first = i * page_size
            n = min(page_size, run.length - first)
            if n <= 0:
                break
            explicit = None
            if run.positions is not None:
                explicit = [run.positions[first + j] if j < n else HIDDEN_POS for j in range(page_size)]
                any_explicit = True
            elif run.hidden and any(first + j in run.hidden for j in range(n)):
                if all(first + j in run.hidden for j in range(n)):
                    continue
                explicit = [HIDDEN_POS if first + j in run.hidden or j >= n else run.pos + first + j
                            for j in range(page_size)]
                any_explicit = True
            ids.append(page)
            pos.append(run.pos + first)
            lens.append(n)
            shift.append(run.rot_shift)
            slots.append(explicit)
    return ids, pos, lens, shift, slots if any_explicit else None


def build_table(seqs, page_size: int, device) -> PageTable:
    """The page table of a batch of sequences (one CSR row each)."""
    return table_of_rows([page_rows(s, page_size) for s in seqs], device)


def group_rows(rows, page_size: int, in_group) -> tuple:
    """The entries of ``page_rows`` output restricted to the slots whose position satisfies
    ``in_group`` (a page split between groups keeps only its own slots visible, through explicit
    positions). Returns rows in the same format."""
    ids, pos, lens, shift, slots = rows
    out = ([], [], [], [], [])
    any_explicit = False
    for e in range(len(ids)):
        explicit = slots[e] if slots is not None else None
        where = [explicit[j] if explicit is not None else pos[e] + j for j in range(lens[e])]
        mine = [p != HIDDEN_POS and in_group(p) for p in where]
        if not any(mine):
            continue
        if not all(mine) or explicit is not None:
            explicit = [where[j] if j < lens[e] and mine[j] else HIDDEN_POS for j in range(page_size)]
            any_explicit = True
        for col, value in zip(out, (ids[e], pos[e], lens[e], shift[e], explicit)):
            col.append(value)
    return (*out[:4], out[4] if any_explicit else None)


def table_of_rows(rows_per_seq: list, device) -> PageTable:
    ids, pos, lens, shift, slots = (list(col) for col in zip(*rows_per_seq)) if rows_per_seq else ([], [], [], [], [])
    if all(s is None for s in slots):
        return PageTable.from_lists(ids, pos, lens, shift, device=device)
    slots = [s if s is not None else [None] * len(i) for s, i in zip(slots, ids)]
    return PageTable.from_lists(ids, pos, lens, shift, device=device, slot_pos=slots)


def write_targets(seq, positions: list[int], page_size: int) -> list[tuple[int, int, int]]:
    """(page, slot, rot_shift) for each new token (positions sorted): where its KV goes in its
    private runs, and the rotation origin its stored key takes (its run's rot_shift)."""
    scattered = {}  # compact runs of explicit positions (recomputed chunk tokens)
    for run in seq.private_runs:
        if run.positions is not None:
            scattered.update((p, (run, i)) for i, p in enumerate(run.positions))
    runs = [run for run in seq.private_runs if run.positions is None]
    out = []
    r = 0
    for p in positions:
        if p in scattered:
            run, i = scattered[p]
        else:
            while not (runs[r].pos <= p < runs[r].pos + runs[r].length):
                r += 1
            run, i = runs[r], p - runs[r].pos
        out.append((run.pages[i // page_size], i % page_size, run.rot_shift))
    return out


@dataclass
class StepTokens:
    """A step's new tokens on the host, packed in sequence order: ids, logical positions, KV write
    targets (page, slot), the positions their keys are rotated at (position - rot_shift), and each
    sequence's [a, b) span of rows."""

    ids: list
    pos: list
    pages: list
    slots: list
    key_pos: list
    spans: list


def step_tokens(seqs, page_size: int) -> StepTokens:
    out = StepTokens([], [], [], [], [], [])
    for seq in seqs:
        a = len(out.ids)
        toks = seq.tokens  # a new list per access: take it once (10k-token prompts)
        out.ids += [toks[p] for p in seq.compute_pos]
        out.pos += seq.compute_pos
        for p, (page, slot, shift) in zip(seq.compute_pos, write_targets(seq, seq.compute_pos, page_size)):
            out.pages.append(page)
            out.slots.append(slot)
            out.key_pos.append(p - shift)
        out.spans.append((a, len(out.ids)))
    return out


def slot_map(seq, page_size: int, positions) -> dict[int, tuple[int, int, int]]:
    """position -> (page, slot, rot_shift) of the KV this sequence reads for each of ``positions``
    (hidden slots are not read, so they are not found)."""
    wanted, out = set(positions), {}
    for run in seq.cached_runs + seq.private_runs:
        for i in range(run.length):
            p = run.position(i)
            if p in wanted and i not in run.hidden:
                out[p] = (run.pages[i // page_size], i % page_size, run.rot_shift)
    return out


def is_fresh(seq) -> bool:
    """Nothing cached and every token computed now: plain causal attention over the new tokens."""
    return not seq.cached_runs and len(seq.compute_pos) == seq.num_tokens


def contiguous_pages(seq, page_size: int) -> list[int] | None:
    """Pages holding the sequence's whole KV in position order when it is one stretch from
    position 0 with keys at logical positions (prefix mode: reused pages + its own run), and
    its new tokens are that stretch's tail; else None."""
    pages, pos = [], 0
    for r in seq.cached_runs + seq.private_runs:
        if r.pos != pos or r.rot_shift != 0 or r.hidden or r.positions is not None or (pos % page_size):
            return None
        pages.extend(r.pages[:-(-r.length // page_size)])
        pos += r.length
    n = len(seq.compute_pos)
    if pos != seq.num_tokens or seq.compute_pos != list(range(pos - n, pos)):
        return None
    return pages


def is_decode_step(seqs) -> bool:
    return all(len(s.compute_pos) == 1 and s.kv_len == s.num_tokens - 1 for s in seqs)


def attention_path(seq, kernels: bool, page_size: int) -> tuple[str, list[int] | None]:
    """Which path computes a sequence's attention in a step (``model_runner``'s docstring): "fresh",
    "tail" (with its contiguous history pages), "ape", "paged" (the Triton kernels) or "torch"."""
    if is_fresh(seq):
        return "fresh", None
    history = contiguous_pages(seq, page_size) if kernels and len(seq.compute_pos) >= 128 else None
    if history is not None:
        return "tail", history
    if not kernels:
        return "torch", None
    if getattr(seq, "recovery", None) is not None and seq.recovery.ape:
        return "ape", None
    return "paged", None
