"""Reuse risk: the first token's entropy under reuse, its calibration to the probability that the
answer differs from full re-encoding's, and recovery ``auto`` serving risky requests again."""
from __future__ import annotations

import math
import random

import pytest
import torch

from helpers import small_llm
from lazy_rag import Chunk
from lazy_rag.errors import LazyRagError
from lazy_rag.random_models import IdTokenizer
from lazy_rag.reuse_risk import (AutoPolicy, RiskCalibration, describe_risk, find_calibration, first_token_entropy,
                                 monotone_fit)
from tiny_models import tiny_model


def test_entropy_of_a_certain_and_of_a_uniform_distribution():
    assert first_token_entropy(torch.tensor([50.0, 0.0, 0.0, 0.0])) < 1e-12
    assert first_token_entropy(torch.zeros(1000)) == pytest.approx(math.log(1000), rel=1e-6)


def test_the_fit_never_falls_and_averages_where_the_outcomes_do():
    knots, risks = monotone_fit([0.1, 0.2, 0.3, 0.4, 0.5], [0, 1, 0, 1, 1])
    assert risks == [0.0, 0.5, 1.0] and knots == pytest.approx([0.1, 0.25, 0.45])
    cal = RiskCalibration.fit([0.1, 0.2, 0.3, 0.4, 0.5], [False, True, False, True, True], "m", None)
    got = [cal.risk(e) for e in (0.0, 0.1, 0.25, 0.3, 0.45, 9.0, float("nan"))]
    assert got == pytest.approx([0.0, 0.0, 0.5, 0.625, 1.0, 1.0, 1.0])
    grid = [cal.risk(e / 100) for e in range(60)]
    assert grid == sorted(grid)  # never falls as entropy rises
    with pytest.raises(LazyRagError, match="as many outcomes"):
        monotone_fit([0.1], [])


def test_a_calibration_round_trips_through_its_file_and_is_found_by_model_and_wrapper(tmp_path):
    cal = RiskCalibration.fit([0.5, 1.5, 2.5], [False, False, True], "fp1", "w1",
                              AutoPolicy(((0.4, 0.2), (0.9, 1.0))), {"n": 3})
    cal.save(tmp_path / "fp1-w1.json")
    assert find_calibration("fp1", "w1", tmp_path) == cal
    assert find_calibration("fp1", None, tmp_path) is None and find_calibration("fp2", "w1", tmp_path) is None
    (tmp_path / "fp1-plain.json").write_text("{}")
    with pytest.raises(LazyRagError, match="Not a reuse-risk calibration"):
        find_calibration("fp1", None, tmp_path)


def test_the_policy_recomputes_the_highest_step_the_risk_reaches():
    policy = AutoPolicy(((0.4, 0.2), (0.9, 1.0)))
    assert [policy.fraction(r) for r in (None, 0.0, 0.39, 0.4, 0.8, 0.9, 1.0)] == [0, 0, 0, 0.2, 0.2, 1.0, 1.0]
    for bad in (((0.9, 0.2), (0.4, 1.0)), ((0.5, 0.0),), ((0.5, 1.5),)):
        with pytest.raises(LazyRagError, match="steps"):
            AutoPolicy(bad)


# -- the engine ----------------------------------------------------------------------------------

def _ids(rng, n):
    return [rng.randrange(100, 40000) for _ in range(n)]


@pytest.fixture(scope="module")
def llm(device):
    return small_llm(tiny_model("llama", "llama3", seed=9, hidden_size=128).to(device), IdTokenizer(), page_size=4)


@pytest.fixture(scope="module")
def prompt():
    rng = random.Random(3)
    return [_ids(rng, 4), Chunk(_ids(rng, 40)), _ids(rng, 2), Chunk(_ids(rng, 25)), _ids(rng, 6)]


def _calibrate(llm, monkeypatch, policy: AutoPolicy):
    """A calibration for the test model's plain chunks: risk = entropy / 20 (capped at 1)."""
    fp = llm.engine.host.fingerprint["id"]
    edges = tuple(float(e) for e in range(1, 21))
    cal = RiskCalibration(fp, None, edges, tuple(e / 20 for e in edges), policy)
    monkeypatch.setitem(llm.engine._calibrations, None, cal)
    return cal


