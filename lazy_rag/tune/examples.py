"""Training prompts for a chunk wrapper: a question over k chunks, as lazy-rag assembles it.

- ``squad_examples``: SQuAD v1.1 dev questions of the *train* articles (the first half; the eval
  scores the other half), each over its gold paragraph and k - 1 distractors. With a ranking file
  (``lazy-rag eval retrieve --split train``) the prompt is what serving hands the model: the
  retriever's top k in its order (``gold_position="retrieved"``), the gold paragraph where the
  retriever ranked it, or at a random place instead of the k-th when it ranked it lower. This
  matters: on SQuAD the retriever puts the gold paragraph first for ~64% of questions, and that is
  where a wrapper trained with the gold at a uniformly random place lost its points (Qwen2.5-1.5B,
  QUALITY.md). ``gold_position="random"`` (and any run without a ranking file) places the gold at a
  random place; distractors then come from the ranking, or else half from the same article and
  half from others. ``prompts``: "mixed" rotates through the runtime's default instruction, the
  eval's frozen short-answer prompt and its long-form prompt (a wrapper must keep every answer
  style the user's prompts ask for, not only short spans); "frozen", "default" or "longform" uses one.
- ``index_examples``: a user's own index, no labels. For a random chunk the model writes a
  question that the chunk answers (full attention, the chunk alone in the prompt); the training
  prompt is that question over the chunks the index retrieves for it (random chunks without
  vectors), the source chunk forced in at a random place. The wrapper then learns to read the
  user's chunks as retrieval will hand them over, with questions of the user's domain.
"""
from __future__ import annotations

import random
from dataclasses import dataclass

from ..chat import DEFAULT_INSTRUCTION, build_rag_segments
from ..errors import LazyRagError
from ..requests import ChunkSource
from ..segments import Chunk

MAX_CHUNK_TOKENS = 512


@dataclass(frozen=True)
class Example:
    question: str
    chunks: tuple[tuple[int, ...], ...]   # token ids, in prompt order
    instruction: str = DEFAULT_INSTRUCTION
    system_prompt: str | None = None
    origin: str = ""                      # where it came from (a question id, a chunk id)
    gold: str | None = None               # a labelled answer (SQuAD's first), for --gold-weight

    def segments(self, tokenizer) -> list:
        return build_rag_segments(tokenizer, self.question, [Chunk(list(c)) for c in self.chunks],
                                  self.system_prompt, self.instruction)


PROMPT_CHOICES = ("mixed", "frozen", "default", "longform")
GOLD_POSITIONS = ("retrieved", "random")


def _prompts(choice: str) -> tuple[tuple[str, str | None], ...]:
    """(instruction, system prompt) pairs the SQuAD prompts alternate between."""
    from ..quality.prompts import FROZEN, get_prompt

    if choice not in PROMPT_CHOICES:
        raise LazyRagError(f"Unknown prompt choice {choice!r}; choose one of {', '.join(PROMPT_CHOICES)}.")
    frozen, longform = get_prompt(FROZEN), get_prompt("longform")
    styles = {"default": (DEFAULT_INSTRUCTION, None), "frozen": (frozen.instruction, frozen.system_prompt),
              "longform": (longform.instruction, longform.system_prompt)}
    return tuple(styles.values()) if choice == "mixed" else (styles[choice],)


def gold_placement(retrieval, gold_position: str) -> str:
    """How ``squad_examples`` places the gold paragraph: "retrieved" (the ranking's order) only
    with a ranking file, else "random"."""
    if gold_position not in GOLD_POSITIONS:
        raise LazyRagError(f"Unknown gold position {gold_position!r}; choose one of {', '.join(GOLD_POSITIONS)}.")
    return gold_position if retrieval is not None else "random"


