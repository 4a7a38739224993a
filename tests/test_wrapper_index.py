"""Chunk wrappers end to end on the CPU: an index built inside a wrapper serves the oracle's
answer; the wrapper is the index's (queries need no flag, re-index keeps it, another one is
refused naming both); `rewrap` re-encodes atomically; `lazy-rag tune` trains one whose KL
falls, on a tiny random model in a few steps."""
import dataclasses
import random

import pytest
import torch

from helpers import rel_err, small_llm
from lazy_rag import LazyIndex
from lazy_rag.errors import FingerprintMismatchError, LazyRagError
from lazy_rag.index import verify_index
from lazy_rag.oracle import block_diagonal_logits
from lazy_rag.tune import Example, TuneOptions, train_wrapper
from lazy_rag.wrapper import ChunkWrapper, WrapperError
from tiny_models import tiny_model

TEXTS = ["The Marrow Point lighthouse was completed in 1871 after six years of work.",
         "Keepers lived on the island until 1954, when the light was automated.",
         "The lens was made in Paris and shipped in crates of oiled wood."]


@pytest.fixture(scope="module")
def llm(tokenizer):
    return small_llm(tiny_model("llama", seed=2, initializer_range=0.2), tokenizer)


def _wrapper(llm, seed, header=2, trailer=3):
    g = torch.Generator().manual_seed(seed)
    vec = torch.randn(header + trailer, llm.model.config.hidden_size, generator=g) * 0.3
    return ChunkWrapper(vec, header, trailer, llm.fingerprint["id"], {"steps": 0}, f"w{seed}")


def _index(llm, out, wrapper):
    return LazyIndex.from_texts(TEXTS, out, llm=llm, ids=["a", "b", "c"], split=False, vectors=False,
                                progress=False, wrapper=wrapper)


def test_index_inside_a_wrapper_serves_the_oracle(llm, tmp_path):
    w = _wrapper(llm, 1)
    idx = _index(llm, tmp_path / "idx", w)
    m = idx.manifest
    assert m["wrapper"]["digest"] == w.digest and (tmp_path / "idx" / m["wrapper_file"]).exists()
    assert [p.name for p in (tmp_path / "idx").glob("kv*")] == [f"kv-w{w.digest}"]  # the wrapper's own KV folder
    assert idx.store.kv_dir.name == f"kv-w{w.digest}" and all(idx.store.location(c) for c in "abc")
    assert [p.name for p in idx.store.kv_dir.iterdir()] == ["seg-000001.kvseg"]
    loaded = LazyIndex.load(tmp_path / "idx", llm=llm)  # the wrapper comes from the index: no flag
    assert loaded.wrapper.digest == w.digest
    llm.engine.clear_cache()
    segs = loaded.segments("When was it completed?", ["c", "a"])
    res = llm.generate(segs, max_new_tokens=1, source=loaded.chunk_source, output_first_logits=True)
    layout = llm.prepare(segs, loaded.chunk_source)
    ref = block_diagonal_logits(llm.model, layout, llm.host.parts.virtual_rows)[-1]
    assert rel_err(res.first_logits, ref) < 1e-4
    chunk_tokens = sum(len(loaded.by_id[c].token_ids) for c in ("c", "a"))
    assert res.stats.cached_tokens == chunk_tokens + 2 * w.slots and res.stats.chunk_sources == {"disk": 2}
    full = llm.generate(segs, max_new_tokens=1, mode="full", source=loaded.chunk_source)
    assert full.stats.prompt_tokens == res.stats.prompt_tokens - 2 * w.slots  # full reads the plain prompt
    assert verify_index(tmp_path / "idx")["ok"]


def test_reindex_keeps_the_wrapper_and_refuses_another(llm, tmp_path):
    w = _wrapper(llm, 1)
    _index(llm, tmp_path / "idx", w)
    again = _index(llm, tmp_path / "idx", "auto")
    assert again.wrapper.digest == w.digest and again.manifest["generation"] == 1
    with pytest.raises(FingerprintMismatchError, match=f"digest {w.digest}.*no wrapper"):
        _index(llm, tmp_path / "idx", "none")
    other = _wrapper(llm, 2)
    with pytest.raises(FingerprintMismatchError, match=f"{w.digest}.*{other.digest}"):
        _index(llm, tmp_path / "idx", other)
    foreign = ChunkWrapper(other.vectors, 2, 3, "0123456789abcdef")
    with pytest.raises(WrapperError, match="0123456789abcdef.*" + llm.fingerprint["id"]):
        _index(llm, tmp_path / "fresh", foreign)


