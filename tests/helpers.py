"""Small assertions shared by the tests."""
from contextlib import contextmanager

import pytest
import torch


@contextmanager
def torch_kernels():
    """The engine's kernels as a CPU user runs them (their torch references), not in Triton's
    interpreter, which the session sets (conftest) for the kernels' own tests and the engine's
    oracle tests. For tests about something else (serving, the integrations, the evaluation,
    the benchmark's records, the CLI), where the interpreter cost seconds a test: block mode's
    page copies alone took 10-13 s of a server test and most of a minute of the evaluation's."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("TRITON_INTERPRET", "0")
        yield


@contextmanager
def reference_page_copies():
    """Block mode's page copies (``copy_rotate_run``) by their torch reference on the CPU, the
    attention kernels still in Triton's interpreter. The interpreter runs the copy kernel one
    program per page, layer and head, ~19 ms each: most of a block-mode parity test on a real
    model. The copy kernel itself is checked against that reference in tests/kernels/
    (test_page_copy.py, test_fp8.py) and on the GPU; CUDA tensors still take it here."""
    from lazy_rag.kernels import page_copy

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(page_copy, "use_triton", lambda t: t.is_cuda)
        yield


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    assert not torch.isnan(out).any(), "NaN in output"
    out = out.to(ref.device)  # engine logits come back on the host; oracle ones stay on the device
    return float((out - ref).abs().max() / ref.abs().max())



def random_ids(rng, n):
    """``n`` random token ids, clear of special tokens."""
    return [rng.randrange(100, 40000) for _ in range(n)]


def chunked_prompt(rng, chunks):
    """A prompt's segments: a few ids, each chunk (a ``Chunk``) with a few ids after it, a question."""
    from lazy_rag import Chunk

    segs = [random_ids(rng, 4)]
    for c in chunks:
        segs += [Chunk(c), random_ids(rng, 2)]
    return segs + [random_ids(rng, 5)]


def small_llm(model, tokenizer, **options):
    """A LazyLLM with a small engine (256 MiB pool, 16-token pages on every device): tests build
    many, and the default pool is a fifth of the GPU."""
    from lazy_rag import LazyLLM

    return LazyLLM(model, tokenizer, **{"kv_bytes": 256 << 20, "host_bytes": 256 << 20, "page_size": 16, **options})


def squad_file(path, articles):
    """A SQuAD-format file: ``articles`` is a list of articles, each a list of (context, [(question, answer)])."""
    import json

    data = {"data": [{"title": f"t{a}", "paragraphs": [
        {"context": ctx, "qas": [{"id": f"q{a}-{p}-{i}", "question": q,
                                  "answers": [{"text": ans, "answer_start": ctx.find(ans)}]}
                                 for i, (q, ans) in enumerate(qas)]}
        for p, (ctx, qas) in enumerate(paras)]} for a, paras in enumerate(articles)]}
    path.write_text(json.dumps(data))
    return path


def index_settings(out) -> dict:
    """The settings of the index at ``out``, read from its database."""
    from lazy_rag.store import IndexDB

    db = IndexDB(out)
    try:
        return db.settings()
    finally:
        db.close()


def index_sql(out, statement: str, args=()) -> None:
    """Change the index's database behind lazy-rag's back (damage or forgery, as a test makes it),
    and checkpoint it: everything in the main file."""
    import gc

    from lazy_rag.store import IndexDB

    gc.collect()  # indexes loaded earlier in the test release their snapshots
    db = IndexDB(out)
    try:
        with db.transaction() as cur:
            cur.execute(statement, args)
        db.conn.execute("PRAGMA wal_checkpoint(TRUNCATE)")
    finally:
        db.close()
