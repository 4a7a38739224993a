"""The quality evaluation's parts, without a model: scoring, statistics, configurations, data
splits, the tasks' chunk lists, the retrieval file, progress lines and the QUALITY.md update."""
import io
import json
import re
import tarfile

import numpy as np
import pytest
import torch

from lazy_rag.errors import LazyRagError
from lazy_rag.quality import configs as configs_mod
from lazy_rag.quality.configs import Config, Suffix, parse_configs, split_config_list
from lazy_rag.quality.data import BIGBENCH_DIR, DATASETS, extract_bigbench_data, load_dataset, passages_hash
from lazy_rag.progress import Progress
from lazy_rag.quality.prompts import FROZEN, PROMPTS
from lazy_rag.quality.report import update_quality_md
from lazy_rag.quality.retrieval import load_retrieval, save_retrieval
from lazy_rag.quality.scoring import clean_prediction, contains_answer, kl_divergence, normalize_answer, score_answer
from lazy_rag.quality.statistics import PairedBootstrap
from lazy_rag.quality.tasks import build_bridge_task, classify_bridge, open_items, place_gold, split_sentences
from lazy_rag.engine.recovery import Recovery
from tests.helpers import squad_file


# -- scoring --------------------------------------------------------------------------------------
def test_official_squad_normalisation_and_scores():
    assert normalize_answer("The  Denver Broncos!") == "denver broncos"
    s = score_answer("the Broncos", ["Broncos.", "Denver"])
    assert s["em"] == 1.0 and s["f1"] == 1.0 and s["contains"] == 1.0
    assert score_answer("Denver Broncos team", ["Denver Broncos"])["f1"] == pytest.approx(0.8)
    assert score_answer("Panthers", ["Denver Broncos"]) == {"em": 0.0, "f1": 0.0, "contains": 0.0}


def test_contains_sees_a_verbose_right_answer_and_only_whole_words():
    verbose = "The Denver Broncos won Super Bowl 50 in 2016."
    s = score_answer(verbose, ["2016"])
    assert s["contains"] == 1.0 and s["em"] == 0.0 and s["f1"] == pytest.approx(2 / 9)
    assert contains_answer("in 19901", "1990") == 0.0
    assert contains_answer("anything", "the") == 0.0 and contains_answer("", "The") == 1.0  # gold normalises to ""


def test_clean_prediction_keeps_the_first_line_without_label_or_full_stop():
    assert clean_prediction(" Answer: Yuri Gagarin.\nHe was the first.") == "Yuri Gagarin"
    assert clean_prediction("1946") == "1946"


def test_kl_is_zero_for_equal_and_positive_otherwise():
    a, b = torch.randn(50), torch.randn(50)
    assert kl_divergence(a, a) == pytest.approx(0.0, abs=1e-12) and kl_divergence(a, b) > 0


# -- statistics -----------------------------------------------------------------------------------
def test_paired_interval_contains_a_known_difference_and_excludes_zero():
    rng = np.random.default_rng(1)
    ref = rng.random(400)
    config = ref - 0.10 + rng.normal(0, 0.05, 400)  # paired: the same questions, 0.10 worse on average
    iv = PairedBootstrap(400, 4000, seed=3).mean_difference(config, ref)
    assert iv.low < -0.10 < iv.high and iv.excludes_zero()
    assert iv.estimate == pytest.approx(float(np.mean(config - ref)))
    same = PairedBootstrap(400, 4000, seed=3).mean_difference(ref + rng.normal(0, 0.05, 400), ref)
    assert same.low < 0 < same.high and not same.excludes_zero()


def test_pairing_makes_the_interval_narrower_than_the_spread_of_scores():
    rng = np.random.default_rng(2)
    ref = rng.integers(0, 2, 300).astype(float)  # per-question scores vary a lot
    config = ref.copy()
    config[:30] = 1 - config[:30]                # but only 30 answers change
    iv = PairedBootstrap(300, 3000, seed=0).mean_difference(config, ref)
    assert iv.high - iv.low < 0.15


def test_gap_closed_estimates_the_share_and_is_seeded():
    rng = np.random.default_rng(4)
    full = rng.random(500) * 0.5 + 0.5
    lazy = full - 0.2 - rng.random(500) * 0.02
    half = (full + lazy) / 2
    boot = PairedBootstrap(500, 2000, seed=5)
    g = boot.gap_closed(half, lazy, full)
    assert g.estimate == pytest.approx(0.5) and g.low < 0.5 < g.high
    assert PairedBootstrap(500, 2000, seed=5).gap_closed(half, lazy, full) == g
    none = boot.gap_closed(full, full, full)  # no gap at all: undefined, not a crash
    assert np.isnan(none.estimate) and np.isnan(none.low)
    with pytest.raises(ValueError, match="paired"):
        boot.mean_difference(full[:10], lazy[:10])


