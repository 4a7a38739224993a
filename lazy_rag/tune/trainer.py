"""The training loop of a chunk wrapper: AdamW on the wrapper's vectors only, linear decay, the
model frozen; held-out KL (and sample answers) at intervals; atomic checkpoints, so an
interrupted run resumes where it stopped.

Defaults follow the measured 0.5B starting point (../shared/reference/lazyattention.md): 8 + 8
fp32 vectors initialised from token embeddings, batch 64, 240 steps, lr 2e-3 (it beat 5e-4).
``method="lora"`` trains a chunk adapter (chunk_adapter.py: LoRA deltas on while chunks are
encoded) with the vectors, in its own parameter group (``adapter_lr``).
"""
from __future__ import annotations

import hashlib
import json
import math
import random
import time
from collections import Counter
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import torch

from ..chunk_adapter import DEFAULT_TARGETS, ChunkAdapter, ChunkAdapters, new_adapter
from ..errors import LazyRagError
from ..progress import Progress
from ..segments import leading_bos
from ..wrapper import ChunkWrapper
from .student import distill_kl, student_input, student_logp
from .teacher import _save, teacher_outputs

MIN_TRAIN, MIN_HELD_OUT = 16, 4
INIT_TEXT = ("\n\nDocument:\n", "\n\n")  # header and trailer start as these tokens' embeddings
# names how a run without a starting wrapper begins (and what its student reads), so a work dir's
# checkpoint from another recipe is not resumed
INIT_RECIPE = "token-embeddings, BOS first, windowed student"


@dataclass
class TuneOptions:
    header: int = 8
    trailer: int = 8
    steps: int = 240
    lr: float = 2e-3
    batch: int = 64
    micro_batch: int = 8           # examples per forward (with a gold answer, still one sequence each)
    seed: int = 0
    held_out: int = 32
    top_k: int = 64                # teacher log-probs kept per row
    max_answer_tokens: int = 24
    eval_every: int = 20
    method: str = "auto"           # "wrapper": vectors only; "lora": vectors + a chunk adapter; "auto":
                                   # lora when the wrapper it starts from carries an adapter (``for_start``)
    rank: int = 8                  # the chunk adapter's LoRA rank (method lora)
    alpha: float = 16.0            # its scale is alpha / rank
    adapter_lr: float = 5e-4
    targets: tuple = DEFAULT_TARGETS
    gold_weight: float = 0.0       # cross-entropy on labelled answers, added to the KL with this weight

    def for_start(self, init: "ChunkWrapper | None") -> "TuneOptions":
        """The options a run from ``init`` trains with: "auto" becomes lora with ``init``'s adapter
        settings when it carries an adapter (its adapter is trained on, not dropped), else wrapper.
        An adapter cannot be continued as vectors alone, nor under other LoRA settings."""
        adapter = init.adapter if init is not None else None
        if adapter is None:
            return self if self.method != "auto" else replace(self, method="wrapper")
        mine = replace(self, method="lora", rank=adapter.rank, alpha=adapter.alpha, targets=tuple(adapter.targets))
        if self.method == "auto":
            return mine
        if replace(self, targets=tuple(self.targets)) != mine:   # lora with the adapter's own settings, or refused
            raise LazyRagError(f"Wrapper {init.name or init.digest} carries a chunk adapter (rank {adapter.rank}, "
                               f"alpha {adapter.alpha:g}, {len(adapter.targets)} target layers) that --method "
                               f"{self.method} --rank {self.rank} --alpha {self.alpha:g} would not continue. Use "
                               "--method auto (or lora with its settings), or start from token embeddings (--init none).")
        return self

    def check(self) -> None:
        if self.method not in ("wrapper", "lora", "auto"):
            raise LazyRagError(f"--method must be auto, wrapper or lora (got {self.method!r}).")
        if self.method == "lora" and (self.rank < 1 or self.adapter_lr <= 0 or not self.targets):
            raise LazyRagError(f"--method lora needs --rank >= 1, --adapter-lr > 0 and some --targets (got "
                               f"{self.rank}, {self.adapter_lr}, {self.targets}).")
        if not (self.gold_weight >= 0 and math.isfinite(self.gold_weight)):
            raise LazyRagError(f"--gold-weight must be a finite number >= 0 (got {self.gold_weight}).")
        if self.header < 0 or self.trailer < 0 or self.header + self.trailer == 0:
            raise LazyRagError(f"A wrapper needs --header + --trailer > 0 (got {self.header} + {self.trailer}).")
        if self.steps < 1 or self.batch < 1 or self.micro_batch < 1 or self.lr <= 0 or self.top_k < 1:
            raise LazyRagError("--steps, --batch, --micro-batch and --top-k must be >= 1 and --lr > 0 (got "
                               f"{self.steps}, {self.batch}, {self.micro_batch}, {self.top_k}, {self.lr}).")


