"""Faithfulness to `full`, the headline of `lazy-rag eval`: the teacher-forced KL over full's
answer, ROUGE-L against full's answer, the paired statistics on them, the long-form prompt, and
the records and report that lead with them. The model tests use the bundled SmolLM2, as
test_quality_run.py does."""
import json
import math

import pytest
import torch

from lazy_rag.quality import run_eval, write_report
from lazy_rag.quality.prompts import PROMPTS
from lazy_rag.quality.report import markdown_tables
from lazy_rag.quality.scoring import kl_divergence, reference_rows, rouge_l, teacher_forced_kl
from lazy_rag.quality.statistics import PairedBootstrap
from tests.quality.test_quality_run import _options, corpus_file

# a boundary longer than any chunk of the test corpus: EPIC recomputes every chunk token at query
# time, with the prompt's own positions and attention, which is what `full` computes
EVERY_CHUNK_TOKEN_RECOMPUTED = "lazy+epic100000"


# -- without a model ----------------------------------------------------------------------------------

def test_rouge_l_is_the_lcs_f_measure_of_the_words():
    assert rouge_l("The Broncos won in 2016.", "the broncos won in 2016") == 1.0
    assert rouge_l("a b c d", "a c d e") == pytest.approx(0.75)  # LCS a c d: 3/4 both ways
    assert rouge_l("d c b a", "a b c d") == pytest.approx(0.25)  # order matters: one word in common order
    assert rouge_l("Denver", "Carolina Panthers") == 0.0
    assert rouge_l("", "") == 1.0 and rouge_l("", "Denver") == 0.0 and rouge_l("Denver", "") == 0.0


def test_teacher_forced_kl_is_exact_over_every_token_and_a_lower_bound_over_the_top_k():
    gen = torch.Generator().manual_seed(0)
    full = torch.randn(4, 500, generator=gen) * 3
    config = full + torch.randn(4, 500, generator=gen)
    exact = [kl_divergence(f, c) for f, c in zip(full, config)]
    every = reference_rows(full, 0)
    assert teacher_forced_kl(every, config) == pytest.approx(exact, rel=1e-9)
    assert every.tail_mass() == [0.0] * 4
    assert teacher_forced_kl(every, full) == pytest.approx([0.0] * 4, abs=1e-12)
    previous = [0.0] * 4
    for k in (1, 8, 64, 499):
        ref = reference_rows(full, k)
        kl = teacher_forced_kl(ref, config)
        # keeping more of full's tokens only refines the buckets: the bound rises toward the exact KL
        assert all(p - 1e-12 <= x <= e + 1e-12 for p, x, e in zip(previous, kl, exact))
        assert teacher_forced_kl(ref, full) == pytest.approx([0.0] * 4, abs=1e-12)
        assert all(0 < t < 1 for t in ref.tail_mass())
        previous = kl
    assert reference_rows(full, 10_000).token_ids.shape == (4, 500)  # k above the vocabulary: every token


def test_bootstrap_mean_and_ratio_of_means():
    boot = PairedBootstrap(5, 500, seed=1)
    agree = boot.mean([1, 1, 0, 1, 1])
    assert agree.estimate == pytest.approx(0.8) and 0 <= agree.low < 0.8 < agree.high <= 1
    same = boot.mean([0.5] * 5)
    assert (same.estimate, same.low, same.high) == pytest.approx((0.5, 0.5, 0.5))
    ratio = boot.ratio_of_means([1, 2, 3, 4, 5], [2, 4, 6, 8, 10])
    assert (ratio.estimate, ratio.low, ratio.high) == pytest.approx((0.5, 0.5, 0.5))
    assert math.isnan(boot.ratio_of_means([1] * 5, [0] * 5).estimate)


# -- with SmolLM2 -------------------------------------------------------------------------------------

