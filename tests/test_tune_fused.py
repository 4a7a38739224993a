"""`lazy-rag tune --gold-weight`: an example's teacher answer and gold answer share one student
forward (the gold answer a side branch after the prompt). Its per-kind loss sums and gradients
must equal the two separate forwards it replaces (prompt + teacher answer, prompt + gold
answer), written here from ``student_logp`` on those layouts: on a tiny random fp32 model, with
examples without a gold answer, gold and teacher answers of other lengths (an empty teacher
answer, a one-token gold answer), padding in a micro-batch, with and without a chunk adapter."""
import random
from types import SimpleNamespace

import pytest
import torch

from helpers import random_ids, small_llm
from lazy_rag.chunk_adapter import ChunkAdapters, new_adapter
from lazy_rag.tune import Example, TuneOptions
from lazy_rag.tune.student import StudentInput, distill_kl, student_input, student_logp, wrapped_layout
from lazy_rag.tune.trainer import _items, _loss_of, _rows
from tiny_models import tiny_model

HEADER, TRAILER, TOP_K = 2, 3, 8
ANSWER_LENGTHS = [3, 6, 4, 0, 2]                    # the teacher's answers
GOLD = {0: 5, 1: 2, 3: 1, 4: 7}                     # gold answer lengths; example 2 has none


@pytest.fixture(scope="module")
def llm(tokenizer):
    return small_llm(tiny_model("llama", seed=2, initializer_range=0.2), tokenizer)


def _case(seed: int = 0):
    """Examples over chunks of different lengths, a teacher (answers and top-K log-probs that
    leave some mass to the rest of the vocabulary) and gold targets."""
    rng, g = random.Random(seed), torch.Generator().manual_seed(seed)
    chunks = [tuple(random_ids(rng, n)) for n in (7, 12, 9, 15)]
    examples = [Example(f"Question {i}?", tuple(rng.sample(chunks, 2 + i % 2))) for i in range(len(ANSWER_LENGTHS))]
    answers = [random_ids(rng, n) for n in ANSWER_LENGTHS]
    top_ids = [torch.randint(100, 40000, (n + 1, TOP_K), generator=g) for n in ANSWER_LENGTHS]
    top_logp = [torch.log_softmax(torch.randn(n + 1, TOP_K + 1, generator=g), -1)[:, :TOP_K] for n in ANSWER_LENGTHS]
    teacher = SimpleNamespace(answers=answers, top_ids=top_ids, top_logp=top_logp)
    return examples, teacher, {i: random_ids(rng, n) for i, n in GOLD.items()}


def _reference(llm, vectors, examples, teacher, gold, column) -> dict[str, torch.Tensor]:
    """The two-forward losses: prompt + teacher answer (KL over len(answer) + 1 rows from the last
    prompt token on) and prompt + gold answer (cross-entropy of each gold token)."""
    sums = {"kl": torch.zeros(()), "gold": torch.zeros(())}
    for i, e in enumerate(examples):
        answer = teacher.answers[i]
        layout, last = wrapped_layout(llm, e, answer, HEADER, TRAILER)
        (lp,) = student_logp(llm, vectors, [StudentInput(layout, {"kl": tuple(range(last, last + len(answer) + 1))})],
                             column)
        sums["kl"] = sums["kl"] + distill_kl(lp["kl"], teacher.top_ids[i], teacher.top_logp[i]).sum()
        if i in gold:
            ids = gold[i]
            layout, last = wrapped_layout(llm, e, ids, HEADER, TRAILER)
            (lp,) = student_logp(llm, vectors, [StudentInput(layout, {"gold": tuple(range(last, last + len(ids)))})],
                                 column)
            sums["gold"] = sums["gold"] - lp["gold"].gather(-1, torch.tensor(ids)[:, None]).sum()
    return sums