def squad_examples(tokenizer, n: int, k: int = 4, seed: int = 0, data=None, retrieval=None,
                   prompts: str = "mixed", gold_position: str = "retrieved") -> list[Example]:
    """``n`` prompts from the train articles of SQuAD v1.1 dev (``data``: its file, default the
    packaged copy); never a question of the evaluated half. ``retrieval``: a ranking file of the
    train split (distractors as retrieved); ``gold_position``: "retrieved" keeps the ranking's
    order (needs ``retrieval``), "random" puts the gold paragraph at a random place."""
    from ..quality.data import load_dataset, passages_hash
    from ..quality.prompts import EXAMPLE_QUESTION_IDS
    from ..quality.retrieval import load_retrieval

    keep_order = gold_placement(retrieval, gold_position) == "retrieved"
    ds = load_dataset("squad", data)
    questions = [q for q in ds.split("train") if q.id not in EXAMPLE_QUESTION_IDS]
    ranked = None
    if retrieval is not None:
        ranked = load_retrieval(retrieval, data_hash=passages_hash(ds.passages), question_ids=[q.id for q in questions],
                                depth=k)
    article_of = {q.passage: q.article for q in ds.questions}
    train_passages = sorted({q.passage for q in questions})
    by_article: dict[int, list[str]] = {}
    for p in train_passages:
        by_article.setdefault(article_of[p], []).append(p)
    if len(train_passages) < k:
        raise LazyRagError(f"{ds.path} has {len(train_passages)} train paragraphs; k={k} needs at least {k}.")
    rng = random.Random(seed)
    ids_of: dict[str, tuple[int, ...]] = {}

    def ids(pid):
        if pid not in ids_of:
            ids_of[pid] = tuple(tokenizer(ds.text_of[pid], add_special_tokens=False).input_ids[:MAX_CHUNK_TOKENS])
        return ids_of[pid]

    choices = _prompts(prompts)
    out = []
    for i, q in enumerate(rng.sample(questions, min(n, len(questions)))):
        order = [p for p, _ in ranked[q.id]] if ranked is not None else None
        if keep_order and q.passage in order[:k]:
            chosen = order[:k]  # the gold paragraph already where the retriever ranked it
        elif order is not None:
            chosen = [p for p in order if p != q.passage][:k - 1]
        else:
            same = [p for p in by_article[q.article] if p != q.passage]
            near = rng.sample(same, min(len(same), (k - 1 + 1) // 2))
            others = [p for p in train_passages if p != q.passage and p not in near]
            chosen = near + rng.sample(others, k - 1 - len(near))
        if q.passage not in chosen:
            chosen.insert(rng.randrange(len(chosen) + 1), q.passage)
        instruction, system_prompt = choices[i % len(choices)]
        out.append(Example(q.question.strip(), tuple(ids(p) for p in chosen), instruction, system_prompt,
                           origin=f"squad:{q.id}", gold=q.answers[0].strip() if q.answers else None))
    return out


QUESTION_PROMPT = ("Here is a passage:\n\n{text}\n\nWrite one question that this passage answers, in one line. "
                   "Reply with the question only.")


def index_examples(index, n: int, k: int = 4, seed: int = 0, batch_size: int = 32) -> list[Example]:
    """``n`` prompts over ``index``'s own chunks, each with a question the model wrote for one of them."""
    llm = index.llm
    records = [r for r in index.records if r.token_ids]
    if len(records) < 2:
        raise LazyRagError(f"The index at {index.path} has {len(records)} chunks; tuning needs at least 2 "
                           "(index more text first).")
    rng = random.Random(seed)
    picks = [rng.choice(records) for _ in range(n)]
    plain = ChunkSource()
    requests = []
    for r in picks:
        msg = [{"role": "user", "content": QUESTION_PROMPT.format(text=r.text)}]
        tok = llm.tokenizer
        prompt = (tok.apply_chat_template(msg, tokenize=False, add_generation_prompt=True)
                  if getattr(tok, "chat_template", None) else msg[0]["content"] + "\nQuestion:")
        requests.append(dict(segments=[prompt], mode="full", max_new_tokens=48, stop=["\n"], source=plain))
    questions = []
    for s in range(0, len(requests), batch_size):
        questions += [res.text.strip() for res in llm.engine.generate(requests[s:s + batch_size])]
    system_prompt, instruction = index.prompt_settings()
    kk = min(k, len(records))
    out = []
    for r, question in zip(picks, questions):
        if not question:
            continue
        if index.vectors is not None:
            ids = [s.chunk_id for s in index.retrieve(question, kk) if s.chunk_id != r.id][:kk - 1]
        else:
            ids = [x.id for x in rng.sample(records, kk) if x.id != r.id][:kk - 1]
        ids.insert(rng.randrange(len(ids) + 1), r.id)
        chunks = tuple(tuple(index.by_id[c].token_ids[:MAX_CHUNK_TOKENS]) for c in ids)
        out.append(Example(question, chunks, instruction, system_prompt, origin=f"index:{r.id}"))
    return out
