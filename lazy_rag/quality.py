"""Answer quality of KV reuse on open-retrieval SQuAD v1.1, against full re-encoding.

All 2,067 dev paragraphs are indexed (one chunk each; KV encoded on first retrieval); a seeded
sample of questions is answered by every configuration on the same retrieved chunks, greedy,
through the chat template. Scores use the official SQuAD v1.1 normalisation (exact match, token
F1, max over gold answers). We also report retrieval recall@k, agreement of each configuration's
answers with ``full``'s, and the mean KL(full || config) of the first-token distributions.

Configurations are named ``MODE[+sink][+epicN]``: ``lazy+sink`` encodes every chunk after the
prompt's fixed head (shared prefix, an attention sink); ``lazy+epic16`` recomputes the first 16
tokens of each chunk at query time (boundary recompute).
"""
from __future__ import annotations

import collections
import json
import os
import random
import re
import string
import subprocess
import sys
import tarfile
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from .errors import LazyRagError
from .llm import MODES

SQUAD_MEMBER = "bigbench/benchmark_tasks/squad_shifts/squaddev_v1.1.json"
EVAL_INSTRUCTION = ("Answer the question with a short phrase copied from the context. "
                    "Do not explain, do not write a full sentence.")


# -- the official SQuAD v1.1 scoring -------------------------------------------------------------
def normalize_answer(s: str) -> str:
    s = s.lower()
    s = "".join(ch for ch in s if ch not in set(string.punctuation))
    s = re.sub(r"\b(a|an|the)\b", " ", s)
    return " ".join(s.split())


def f1_score(prediction: str, truth: str) -> float:
    pred, gold = normalize_answer(prediction).split(), normalize_answer(truth).split()
    common = collections.Counter(pred) & collections.Counter(gold)
    same = sum(common.values())
    if same == 0:
        return 0.0
    precision, recall = same / len(pred), same / len(gold)
    return 2 * precision * recall / (precision + recall)


def exact_match(prediction: str, truth: str) -> float:
    return float(normalize_answer(prediction) == normalize_answer(truth))


def best_over(metric, prediction: str, truths: list[str]) -> float:
    return max(metric(prediction, t) for t in truths)


# -- data ------------------------------------------------------------------------------------------
def default_squad_path() -> Path:
    env = os.environ.get("LAZY_RAG_SQUAD")
    if env:
        return Path(env)
    return Path(__file__).resolve().parents[2] / "shared" / "data" / "squad_v1.1_dev.json"


def fetch_squad(dest: Path) -> Path:
    """Extract SQuAD v1.1 dev from the ``bigbench==1.0.0`` sdist on PyPI (358 MB download, once)."""
    dest.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:", "-d", tmp,
                        "bigbench==1.0.0"], check=True)
        sdist = next(Path(tmp).glob("bigbench-1.0.0*"))
        with tarfile.open(sdist) as tar:
            member = next(m for m in tar.getmembers() if m.name.endswith(SQUAD_MEMBER))
            data = tar.extractfile(member).read()
    tmp_out = dest.with_suffix(".tmp")
    tmp_out.write_bytes(data)
    os.replace(tmp_out, dest)
    return dest


def load_squad(path: Path | None = None, fetch: bool = False):
    """(paragraphs, questions): paragraphs as (id, text); questions as dicts with gold answers."""
    path = Path(path) if path else default_squad_path()
    if not path.exists():
        cached = Path(os.environ.get("LAZY_RAG_CACHE", Path.home() / ".cache" / "lazy-rag")) / "squad_v1.1_dev.json"
        if cached.exists():
            path = cached
        elif fetch:
            path = fetch_squad(cached)
        else:
            raise LazyRagError(f"SQuAD v1.1 dev not found at {path}. Pass --squad PATH, set LAZY_RAG_SQUAD, or add "
                               "--fetch to extract it from the bigbench sdist on PyPI (358 MB).")
    data = json.loads(path.read_text())["data"]
    paragraphs, questions = [], []
    for a, article in enumerate(data):
        for p, para in enumerate(article["paragraphs"]):
            pid = f"a{a:02d}p{p:03d}"
            paragraphs.append((pid, para["context"]))
            for qa in para["qas"]:
                questions.append({"id": qa["id"], "question": qa["question"], "paragraph": pid,
                                  "answers": [x["text"] for x in qa["answers"]]})
    return paragraphs, questions


# -- configurations -----------------------------------------------------------------------------------
@dataclass(frozen=True)
class Config:
    name: str
    mode: str
    sink: bool = False
    boundary: int = 0

    @classmethod
    def parse(cls, name: str) -> "Config":
        parts = name.split("+")
        mode, sink, boundary = parts[0], False, 0
        if mode not in MODES:
            raise LazyRagError(f"Unknown mode {mode!r} in {name!r}; modes: {', '.join(MODES)}.")
        for extra in parts[1:]:
            if extra == "sink":
                sink = True
            elif re.fullmatch(r"epic\d+", extra):
                boundary = int(extra[4:])
            else:
                raise LazyRagError(f"Unknown mitigation {extra!r} in {name!r}; use +sink and/or +epicN.")
        if (sink or boundary) and mode not in ("lazy", "block"):
            raise LazyRagError(f"{name!r}: mitigations apply to chunk reuse (lazy, block) only.")
        return cls(name, mode, sink, boundary)