def _trainable(llm, seed: int, lora: bool):
    """Wrapper vectors and, with ``lora``, a chunk adapter (B off zero, so it changes the chunks'
    encoding) installed with its gate column; all fp32 leaves."""
    g = torch.Generator().manual_seed(seed)
    vectors = torch.nn.Parameter(torch.randn(HEADER + TRAILER, llm.model.config.hidden_size, generator=g) * 0.3)
    if not lora:
        return [vectors], None
    adapter = new_adapter(llm.model, rank=2, alpha=4.0, seed=seed)
    with torch.no_grad():
        for _, b in adapter.weights.values():
            b.copy_(torch.randn(b.shape, generator=g) * 0.05)
    column = ChunkAdapters.of(llm.model).add(adapter, key="test-fused", trainable=True)
    return [vectors, *(t for pair in adapter.weights.values() for t in pair)], column


def _grads(params) -> list[torch.Tensor]:
    out = [p.grad.clone() for p in params]
    for p in params:
        p.grad = None
    return out


def _close(out: torch.Tensor, ref: torch.Tensor) -> None:
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out, ref, rtol=0, atol=1e-5 * max(float(ref.abs().max()), 1e-12))


@pytest.mark.parametrize("lora", [False, True], ids=["wrapper", "lora"])
def test_fused_gold_branch_equals_two_forwards(llm, lora):
    examples, teacher, gold = _case()
    params, column = _trainable(llm, seed=1, lora=lora)
    vectors = params[0]
    items = _items(llm, examples, teacher, gold, TuneOptions(header=HEADER, trailer=TRAILER))
    rows = _rows(items)
    assert rows == {"kl": sum(ANSWER_LENGTHS) + len(ANSWER_LENGTHS), "gold": sum(GOLD.values())}
    scale = {"kl": 1 / rows["kl"], "gold": 0.5 / rows["gold"]}
    forwards = []
    hook = llm.model.model.register_forward_hook(lambda *a: forwards.append(1))
    try:
        # 5 examples, 3 per forward: two forwards, the second padded (its sequences are shorter)
        fused = _loss_of(llm, vectors, items, teacher, micro_batch=3, scale=scale, column=column)
        hook.remove()
        fused_grads = _grads(params)
        ref = _reference(llm, vectors, examples, teacher, gold, column)
        sum(v * scale[k] for k, v in ref.items()).backward()
        ref_grads = _grads(params)
    finally:
        hook.remove()
        ChunkAdapters.of(llm.model).remove("test-fused")
    assert len(forwards) == 2
    for k in ("kl", "gold"):
        _close(fused[k], ref[k].detach())
    # the vectors and the adapter are reached (not every factor: the last layer's queries and MLP on
    # chunk tokens feed no row that is read)
    assert float(ref_grads[0].abs().max()) > 0 and (not lora or any(float(g.abs().max()) > 0 for g in ref_grads[1:]))
    for out, want in zip(fused_grads, ref_grads):
        _close(out, want)


def test_the_gold_branch_is_one_sequence_and_without_gold_nothing_changes(llm):
    """An example's input is prompt + teacher answer + all gold tokens but the last (the rows read
    never see it); without a gold answer it is exactly the layout and rows of the KL alone."""
    examples, teacher, gold = _case()
    for i, e in enumerate(examples):
        answer = teacher.answers[i]
        alone, last = wrapped_layout(llm, e, answer, HEADER, TRAILER)
        plain = student_input(llm, e, answer, [], HEADER, TRAILER)
        assert plain.layout == alone and plain.branch == 0
        assert plain.reads == {"kl": tuple(range(last, last + len(answer) + 1))}
        if i in gold:
            fused = student_input(llm, e, answer, gold[i], HEADER, TRAILER)
            assert fused.layout.token_ids == alone.token_ids + gold[i][:-1] and fused.prompt == last + 1
            assert fused.reads["gold"][0] == last and len(fused.reads["gold"]) == len(gold[i])


class _NanGradient(torch.autograd.Function):
    """The identity forward, a NaN gradient backward: an example whose loss is finite and whose
    gradient is not (a bf16 overflow in the backward)."""

    @staticmethod
    def forward(ctx, x):
        return x.clone()

    @staticmethod
    def backward(ctx, g):
        return g * float("nan")