def test_every_reused_answer_reports_its_first_tokens_entropy_and_risk(llm, prompt, monkeypatch):
    monkeypatch.setitem(llm.engine._calibrations, None, None)
    res = llm.generate(prompt, max_new_tokens=3, output_first_logits=True)
    assert res.stats.first_token_entropy == pytest.approx(first_token_entropy(res.first_logits), rel=1e-4)
    assert res.stats.reuse_risk is None and "no risk calibration" in describe_risk(res.stats)
    assert llm.generate(prompt, max_new_tokens=1, mode="full").stats.first_token_entropy is None  # nothing reused
    cal = _calibrate(llm, monkeypatch, AutoPolicy())
    res = llm.generate(prompt, max_new_tokens=3)
    assert res.stats.reuse_risk == cal.risk(res.stats.first_token_entropy) and not res.stats.served_again
    assert describe_risk(res.stats) == f" | reuse risk {100 * res.stats.reuse_risk:.0f}%"


def test_auto_below_every_step_is_plain_lazy(llm, prompt, monkeypatch):
    _calibrate(llm, monkeypatch, AutoPolicy(((1.0 + 1e-9, 1.0),)))  # a risk no entropy here reaches
    lazy = llm.generate(prompt, max_new_tokens=5, output_first_logits=True)
    auto = llm.generate(prompt, max_new_tokens=5, recovery="auto", output_first_logits=True)
    assert auto.token_ids == lazy.token_ids and torch.equal(auto.first_logits, lazy.first_logits)
    assert auto.stats.recovery == "auto" and not auto.stats.served_again and auto.stats.recomputed_tokens == 0


def test_auto_at_full_recompute_serves_the_full_answer_and_frees_everything(llm, prompt, monkeypatch):
    _calibrate(llm, monkeypatch, AutoPolicy(((0.0, 1.0),)))  # every request: all chunk tokens recomputed
    full = llm.generate(prompt, max_new_tokens=5, mode="full", output_first_logits=True)
    before = llm.engine.num_served_again
    auto = llm.generate(prompt, max_new_tokens=5, recovery="auto", output_first_logits=True)
    assert auto.token_ids == full.token_ids
    assert (auto.first_logits - full.first_logits).abs().max() / full.first_logits.abs().max() < 1e-4
    st = auto.stats
    assert st.served_again and st.recovery == "auto" and st.recovery_applied == "prophet100"
    assert st.recomputed_tokens == 65 and st.cached_tokens == 0 and st.first_token_entropy is not None
    assert llm.engine.num_served_again == before + 1
    assert llm.stats()["pages_private"] == 0
    llm.engine.pm.check()


def test_auto_serves_a_batch_where_only_the_risky_requests_are_recomputed(llm, prompt, monkeypatch):
    cal = _calibrate(llm, monkeypatch, AutoPolicy())
    rng = random.Random(11)
    prompts = [prompt] + [[_ids(rng, 4), Chunk(_ids(rng, 30)), _ids(rng, 5)] for _ in range(3)]
    plain = [llm.generate(p, max_new_tokens=4) for p in prompts]
    cut = sorted(cal.risk(r.stats.first_token_entropy) for r in plain)[1]  # the riskier three go again
    _calibrate(llm, monkeypatch, AutoPolicy(((cut, 0.5),)))
    got = llm.engine.generate([{"segments": p, "max_new_tokens": 4, "recovery": "auto"} for p in prompts])
    for p, g, r in zip(prompts, got, plain):
        risky = cal.risk(r.stats.first_token_entropy) >= cut
        assert g.stats.served_again == risky
        if risky:
            want = llm.generate(p, max_new_tokens=4, recovery="prophet50")
            assert g.token_ids == want.token_ids and g.stats.recomputed_tokens == want.stats.recomputed_tokens
        else:
            assert g.token_ids == r.token_ids and g.stats.recomputed_tokens == 0
    llm.engine.pm.check()