def test_runs_lead_with_faithfulness_and_a_config_equal_to_full_matches_it(runtime, tmp_path):
    run = run_eval(_options(tmp_path, corpus_file(tmp_path / "c.json"), ks=(2,), n=2, max_new_tokens=5,
                            configs=f"lazy,{EVERY_CHUNK_TOKEN_RECOMPUTED}", kl_top_k=0), runtime)
    rec = {r["mode"]: r for r in run.records}
    rows = {(a["config"], a["question_id"]): a for a in run.answers}
    full, lazy, same = rec["full"], rec["lazy"], rec[EVERY_CHUNK_TOKEN_RECOMPUTED]

    # full against itself, through the same arithmetic as every other configuration: 0
    assert full["tf_kl_per_token_mean"] == pytest.approx(0, abs=1e-12)
    assert full["agreement_with_full_pct"] == 100 and full["rouge_l_vs_full"] == 100
    assert full["answer_words_vs_full"] == 1 and full["recomputed_chunk_pct"] == 100 and full["cached_token_pct"] == 0
    # every chunk token recomputed computes what full computes: the same answers and distributions
    assert same["agreement_with_full_pct"] == 100 and (same["agreement_ci_low"], same["agreement_ci_high"]) == (100, 100)
    assert same["tf_kl_per_token_mean"] == pytest.approx(0, abs=1e-6)
    assert same["rouge_l_vs_full"] == 100 and same["contains_delta_vs_full"] == 0
    assert same["recomputed_chunk_pct"] == 100 and same["cached_token_pct"] == 0
    # plain lazy reads its chunks from the cache and strays from full over the answer
    assert lazy["recomputed_chunk_pct"] == 0 and lazy["cached_token_pct"] > 50
    assert lazy["tf_kl_per_token_mean"] > 1e-3
    assert same["tf_kl_ratio_to_lazy"] < 1e-3 and same["tf_kl_delta_ci_high"] < 0
    assert lazy["tf_kl_ratio_to_lazy"] is None and full["tf_kl_delta_vs_lazy"] is None

    for (config, q), a in rows.items():
        ref = rows[("full", q)]
        # one scored row per decision of full's answer, the same rows for every configuration
        assert a["tf_positions"] == ref["tf_positions"] and 1 <= a["tf_positions"] <= 5 + 1
        assert a["tf_full_tail_mass"] == 0  # kl_top_k=0 keeps every token: the KL is exact
        assert a["first_token_entropy"] > 0 and 0 <= a["rouge_l_vs_full"] <= 1
    for q in {q for _, q in rows}:
        # the first teacher-forced row is the first token's distribution of the generation pass
        assert rows[("lazy", q)]["tf_kl_first"] == pytest.approx(rows[("lazy", q)]["kl_vs_full"], rel=1e-3, abs=1e-7)

    records = json.loads(write_report(run, tmp_path / "results", plot=False)["records"].read_text())
    faithfulness = {"agreement_with_full_pct", "agreement_ci_low", "agreement_ci_high", "contains_delta_vs_full",
                    "contains_delta_ci_low", "contains_delta_ci_high", "tf_kl_per_token_mean", "tf_kl_first_token_mean",
                    "tf_kl_delta_vs_lazy", "tf_kl_delta_ci_low", "tf_kl_delta_ci_high", "tf_kl_ratio_to_lazy",
                    "tf_kl_ratio_ci_low", "tf_kl_ratio_ci_high", "kl_top_k", "tf_full_tail_mass_max", "rouge_l_vs_full",
                    "rouge_l_ci_low", "rouge_l_ci_high", "answer_words_vs_full", "recomputed_chunk_pct",
                    "cached_token_pct", "first_token_entropy_mean", "max_new_tokens", "long_form"}
    assert all(faithfulness <= set(r) for r in records)
    # the records lead with faithfulness: every one of its fields comes before the gold scores
    assert all(max(list(r).index(k) for k in faithfulness - {"max_new_tokens", "long_form", "cached_token_pct"})
               < list(r).index("f1") for r in records)
    table = markdown_tables(run)
    header = next(line for line in table.splitlines() if line.startswith("| config |"))
    columns = [c.strip() for c in header.strip("|").split("|")]
    assert columns[1].startswith("agree %") and columns.index("TF KL / token") < columns.index("F1")
    assert "not meaningful" not in table


def test_the_long_form_prompt_answers_in_up_to_128_tokens(runtime, tmp_path):
    asked = []

    class Recording(type(runtime)):
        def answer(self, requests):
            asked.extend(r.max_new_tokens for r in requests)
            return super().answer(requests)

    recording = Recording(runtime.llm, "smollm2", runtime.embedder.inner)
    run = run_eval(_options(tmp_path, corpus_file(tmp_path / "c.json"), ks=(2,), n=1, max_new_tokens=4,
                            configs="full", prompts=("short", "longform")), recording)
    assert PROMPTS["longform"].max_new_tokens == 128
    assert asked == [4, 128]
    by_prompt = {r["prompt"]: r for r in run.records}
    assert by_prompt["longform"]["max_new_tokens"] == 128 and by_prompt["longform"]["long_form"]
    assert by_prompt["short"]["max_new_tokens"] == 4 and not by_prompt["short"]["long_form"]
    long_answer = next(a for a in run.answers if a["prompt"] == "longform")
    assert long_answer["tf_positions"] > 4  # it did answer at length, and was scored over all of it
    tables = markdown_tables(run).split("### ")[1:]
    assert [("not meaningful" in t) for t in tables] == [False, True]  # under the long-form table only
