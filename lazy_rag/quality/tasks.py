"""What each question is answered from: the chunks, in prompt order, for every task and setting.

Two tasks:

- ``open``: open-retrieval QA. Every paragraph of the dataset is one chunk; a question gets its
  top-k retrieved paragraphs. ``gold_position`` ``first``/``middle``/``last`` forces the gold
  paragraph into the top k at that place (0-based index 0, k // 2, k - 1; the lowest-ranked
  other paragraph makes room), to see how reuse quality depends on where the evidence sits;
  ``retrieved`` keeps the retriever's order (the gold paragraph may be missing).
- ``bridge``: a multi-chunk task built from SQuAD-format paragraphs. Each paragraph is split
  into sentences, one chunk per sentence, given in document order. A *bridge* question names
  an entity (e.g. "When did Tesla move to Prague?") that its answer sentence mentions only by a
  pronoun ("In 1880, he moved to Prague ..."), while an earlier sentence of the same paragraph
  names it: no single chunk holds both the question's entity and the answer. With full
  re-encoding the pronoun's keys and values are computed attending to the sentence that names
  the entity; encoded alone, the answer chunk never saw that sentence, and only the question's
  tokens, at answer time, can link the two. The *control* questions are split the same way, but
  their answer sentence names the question's entities itself: the difference between the two
  gaps is what cross-chunk reference costs, beyond the cost of small chunks.
"""
from __future__ import annotations

import re
from dataclasses import dataclass

from ..errors import LazyRagError
from .data import Dataset, Passage, Question

TASKS = ("open", "bridge")
GOLD_POSITIONS = ("retrieved", "first", "middle", "last")


@dataclass(frozen=True)
class TaskItem:
    """One question and the chunks it is answered from, in prompt order."""
    question: Question
    chunk_ids: tuple[str, ...]
    gold_index: int | None   # where the chunk holding the answer sits in chunk_ids (None: absent)