# -- configurations -------------------------------------------------------------------------------
def test_options_refuse_a_progress_style_before_any_model_loads():
    from lazy_rag.quality import EvalOptions

    with pytest.raises(LazyRagError, match="'plain' is not a progress style; choose one of auto, bar"):
        EvalOptions(model="smollm2", progress="plain").check()


def test_configs_parse_and_refuse_nonsense():
    c = Config.parse("lazy+sink+epic16")
    assert (c.mode, c.index_options, c.generate_options) == ("lazy", {"shared_prefix": True}, {"recovery": "epic16"})
    assert Config.parse("full").index_options == {} and Config.parse("block+sink").mode == "block"
    assert [Config.parse(f"lazy+{d}").index_options for d in ("fp8", "int4")] == [{"kv_dtype": "fp8"},
                                                                                 {"kv_dtype": "int4"}]
    with pytest.raises(LazyRagError, match="kv_dtype twice"):
        Config.parse("lazy+fp8+int4")
    with pytest.raises(LazyRagError, match="Unknown mode"):
        Config.parse("lazzy")
    with pytest.raises(LazyRagError, match="chunk reuse modes"):
        Config.parse("full+sink")
    with pytest.raises(LazyRagError, match=r"Unknown option \+magic.*\+sink"):
        Config.parse("lazy+magic")
    with pytest.raises(LazyRagError, match="boundary twice"):
        Config.parse("lazy+epic8+epic16")
    with pytest.raises(LazyRagError, match="select twice"):
        Config.parse("lazy+prophet20+cacheblend10")
    with pytest.raises(LazyRagError, match="fraction"):
        Config.parse("lazy+prophet150")  # the engine's own check of the value
    assert [c.name for c in parse_configs("lazy,lazy+sink,full")] == ["full", "lazy", "lazy+sink"]
    assert [c.name for c in parse_configs(["lazy"])] == ["full", "lazy"]  # full is always the reference
    with pytest.raises(LazyRagError, match="listed twice"):
        parse_configs("lazy,lazy")


def test_recovery_parts_compose_one_engine_option_and_may_be_in_a_list(monkeypatch):
    c = Config.parse("lazy+sink+epic8+prophet20+ape0.9s1.1")
    assert c.generate_options == {"recovery": "epic8+prophet20+ape0.9s1.1"} and c.index_options == {"shared_prefix": True}
    assert Recovery.parse(c.recovery) == Recovery(boundary=8, select="question_attention", ratio=0.2,
                                                  ape_temperature=0.9, ape_scale=1.1)
    assert Config.parse("block+cacheblend15").generate_options == {"recovery": "cacheblend15"}
    assert split_config_list("full, lazy+ape0.9s1.1,lazy+prophet12.5,lazy") == [
        "full", "lazy+ape0.9s1.1", "lazy+prophet12.5", "lazy"]
    # a new index option is one table row
    monkeypatch.setitem(configs_mod.SUFFIXES, "wide", Suffix(r"wide(\d+)", "a wider chunk",
                                                             index=lambda m: {"chunk_size": int(m[1])}))
    assert Config.parse("lazy+wide64+epic4").index_options == {"chunk_size": 64}


# -- data -----------------------------------------------------------------------------------------
def test_split_is_by_article_halves_and_shifts_sets_are_test_only(tmp_path):
    arts = [[(f"Paragraph {a} says {a * 7}.", [(f"What does paragraph {a} say?", f"{a * 7}")])] for a in range(4)]
    path = squad_file(tmp_path / "four.json", arts)
    ds = load_dataset("squad", path)
    assert [p.id for p in ds.passages] == ["a000p0000", "a001p0000", "a002p0000", "a003p0000"]
    assert {q.article for q in ds.split("train")} == {0, 1} and {q.article for q in ds.split("test")} == {2, 3}
    assert len(ds.split("all")) == 4 and ds.questions[0].answer_starts == (ds.passages[0].text.find("0"),)
    shifted = load_dataset("nyt", path)  # the same file read as an evaluation-only set
    assert {q.split for q in shifted.questions} == {"test"}
    with pytest.raises(LazyRagError, match="evaluation only"):
        shifted.split("train")
    with pytest.raises(LazyRagError, match="Unknown split"):
        ds.split("dev")
    with pytest.raises(LazyRagError, match="does not exist"):
        load_dataset("squad", tmp_path / "missing.json")