class _MemoEmbedder:
    """Remembers vectors by text, so building a second index over the same texts embeds nothing."""

    def __init__(self, inner):
        self.inner, self.name, self.dim, self._memo = inner, inner.name, inner.dim, {}

    def encode(self, texts, **kwargs):
        import numpy as np

        missing = [t for t in dict.fromkeys(texts) if t not in self._memo]
        if missing:
            self._memo.update(zip(missing, self.inner.encode(missing, **kwargs)))
        return np.stack([self._memo[t] for t in texts]) if texts else np.zeros((0, self.dim), np.float32)


def clean_prediction(text: str) -> str:
    text = text.strip().split("\n")[0].strip()
    return text.rstrip(".").strip()


def kl_divergence(p_logits: torch.Tensor, q_logits: torch.Tensor) -> float:
    """KL(P || Q) of two next-token distributions given as logits."""
    logp = torch.log_softmax(p_logits.double(), -1)
    logq = torch.log_softmax(q_logits.double(), -1)
    return float((logp.exp() * (logp - logq)).sum())


def run_squad_eval(model: str = "qwen2.5-0.5b", configs=("full", "block", "lazy", "lazy+sink", "lazy+epic16"),
                   n: int = 200, k: int = 4, seed: int = 0, max_new_tokens: int = 24, squad: Path | None = None,
                   fetch: bool = False, device: str = "auto", dtype: str = "auto", work_dir: Path | None = None,
                   progress: bool = True, llm=None, embedder=None):
    """Returns (summary records, per-question records). ``full`` always runs (the reference)."""
    from .embedder import Embedder
    from .index import LazyIndex
    from .llm import LazyLLM

    parsed = [Config.parse(c) for c in configs]
    if "full" not in [c.name for c in parsed]:
        parsed.insert(0, Config.parse("full"))
    paragraphs, questions = load_squad(squad, fetch)
    sample = random.Random(seed).sample(questions, min(n, len(questions)))
    llm = llm or LazyLLM.from_pretrained(model, device=device, dtype=dtype)
    embedder = _MemoEmbedder(embedder or Embedder())  # the plain and sink indexes embed the same paragraphs
    work_dir = Path(work_dir or Path(os.environ.get("LAZY_RAG_CACHE", Path.home() / ".cache" / "lazy-rag")) / "eval")
    fp = llm.fingerprint["id"]
    indexes = {}
    for sink in sorted({c.sink for c in parsed if c.mode in ("lazy", "block")} | {False}):
        out = work_dir / f"squad-{fp}-{'sink' if sink else 'plain'}-{str(llm.dtype).removeprefix('torch.')}"
        if (out / "manifest.json").exists():
            indexes[sink] = LazyIndex.load(out, llm=llm, embedder=embedder)
        else:
            indexes[sink] = LazyIndex.from_texts(
                [t for _, t in paragraphs], out, llm=llm, embedder=embedder, ids=[p for p, _ in paragraphs],
                split=False, shared_prefix=sink, precompute_kv=False, progress=progress,
                instruction=EVAL_INSTRUCTION)
    base = indexes[False]
    per_question, agg = [], {c.name: collections.defaultdict(float) for c in parsed}
    from rich.progress import Progress

    with Progress(disable=not progress) as bar:
        task = bar.add_task("SQuAD questions", total=len(sample))
        for q in sample:
            sources = base.retrieve(q["question"], k)
            hit = any(s.chunk_id == q["paragraph"] for s in sources)
            for index in indexes.values():  # KV "already stored", as in deployment: encode outside the timing
                for src in sources:
                    index.chunk_kv(tuple(index.by_id[src.chunk_id].token_ids), src.chunk_id)
            ref_logits, ref_pred = None, None
            for c in parsed:
                index = indexes[c.sink] if c.mode in ("lazy", "block") else base
                segs = index.segments(q["question"], sources)
                t0 = time.perf_counter()
                res = llm.generate(segs, max_new_tokens=max_new_tokens, mode=c.mode, kv_source=index,
                                   boundary_recompute=c.boundary, output_first_logits=True, stop=["\n"])
                wall = time.perf_counter() - t0
                pred = clean_prediction(res.text)
                em, f1 = best_over(exact_match, pred, q["answers"]), best_over(f1_score, pred, q["answers"])
                if c.name == "full":
                    ref_logits, ref_pred = res.first_logits, pred
                kl = kl_divergence(ref_logits, res.first_logits)
                agree = float(normalize_answer(pred) == normalize_answer(ref_pred))
                a = agg[c.name]
                a["em"] += em
                a["f1"] += f1
                a["agree"] += agree
                a["kl"] += kl
                a["ttft_ms"] += res.stats.ttft_ms
                a["seconds"] += wall
                a["cached_tokens"] += res.stats.cached_tokens
                a["prompt_tokens"] += res.stats.prompt_tokens
                per_question.append({"question_id": q["id"], "config": c.name, "prediction": pred, "em": em, "f1": f1,
                                     "agree_with_full": agree, "kl_vs_full": kl, "retrieval_hit": hit,
                                     "ttft_ms": res.stats.ttft_ms})
            bar.advance(task)
    hits = sum(1 for r in per_question if r["config"] == "full" and r["retrieval_hit"])
    m = len(sample)
    model_name = model if llm.model_name is None else llm.model_name
    summary = []
    for c in parsed:
        a = agg[c.name]
        summary.append({
            "benchmark": "quality_squad", "mode": c.name, "device": str(llm.device), "model": model_name,
            "dtype": str(llm.dtype).removeprefix("torch."), "k": k, "n": m, "seed": seed,
            "base_mode": c.mode, "shared_prefix": c.sink, "boundary_recompute": c.boundary,
            "em": 100 * a["em"] / m, "f1": 100 * a["f1"] / m, "recall_at_k": 100 * hits / m,
            "agreement_with_full_pct": 100 * a["agree"] / m, "kl_vs_full_first_token": a["kl"] / m,
            "ttft_ms_mean": a["ttft_ms"] / m, "seconds_per_question": a["seconds"] / m,
            "cached_token_pct": 100 * a["cached_tokens"] / max(a["prompt_tokens"], 1),
        })
    return summary, per_question



