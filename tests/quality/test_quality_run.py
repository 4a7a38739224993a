"""Evaluation runs with the bundled SmolLM2 on a small SQuAD-format file: structure, pairing,
the data-keyed index cache, the retrieval file and the bridge task. SmolLM2's answers are poor:
nothing here asserts a score."""
import gzip
import json
from pathlib import Path

import pytest

from lazy_rag.errors import LazyRagError
from lazy_rag.quality import EvalOptions, precompute_retrieval, run_eval, write_report
from lazy_rag.quality.configs import Config
from lazy_rag.quality.evaluate import _Evaluation
from lazy_rag.quality.prompts import PROMPTS
from lazy_rag.quality.runner import Runtime
from tests.helpers import squad_file

CORPUS = Path(__file__).resolve().parents[2] / "examples" / "corpus"
BRIDGE = [
    ("Agnes Thorold trained as an engineer in Leeds. She designed the Marrow Point Lighthouse in 1869. "
     "Agnes Thorold retired to Whitby in 1890.",
     [("What did Agnes Thorold design?", "the Marrow Point Lighthouse"),
      ("Where did Agnes Thorold retire to?", "Whitby")]),
    ("Lidia Varga trained as a baker in Budapest. In 2016 she became head baker at Kestrel Street. "
     "Lidia Varga introduced the poppy seed roll.",
     [("Where did Lidia Varga become head baker?", "Kestrel Street"),
      ("What did Lidia Varga introduce?", "the poppy seed roll")]),
]


def corpus_file(path: Path, edit=lambda text: text) -> Path:
    """The sample corpus as a SQuAD-format file (one article per document), plus the bridge article."""
    articles = []
    for f in sorted(CORPUS.iterdir()):
        paras = [edit(p.strip()) for p in f.read_text().split("\n\n") if len(p) > 80]
        articles.append([(p, [(f"What does the passage say about {p.split()[1]}?", " ".join(p.split()[:3]))])
                         for p in paras])
    return squad_file(path, articles + [BRIDGE])


def _options(tmp_path, data, **kw) -> EvalOptions:
    base = dict(model="smollm2", data=data, split="all", n=3, max_new_tokens=6, ttft_n=0, bootstrap=200,
                work_dir=tmp_path / "work", progress="none")
    return EvalOptions(**{**base, **kw})


def test_open_retrieval_run_pairs_every_config_with_full_and_writes_the_report(runtime, tmp_path):
    # two questions (the suite's time budget): every pairing and report path still runs
    run = run_eval(_options(tmp_path, corpus_file(tmp_path / "c.json"), configs="lazy,block,lazy+sink,lazy+epic8+prophet20",
                            ks=(2,), gold_positions=("retrieved", "last"), ttft_n=1, n=2, max_new_tokens=3), runtime)
    modes = ["full", "lazy", "block", "lazy+sink", "lazy+epic8+prophet20"]
    assert [r["mode"] for r in run.records] == modes * 2 and len(run.answers) == 2 * 5 * 2
    assert {r["mode"]: r["generate_options"] for r in run.records}["lazy+epic8+prophet20"] == {
        "recovery": "epic8+prophet20"}
    by_setting = {pos: {r["mode"]: r for r in run.records if r["gold_position"] == pos} for pos in ("retrieved", "last")}
    full, lazy = by_setting["retrieved"]["full"], by_setting["retrieved"]["lazy"]
    assert full["agreement_with_full_pct"] == 100.0 and full["kl_vs_full_first_token"] == pytest.approx(0, abs=1e-9)
    assert (full["f1_delta_vs_full"], full["f1_delta_ci_low"], full["f1_delta_ci_high"]) == (0.0, 0.0, 0.0)
    assert full["cached_token_pct"] == 0 and lazy["cached_token_pct"] > 50
    # recovery recomputes chunk tokens: fewer of the prompt's tokens come from the cache
    assert by_setting["retrieved"]["lazy+epic8+prophet20"]["cached_token_pct"] < lazy["cached_token_pct"] - 10
    assert full["gap_closed_pct"] is None and lazy["gap_closed_pct"] is None
    assert "gap_closed_ci_low" in by_setting["retrieved"]["lazy+sink"]
    assert all(r["ttft_n"] == 1 and r["ttft_ms_mean"] > 0 for r in run.records)
    # where the timed request's chunks came from: full reads none; lazy's two chunks, each from one tier
    served = lambda r: sum(r[f"ttft_chunks_{t}"] for t in ("pool", "host", "disk", "encoded", "recomputed"))  # noqa: E731
    assert served(full) == 0 and served(lazy) == 2
    assert by_setting["last"]["full"]["recall_at_k_pct"] == 100.0
    assert all(a["gold_index"] == 1 for a in run.answers if a["gold_position"] == "last")
    # block and lazy compute the same function: the same answers
    pred = {(a["gold_position"], a["question_id"], a["config"]): a["prediction"] for a in run.answers}
    assert all(pred[(g, q, "block")] == p for (g, q, c), p in pred.items() if c == "lazy")
    # no +wrapper: plain chunks, though SmolLM2 has a bundled wrapper (`full`, run first, once built the
    # shared index with the build's default and so wrapped `lazy`'s chunks): the same tokens as full's prompt
    tokens = {(a["gold_position"], a["question_id"], a["config"]): a["prompt_tokens"] for a in run.answers}
    assert all(tokens[(g, q, "full")] == n for (g, q, c), n in tokens.items() if c != "lazy+sink")
    assert all(r["wrapper_digest"] is None for r in run.records)
    # every configuration saw the same chunks as full on every question
    chunks = {(a["gold_position"], a["question_id"], a["config"]): a["chunk_ids"] for a in run.answers}
    assert all(chunks[(g, q, "full")] == ids for (g, q, c), ids in chunks.items())

    md = tmp_path / "QUALITY.md"
    paths = write_report(run, tmp_path / "results", md, command="lazy-rag eval squad --test")
    records = json.loads(paths["records"].read_text())
    want = {"benchmark", "mode", "device", "model", "dtype", "split", "k", "n", "seed", "gold_position", "task", "f1",
            "em", "contains", "f1_delta_vs_full", "f1_delta_ci_low", "f1_delta_ci_high", "agreement_with_full_pct",
            "kl_vs_full_first_token", "ttft_ms_mean", "ttft_n", "date"}
    assert all(want <= set(r) for r in records)
    assert len(gzip.decompress(paths["answers"].read_bytes()).decode().splitlines()) == len(run.answers)
    assert paths["plot"].stat().st_size > 0
    text = md.read_text()
    assert text.count("## open retrieval") == 1 and "| lazy+sink |" in text and "`lazy-rag eval squad --test`" in text
    write_report(run, tmp_path / "results", md, plot=False)  # the same run again: its section is replaced
    assert md.read_text().count("## open retrieval") == 1