def test_rewrap_reencodes_atomically_and_changes_the_answer(llm, tmp_path):
    plain = _index(llm, tmp_path / "idx", "none")
    segs = plain.segments("Who lived there?", ["b", "a"])
    before = llm.next_token_logits(segs, source=plain.chunk_source)
    w = _wrapper(llm, 3)
    plain_locations = {c: plain.store.location(c) for c in "abc"}
    written = plain.rewrap(w, progress=False)
    assert written > 0 and not (tmp_path / "idx" / "kv").exists()  # the plain KV folder is gone
    assert plain.wrapper.digest == w.digest and plain.store.kv_dir.name == f"kv-w{w.digest}"
    assert all(plain.store.location(c) not in (None, plain_locations[c]) for c in "abc")  # every row: new KV
    fresh = LazyIndex.load(tmp_path / "idx", llm=llm)
    assert fresh.manifest["generation"] == 1 and fresh.wrapper.digest == w.digest
    llm.engine.clear_cache()
    after = llm.next_token_logits(fresh.segments("Who lived there?", ["b", "a"]), source=fresh.chunk_source)
    assert rel_err(after, before) > 1e-3
    ref = block_diagonal_logits(llm.model, llm.prepare(segs, fresh.chunk_source), llm.host.parts.virtual_rows)[-1]
    assert rel_err(after, ref) < 1e-4
    report = verify_index(tmp_path / "idx")
    assert report["ok"] and report["kv_ok"] == 3
    # a damaged wrapper file is found by verify and refused on load, naming the file
    wf = tmp_path / "idx" / fresh.manifest["wrapper_file"]
    data = bytearray(wf.read_bytes())
    data[-3] ^= 0x55
    wf.write_bytes(bytes(data))
    assert not verify_index(tmp_path / "idx")["ok"]
    with pytest.raises(LazyRagError, match=wf.name):
        LazyIndex.load(tmp_path / "idx", llm=llm)


def _examples(n, rng):
    chunks = [tuple(rng.randrange(100, 40000) for _ in range(12)) for _ in range(3)]
    return [Example(f"Question number {i}?", tuple(rng.sample(chunks, 3))) for i in range(n)]


def test_tune_reduces_held_out_kl_and_writes_a_loadable_wrapper(llm, tmp_path):
    options = TuneOptions(header=2, trailer=2, steps=16, batch=16, micro_batch=8, lr=5e-2, held_out=8,
                          max_answer_tokens=3, eval_every=8)
    wrapper, report = train_wrapper(llm, _examples(40, random.Random(0)), options, tmp_path / "w.safetensors",
                                    tmp_path / "work", progress="none", log=lambda m: None)
    kl = [h["held_out_kl"] for h in report["history"]]
    assert kl[-1] < kl[0] * 0.9, kl
    assert 0 <= report["held_out_agreement_start"] <= 1 and 0 <= report["held_out_agreement_end"] <= 1
    assert report["held_out_examples"] == 4  # a tenth of 40 examples (at least 4, at most held_out)
    back = ChunkWrapper.load(tmp_path / "w.safetensors")
    assert back.digest == wrapper.digest and back.matches(llm.fingerprint["id"]) and back.recipe["steps"] == 16
    assert list((tmp_path / "work").glob("teacher-*.pt")) and list((tmp_path / "work").glob("checkpoint-wrapper-*.pt"))
    # a second run with the same settings resumes from the finished checkpoint: no step runs again
    lines = []
    again, _ = train_wrapper(llm, _examples(40, random.Random(0)), options, tmp_path / "w2.safetensors",
                             tmp_path / "work", progress="none", log=lines.append)
    assert any("resuming" in s for s in lines) and again.digest == wrapper.digest


