"""One evaluation run: questions, their chunks, every configuration's answers, paired statistics.

Faithfulness to ``full`` is the measure: how often a configuration gives full's answer, how far
its distributions stray from full's over full's whole answer (teacher-forced KL), how much of
full's wording it keeps (ROUGE-L) and what it recomputed to get there; F1/EM against the gold
answers come after (and say little for a long-form prompt).

A run is a set of *settings* (prompt x k x gold position for open retrieval; prompt x subset for
the bridge task). Within a setting every configuration answers the same questions over the same
chunks, and ``full`` (re-encode everything) is the reference each one is paired with. The
quality pass goes block by block (one engine batch per block where the engine serves the
requests); the TTFT pass afterwards times the first ``ttft_n`` questions of each setting one
request at a time, with their chunks already stored, as in deployment.
"""
from __future__ import annotations

import random
import statistics as stats
import time
from collections import Counter
from dataclasses import dataclass, field
from itertools import product
from pathlib import Path

import torch
import transformers

from ..errors import LazyRagError
from .checkpoint import Checkpoint, code_digest, signature_digest
from .configs import Config, parse_configs
from .data import Dataset, cache_dir, load_dataset, passages_hash
from ..progress import Progress, check_style
from ..reuse_risk import first_token_entropy
from .prompts import EXAMPLE_QUESTION_IDS, FROZEN, Prompt, get_prompt
from .retrieval import load_retrieval, save_retrieval
from .runner import REUSE_MODES, Request, Runtime
from .scoring import clean_prediction, kl_divergence, rouge_l, same_answer, score_answer
from .statistics import PairedBootstrap
from .tasks import GOLD_POSITIONS, TASKS, TaskItem, build_bridge_task, open_items

BENCHMARK = "quality_squad"
# where a served chunk's KV came from (GenerationStats.chunk_sources): resident in the pool, the
# host tier, read from the disk, encoded (never stored), or encoded although stored (faster here)
TTFT_TIERS = ("pool", "host", "disk", "encoded", "recomputed")


@dataclass
class EvalOptions:
    model: str = "qwen2.5-0.5b"
    configs: tuple[str, ...] | str = ("full", "lazy", "lazy+sink", "lazy+epic16")  # or "full,lazy,..."
    task: str = "open"
    dataset: str = "squad"
    data: Path | None = None             # a SQuAD-format file instead of the named dataset's
    fetch: bool = False
    split: str = "test"
    n: int = 100
    seed: int = 0
    ks: tuple[int, ...] | None = None                # open task; default (4,)
    gold_positions: tuple[str, ...] | None = None    # open task; default ("retrieved",)
    prompts: tuple[str, ...] = (FROZEN,)
    max_new_tokens: int = 24             # a prompt's own (Prompt.max_new_tokens, long form) comes first
    kl_top_k: int = 256                  # full's tokens per position the teacher-forced KL keeps (0: all, exact)
    retrieval_file: Path | None = None   # ranked passages from `lazy-rag eval retrieve`
    ttft_n: int = 20
    batch_size: int = 32
    bootstrap: int = 5000
    device: str = "auto"
    dtype: str = "auto"
    work_dir: Path | None = None          # where the cached indexes live
    progress: str = "auto"
    checkpoint: Path | None = None        # answers so far (default: in work_dir, named by the run's signature)
    resume: bool = True                   # start from the checkpoint's answers (False: overwrite it)

    def check(self) -> None:
        try:
            check_style(self.progress)
        except ValueError as e:
            raise LazyRagError(str(e)) from None
        if self.task not in TASKS:
            raise LazyRagError(f"Unknown task {self.task!r}; choose one of {', '.join(TASKS)}.")
        if self.task == "bridge" and (self.retrieval_file or self.ks or self.gold_positions):
            raise LazyRagError("The bridge task gives each question its paragraph's sentences in order: --retrieval, "
                               "--top-k and --gold-position apply to --task open only.")
        self.ks = tuple(self.ks or (4,))
        self.gold_positions = tuple(self.gold_positions or ("retrieved",))
        for p in self.gold_positions:
            if p not in GOLD_POSITIONS:
                raise LazyRagError(f"Unknown gold position {p!r}; choose from {', '.join(GOLD_POSITIONS)}.")
        if (self.n < 1 or min(self.ks) < 1 or self.ttft_n < 0 or self.batch_size < 1 or self.bootstrap < 100
                or self.kl_top_k < 0):
            raise LazyRagError(f"Need n >= 1, every k >= 1, ttft_n >= 0, batch_size >= 1, bootstrap >= 100 and "
                               f"kl_top_k >= 0 (got n={self.n}, k={self.ks}, ttft_n={self.ttft_n}, "
                               f"batch_size={self.batch_size}, bootstrap={self.bootstrap}, kl_top_k={self.kl_top_k}).")