# -- open retrieval -------------------------------------------------------------------------------
def place_gold(ranked: list[str], gold: str, k: int, position: str) -> list[str]:
    """The k chunk ids of one question: the ranked list cut at k, or with ``gold`` forced in."""
    if k < 1:
        raise LazyRagError(f"k must be at least 1, got {k}.")
    if position not in GOLD_POSITIONS:
        raise LazyRagError(f"Unknown gold position {position!r}; choose one of {', '.join(GOLD_POSITIONS)}.")
    if position == "retrieved":
        return list(ranked[:k])
    others = [c for c in ranked if c != gold][:k - 1]
    if len(others) < k - 1:
        raise LazyRagError(f"Only {len(others) + 1} ranked paragraphs for a question, {k} wanted: retrieve deeper.")
    at = {"first": 0, "middle": k // 2, "last": k - 1}[position]
    return others[:at] + [gold] + others[at:]


def open_items(questions: list[Question], ranked: dict[str, list[str]], k: int, position: str) -> list[TaskItem]:
    items = []
    for q in questions:
        ids = place_gold(ranked[q.id], q.passage, k, position)
        items.append(TaskItem(q, tuple(ids), ids.index(q.passage) if q.passage in ids else None))
    return items


# -- the bridge task ------------------------------------------------------------------------------
# a sentence ends at . ! ? (and a closing quote) before whitespace and a capital, digit or quote,
# unless the word before is an abbreviation or an initial
_BOUNDARY = re.compile(r"(?<=[.!?])[\"'”’)]*\s+(?=[A-Z0-9\"“(])")
_ABBREVIATION = re.compile(r"(?:\b[A-Z]|\b(?:Mr|Mrs|Ms|Dr|St|Jr|Sr|Prof|Gen|Col|Capt|Lt|Rev|Gov|Sen|Rep|No|vs|"
                           r"etc|e\.g|i\.e|U\.S|U\.K|Inc|Co|Ltd|ca|c|Jan|Feb|Mar|Apr|Jun|Jul|Aug|Sep|Sept|Oct|"
                           r"Nov|Dec))\.[\"'”’)]*$")
PRONOUNS = frozenset({"he", "she", "they", "his", "her", "their", "its", "him", "them"})
_STOP = frozenset("""what who whom whose which when where why how in on at of for to from by with the a an is was
were are did does do has had have be been this that these those and or as after before during about into
than then there many much one two three""".split())


def split_sentences(text: str) -> list[tuple[int, int]]:
    """(start, end) character spans of the sentences of ``text``, covering it without gaps."""
    starts = [0]
    for m in _BOUNDARY.finditer(text):
        if not _ABBREVIATION.search(text[starts[-1]:m.start()]):
            starts.append(m.end())
    ends = starts[1:] + [len(text)]
    return [(s, e) for s, e in zip(starts, ends) if text[s:e].strip()]


def entity_words(question: str) -> set[str]:
    """Capitalised words of a question after its first word, minus function words: the names it asks about."""
    words = [re.sub(r"['’]s?$", "", w) for w in re.findall(r"[A-Za-z][\w'’\-]*", question)]
    return {w for w in words[1:] if w[0].isupper() and w.lower() not in _STOP}


def _has_word(text: str, word: str) -> bool:
    """Whether ``word`` occurs as a whole word (any case: questions capitalise loosely)."""
    return re.search(rf"(?<![\w-]){re.escape(word)}(?![\w-])", text, re.IGNORECASE) is not None


def _opens_with_pronoun(sentence: str) -> bool:
    return any(w.lower() in PRONOUNS for w in re.findall(r"[A-Za-z]+", sentence)[:4])


def classify_bridge(question: Question, paragraph: str, spans: list[tuple[int, int]]) -> tuple[str | None, int]:
    """("bridge" | "control" | None, index of the answer sentence) for one question."""
    starts = [s for s in question.answer_starts if s >= 0]
    if not starts or len(spans) < 2:
        return None, -1
    where = {next((i for i, (s, e) in enumerate(spans) if s <= a < e), -1) for a in starts}
    j = where.pop() if len(where) == 1 else -1
    if j < 1:  # answers in more than one sentence, or in the first (nothing to refer back to)
        return None, j
    first = starts[0]
    if first + len(question.answers[0]) > spans[j][1]:
        return None, j  # the answer runs past its sentence
    names = entity_words(question.question)
    if not names:
        return None, j
    sentence = paragraph[spans[j][0]:spans[j][1]]
    before = paragraph[:spans[j][0]]
    if all(_has_word(sentence, w) for w in names):
        return "control", j
    if (_opens_with_pronoun(sentence) and not any(_has_word(sentence, w) for w in names)
            and any(_has_word(before, w) for w in names)):
        return "bridge", j
    return None, j


@dataclass
class BridgeTask:
    passages: list[Passage]              # sentence chunks of the paragraphs used
    items: dict[str, list[TaskItem]]     # "bridge" and "control"


def build_bridge_task(dataset: Dataset, questions: list[Question]) -> BridgeTask:
    """Sentence chunks and the bridge/control questions among ``questions``. Only paragraphs with
    a selected question are chunked, so the chunk set depends on the data and split alone."""
    spans_of: dict[str, list[tuple[int, int]]] = {}
    items: dict[str, list[TaskItem]] = {"bridge": [], "control": []}
    used: list[str] = []
    for q in questions:
        text = dataset.text_of[q.passage]
        if q.passage not in spans_of:
            spans_of[q.passage] = split_sentences(text)
        spans = spans_of[q.passage]
        kind, j = classify_bridge(q, text, spans)
        if kind is None:
            continue
        if q.passage not in used:
            used.append(q.passage)
        items[kind].append(TaskItem(q, tuple(f"{q.passage}s{i:02d}" for i in range(len(spans))), j))
    passages = [Passage(f"{pid}s{i:02d}", dataset.text_of[pid][s:e].strip())
                for pid in used for i, (s, e) in enumerate(spans_of[pid])]
    if not items["bridge"]:
        raise LazyRagError(f"No bridge questions found in the {len(questions)} questions of {dataset.name}.")
    return BridgeTask(passages, items)