def test_passages_hash_follows_ids_and_texts(tmp_path):
    ds = load_dataset("squad", squad_file(tmp_path / "a.json", [[("One. Two.", [("Q?", "One")])]]))
    other = load_dataset("squad", squad_file(tmp_path / "b.json", [[("One. Three.", [("Q?", "One")])]]))
    assert passages_hash(ds.passages) == passages_hash(list(ds.passages))
    assert passages_hash(ds.passages) != passages_hash(other.passages)


def test_bigbench_extraction_takes_the_five_files_from_the_sdist(tmp_path):
    sdist = tmp_path / "bigbench-1.0.0.tar.gz"
    with tarfile.open(sdist, "w:gz") as tar:
        for info in DATASETS.values():
            body = json.dumps({"data": [], "name": info.file}).encode()
            member = tarfile.TarInfo(f"bigbench-1.0.0/{BIGBENCH_DIR}{info.file}")
            member.size = len(body)
            tar.addfile(member, io.BytesIO(body))
    written = extract_bigbench_data(sdist, tmp_path / "data")
    assert sorted(p.name for p in written) == sorted(i.file for i in DATASETS.values())
    assert json.loads((tmp_path / "data" / "nyt_v1.0.json").read_text())["name"] == "nyt_v1.0.json"


# -- tasks ----------------------------------------------------------------------------------------
def test_gold_is_placed_first_middle_or_last_and_retrieved_keeps_the_ranking():
    ranked = ["p1", "gold", "p2", "p3", "p4"]
    assert place_gold(ranked, "gold", 4, "retrieved") == ["p1", "gold", "p2", "p3"]
    assert place_gold(ranked, "gold", 4, "first") == ["gold", "p1", "p2", "p3"]
    assert place_gold(ranked, "gold", 4, "middle") == ["p1", "p2", "gold", "p3"]
    assert place_gold(ranked, "gold", 4, "last") == ["p1", "p2", "p3", "gold"]
    missed = ["p1", "p2", "p3", "p4"]  # the retriever missed it: the lowest-ranked one makes room
    assert place_gold(missed, "gold", 4, "last") == ["p1", "p2", "p3", "gold"]
    with pytest.raises(LazyRagError, match="retrieve deeper"):
        place_gold(["p1"], "gold", 4, "first")


def test_open_items_record_where_the_gold_chunk_is(tmp_path):
    ds = load_dataset("squad", squad_file(tmp_path / "s.json", [[("Alpha is 1.", [("What is Alpha?", "1")]),
                                                                  ("Beta is 2.", [("What is Beta?", "2")])]]))
    q_alpha, q_beta = ds.questions
    ranked = {q_alpha.id: ["a000p0001", "a000p0000"], q_beta.id: ["a000p0000"]}
    items = open_items([q_alpha, q_beta], ranked, 1, "retrieved")
    assert [i.gold_index for i in items] == [None, None]
    assert open_items([q_alpha], ranked, 2, "retrieved")[0].gold_index == 1


def test_sentences_split_at_full_stops_but_not_after_abbreviations_or_initials():
    text = "Dr. Smith met J. R. Tolkien in the U.S. in 1950. He left. They stayed!"
    assert [text[s:e].strip() for s, e in split_sentences(text)] == [
        "Dr. Smith met J. R. Tolkien in the U.S. in 1950.", "He left.", "They stayed!"]


BRIDGE_PARAGRAPH = ("Agnes Thorold trained as an engineer in Leeds. She designed the Marrow Point Lighthouse in 1869. "
                    "Agnes Thorold retired to Whitby in 1890.")


def test_bridge_needs_the_pronoun_sentence_and_an_earlier_naming_one(tmp_path):
    ds = load_dataset("squad", squad_file(tmp_path / "b.json", [[(BRIDGE_PARAGRAPH, [
        ("What did Agnes Thorold design?", "the Marrow Point Lighthouse"),  # "She designed ...": bridge
        ("Where did Agnes Thorold retire to?", "Whitby"),                   # the answer sentence names her: control
        ("Where did Agnes Thorold train?", "Leeds")])]]))                    # first sentence: neither
    spans = split_sentences(BRIDGE_PARAGRAPH)
    kinds = [classify_bridge(q, BRIDGE_PARAGRAPH, spans) for q in ds.questions]
    assert kinds == [("bridge", 1), ("control", 2), (None, 0)]
    task = build_bridge_task(ds, ds.questions)
    assert [p.id for p in task.passages] == ["a000p0000s00", "a000p0000s01", "a000p0000s02"]
    assert task.passages[1].text == "She designed the Marrow Point Lighthouse in 1869."
    (bridge,), (control,) = task.items["bridge"], task.items["control"]
    assert bridge.chunk_ids == ("a000p0000s00", "a000p0000s01", "a000p0000s02") and bridge.gold_index == 1
    assert control.gold_index == 2