@dataclass(frozen=True)
class Setting:
    prompt: Prompt
    k: int | None                # open retrieval: chunks per question
    gold_position: str | None    # open retrieval: retrieved / first / middle / last
    subset: str | None           # bridge task: bridge / control

    def label(self) -> str:
        parts = [f"prompt {self.prompt.name}"]
        if self.k is not None:
            parts += [f"k={self.k}", f"gold {self.gold_position}"]
        if self.subset:
            parts.append(f"{self.subset} questions")
        return ", ".join(parts)


@dataclass
class EvalRun:
    options: EvalOptions
    meta: dict                              # what every record of the run shares
    records: list[dict]                     # one per setting and configuration
    answers: list[dict]                     # one per setting, configuration and question
    settings: list[Setting] = field(default_factory=list)
    checkpoint: Checkpoint | None = None    # the answers on disk until the results are written

    def discard_checkpoint(self) -> None:
        if self.checkpoint is not None:
            self.checkpoint.remove()


def index_folder(work_dir: Path, task: str, dataset_tag: str, runtime: Runtime, prompt: Prompt, options: dict,
                 data_hash: str) -> Path:
    """A cached index's folder, named by everything its contents depend on: the model (fingerprint,
    dtype), the passages (content hash), the prompt's head (system prompt, instruction) and the index options."""
    opts = "-".join(f"{k}={v}" for k, v in sorted(options.items())) or "plain"
    return work_dir / (f"{task}-{dataset_tag}-{runtime.fingerprint_id}-{runtime.dtype}-{opts}-"
                       f"p{prompt.index_key()}-d{data_hash[:12]}")


def _sample(items: list, n: int, seed: int) -> list:
    return random.Random(seed).sample(items, min(n, len(items)))