def test_held_out_agreement_is_the_engines_greedy_answer_equal_to_full(tokenizer):
    """What `lazy-rag tune` reports as agreement before and after: per prompt, the trainer's
    teacher-forced check says "equal" exactly when the engine's greedy answer under the wrapper
    (lazy) is full's answer token for token."""
    from lazy_rag.requests import ChunkSource
    from lazy_rag.tune.teacher import STOP, teacher_outputs
    from lazy_rag.tune.trainer import _greedy_agreement, _items

    # small weights: lazy and full answers agree on about a third of these prompts
    llm = small_llm(tiny_model("llama", seed=2, initializer_range=0.02), tokenizer)
    examples = _examples(24, random.Random(6))
    teacher = teacher_outputs(llm, examples, None, top_k=8, max_new_tokens=3, progress="none")
    items = _items(llm, examples, teacher, {}, TuneOptions(header=2, trailer=2, max_answer_tokens=3))
    seen = []
    for seed in (1, 2):
        w = _wrapper(llm, seed, header=2, trailer=2)
        w.vectors.mul_(0.1)
        vectors = w.vectors.to(llm.host.parts.device)
        lazy = llm.engine.generate([dict(segments=e.segments(llm.tokenizer), mode="lazy", max_new_tokens=3,
                                         stop=list(STOP), source=ChunkSource(wrapper=w)) for e in examples])
        for it, res in zip(items, lazy):
            equal = list(res.token_ids) == teacher.answers[it["i"]]
            assert _greedy_agreement(llm, vectors, [it], teacher, 8, 3) == float(equal), (seed, it["i"])
            seen.append(equal)
    assert set(seen) == {True, False}  # both outcomes occur, so the check can fail either way
    both = _greedy_agreement(llm, vectors, items, teacher, 8, 3)   # the share over many, in micro-batches
    assert both == sum(seen[len(items):]) / len(items)


def test_tune_lora_trains_a_chunk_adapter_that_the_engine_serves(llm, tmp_path):
    from lazy_rag.chunk_adapter import ChunkAdapters
    from lazy_rag.oracle import block_diagonal_logits
    from lazy_rag.requests import ChunkSource

    options = TuneOptions(header=2, trailer=2, steps=12, batch=16, micro_batch=8, lr=5e-2, held_out=8,
                          max_answer_tokens=3, eval_every=6, method="lora", rank=2, alpha=4.0, adapter_lr=2e-2)
    examples = _examples(40, random.Random(2))
    wrapper, report = train_wrapper(llm, examples, options, tmp_path / "w.safetensors", tmp_path / "work",
                                    progress="none", log=lambda m: None)
    kl = [h["held_out_kl"] for h in report["history"]]
    assert kl[-1] < kl[0] * 0.9, kl
    assert ChunkAdapters.find(llm.model) is None  # the trainer's hooks are gone
    back = ChunkWrapper.load(tmp_path / "w.safetensors")
    assert back.adapter is not None and back.adapter.rank == 2 and back.digest == wrapper.digest
    assert any(float(b.abs().max()) > 0 for _, b in back.adapter.weights.values())  # B moved off zero
    # the engine serves it as the oracle defines it
    source = ChunkSource(wrapper=back)
    segs = examples[0].segments(llm.tokenizer)
    ref = block_diagonal_logits(llm.model, llm.prepare(segs, source), llm.host.parts.virtual_rows)[-1]
    assert rel_err(llm.next_token_logits(segs, source=source), ref) < 1e-4
    # resuming restores the adapter too
    again, _ = train_wrapper(llm, examples, options, tmp_path / "w2.safetensors", tmp_path / "work",
                             progress="none", log=lambda m: None)
    assert again.digest == wrapper.digest


def test_tune_gold_answers_add_a_cross_entropy_that_falls(llm, tmp_path):
    """--gold-weight: the labelled answers' cross-entropy is trained and reported beside the KL."""
    rng = random.Random(3)
    examples = [dataclasses.replace(e, gold=f"castle {i % 3}") for i, e in enumerate(_examples(40, rng))]
    options = TuneOptions(header=2, trailer=2, steps=16, batch=16, micro_batch=8, lr=5e-2, held_out=8,
                          max_answer_tokens=3, eval_every=8, gold_weight=1.0)
    wrapper, report = train_wrapper(llm, examples, options, tmp_path / "w.safetensors", tmp_path / "work",
                                    progress="none", log=lambda m: None)
    ce = [h["held_out_gold_ce"] for h in report["history"]]
    assert ce[-1] < ce[0] * 0.9, ce
    assert "train_gold_ce" in report["history"][-1] and wrapper.recipe["gold_weight"] == 1.0
    # without labels the option is refused, naming it
    with pytest.raises(LazyRagError, match="--gold-weight"):
        train_wrapper(llm, _examples(40, rng), options, tmp_path / "w2.safetensors", None, progress="none")