def _init_vectors(llm, header: int, trailer: int) -> torch.Tensor:
    # the embedding module's output, not its weight rows: wrapper rows enter where it returns, and
    # Gemma's module scales token rows by sqrt(hidden) (raw rows would start 25-60x too small)
    embed, device = llm.host.parts.embed, llm.host.parts.device
    rows = []
    for text, n in zip(INIT_TEXT, (header, trailer)):
        ids = llm.tokenizer(text, add_special_tokens=False).input_ids or [0]
        rows += [ids[i % len(ids)] for i in range(n)]
    bos = leading_bos(llm.tokenizer)
    if bos is not None and header:
        # a model whose prompts start with BOS (Gemma) attends to it as to nothing else; a chunk
        # encoded alone has none, so the header's first vector starts as that token
        rows[0] = bos
    with torch.no_grad():
        return embed(torch.tensor(rows, device=device)).float().clone()


def _zero_losses(device) -> dict[str, torch.Tensor]:
    return {"kl": torch.zeros((), device=device), "gold": torch.zeros((), device=device)}


def _losses(llm, vectors, part, teacher, column) -> dict[str, torch.Tensor]:
    """Summed losses of one forward over ``part``'s examples, by kind (graph kept when grad is on)."""
    logp = student_logp(llm, vectors, [it["input"] for it in part], column)
    sums = _zero_losses(vectors.device)
    for lp, it in zip(logp, part):
        i, dev = it["i"], lp["kl"].device
        kl = distill_kl(lp["kl"], teacher.top_ids[i].to(dev), teacher.top_logp[i].to(dev))
        sums["kl"] = sums["kl"] + kl.sum()
        if "gold" in lp:
            sums["gold"] = sums["gold"] - lp["gold"].gather(-1, it["target"].to(dev)[:, None]).sum()
    return sums


def _finite_step(llm, vectors, part, teacher, column, scale, params) -> dict[str, torch.Tensor] | None:
    """``part``'s losses, their weighted gradient added to ``params``' (``scale`` given) - or
    None, the gradients left as they were, when a loss or the gradient is not finite."""
    before = [None if p.grad is None else p.grad.clone() for p in params] if scale is not None else []
    with torch.set_grad_enabled(scale is not None):
        sums = _losses(llm, vectors, part, teacher, column)
        if not all(bool(torch.isfinite(v)) for v in sums.values()):
            return None
        if scale is None:
            return sums
        sum(v * scale[k] for k, v in sums.items()).backward()
    if all(p.grad is None or bool(torch.isfinite(p.grad).all()) for p in params):
        return {k: v.detach() for k, v in sums.items()}
    for p, g in zip(params, before):
        p.grad = g
    return None