class _Evaluation:
    """The state of one run while it executes (see ``run_eval``)."""

    def __init__(self, options: EvalOptions, runtime: Runtime | None):
        options.check()
        self.o = options
        self.configs = parse_configs(options.configs)
        self.prompts = [get_prompt(p) for p in dict.fromkeys(options.prompts)]
        self.dataset: Dataset = load_dataset(options.dataset, options.data, options.fetch)
        self.dataset_tag = options.dataset if options.data is None else Path(options.data).stem
        pool = [q for q in self.dataset.split(options.split) if q.id not in EXAMPLE_QUESTION_IDS]
        if options.task == "open":
            self.passages = self.dataset.passages
            self.questions = _sample(pool, options.n, options.seed)
            self.bridge = None
        else:
            self.bridge = build_bridge_task(self.dataset, pool)
            self.passages = self.bridge.passages
        self.data_hash = passages_hash(self.passages)
        self.runtime = runtime or Runtime.load(options.model, options.device, options.dtype,
                                               retrieval=options.task == "open" and options.retrieval_file is None)
        self.work_dir = Path(options.work_dir or cache_dir() / "eval")
        self.indexes: dict[Path, object] = {}
        # until the run's total is known: messages only (which index, which retrieval file)
        self.progress = Progress(0, "eval", style="none" if options.progress == "none" else "lines")

    # -- indexes and chunks ---------------------------------------------------------------------------
    def index_for(self, prompt: Prompt, config: Config):
        """The index a configuration reads its chunks from; prompts with the same instruction share it."""
        options = dict(config.index_options) if config.mode in REUSE_MODES else {}
        # A chunk wrapper only where named (+wrapper), by its digest in the folder. Every index is
        # built with its wrapper given explicitly, "none" included: `full` and plain `lazy` share
        # the unwrapped folder, and an index built with the build's default ("auto", the model's
        # bundled wrapper) by whichever opened it first had silently wrapped plain `lazy`'s chunks.
        options["wrapper"] = self.runtime.wrapper(options.get("wrapper", "none"))
        named = {k: v for k, v in options.items() if k != "wrapper"}
        if options["wrapper"] is not None:
            named["wrapper"] = options["wrapper"].digest
        folder = self.runtime.index_folder(index_folder(self.work_dir, self.o.task, self.dataset_tag, self.runtime,
                                                        prompt, named, self.data_hash))
        if folder not in self.indexes:
            existed = (folder / "manifest.json").exists()
            index = self.runtime.open_index(self.passages, folder, prompt.system_prompt, prompt.instruction, options,
                                            progress=self.progress.style == "bar")
            have, want = (w.digest if w is not None else None for w in (index.wrapper, options["wrapper"]))
            if have != want:  # a folder cached before every index named its wrapper
                raise LazyRagError(f"The cached evaluation index {folder} holds chunks encoded inside wrapper "
                                   f"{have or 'none'}, but {config.name!r} needs {want or 'none'}: it was built by an "
                                   "older lazy-rag. Delete that folder (it is rebuilt on the next run).")
            self.indexes[folder] = index
            self.progress.say(f"index ({'loaded' if existed else 'built'}): {folder}")
        return self.indexes[folder]

    def wrapper_digest(self, prompt: Prompt, config: Config) -> str | None:
        """The digest of the wrapper ``config``'s chunks were encoded inside (None: plain chunks;
        modes that read no cached chunk share the plain index), for the records: what was served,
        not what was asked."""
        wrapper = self.index_for(prompt, config).wrapper
        return wrapper.digest if wrapper is not None else None

    def ranked(self) -> dict[str, list[str]]:
        depth = max(self.o.ks)
        ids = [q.id for q in self.questions]
        if self.o.retrieval_file:
            ranked = load_retrieval(self.o.retrieval_file, data_hash=self.data_hash, question_ids=ids, depth=depth)
            self.progress.say(f"retrieval: {self.o.retrieval_file} ({len(ids)} questions, top {depth})")
        else:
            index = self.index_for(self.prompts[0], self.configs[0])
            ranked = {q.id: self.runtime.retrieve(index, q.question, depth) for q in self.questions}
        return {q: [pid for pid, _ in r] for q, r in ranked.items()}

    def settings(self) -> list[tuple[Setting, list[TaskItem]]]:
        out = []
        if self.bridge is None:
            ranked = self.ranked()
            for prompt, k, pos in product(self.prompts, self.o.ks, self.o.gold_positions):
                out.append((Setting(prompt, k, pos, None), open_items(self.questions, ranked, k, pos)))
        else:
            for prompt, subset in product(self.prompts, ("bridge", "control")):
                out.append((Setting(prompt, None, None, subset),
                            _sample(self.bridge.items[subset], self.o.n, self.o.seed)))
        return out

    def request(self, setting: Setting, config: Config, item: TaskItem, max_new_tokens: int) -> Request:
        return Request(self.index_for(setting.prompt, config), setting.prompt.question_text(item.question.question),
                       item.chunk_ids, config.mode, max_new_tokens, config.generate_options)

    def max_new_tokens(self, setting: Setting) -> int:
        return setting.prompt.max_new_tokens or self.o.max_new_tokens

    # -- the two passes -------------------------------------------------------------------------------
    def teacher_forced(self, requests: dict[str, list[Request]], answers: dict[str, list]) -> dict[str, list]:
        """Per configuration and question: the KL(full || config) at every decision of full's
        answer, and full's probability outside the tokens that KL kept (``kl_top_k``). Two engine
        batches: full's own pass gives the reference rows, which the others' pass reads."""
        reference = self.runtime.reference_rows(requests["full"], answers["full"], self.o.kl_top_k or None)
        tail = [ref.tail_mass() for ref, _ in reference]
        out = {"full": [(kl, t) for (_, kl), t in zip(reference, tail)]}
        others = [c.name for c in self.configs if c.name != "full"]
        n = len(answers["full"])
        kls = self.runtime.teacher_forced_kl([r for c in others for r in requests[c]], answers["full"] * len(others),
                                             [ref for ref, _ in reference] * len(others))
        for i, c in enumerate(others):
            out[c] = list(zip(kls[i * n:(i + 1) * n], tail))
        return out

    def quality_pass(self, setting: Setting, items: list[TaskItem], rows: dict[str, list[dict]],
                     after_block=lambda: None) -> dict[str, list[dict]]:
        """Per configuration, one row per item (same order): prediction, its faithfulness to
        full's (agreement, first-token and teacher-forced KL, ROUGE-L, length), what was
        recomputed, and the scores vs gold. ``rows`` holds the answers of a checkpoint (the first
        items); the pass goes on from there and calls ``after_block`` after every engine batch."""
        block = self.o.batch_size
        max_new_tokens = self.max_new_tokens(setting)
        for start in range(len(rows["full"]), len(items), block):
            chunk = items[start:start + block]
            requests = {c.name: [self.request(setting, c, it, max_new_tokens) for it in chunk] for c in self.configs}
            answers = self.runtime.answer([r for c in self.configs for r in requests[c.name]])
            by_config = {c.name: answers[i * len(chunk):(i + 1) * len(chunk)] for i, c in enumerate(self.configs)}
            forced = self.teacher_forced(requests, by_config)
            full = by_config["full"]
            for c in self.configs:
                for it, a, ref, (kl, tail) in zip(chunk, by_config[c.name], full, forced[c.name]):
                    pred, ref_pred = clean_prediction(a.text), clean_prediction(ref.text)
                    words, ref_words = len(pred.split()), len(ref_pred.split())
                    # full and the modes that read no cached chunk compute every chunk token at query time
                    computed = a.recomputed_tokens if c.mode in REUSE_MODES else a.chunk_tokens
                    rows[c.name].append({
                        **score_answer(pred, list(it.question.answers)), "question_id": it.question.id,
                        "config": c.name, "prediction": pred, "raw": a.text,
                        "agree_with_full": float(same_answer(pred, ref_pred)),
                        "kl_vs_full": kl_divergence(ref.first_logits, a.first_logits),
                        "tf_kl_mean": stats.fmean(kl), "tf_kl_first": kl[0], "tf_positions": len(kl),
                        "tf_full_tail_mass": max(tail),  # the largest over the answer's positions
                        "rouge_l_vs_full": rouge_l(pred, ref_pred),
                        "answer_words": words, "answer_words_vs_full": words / ref_words if ref_words else None,
                        "first_token_entropy": first_token_entropy(a.first_logits),
                        "chunk_ids": list(it.chunk_ids),
                        "gold_index": it.gold_index, "cached_tokens": a.cached_tokens,
                        "prompt_tokens": a.prompt_tokens, "cached_fraction": a.cached_tokens / max(a.prompt_tokens, 1),
                        "chunk_tokens": a.chunk_tokens, "recomputed_chunk_tokens": computed,
                        "recomputed_fraction": computed / a.chunk_tokens if a.chunk_tokens else None,
                        "seconds": a.seconds})
            done_full = rows["full"]
            f1 = 100 * sum(r["f1"] for r in done_full) / len(done_full)
            self.progress.advance(len(chunk) * len(self.configs), note=f"{setting.label()}: full F1 {f1:.1f} over {len(done_full)}")
            after_block()
        return rows

    def ttft_pass(self, setting: Setting, items: list[TaskItem]) -> dict[str, dict]:
        """TTFT of each configuration on the first ``ttft_n`` items, one request at a time,
        interleaved across configurations (load changes hit them alike), after the same requests
        once untimed: one-time costs (the shared prefix's KV, kernel compiles, a CUDA graph
        captured for each new step shape, ~0.1 s each) are paid there, so the times are a warm
        server's. Per configuration: ``ms`` (one per item) and ``sources`` (tier -> chunks, summed)."""
        subset = items[:self.o.ttft_n]
        out: dict[str, dict] = {c.name: {"ms": [], "sources": Counter()} for c in self.configs}
        if not subset:
            return out
        for it in subset:
            for c in self.configs:
                self.runtime.first_token(self.request(setting, c, it, 1))
        for it in subset:
            for c in self.configs:
                ms, sources = self.runtime.first_token(self.request(setting, c, it, 1))
                out[c.name]["ms"].append(ms)
                out[c.name]["sources"].update(sources)
            self.progress.advance(len(self.configs))
        return out

    # -- records --------------------------------------------------------------------------------------
    def summarise(self, setting: Setting, rows: dict[str, list[dict]], ttft: dict[str, dict],
                  seconds: float) -> list[dict]:
        n = len(rows["full"])
        boot = PairedBootstrap(n, self.o.bootstrap, self.o.seed)
        full = rows["full"]
        lazy = rows.get("lazy")
        out = []
        for c in self.configs:
            r = rows[c.name]
            col = lambda key, rs=r: [x[key] for x in rs]  # noqa: E731
            rec = {
                "benchmark": BENCHMARK, "mode": c.name, "task": self.o.task, "dataset": self.dataset_tag,
                "split": self.o.split, "prompt": setting.prompt.name, "k": setting.k,
                "gold_position": setting.gold_position, "subset": setting.subset, "n": n, "seed": self.o.seed,
                "base_mode": c.mode, "index_options": c.index_options, "generate_options": c.generate_options,
                "wrapper_digest": self.wrapper_digest(setting.prompt, c),
                "max_new_tokens": self.max_new_tokens(setting), "long_form": setting.prompt.long_form,
            }
            # faithfulness to full first: the measure of a reuse configuration
            agree = boot.mean(col("agree_with_full")).scaled(100)
            contains = boot.mean_difference(col("contains"), [x["contains"] for x in full]).scaled(100)
            rouge = boot.mean(col("rouge_l_vs_full")).scaled(100)
            words, full_words = sum(col("answer_words")), sum(x["answer_words"] for x in full)
            rec.update({
                "agreement_with_full_pct": agree.estimate, "agreement_ci_low": agree.low,
                "agreement_ci_high": agree.high,
                "contains_delta_vs_full": contains.estimate, "contains_delta_ci_low": contains.low,
                "contains_delta_ci_high": contains.high,
                # per question the mean over full's answer, then the mean over questions (each weighs the same)
                "tf_kl_per_token_mean": stats.fmean(col("tf_kl_mean")),
                "tf_kl_first_token_mean": stats.fmean(col("tf_kl_first")),
                "tf_positions_mean": stats.fmean(col("tf_positions")),
                "kl_top_k": self.o.kl_top_k or None,  # None: every token kept, the KL exact
                # the most probability full put outside the kept tokens at any position (0 when exact)
                "tf_full_tail_mass_max": max(col("tf_full_tail_mass")),
                "rouge_l_vs_full": rouge.estimate, "rouge_l_ci_low": rouge.low, "rouge_l_ci_high": rouge.high,
                "answer_words_vs_full": words / full_words if full_words else None,
                "recomputed_chunk_pct": 100 * sum(col("recomputed_chunk_tokens")) / max(sum(col("chunk_tokens")), 1),
                "cached_token_pct": 100 * sum(col("cached_tokens")) / max(sum(col("prompt_tokens")), 1),
                "first_token_entropy_mean": stats.fmean(col("first_token_entropy")),
            })
            if lazy is not None and c.name not in ("full", "lazy"):
                d = boot.mean_difference(col("tf_kl_mean"), [x["tf_kl_mean"] for x in lazy])
                q = boot.ratio_of_means(col("tf_kl_mean"), [x["tf_kl_mean"] for x in lazy])
                rec.update({"tf_kl_delta_vs_lazy": d.estimate, "tf_kl_delta_ci_low": d.low,
                            "tf_kl_delta_ci_high": d.high, "tf_kl_ratio_to_lazy": q.estimate,
                            "tf_kl_ratio_ci_low": q.low, "tf_kl_ratio_ci_high": q.high})
            else:
                rec.update({k: None for k in ("tf_kl_delta_vs_lazy", "tf_kl_delta_ci_low", "tf_kl_delta_ci_high",
                                              "tf_kl_ratio_to_lazy", "tf_kl_ratio_ci_low", "tf_kl_ratio_ci_high")})
            rec.update({"f1": 100 * stats.fmean(col("f1")), "em": 100 * stats.fmean(col("em")),
                        "contains": 100 * stats.fmean(col("contains"))})
            for metric in ("f1", "em"):
                d = boot.mean_difference(col(metric), [x[metric] for x in full]).scaled(100)
                rec.update({f"{metric}_delta_vs_full": d.estimate, f"{metric}_delta_ci_low": d.low,
                            f"{metric}_delta_ci_high": d.high})
            if lazy is not None and c.name not in ("full", "lazy"):
                g = boot.gap_closed(col("f1"), [x["f1"] for x in lazy], [x["f1"] for x in full]).scaled(100)
                rec.update({"gap_closed_pct": g.estimate, "gap_closed_ci_low": g.low, "gap_closed_ci_high": g.high})
            else:
                rec.update({"gap_closed_pct": None, "gap_closed_ci_low": None, "gap_closed_ci_high": None})
            hits = [x["gold_index"] is not None for x in r]
            timed = ttft.get(c.name) or {}
            ttft_ms, sources = timed.get("ms", []), timed.get("sources", {})
            rec.update({
                "kl_vs_full_first_token": stats.fmean(col("kl_vs_full")),
                "answer_words_mean": stats.fmean(col("answer_words")),
                "recall_at_k_pct": 100 * stats.fmean(hits) if setting.k is not None else None,
                "chunks_per_question_mean": stats.fmean(len(x["chunk_ids"]) for x in r),
                "ttft_ms_mean": stats.fmean(ttft_ms) if ttft_ms else None,
                "ttft_ms_p50": stats.median(ttft_ms) if ttft_ms else None, "ttft_n": len(ttft_ms),
                # where the timed requests' chunks came from (a cold chunk encoded costs a forward)
                **{f"ttft_chunks_{tier}": sources.get(tier, 0) for tier in TTFT_TIERS},
                "seconds_per_question": stats.fmean(col("seconds")),
                "quality_pass_s": seconds,
                "bootstrap_resamples": self.o.bootstrap,
            })
            out.append(rec)
        return out

    def signature(self, settings: list[tuple[Setting, list[TaskItem]]]) -> dict:
        """Everything a run's answers depend on: resumed answers must be the ones this run would give."""
        return {"code": code_digest(), "model": self.runtime.fingerprint_id, "dtype": self.runtime.dtype,
                "data": self.data_hash,
                "configs": [c.name for c in self.configs], "max_new_tokens": self.o.max_new_tokens,
                "kl_top_k": self.o.kl_top_k,
                "settings": [[s.label(), [[it.question.id, list(it.chunk_ids)] for it in items]]
                             for s, items in settings]}

    def checkpoint(self, settings) -> Checkpoint:
        signature = self.signature(settings)
        path = self.o.checkpoint or self.work_dir / "checkpoints" / f"{signature_digest(signature)}.json"
        ckpt = Checkpoint(path, signature)
        if not self.o.resume:
            return ckpt
        done = ckpt.load()
        if done:
            self.progress.say(f"resuming from {path}: {done} answers done")
        return ckpt

    def result(self, settings, state: dict) -> EvalRun:
        """The run's records from ``state`` (label -> rows, seconds, ttft): every setting done so far,
        and the one under way with the questions it has answered (a partial run has smaller n)."""
        records, answers, done = [], [], []
        for setting, _ in settings:
            s = state.get(setting.label())
            if not s or not s["rows"]["full"]:
                continue
            rows = s["rows"]
            records += self.summarise(setting, rows, s.get("ttft") or {}, s["seconds"])
            keys = {"task": self.o.task, "dataset": self.dataset_tag, "split": self.o.split,
                    "prompt": setting.prompt.name, "k": setting.k, "gold_position": setting.gold_position,
                    "subset": setting.subset}
            answers += [{**keys, **row} for c in self.configs for row in rows[c.name]]
            done.append(setting)
        meta = {"model": self.runtime.model_name, "device": self.runtime.device,
                "device_name": self.runtime.device_name(), "dtype": self.runtime.dtype,
                "data_file": str(self.dataset.path), "data_hash": self.data_hash,
                "retrieval_file": str(self.o.retrieval_file) if self.o.retrieval_file else None,
                "max_new_tokens": self.o.max_new_tokens, "configs": [c.name for c in self.configs],
                "torch": torch.__version__, "transformers": transformers.__version__}
        for r in records:  # the versions of the machine that ran it (a report may be written elsewhere)
            r.update({k: meta[k] for k in ("model", "device", "device_name", "dtype", "data_hash", "retrieval_file",
                                            "torch", "transformers")})
        return EvalRun(self.o, meta, records, answers, done)

    def run(self, on_partial=None, partial_every_s: float = 60.0) -> EvalRun:
        """``on_partial(EvalRun)``, if given, receives the run so far every ``partial_every_s``
        seconds (at the end of an engine batch), so a run stopped from outside leaves its numbers."""
        try:
            settings = self.settings()
            ckpt = self.checkpoint(settings)
            total = sum(len(items) * len(self.configs) + min(self.o.ttft_n, len(items)) * len(self.configs)
                        for _, items in settings)
            self.progress.close()
            self.progress = Progress(total, "eval", style=self.o.progress)
            self.progress.advance(ckpt.answers() + sum(len(t["ms"]) for s in ckpt.state.values()
                                                       for t in (s.get("ttft") or {}).values()))
            for setting, _ in settings:  # open every index first: its messages come before the progress lines
                for c in self.configs:
                    self.index_for(setting.prompt, c)
            last_partial = time.monotonic()

            def saved():
                nonlocal last_partial
                ckpt.save()
                if on_partial is not None and time.monotonic() - last_partial >= partial_every_s:
                    on_partial(self.result(settings, ckpt.state))
                    last_partial = time.monotonic()

            for setting, items in settings:
                s = ckpt.state.setdefault(setting.label(), {"rows": {c.name: [] for c in self.configs},
                                                            "seconds": 0.0, "ttft": None})
                if len(s["rows"]["full"]) < len(items):
                    t0 = time.perf_counter() - s["seconds"]

                    def after_block(s=s, t0=t0):
                        s["seconds"] = time.perf_counter() - t0
                        saved()

                    self.quality_pass(setting, items, s["rows"], after_block)
                if s["ttft"] is None:
                    s["ttft"] = self.ttft_pass(setting, items)
                    saved()
        finally:
            self.progress.close()
        run = self.result(settings, ckpt.state)
        run.checkpoint = ckpt  # removed by the caller once the results are written
        return run