def test_tune_starts_from_a_given_wrapper(llm, tmp_path):
    """init=: the run starts from that wrapper's vectors (an index's own tuning starts from its
    wrapper); one of another shape is refused."""
    options = TuneOptions(header=2, trailer=2, steps=2, batch=8, micro_batch=8, lr=1e-6, held_out=8,
                          max_answer_tokens=3, eval_every=2)
    examples = _examples(40, random.Random(4))
    start = _wrapper(llm, 7, header=2, trailer=2)
    wrapper, report = train_wrapper(llm, examples, options, tmp_path / "w.safetensors", None, progress="none",
                                    log=lambda m: None, init=start)
    assert torch.allclose(wrapper.vectors, start.vectors, atol=1e-4) and report["init"] == start.digest
    fresh, _ = train_wrapper(llm, examples, options, tmp_path / "w2.safetensors", None, progress="none",
                             log=lambda m: None)
    assert not torch.allclose(fresh.vectors, start.vectors, atol=1e-2)  # without init: token embeddings
    with pytest.raises(LazyRagError, match="Cannot start from wrapper"):
        train_wrapper(llm, examples, dataclasses.replace(options, header=3), tmp_path / "w3.safetensors", None,
                      progress="none", init=start)


def test_tune_index_starts_from_its_wrapper_and_rewraps_it(llm, tmp_path):
    """`lazy-rag tune INDEX_DIR`: questions the model writes for the index's chunks, a run that
    starts from the index's wrapper, the index's KV re-encoded inside the result (oracle-exact);
    --gold-weight is refused (an index has no labels)."""
    from lazy_rag.tune.run import tune_index

    start = _wrapper(llm, 5, header=2, trailer=2)
    _index(llm, tmp_path / "idx", start)
    options = TuneOptions(header=2, trailer=2, steps=4, batch=8, micro_batch=8, lr=5e-2, held_out=4,
                          max_answer_tokens=3, eval_every=2)
    lines = []
    wrapper, report = tune_index(tmp_path / "idx", options, examples=24, k=2, device="cpu", progress="none",
                                 work_dir=tmp_path / "work", log=lines.append, llm=llm)
    assert any(start.digest in s for s in lines) and report["init"] == start.digest
    assert wrapper.digest != start.digest and report["kv_bytes_written"] > 0
    assert wrapper.recipe["data"]["source"].startswith("index")
    fresh = LazyIndex.load(tmp_path / "idx", llm=llm)
    assert fresh.wrapper.digest == wrapper.digest
    llm.engine.clear_cache()
    segs = fresh.segments("Who lived there?", ["b", "a"])
    ref = block_diagonal_logits(llm.model, llm.prepare(segs, fresh.chunk_source), llm.host.parts.virtual_rows)[-1]
    assert rel_err(llm.next_token_logits(segs, source=fresh.chunk_source), ref) < 1e-4
    with pytest.raises(LazyRagError, match="--gold-weight"):
        tune_index(tmp_path / "idx", dataclasses.replace(options, gold_weight=1.0), examples=24, device="cpu",
                   progress="none", llm=llm)