QUALITY_MD_HEADER = """# Answer quality: KV reuse vs full re-encoding (SQuAD v1.1 dev, open retrieval)

Generated by `lazy-rag eval squad` (same code as `python benchmarks/quality_squad.py`). Each
section is one run: model, k retrieved paragraphs, n seeded questions; every configuration
answers the same questions over the same retrieved chunks (greedy, chat template). EM/F1 use
the official SQuAD normalisation (x100); `agree` = % of answers equal to `full`'s after
normalisation; `KL` = mean KL(full || config) of the first-token distributions; `TTFT` and
`s/q` (seconds per question, incl. decoding) on the device named. Configurations:
`lazy+sink` = chunks encoded after the prompt's fixed head (shared prefix); `lazy+epicN` = the
first N tokens of every chunk recomputed at query time. `block` computes the same function as
`lazy` (different cost), so its scores match `lazy`'s up to float rounding.
"""


def markdown_table(summary: list[dict]) -> str:
    s0 = summary[0]
    lines = [f"## {s0['model']} ({s0['dtype']}, {s0['device']}), k={s0['k']}, n={s0['n']}, seed={s0['seed']}, "
             f"recall@{s0['k']} = {s0['recall_at_k']:.1f}%  ({s0.get('date', '')})", "",
             "| config | EM | F1 | agree w/ full % | KL vs full | cached tokens % | TTFT ms | s/q |",
             "|---|---:|---:|---:|---:|---:|---:|---:|"]
    for r in summary:
        lines.append(f"| {r['mode']} | {r['em']:.1f} | {r['f1']:.1f} | {r['agreement_with_full_pct']:.1f} | "
                     f"{r['kl_vs_full_first_token']:.3f} | {r['cached_token_pct']:.0f} | {r['ttft_ms_mean']:.0f} | "
                     f"{r['seconds_per_question']:.2f} |")
    return "\n".join(lines) + "\n"


def write_report(summary: list[dict], per_question: list[dict], results_dir: Path, quality_md: Path | None) -> Path:
    """JSON records to ``results_dir`` and the table into QUALITY.md (one section per model/k/n)."""
    import datetime as _dt

    date = _dt.date.today().isoformat()
    for r in summary:
        r["date"] = date
        r["torch"] = torch.__version__
    results_dir.mkdir(parents=True, exist_ok=True)
    s0 = summary[0]
    stem = f"quality_squad_{s0['model'].replace('/', '_')}_k{s0['k']}_n{s0['n']}"
    path = results_dir / f"{stem}.json"
    path.write_text(json.dumps(summary, indent=1) + "\n")
    (results_dir / f"{stem}_answers.jsonl").write_text("".join(json.dumps(r) + "\n" for r in per_question))
    if quality_md is not None:
        table = markdown_table(summary)
        key = table.splitlines()[0].split("  (")[0]
        text = quality_md.read_text() if quality_md.exists() else QUALITY_MD_HEADER
        sections = re.split(r"(?m)^(?=## )", text)
        sections = [sec for sec in sections if not sec.startswith(key.split(" recall@")[0])]
        quality_md.write_text("".join(sections).rstrip() + "\n\n" + table)
    return path