def test_cached_indexes_are_keyed_by_the_data(runtime, tmp_path, capsys):
    """A second data file whose paragraphs have the same ids must not reuse the first file's index."""
    first = corpus_file(tmp_path / "first.json")
    second = corpus_file(tmp_path / "second.json", edit=lambda t: t.replace("Kestrel", "Osprey"))
    prompt, plain = PROMPTS["short"], Config.parse("full")
    indexes = []
    for data in (first, second):
        ev = _Evaluation(_options(tmp_path, data, configs="full", prompts=("short",), progress="lines"), runtime)
        indexes.append(ev.index_for(prompt, plain))
    a, b = indexes
    assert a.path != b.path and a.path.parent == b.path.parent
    assert "Osprey" in b.by_id["a000p0000"].text and "Osprey" not in a.by_id["a000p0000"].text
    top = runtime.retrieve(b, "Osprey Street Bakery founders", 1)[0][0]
    assert "Osprey" in b.by_id[top].text
    err = capsys.readouterr().err
    assert f"index (built): {a.path}" in err and f"index (built): {b.path}" in err


def test_a_quantised_kv_configuration_is_encoded_up_front_and_answers_from_its_stored_kv(runtime, tmp_path):
    """+int4's index holds every chunk's int4 KV before any question (a chunk's first use would
    otherwise answer from the unquantised KV it encoded), and its answers read it (not encode)."""
    data = corpus_file(tmp_path / "c.json")
    ev = _Evaluation(_options(tmp_path, data, configs="lazy,lazy+int4", prompts=("short",)), runtime)
    plain, int4 = (ev.index_for(PROMPTS["short"], Config.parse(c)) for c in ("lazy", "lazy+int4"))
    assert int4.store.kv_format == "int4" and all(int4.store.read(r.id, r.token_ids)[1] is None for r in int4.records)
    assert plain.store.read(plain.records[0].id, plain.records[0].token_ids)[1] == "missing"  # on first use
    runtime.llm.engine.clear_cache()
    ids = [r.id for r in int4.records[:2]]
    res = runtime.llm.generate(int4.segments("Who designed the lighthouse?", ids), max_new_tokens=1,
                               source=int4.chunk_source)
    assert res.stats.chunk_sources == {"disk": 2}


class _NoRetrieval(Runtime):
    def retrieve(self, *args, **kwargs):
        raise AssertionError("retrieval ran although a retrieval file was given")