def test_tuning_an_index_whose_wrapper_carries_an_adapter_continues_that_adapter(llm, tmp_path):
    """Qwen2.5-0.5B's bundled wrapper carries a chunk adapter: `lazy-rag tune DIR` (method auto)
    starts from its vectors and its adapter and trains both, rather than dropping the adapter for
    vectors from token embeddings; a method that would not continue it is refused, naming it."""
    from lazy_rag.chunk_adapter import new_adapter
    from lazy_rag.tune.run import tune_index

    adapter = new_adapter(llm.model, rank=2, alpha=4.0, seed=3)
    g = torch.Generator().manual_seed(3)
    adapter.weights = {n: (a.detach().cpu(), torch.randn(b.shape, generator=g) * 0.2) for n, (a, b) in adapter.weights.items()}
    start = dataclasses.replace(_wrapper(llm, 9, header=2, trailer=2), adapter=adapter)
    _index(llm, tmp_path / "idx", start)
    options = TuneOptions(header=2, trailer=2, steps=2, batch=8, micro_batch=8, lr=1e-7, adapter_lr=1e-7, held_out=4,
                          max_answer_tokens=3, eval_every=2)
    wrapper, report = tune_index(tmp_path / "idx", options, examples=24, k=2, device="cpu", progress="none",
                                 work_dir=tmp_path / "work", log=lambda m: None, llm=llm)
    assert report["init"] == start.digest and wrapper.adapter is not None and wrapper.recipe["method"] == "lora"
    assert (wrapper.adapter.rank, wrapper.adapter.alpha) == (2, 4.0)
    for name, (a, b) in wrapper.adapter.weights.items():   # a near-zero rate: still the adapter it started from
        a0, b0 = adapter.weights[name]
        assert torch.allclose(a, a0, atol=2e-3) and torch.allclose(b, b0, atol=2e-3), name   # (stored in bf16)
    assert torch.allclose(wrapper.vectors, start.vectors, atol=1e-4)
    for method, rank in (("wrapper", 8), ("lora", 4)):
        with pytest.raises(LazyRagError, match="carries a chunk adapter"):
            train_wrapper(llm, _examples(40, random.Random(5)), dataclasses.replace(options, method=method, rank=rank),
                          tmp_path / "w.safetensors", None, progress="none", init=start)


def test_tune_refuses_too_little_data(llm, tmp_path):
    with pytest.raises(LazyRagError, match="Too little data"):
        train_wrapper(llm, _examples(10, random.Random(1)), TuneOptions(steps=1), tmp_path / "w.safetensors",
                      None, progress="none")


def test_cli_tune_a_model_then_index_with_the_wrapper(tmp_path, tokenizer):
    """`lazy-rag tune --model FOLDER` on a tiny model and a small SQuAD-format file, then
    `lazy-rag index --wrapper FILE` and `lazy-rag models` (no wrapper bundled for it)."""
    from typer.testing import CliRunner

    from helpers import squad_file
    from lazy_rag.cli import app

    model_dir = tmp_path / "tiny"
    tiny_model("llama", seed=3, initializer_range=0.2).save_pretrained(model_dir)
    tokenizer.save_pretrained(model_dir)
    rng = random.Random(0)
    words = ["river", "castle", "harbour", "mill", "bridge", "tower", "market", "abbey"]
    articles = [[(f"The {w} of town {a}{p} was built in {1800 + a * 10 + p} by {w.title()} guild {p}.",
                  [(f"Who built the {w} of town {a}{p}?", f"{w.title()} guild {p}")])
                 for p, w in enumerate(rng.sample(words, 6))] for a in range(8)]
    data = squad_file(tmp_path / "squad.json", articles)
    out = tmp_path / "w.safetensors"
    runner = CliRunner()
    res = runner.invoke(app, ["tune", "--model", str(model_dir), "--data", str(data), "--examples", "24", "--k", "2",
                              "--steps", "2", "--batch", "4", "--micro-batch", "4", "--device", "cpu",
                              "--gold-weight", "0.5", "--out", str(out), "--work-dir", str(tmp_path / "work")])
    assert res.exit_code == 0, res.output
    recipe = ChunkWrapper.load(out).recipe
    assert recipe["gold_weight"] == 0.5
    # how the prompts were laid out travels in the file (no ranking file: the gold at a random place)
    assert recipe["data"]["gold_position"] == "random" and recipe["data"]["retrieval"] is None
    assert recipe["data"]["k"] == 2
    assert "held-out KL" in res.output and out.exists()
    src = tmp_path / "docs"
    src.mkdir()
    (src / "a.txt").write_text(" ".join(TEXTS))
    res = runner.invoke(app, ["index", str(src), "--out", str(tmp_path / "idx"), "--model", str(model_dir),
                              "--device", "cpu", "--wrapper", str(out), "--no-precompute"])
    assert res.exit_code == 0, res.output
    assert "chunk wrapper" in res.output and "8+8" in res.output
    res = runner.invoke(app, ["index", str(src), "--out", str(tmp_path / "idx"), "--model", str(model_dir),
                              "--device", "cpu", "--wrapper", "none"])
    assert res.exit_code == 2 and "tune" in res.output