def test_an_example_that_is_not_finite_is_retried_with_the_math_kernel_or_left_out(llm, monkeypatch):
    """Example 1's gradient is not finite except under the math attention kernel (as with the
    fused CUDA backward), example 3's loss is not finite anyway: each forward holding one is run
    again one example at a time; 1 is rescued by the math kernel, 3 is reported and left out; the
    losses and the gradient (added to one already accumulated) are those of the other four. An
    example known to need the math kernel (``slow``) goes straight to it."""
    import contextlib

    from lazy_rag.tune import trainer

    examples, teacher, gold = _case()
    teacher.top_logp[3] = teacher.top_logp[3].clone()
    teacher.top_logp[3][0, 0] = float("nan")
    fragile, in_math, fused_tries = teacher.top_ids[1], [False], []

    @contextlib.contextmanager
    def math_attention():
        in_math[0] = True
        try:
            yield
        finally:
            in_math[0] = False

    def kl(s, ids, lp):
        if ids is fragile and not in_math[0]:
            fused_tries.append(1)
            return _NanGradient.apply(distill_kl(s, ids, lp))
        return distill_kl(s, ids, lp)

    monkeypatch.setattr(trainer, "math_attention", math_attention)
    monkeypatch.setattr(trainer, "distill_kl", kl)
    (vectors,), _ = _trainable(llm, seed=1, lora=False)
    items = _items(llm, examples, teacher, gold, TuneOptions(header=HEADER, trailer=TRAILER))
    scale = {"kl": 0.1, "gold": 0.05}
    vectors.grad = torch.ones_like(vectors)
    dropped, rescued = [], []
    out = _loss_of(llm, vectors, items, teacher, micro_batch=3, scale=scale, params=[vectors], dropped=dropped,
                   rescued=rescued)
    got = vectors.grad - 1
    assert dropped == [3] and rescued == [1] and len(fused_tries) == 2  # in its micro-batch, then alone
    vectors.grad = None
    kept = [it for it in items if it["i"] != 3]
    fused_tries.clear()
    ref = _loss_of(llm, vectors, kept, teacher, micro_batch=5, scale=scale, params=[vectors], slow={1})
    assert fused_tries == []
    for k in ("kl", "gold"):
        _close(out[k], ref[k])
    _close(got, vectors.grad)


def test_the_math_kernel_retry_computes_the_same_losses(llm):
    """``math_attention`` only changes which attention kernel runs: the same losses and gradient."""
    from lazy_rag.tune.trainer import math_attention

    examples, teacher, gold = _case()
    (vectors,), _ = _trainable(llm, seed=1, lora=False)
    items = _items(llm, examples, teacher, gold, TuneOptions(header=HEADER, trailer=TRAILER))
    scale = {"kl": 0.1, "gold": 0.05}
    plain = _loss_of(llm, vectors, items, teacher, micro_batch=5, scale=scale)
    plain_grad = _grads([vectors])[0]
    with math_attention():
        math = _loss_of(llm, vectors, items, teacher, micro_batch=5, scale=scale)
    for k in ("kl", "gold"):
        _close(math[k], plain[k])
    _close(vectors.grad, plain_grad)


@pytest.mark.parametrize("family", ["llama", "gemma3_text"])
def test_the_student_reads_what_lazy_serves_with_its_wrapper(tokenizer, family):
    """The function a wrapper is trained on is the one ``lazy`` serves: the student's log-probs of
    the last prompt row equal the engine's with the same vectors installed as a wrapper. Gemma 3's
    window (8) is shorter than the chunks and the prompt, so a student that gave its sliding layers
    the global mask would miss (the teacher's plain forward applies the window)."""
    from lazy_rag.requests import ChunkSource
    from lazy_rag.wrapper import ChunkWrapper

    model = tiny_model(family, seed=5)
    llm = small_llm(model, tokenizer)
    rng = random.Random(3)
    example = Example("What is it?", tuple(tuple(random_ids(rng, n)) for n in (11, 20, 6)))
    vectors = torch.randn(HEADER + TRAILER, model.config.hidden_size, generator=torch.Generator().manual_seed(1))
    layout, last = wrapped_layout(llm, example, [], HEADER, TRAILER)
    (lp,) = student_logp(llm, vectors, [StudentInput(layout, {"kl": (last,)})])
    wrapper = ChunkWrapper(vectors, HEADER, TRAILER, "")
    served = llm.next_token_logits(example.segments(tokenizer), mode="lazy", source=ChunkSource(wrapper=wrapper))
    _close(lp["kl"][0], torch.log_softmax(served.float(), -1))
