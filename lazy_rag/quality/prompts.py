"""The evaluation's prompts: the instruction before the chunks and the text after the question.

A prompt here is what an index's prompt settings and the eval's segments can express: the
``system_prompt`` and ``instruction`` are stored in each index (they sit in the fixed head before
the first chunk, so ``+sink`` indexes encode their chunks after them; ``None`` keeps the chat
template's default system prompt) and ``question_suffix`` is uncached text the eval appends to
every question. Few-shot examples go in the instruction as question/answer pairs
without contexts: they show the answer's form, not facts to copy. Their questions come from the
train articles of SQuAD dev and are dropped from every evaluated sample.

A long-form prompt (``long_form``) asks for an answer of a few sentences and has its own
``max_new_tokens``: it is judged against full's answer (teacher-forced KL, ROUGE-L), since F1
against SQuAD's short gold spans says little about a paragraph.

``FROZEN`` is the prompt chosen on the train split (QUALITY.md, "Prompt selection") and used by
default; the other variants stay for the record and for re-running the selection.
"""
from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass

from ..errors import LazyRagError


@dataclass(frozen=True)
class Prompt:
    name: str
    instruction: str
    question_suffix: str = ""
    example_question_ids: tuple[str, ...] = ()  # few-shot questions, never evaluated
    system_prompt: str | None = None
    max_new_tokens: int | None = None           # None: the run's (EvalOptions.max_new_tokens)
    long_form: bool = False                     # answers of a few sentences: F1/EM vs gold are not meaningful

    def question_text(self, question: str) -> str:
        return question.strip() + self.question_suffix

    def index_key(self) -> str:
        """Names the indexes built with this prompt (their manifests store its system prompt and instruction)."""
        head = [self.instruction] if self.system_prompt is None else [self.instruction, self.system_prompt]
        return hashlib.sha256(json.dumps(head).encode()).hexdigest()[:8]


_SHORT = ("Answer the question with a short phrase copied from the context. "
          "Do not explain, do not write a full sentence.")
# train-split questions (articles 14, 17, 18 of SQuAD dev), one per answer type: a name, a year, a noun
_EXAMPLES = (("5725bc7138643c19005acc1d", "Who was the first person in space?", "Yuri Gagarin"),
             ("5725f46289a1e219009ac0fa", "When was the Sierra Sky Park Airport formed?", "1946"),
             ("5726400589a1e219009ac5f1", "What do Cydippids use to capture their prey?", "colloblasts"))
_FEWSHOT = ("Answer the question with the shortest span of the context that answers it: a name, a number, a "
            "date or a few words, never a full sentence. Examples of the answer format:\n"
            + "\n".join(f"Question: {q}\nAnswer: {a}" for _, q, a in _EXAMPLES))
_FEWSHOT_IDS = tuple(i for i, _, _ in _EXAMPLES)
_SUFFIX = "\nAnswer with a few words copied from the context."
_LONGFORM = ("Answer the question in three or four sentences of one paragraph, using only the context: "
             "give the answer first, then the details of the context that support it.")
_EXTRACTIVE = ("You are an extractive question answering system. You reply with the exact answer span copied "
               "from the context: a few words, never a full sentence.")

PROMPTS = {p.name: p for p in (
    Prompt("short", _SHORT),
    Prompt("short-suffix", _SHORT, _SUFFIX),
    Prompt("fewshot", _FEWSHOT, "", _FEWSHOT_IDS),
    Prompt("fewshot-suffix", _FEWSHOT, _SUFFIX, _FEWSHOT_IDS),
    Prompt("system-short", _SHORT, system_prompt=_EXTRACTIVE),
    Prompt("system-fewshot", _SHORT, "", _FEWSHOT_IDS, _EXTRACTIVE + "\nExamples:\n"
           + "\n".join(f"Question: {q}\nAnswer: {a}" for _, q, a in _EXAMPLES)),
    # long enough for a few sentences; a paragraph break ends the answer like any line (runner.STOP)
    Prompt("longform", _LONGFORM, max_new_tokens=128, long_form=True),
)}
# never evaluated, whichever prompts a run uses: every run samples from the same questions
EXAMPLE_QUESTION_IDS = frozenset(i for p in PROMPTS.values() for i in p.example_question_ids)
FROZEN = "system-short"


def get_prompt(name: str) -> Prompt:
    try:
        return PROMPTS[name]
    except KeyError:
        raise LazyRagError(f"Unknown prompt {name!r}; choose one of {', '.join(PROMPTS)}.") from None