def run_eval(options: EvalOptions, runtime: Runtime | None = None, on_partial=None,
             partial_every_s: float = 60.0) -> EvalRun:
    """Run every setting and configuration of ``options``; see the module docstring. Answers are
    checkpointed after every engine batch and a run of the same signature resumes from them
    (``options.checkpoint``, ``options.resume``); ``on_partial`` receives the run so far every
    ``partial_every_s`` seconds."""
    return _Evaluation(options, runtime).run(on_partial, partial_every_s)


def precompute_retrieval(out: Path, *, dataset: str = "squad", data: Path | None = None, fetch: bool = False,
                         split: str = "test", depth: int = 20, configs="full", prompts=(FROZEN,),
                         model: str = "qwen2.5-0.5b", device: str = "cpu", dtype: str = "auto",
                         work_dir: Path | None = None, progress: str = "auto", runtime: Runtime | None = None) -> Path:
    """Rank the passages of every question of ``split`` once and save them (see retrieval.py).

    Also builds (without chunk KV) every index that ``configs`` x ``prompts`` read from, in
    ``work_dir``: a machine without llama-index cannot build one, but can load one carried there.
    The model is loaded because an index tokenizes its passages with it."""
    options = EvalOptions(model=model, configs=configs, prompts=tuple(prompts), dataset=dataset, data=data,
                          fetch=fetch, split=split, n=1, ks=(depth,), device=device, dtype=dtype,
                          work_dir=work_dir, progress=progress)
    ev = _Evaluation(options, runtime)
    for prompt, config in product(ev.prompts, ev.configs):
        ev.index_for(prompt, config)
    index = ev.index_for(ev.prompts[0], ev.configs[0])
    ranked = {}
    questions = ev.dataset.split(split)  # all of them (few-shot questions are dropped at eval time)
    with Progress(len(questions), "retrieve", style=progress) as bar:
        for q in questions:
            ranked[q.id] = ev.runtime.retrieve(index, q.question, depth)
            bar.advance()
    return save_retrieval(out, ranked, data_hash=ev.data_hash, dataset=ev.dataset_tag, split=split,
                          embedder=ev.runtime.embedder.name, depth=depth)