def test_a_retrieval_file_replaces_retrieval_and_is_tied_to_its_data(runtime, tmp_path):
    data = corpus_file(tmp_path / "c.json")
    path = precompute_retrieval(tmp_path / "r.json", data=data, split="all", depth=3, work_dir=tmp_path / "work",
                                progress="none", runtime=runtime, configs="full,lazy+sink")
    doc = json.loads(path.read_text())
    assert doc["depth"] == 3 and all(len(r) == 3 for r in doc["questions"].values())
    assert len(list((tmp_path / "work").iterdir())) == 2  # the plain and the +sink index, built beside it
    live = run_eval(_options(tmp_path, data, configs="full", ks=(2,), max_new_tokens=2), runtime)
    # no embedder on the machine that runs from the file: its indexes have no vectors
    offline = run_eval(_options(tmp_path, data, configs="full", ks=(2,), max_new_tokens=2, retrieval_file=path),
                       _NoRetrieval(runtime.llm, "smollm2"))
    assert [a["chunk_ids"] for a in offline.answers] == [a["chunk_ids"] for a in live.answers]
    assert [a["prediction"] for a in offline.answers] == [a["prediction"] for a in live.answers]
    assert any(p.name.endswith("-novectors") for p in (tmp_path / "work").iterdir())
    assert offline.meta["retrieval_file"] == str(path)
    other = corpus_file(tmp_path / "other.json", edit=lambda t: t + " Extra.")
    with pytest.raises(LazyRagError, match="ranked other passages"):
        run_eval(_options(tmp_path, other, configs="full", retrieval_file=path), runtime)


def test_bridge_task_runs_bridge_and_control_questions_over_sentence_chunks(runtime, tmp_path):
    run = run_eval(_options(tmp_path, corpus_file(tmp_path / "c.json"), task="bridge", configs="lazy", n=2,
                            ttft_n=1), runtime)
    assert [(r["subset"], r["mode"]) for r in run.records] == [
        ("bridge", "full"), ("bridge", "lazy"), ("control", "full"), ("control", "lazy")]
    assert all(r["n"] == 2 and r["k"] is None and r["chunks_per_question_mean"] == 3 for r in run.records)
    assert all(len(a["chunk_ids"]) == 3 and a["chunk_ids"][0].endswith("s00") for a in run.answers)
    with pytest.raises(LazyRagError, match="--task open only"):
        run_eval(_options(tmp_path, corpus_file(tmp_path / "c.json"), task="bridge", ks=(8,)), runtime)


class _StopAfter:
    """A runtime whose answers stop (as a killed run would) after ``calls`` engine batches."""

    def __init__(self, inner, calls: int):
        self.inner, self.calls, self.batches = inner, calls, 0

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def answer(self, requests):
        if self.batches == self.calls:
            raise KeyboardInterrupt
        self.batches += 1
        return self.inner.answer(requests)


def test_an_interrupted_run_resumes_from_its_checkpoint_with_the_same_answers(runtime, tmp_path, monkeypatch):
    # the signature includes a digest of lazy-rag's source: fixed here (edits elsewhere in a working
    # tree must not break the test); a changed digest is checked at the end
    monkeypatch.setattr("lazy_rag.quality.evaluate.code_digest", lambda: "code-a")
    data = corpus_file(tmp_path / "c.json")
    # two questions a setting, one a batch (the suite's time budget): the same batches as four in twos
    opts = dict(configs="lazy", ks=(2,), gold_positions=("retrieved", "first"), n=2, batch_size=1, max_new_tokens=3)
    whole = run_eval(_options(tmp_path, data, checkpoint=tmp_path / "whole.json", **opts), runtime)
    assert whole.checkpoint.path.exists()
    whole.discard_checkpoint()
    assert not (tmp_path / "whole.json").exists()

    partials = []
    stopping = _StopAfter(runtime, calls=3)  # 2 batches of the first setting, 1 of the second
    with pytest.raises(KeyboardInterrupt):
        run_eval(_options(tmp_path, data, **opts), stopping, on_partial=partials.append, partial_every_s=0)
    saved = list((tmp_path / "work" / "checkpoints").glob("*.json"))
    assert len(saved) == 1 and stopping.batches == 3
    state = json.loads(saved[0].read_text())["settings"]
    assert [len(s["rows"]["full"]) for s in state.values()] == [2, 1]
    # a partial run reports the questions answered so far
    assert partials and partials[-1].records[-1]["n"] == 1

    resumed = _StopAfter(runtime, calls=99)
    run = run_eval(_options(tmp_path, data, **opts), resumed)
    assert resumed.batches == 1  # only the missing batch ran
    key = lambda a: (a["gold_position"], a["question_id"], a["config"])  # noqa: E731
    assert {key(a): a["prediction"] for a in run.answers} == {key(a): a["prediction"] for a in whole.answers}
    assert [r["f1"] for r in run.records] == [r["f1"] for r in whole.records]

    # another run's checkpoint is refused, not mixed in
    with pytest.raises(LazyRagError, match="belongs to another run"):
        run_eval(_options(tmp_path, data, checkpoint=saved[0], **{**opts, "n": 3}), runtime)
    fresh = _StopAfter(runtime, calls=99)
    run_eval(_options(tmp_path, data, resume=False, **opts), fresh)
    assert fresh.batches == 4
    # answers given by other code are never resumed
    run.discard_checkpoint()
    with pytest.raises(KeyboardInterrupt):
        run_eval(_options(tmp_path, data, **opts), _StopAfter(runtime, calls=1))
    monkeypatch.setattr("lazy_rag.quality.evaluate.code_digest", lambda: "code-b")
    changed = _StopAfter(runtime, calls=99)
    run_eval(_options(tmp_path, data, **opts), changed)
    assert changed.batches == 4