# -- retrieval file -------------------------------------------------------------------------------
def test_retrieval_file_round_trip_and_refusals(tmp_path):
    ranked = {"q1": [("p3", 0.9), ("p1", 0.5)], "q2": [("p2", 0.8), ("p3", 0.1)]}
    path = save_retrieval(tmp_path / "r.json", ranked, data_hash="abc", dataset="squad", split="test",
                          embedder="all-MiniLM-L6-v2", depth=2)
    assert load_retrieval(path, data_hash="abc", question_ids=["q2", "q1"], depth=2) == \
        {"q2": [("p2", 0.8), ("p3", 0.1)], "q1": [("p3", 0.9), ("p1", 0.5)]}
    with pytest.raises(LazyRagError, match="ranked other passages"):
        load_retrieval(path, data_hash="xyz", question_ids=["q1"], depth=2)
    with pytest.raises(LazyRagError, match="--depth 4"):
        load_retrieval(path, data_hash="abc", question_ids=["q1"], depth=4)
    with pytest.raises(LazyRagError, match="no ranking for 1"):
        load_retrieval(path, data_hash="abc", question_ids=["q1", "q9"], depth=2)
    with pytest.raises(LazyRagError, match="eval retrieve"):
        load_retrieval(tmp_path / "none.json", data_hash="abc", question_ids=[], depth=1)


# -- progress, prompts, report --------------------------------------------------------------------
class _Clock:
    def __init__(self):
        self.t = 0.0

    def __call__(self):
        return self.t


def test_progress_prints_plain_lines_every_5_percent_or_30_seconds_when_not_a_terminal():
    stream, clock = io.StringIO(), _Clock()
    p = Progress(200, "eval", stream=stream, clock=clock)
    assert p.style == "lines"  # a StringIO is not a terminal
    for i in range(9):  # 4.5%: nothing yet
        clock.t += 1
        p.advance(note="full F1 40.0")
    assert stream.getvalue() == ""
    clock.t += 1
    p.advance()  # 5%
    clock.t += 31
    p.advance()  # 30 s later, 5.5%
    lines = stream.getvalue().splitlines()
    assert len(lines) == 2 and lines[0].startswith("[eval] 10/200 (5%), elapsed 0m10s, ETA 3m10s; full F1 40.0")
    assert "11/200" in lines[1]
    quiet = io.StringIO()
    q = Progress(10, "eval", style="none", stream=quiet)
    q.advance(10)
    q.say("index: somewhere")
    assert quiet.getvalue() == ""


def test_frozen_prompt_exists_and_few_shot_questions_are_train_questions(tmp_path):
    from lazy_rag.quality.data import default_squad_path

    assert FROZEN in PROMPTS
    examples = {i for p in PROMPTS.values() for i in p.example_question_ids}
    if default_squad_path().exists():  # the real data: few-shot questions must come from the train half
        ds = load_dataset("squad")
        split_of = {q.id: q.split for q in ds.questions}
        assert examples and all(split_of[i] == "train" for i in examples)


def test_quality_md_section_replaces_its_own_title_and_keeps_the_rest(tmp_path):
    md = tmp_path / "Q.md"
    md.write_text("# Title\n\nHeader text.\n\n## run A  (2026-01-01)\nold A\n\n## run B  (2026-01-01)\nB\n")
    update_quality_md(md, "## run A  (2026-02-02)\nnew A\n")
    text = md.read_text()
    assert "old A" not in text and "new A" in text and "## run B" in text and text.startswith("# Title")
    assert len(re.findall(r"(?m)^## run A", text)) == 1


def test_eval_command_refuses_bad_settings_before_loading_a_model(tmp_path):
    from typer.testing import CliRunner

    from lazy_rag.cli import app

    runner = CliRunner()
    res = runner.invoke(app, ["eval", "squad", "--task", "bridge", "--top-k", "8", "--quality-md", ""])
    assert res.exit_code == 2 and "--task open only" in res.output
    res = runner.invoke(app, ["eval", "squad", "--configs", "full,lazy+magic", "--quality-md", ""])
    assert res.exit_code == 2 and "Unknown option +magic" in res.output
    res = runner.invoke(app, ["eval", "squad", "--gold-position", "centre", "--quality-md", ""])
    assert res.exit_code == 2 and "Unknown gold position 'centre'" in res.output
