"""A real corpus of >= 1M tokens that installs offline: Wikipedia articles from the bigbench sdist.

The ``bigbench==1.0.0`` sdist on PyPI (the one ``lazy_rag.quality.data`` takes SQuAD from) holds
the ``paragraph_segmentation`` task: 9,000 Wikipedia articles in 11 languages (CC BY-SA), one
sentence per line, with a label per sentence marking the paragraph ends. Its 1,025 English
articles are ~9M characters, about 2M tokens for a Llama/Qwen tokenizer; all 9,000 are ~44M
characters. ``write_wiki_corpus`` rebuilds the paragraphs and writes one ``.txt`` file per article,
a folder ``lazy-rag index`` takes as it is, like a user's documents.

Why this corpus: it is real prose of the kind RAG indexes (encyclopaedic articles, 1-20k
characters each), it comes with no test questions we tune on (SQuADShifts is kept for
evaluation, SQuAD dev for quality), and it is large enough for the 1M-token and (all languages)
10M-token points of the index-build benchmark.
"""
from __future__ import annotations

import json
import os
import re
import tarfile
from pathlib import Path

from ..errors import LazyRagError
from ..quality.data import BIGBENCH_REQUIREMENT, cache_dir
from ..tempfiles import create_temp

TASK_MEMBER = "bigbench/benchmark_tasks/paragraph_segmentation/task.json"
# share of a few very common English words among an article's words above which it is English:
# over the 9,000 articles the share is bimodal, < 0.07 for the other languages (whose own "is",
# "was" or "of" count) and 0.08-0.32 for English
_ENGLISH_WORDS = frozenset(("the", "and", "of", "was", "is", "with"))
_ENGLISH_SHARE = 0.1


def _is_english(text: str) -> bool:
    words = text.lower().split()
    return bool(words) and sum(w in _ENGLISH_WORDS for w in words) / len(words) > _ENGLISH_SHARE


def article_text(sentences: str, labels: str) -> str:
    """The article with its paragraphs: sentences (one per line) joined by spaces, a blank line
    after each sentence labelled 1 (a paragraph end)."""
    lines = [s.strip() for s in sentences.split("\n") if s.strip()]
    ends = labels.split()
    out, para = [], []
    for i, s in enumerate(lines):
        para.append(s)
        if i < len(ends) and ends[i] == "1":
            out.append(" ".join(para))
            para = []
    if para:
        out.append(" ".join(para))
    return "\n\n".join(out) + "\n"


def read_task(sdist: Path) -> list[dict]:
    """The paragraph_segmentation task's examples from a bigbench sdist."""
    with tarfile.open(sdist) as tar:
        for member in tar:
            if member.name.split("/", 1)[-1] == TASK_MEMBER:
                return json.loads(tar.extractfile(member).read())["examples"]
    raise LazyRagError(f"{sdist} lacks {TASK_MEMBER}; is it the {BIGBENCH_REQUIREMENT} sdist?")


def find_sdist(download: bool = False) -> Path:
    """The bigbench sdist in the cache (downloaded there once with ``download=True``)."""
    folder = cache_dir() / "sdist"
    found = sorted(folder.glob("bigbench-1.0.0*.tar.gz")) if folder.exists() else []
    if found:
        return found[0]
    if not download:
        raise LazyRagError(f"The {BIGBENCH_REQUIREMENT} sdist is not in {folder}; pass --fetch to download it "
                           "from PyPI (358 MB, once), or --sdist FILE.")
    import subprocess
    import sys

    folder.mkdir(parents=True, exist_ok=True)
    subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:", "-d", str(folder),
                    BIGBENCH_REQUIREMENT], check=True)
    return find_sdist(False)


def _slug(text: str) -> str:
    first = text.split(".")[0][:48]
    return re.sub(r"[^A-Za-z0-9]+", "-", first).strip("-").lower() or "article"


def write_wiki_corpus(dest: Path, sdist: Path, languages: str = "en", max_chars: int | None = None) -> dict:
    """Write the articles (``languages``: "en" or "all") as ``dest/<nnnn>-<slug>.txt``, in the
    task's order, up to ``max_chars`` characters in all. Returns counts. Files are written
    atomically; a folder already holding the same articles is left as it is."""
    if languages not in ("en", "all"):
        raise LazyRagError(f"languages must be 'en' or 'all', got {languages!r}.")
    dest.mkdir(parents=True, exist_ok=True)
    n_files = n_chars = 0
    for i, ex in enumerate(read_task(sdist)):
        if languages == "en" and not _is_english(ex["input"]):
            continue
        text = article_text(ex["input"], ex["target"])
        if max_chars is not None and n_chars + len(text) > max_chars and n_files:
            break
        path = dest / f"{i:04d}-{_slug(text)}.txt"
        if not path.exists() or path.read_text() != text:
            fd, tmp = create_temp(dest, prefix=f".{path.name}.")
            with os.fdopen(fd, "w") as f:
                f.write(text)
            os.replace(tmp, path)
        n_files += 1
        n_chars += len(text)
    return {"files": n_files, "chars": n_chars, "languages": languages, "folder": str(dest)}
