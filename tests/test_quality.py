"""SQuAD scoring and the quality evaluation's smoke run (no thresholds on the scores)."""
import json
from pathlib import Path

import pytest

from lazy_rag.errors import LazyRagError
from lazy_rag.quality import (Config, best_over, default_squad_path, exact_match, f1_score, kl_divergence,
                              normalize_answer, run_squad_eval, write_report)

CORPUS = Path(__file__).resolve().parents[1] / "examples" / "corpus"


def _squad_file(tmp_path: Path) -> Path:
    """The real SQuAD dev set beside the checkout (CI has it); elsewhere a small file in the same
    format, built from the sample corpus, so the smoke run still exercises every step."""
    real = default_squad_path()
    if real.exists():
        return real
    paragraphs = [p.strip() for f in sorted(CORPUS.iterdir()) for p in f.read_text().split("\n\n") if len(p) > 80]
    qas = [{"id": f"q{i}", "question": f"What does this passage say about {p.split()[1]}?",
            "answers": [{"text": " ".join(p.split()[:3]), "answer_start": 0}]} for i, p in enumerate(paragraphs)]
    data = {"data": [{"title": "sample", "paragraphs": [{"context": p, "qas": [q]} for p, q in zip(paragraphs, qas)]}]}
    path = tmp_path / "squad_sample.json"
    path.write_text(json.dumps(data))
    return path


def test_official_squad_normalisation_and_scores():
    assert normalize_answer("The  Denver Broncos!") == "denver broncos"
    assert exact_match("the Broncos", "Broncos.") == 1.0
    assert f1_score("Denver Broncos team", "Denver Broncos") == pytest.approx(0.8)
    assert f1_score("Panthers", "Denver Broncos") == 0.0
    assert best_over(f1_score, "Broncos", ["Carolina", "Denver Broncos"]) == pytest.approx(2 / 3)


def test_configs_parse_and_refuse_nonsense():
    assert Config.parse("lazy+sink+epic16") == Config("lazy+sink+epic16", "lazy", True, 16)
    with pytest.raises(LazyRagError, match="Unknown mode"):
        Config.parse("lazzy")
    with pytest.raises(LazyRagError, match="apply to chunk reuse"):
        Config.parse("full+sink")
    with pytest.raises(LazyRagError, match="Unknown mitigation"):
        Config.parse("lazy+magic")


def test_kl_is_zero_for_equal_and_positive_otherwise():
    import torch

    a, b = torch.randn(50), torch.randn(50)
    assert kl_divergence(a, a) == pytest.approx(0.0, abs=1e-12) and kl_divergence(a, b) > 0


def test_squad_smoke_run_writes_records_and_table(smollm2, tmp_path):
    summary, answers = run_squad_eval(model="smollm2", configs=["full", "block", "lazy", "lazy+sink", "lazy+epic8"],
                                      n=10, k=2, max_new_tokens=6, work_dir=tmp_path / "work", progress=False,
                                      llm=smollm2, squad=_squad_file(tmp_path))
    assert [r["mode"] for r in summary] == ["full", "block", "lazy", "lazy+sink", "lazy+epic8"]
    full, block, lazy = summary[:3]
    assert full["agreement_with_full_pct"] == 100.0 and full["kl_vs_full_first_token"] == pytest.approx(0, abs=1e-9)
    # block and lazy compute the same function: same answers
    by = {(a["question_id"], a["config"]): a["prediction"] for a in answers}
    assert all(by[(q, "block")] == by[(q, "lazy")] for q, c in by if c == "lazy")
    assert lazy["cached_token_pct"] > 50 and full["cached_token_pct"] == 0
    assert 0 <= full["recall_at_k"] <= 100 and len(answers) == 5 * full["n"]
    path = write_report(summary, answers, tmp_path / "results", tmp_path / "QUALITY.md")
    records = json.loads(path.read_text())
    assert all({"benchmark", "mode", "device", "em", "f1"} <= set(r) for r in records)
    md = (tmp_path / "QUALITY.md").read_text()
    assert "| lazy+sink |" in md and md.count("## smollm2") == 1
    write_report(summary, answers, tmp_path / "results", tmp_path / "QUALITY.md")  # same run: section replaced
    assert (tmp_path / "QUALITY.md").read_text().count("## smollm2") == 1