def test_squad_examples_use_train_articles_and_retrieved_distractors(tmp_path, tokenizer):
    from helpers import squad_file
    from lazy_rag.quality.data import load_dataset, passages_hash
    from lazy_rag.quality.retrieval import save_retrieval
    from lazy_rag.tune import squad_examples

    articles = [[(f"Paragraph {a}-{p} says the answer is {a * 10 + p}.", [(f"What does {a}-{p} say?", f"{a * 10 + p}")])
                 for p in range(3)] for a in range(4)]
    data = squad_file(tmp_path / "squad.json", articles)
    ds = load_dataset("squad", data)
    train = ds.split("train")
    assert {q.article for q in train} == {0, 1}
    pids = [p.id for p in ds.passages]
    ranked = {q.id: [(p, 1.0 - i / 100) for i, p in enumerate(reversed(pids))] for q in train}
    path = save_retrieval(tmp_path / "r.json", ranked, data_hash=passages_hash(ds.passages), dataset="squad",
                          split="train", embedder="test", depth=len(pids))
    exs = squad_examples(tokenizer, 6, k=3, seed=1, data=data, retrieval=path, prompts="frozen",
                         gold_position="random")
    text_ids = {tuple(tokenizer(p.text, add_special_tokens=False).input_ids): p.id for p in ds.passages}
    for e in exs:
        q = next(q for q in train if q.question == e.question)
        got = [text_ids[c] for c in e.chunks]
        assert q.passage in got and [p for p in got if p != q.passage] == \
            [p for p in reversed(pids) if p != q.passage][:2]
    assert len({e.instruction for e in exs}) == 1 and exs[0].system_prompt
    with pytest.raises(LazyRagError, match="prompt choice"):
        squad_examples(tokenizer, 2, k=3, data=data, prompts="other")
    with pytest.raises(LazyRagError, match="gold position"):
        squad_examples(tokenizer, 2, k=3, data=data, retrieval=path, gold_position="first")


def test_squad_examples_keep_the_retrievers_order(tmp_path, tokenizer):
    """The default with a ranking file: the prompt is the retriever's top k in its order, the gold
    paragraph where it was ranked; ranked below k, it takes a random place instead of the k-th."""
    from helpers import squad_file
    from lazy_rag.quality.data import load_dataset, passages_hash
    from lazy_rag.quality.retrieval import save_retrieval
    from lazy_rag.tune import squad_examples

    articles = [[(f"Paragraph {a}-{p} says the answer is {a * 10 + p}.", [(f"What does {a}-{p} say?", f"{a * 10 + p}")])
                 for p in range(3)] for a in range(4)]
    data = squad_file(tmp_path / "squad.json", articles)
    ds = load_dataset("squad", data)
    train = ds.split("train")
    pids = [p.id for p in ds.passages]
    others = list(reversed(pids))
    # question i's gold at rank i (ranks 0..2 inside k=3, rank 3+ below it)
    ranked = {}
    for i, q in enumerate(train):
        order = [p for p in others if p != q.passage]
        order.insert(i, q.passage)
        ranked[q.id] = [(p, 1.0 - j / 100) for j, p in enumerate(order)]
    path = save_retrieval(tmp_path / "r.json", ranked, data_hash=passages_hash(ds.passages), dataset="squad",
                          split="train", embedder="test", depth=len(pids))
    exs = squad_examples(tokenizer, len(train), k=3, seed=0, data=data, retrieval=path)
    text_ids = {tuple(tokenizer(p.text, add_special_tokens=False).input_ids): p.id for p in ds.passages}
    rank_of = {q.question: i for i, q in enumerate(train)}
    seen_below = 0
    for e in exs:
        i = rank_of[e.question]
        q = train[i]
        got = [text_ids[c] for c in e.chunks]
        top = [p for p, _ in ranked[q.id]][:3]
        if i < 3:
            assert got == top and got.index(q.passage) == i
        else:
            seen_below += 1
            assert len(got) == 3 and q.passage in got
            assert [p for p in got if p != q.passage] == top[:2]
    assert seen_below == len(train) - 3