def math_attention():
    """A context in which ``scaled_dot_product_attention`` runs PyTorch's math kernel (softmax
    materialised, no log-sum-exp recomputation): the retry for an example whose loss or gradient
    is not finite with the fused kernels."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    return sdpa_kernel(SDPBackend.MATH)


def _loss_of(llm, vectors, items, teacher, micro_batch: int, scale: dict | None = None,
             column: int | None = None, params: list | None = None, dropped: list | None = None,
             rescued: list | None = None, slow: frozenset | set = frozenset()) -> dict[str, torch.Tensor]:
    """Summed losses over ``items`` (one per example), ``micro_batch`` examples per forward, by
    kind: "kl" (KL to the teacher over its answer rows) and "gold" (cross-entropy of a labelled
    answer, where the example has one). With ``scale`` (kind -> factor) the gradient of the
    factor-weighted sum is accumulated into ``params``.

    A forward whose loss or gradient is not finite is run again one example at a time. An example
    not finite alone is run once more with PyTorch's math attention kernel (``math_attention``;
    appended to ``rescued`` when that is finite; ``slow``: examples known to need it, run that way
    from the start), and one not finite there either is left out and appended to ``dropped``.
    Why: with Qwen2.5-1.5B in bf16 on the H100 about one batch in ten held such an example, and
    skipping whole batches threw away the other 63 examples' gradient (the run gave up at step
    122). The same examples are finite on the CPU. The likely cause is the fused CUDA attention
    backward, which recomputes the softmax from a saved log-sum-exp and is known to overflow on
    large scores (pytorch/pytorch#125674, #178251); Qwen's attention logits are large."""
    params = params if params is not None else [vectors]
    total = _zero_losses(vectors.device)

    def add(sums) -> None:
        for k, v in sums.items():
            total[k] += v.detach()

    def alone(it) -> dict[str, torch.Tensor] | None:
        one = None if it["i"] in slow else _finite_step(llm, vectors, [it], teacher, column, scale, params)
        if one is None:
            with math_attention():
                one = _finite_step(llm, vectors, [it], teacher, column, scale, params)
            if one is not None and rescued is not None and it["i"] not in slow:
                rescued.append(it["i"])
        if one is None and dropped is not None:
            dropped.append(it["i"])
        return one

    fast = [it for it in items if it["i"] not in slow]
    for s in range(0, len(fast), micro_batch):
        part = fast[s:s + micro_batch]
        sums = _finite_step(llm, vectors, part, teacher, column, scale, params)
        for one in [sums] if sums is not None else [alone(it) for it in part]:
            if one is not None:
                add(one)
    for it in items:
        if it["i"] in slow and (one := alone(it)) is not None:
            add(one)
    return total


def _rows(items) -> dict[str, int]:
    """Rows read per kind over ``items``: the denominators of the mean KL and cross-entropy."""
    return {k: sum(len(it["input"].reads.get(k, ())) for it in items) for k in ("kl", "gold")}


def _gold_targets(llm, examples, teacher, options) -> dict[int, list[int]]:
    """Example index -> the tokens to predict for each example with a labelled answer: its gold
    answer's tokens and then the token the teacher most often ends its answers with (EOS or a
    newline), so the student learns to stop where the model does."""
    ends = Counter(int(teacher.top_ids[i][-1, 0]) for i, a in enumerate(teacher.answers)
                   if len(a) < options.max_answer_tokens)
    end = [ends.most_common(1)[0][0]] if ends else []
    return {i: llm.tokenizer(e.gold, add_special_tokens=False).input_ids[:options.max_answer_tokens] + end
            for i, e in enumerate(examples) if e.gold}


def _items(llm, examples, teacher, gold: dict[int, list[int]], options) -> list[dict]:
    """One item per example: its student input (prompt, teacher answer and, where ``gold`` has
    the example, its gold branch) and the gold targets."""
    out = []
    for i, e in enumerate(examples):
        target = gold.get(i, [])
        out.append({"i": i, "target": torch.tensor(target, dtype=torch.long),
                    "input": student_input(llm, e, teacher.answers[i], target, options.header, options.trailer)})
    return out


def _greedy_agreement(llm, vectors, items, teacher, micro_batch: int, max_tokens: int,
                      column: int | None = None) -> float:
    """The share of ``items`` whose greedy answer under the wrapper is full's own, token for token.
    Teacher-forced, the student's argmax equals the teacher's at every answer row and at the row
    that ends the answer exactly when greedy decoding retraces the teacher's path, so one forward
    per example measures what `lazy-rag eval` calls agreement with full (an answer cut at
    ``max_tokens`` is compared over its tokens only)."""
    same = 0
    with torch.no_grad():
        for s in range(0, len(items), micro_batch):
            part = items[s:s + micro_batch]
            for lp, it in zip(student_logp(llm, vectors, [it["input"] for it in part], column), part):
                answer = teacher.answers[it["i"]]
                rows = len(answer) + (len(answer) < max_tokens)
                want = teacher.top_ids[it["i"]][:rows, 0].to(lp["kl"].device)
                same += bool(torch.equal(lp["kl"][:rows].argmax(-1), want))
    return same / max(len(items), 1)


def _sample_answers(llm, vectors, items, teacher, n: int = 2, column: int | None = None) -> list[str]:
    """The student's next-token choices along the teacher's answer, next to the teacher's own."""
    out = []
    with torch.no_grad():
        for item in items[:n]:
            ans = teacher.answers[item["i"]]
            (lp,) = student_logp(llm, vectors, [item["input"]], column)
            student = lp["kl"].argmax(-1).tolist()[:len(ans)]
            out.append(f"teacher {llm.tokenizer.decode(ans).strip()!r} / student {llm.tokenizer.decode(student).strip()!r}")
    return out


def train_wrapper(llm, examples, options: TuneOptions, out: Path, work_dir: Path | None = None,
                  progress: str = "auto", name: str = "", log=print,
                  init: ChunkWrapper | None = None, data: dict | None = None) -> tuple[ChunkWrapper, dict]:
    """Train a wrapper for ``llm`` on ``examples`` (``tune.examples``); write it to ``out``.
    ``work_dir`` holds the teacher cache and the checkpoint (a run with the same settings
    resumes from it). ``init``: a wrapper of the same shape to start from (its vectors; e.g. the
    one an index already has) instead of token embeddings. With ``options.gold_weight`` > 0 the
    examples' labelled answers (``Example.gold``) add a cross-entropy term. ``data``: how the
    examples were made (source, ranking file, gold placement), recorded in the wrapper's recipe.
    Returns the wrapper and a report (held-out KL curve, timings)."""
    options.check()
    options = options.for_start(init)
    if options.gold_weight > 0 and not any(e.gold for e in examples):
        raise LazyRagError("--gold-weight needs labelled answers, and none of these examples has one (an index's "
                           "own chunks have none: tune it with --gold-weight 0).")
    if init is not None and (init.header, init.trailer) != (options.header, options.trailer):
        raise LazyRagError(f"Cannot start from wrapper {init.name} ({init.header}+{init.trailer} vectors"
                           f"{', with a chunk adapter' if init.adapter else ''}): this run trains {options.header}+"
                           f"{options.trailer} vectors. Match --header/--trailer, or start from token embeddings.")
    n_hold = min(options.held_out, max(MIN_HELD_OUT, len(examples) // 10))
    if len(examples) - n_hold < MIN_TRAIN:
        raise LazyRagError(f"Too little data to tune a wrapper: {len(examples)} examples, need at least "
                           f"{MIN_TRAIN + MIN_HELD_OUT} ({MIN_TRAIN} to train on, {MIN_HELD_OUT} held out). Give more "
                           "examples (--examples) or index more text.")
    t0 = time.perf_counter()
    teacher = teacher_outputs(llm, examples, work_dir, options.top_k, options.max_answer_tokens, progress=progress)
    t_teacher = time.perf_counter() - t0
    gold = _gold_targets(llm, examples, teacher, options) if options.gold_weight > 0 else {}
    items = _items(llm, examples, teacher, gold, options)
    rng = random.Random(options.seed)
    rng.shuffle(items)
    held, train = items[:n_hold], items[n_hold:]
    held_rows = _rows(held)

    model = llm.model
    for p in model.parameters():
        p.requires_grad_(False)
    torch.manual_seed(options.seed)
    vectors = torch.nn.Parameter(init.vectors.to(llm.host.parts.device, torch.float32).clone() if init is not None
                                 else _init_vectors(llm, options.header, options.trailer))
    groups = [{"params": [vectors], "lr": options.lr}]
    adapter, column, adapters = None, None, ChunkAdapters.of(model)
    adapter_key = f"tune:{id(vectors)}"  # this run's adapter, removed when it ends
    if options.method == "lora":
        adapter = new_adapter(model, options.rank, options.alpha, options.targets, options.seed)
        if init is not None and init.adapter is not None:   # continue the wrapper's own adapter
            with torch.no_grad():
                for name, (a, b) in adapter.weights.items():
                    a0, b0 = init.adapter.weights[name]
                    a.copy_(a0.to(a.device, a.dtype))
                    b.copy_(b0.to(b.device, b.dtype))
        factors = [t for pair in adapter.weights.values() for t in pair]
        groups.append({"params": factors, "lr": options.adapter_lr})
        column = adapters.add(adapter, key=adapter_key, trainable=True)
    params = [p for g in groups for p in g["params"]]
    opt = torch.optim.AdamW(groups, weight_decay=0.0)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: max(0.0, 1.0 - s / options.steps))
    settings = json.loads(json.dumps({**asdict(options), "examples": len(examples), "fingerprint": llm.fingerprint["id"],
                                      "init": init.digest if init is not None else INIT_RECIPE}))
    # named by the settings: runs with other settings (another --gold-weight) can share a work dir and its teacher cache
    tag = hashlib.sha256(json.dumps(settings, sort_keys=True).encode()).hexdigest()[:8]
    ckpt = work_dir / f"checkpoint-{options.method}-{tag}.pt" if work_dir is not None else None
    step, history, skipped = 0, [], 0
    dropped: set[int] = set()  # examples whose loss or gradient is not finite alone (_loss_of)
    slow: set[int] = set()     # examples finite only with the math attention kernel (_loss_of)

    def state_of() -> dict:
        return {"vectors": vectors.detach().cpu(),
                **({k: t.detach().cpu() for k, t in adapter.tensors().items()} if adapter else {})}

    if ckpt is not None and ckpt.exists():
        state = torch.load(ckpt, weights_only=True)
        if json.loads(state["settings"]) == settings:
            vectors.data.copy_(state["vectors"].to(vectors.device))
            if adapter is not None:
                for k, t in adapter.tensors().items():
                    t.data.copy_(state[k].to(t.device))
            opt.load_state_dict(state["opt"])
            sched.load_state_dict(state["sched"])
            step, history = int(state["step"]), json.loads(state["history"])
            dropped = set(json.loads(state.get("dropped", "[]")))
            slow = set(json.loads(state.get("slow", "[]")))
            log(f"resuming from {ckpt} at step {step}")

    def note(dropped_ids: list[int], rescued_ids: list[int], where: str) -> None:
        for i in rescued_ids:
            log(f"example {i} ({where}): not finite with the fused attention kernel, finite with the math one; "
                "it runs with that from now on")
        slow.update(rescued_ids)
        if dropped_ids:
            drop(dropped_ids, where)

    def drop(ids: list[int], where: str) -> None:
        nonlocal held, held_rows
        for i in ids:
            log(f"example {i} left out ({where}): its loss or gradient is not finite in {str(llm.dtype).removeprefix('torch.')}")
        dropped.update(ids)
        held = [it for it in held if it["i"] not in dropped]
        held_rows = _rows(held)
        if len(dropped) > max(4, len(items) // 20) or not held:
            raise LazyRagError(f"The loss or its gradient was not finite for {len(dropped)} of {len(items)} examples; "
                               f"train in float32 (--dtype float32) or lower --lr (now {options.lr}).")

    def held_out(agreement: bool = False) -> dict:
        bad: list[int] = []
        saved: list[int] = []
        sums = _loss_of(llm, vectors, held, teacher, options.micro_batch, column=column, dropped=bad, rescued=saved,
                        slow=slow)
        note(bad, saved, "held out")
        out = {"held_out_kl": float(sums["kl"]) / held_rows["kl"]}
        if held_rows["gold"]:
            out["held_out_gold_ce"] = float(sums["gold"]) / held_rows["gold"]
        if agreement:   # before and after: a forward per micro-batch, not worth every eval
            out["held_out_agreement"] = _greedy_agreement(llm, vectors, held, teacher, options.micro_batch,
                                                          options.max_answer_tokens, column)
        return out

    try:
        if not history:
            history.append({"step": 0, **held_out(agreement=True)})
            log(f"step 0: held-out KL {history[-1]['held_out_kl']:.4f}, greedy answers equal to full's "
                f"{100 * history[-1]['held_out_agreement']:.0f}% ({n_hold} held-out examples, {len(train)} to train on)")
        t_train = time.perf_counter()
        what = "the wrapper and its chunk adapter" if adapter else "the wrapper"
        with Progress(options.steps, f"tuning {what}", progress) as bar:
            bar.advance(step, note=f"held-out KL {history[-1]['held_out_kl']:.4f}")
            while step < options.steps:
                pool = [it for it in train if it["i"] not in dropped]
                picks = random.Random(options.seed * 1_000_003 + step).sample(pool, min(options.batch, len(pool)))
                rows = _rows(picks)
                scale = {"kl": 1 / rows["kl"], "gold": options.gold_weight / max(rows["gold"], 1)}
                opt.zero_grad(set_to_none=True)
                bad, saved = [], []
                sums = _loss_of(llm, vectors, picks, teacher, options.micro_batch, scale, column, params, bad, saved,
                                slow)
                # an example left out keeps its rows in this batch's denominators: a hair low, once per example
                note(bad, saved, f"step {step}")
                loss = float(sums["kl"]) / rows["kl"]
                gold_ce = float(sums["gold"]) / rows["gold"] if rows["gold"] else None
                finite = all(p.grad is None or bool(torch.isfinite(p.grad).all()) for p in params)
                if not math.isfinite(loss) or (gold_ce is not None and not math.isfinite(gold_ce)) or not finite:
                    # _loss_of keeps only examples that are finite alone, so this is their sum overflowing:
                    # skip the batch (as AMP's scaler does); many such batches are divergence
                    skipped += 1
                    if skipped > max(3, options.steps // 20):
                        raise LazyRagError(f"The loss or its gradient was not finite in {skipped} batches (last at step "
                                           f"{step}); lower --lr (now {options.lr}) or train in float32 (--dtype float32).")
                    log(f"step {step}: non-finite loss or gradient, batch skipped")
                    step += 1
                    sched.step()
                    continue
                for g in groups:
                    torch.nn.utils.clip_grad_norm_(g["params"], 1.0)
                opt.step()
                sched.step()
                step += 1
                if step % options.eval_every == 0 or step == options.steps:
                    history.append({"step": step, "train_kl": loss,
                                    **({"train_gold_ce": gold_ce} if gold_ce is not None else {}),
                                    **held_out(agreement=step == options.steps)})
                    for line in _sample_answers(llm, vectors, held, teacher, column=column):
                        bar.say(f"  step {step}: {line}")
                    if ckpt is not None:
                        _save(ckpt, {"settings": json.dumps(settings), **state_of(),
                                     "opt": opt.state_dict(), "sched": sched.state_dict(), "step": step,
                                     "history": json.dumps(history), "dropped": json.dumps(sorted(dropped)),
                                     "slow": json.dumps(sorted(slow))})
                bar.advance(1, note=f"train KL {loss:.4f}, held-out KL {history[-1]['held_out_kl']:.4f}")
    finally:
        if adapter is not None:
            adapters.remove(adapter_key)
    seconds = time.perf_counter() - t_train
    recipe = {**settings, **({"data": data} if data else {}),
              "teacher_seconds": round(t_teacher, 1), "train_seconds": round(seconds, 1),
              "held_out_kl_start": history[0]["held_out_kl"], "held_out_kl_end": history[-1]["held_out_kl"],
              "held_out_agreement_start": history[0].get("held_out_agreement"),
              "held_out_agreement_end": history[-1].get("held_out_agreement"),
              "held_out_examples": len(held),
              "examples_left_out": len(dropped), "examples_math_attention": len(slow),
              "device": str(llm.device)}
    if adapter is not None:
        adapter = ChunkAdapter(adapter.rank, adapter.alpha, tuple(adapter.targets),
                               {n: (a.detach().cpu(), b.detach().cpu()) for n, (a, b) in adapter.weights.items()})
    wrapper = ChunkWrapper(vectors.detach().float().cpu(), options.header, options.trailer, llm.fingerprint["id"],
                           recipe, name or str(out), adapter)
    wrapper.save(out)
    return wrapper, {"history": history, "path": str(out), **recipe}

