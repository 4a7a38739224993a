"""Faithfulness to `full`, the headline of `lazy-rag eval`: the teacher-forced KL over full's
answer, ROUGE-L against full's answer and the paired statistics on them."""
import math

import pytest
import torch

from lazy_rag.quality.scoring import kl_divergence, reference_rows, rouge_l, teacher_forced_kl
from lazy_rag.quality.statistics import PairedBootstrap

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
