"""SQuAD-format QA data: SQuAD v1.1 dev and the four SQuADShifts sets, their train/test split,
and a content hash that names everything derived from a set of passages.

All five files come from the ``bigbench==1.0.0`` sdist on PyPI (``--fetch`` downloads it once,
358 MB, and extracts them into the cache). SQuAD dev is split by article: the first half of the
articles (0-23) is "train" (prompt selection, later chunk-wrapper training), the second half
(24-47) is the held-out "test" split. SQuADShifts (new Wikipedia, NYT, Reddit, Amazon reviews) is
kept for evaluation only: every question is "test", so nothing tuned on it can leak into a
transfer measurement.
"""
from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
import tarfile
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

from ..errors import LazyRagError

BIGBENCH_REQUIREMENT = "bigbench==1.0.0"
BIGBENCH_DIR = "bigbench/benchmark_tasks/squad_shifts/"
SPLITS = ("train", "test", "all")


@dataclass(frozen=True)
class DatasetInfo:
    file: str          # the member name inside BIGBENCH_DIR, also the cached file's name
    eval_only: bool    # every question is "test" (no train split to tune on)
    description: str


DATASETS = {
    "squad": DatasetInfo("squaddev_v1.1.json", False, "SQuAD v1.1 dev (Wikipedia)"),
    "new_wiki": DatasetInfo("new_wiki_v1.0.json", True, "SQuADShifts: new Wikipedia articles"),
    "nyt": DatasetInfo("nyt_v1.0.json", True, "SQuADShifts: New York Times articles"),
    "reddit": DatasetInfo("reddit_v1.0.json", True, "SQuADShifts: Reddit posts"),
    "amazon_reviews": DatasetInfo("amazon_reviews_v1.0.json", True, "SQuADShifts: Amazon product reviews"),
}


@dataclass(frozen=True)
class Passage:
    id: str
    text: str


@dataclass(frozen=True)
class Question:
    id: str
    question: str
    answers: tuple[str, ...]
    answer_starts: tuple[int, ...]
    passage: str       # the gold passage's id
    article: int
    split: str         # "train" or "test"


@dataclass
class Dataset:
    name: str
    path: Path
    passages: list[Passage]
    questions: list[Question]
    text_of: dict[str, str] = field(init=False, repr=False)

    def __post_init__(self):
        self.text_of = {p.id: p.text for p in self.passages}

    def split(self, split: str) -> list[Question]:
        if split not in SPLITS:
            raise LazyRagError(f"Unknown split {split!r}; choose one of {', '.join(SPLITS)}.")
        chosen = [q for q in self.questions if split == "all" or q.split == split]
        if not chosen:
            raise LazyRagError(f"{self.name} ({self.path}) has no questions in the {split!r} split"
                               + (" (SQuADShifts sets are for evaluation only: use --split test)."
                                  if split == "train" else "."))
        return chosen


def cache_dir() -> Path:
    return Path(os.environ.get("LAZY_RAG_CACHE", Path.home() / ".cache" / "lazy-rag"))


def passages_hash(passages) -> str:
    """sha256 of the ordered (id, text) pairs: names indexes and retrieval files built from them."""
    h = hashlib.sha256()
    for p in passages:
        h.update(p.id.encode())
        h.update(b"\0")
        h.update(p.text.encode())
        h.update(b"\1")
    return h.hexdigest()


def _candidates(name: str) -> list[Path]:
    """Where a dataset is looked for, in order (the shared folder beside the checkout holds SQuAD)."""
    info = DATASETS[name]
    paths = []
    if name == "squad":
        if os.environ.get("LAZY_RAG_SQUAD"):
            paths.append(Path(os.environ["LAZY_RAG_SQUAD"]))
        paths.append(Path(__file__).resolve().parents[3] / "shared" / "data" / "squad_v1.1_dev.json")
        paths.append(cache_dir() / "squad_v1.1_dev.json")  # where earlier versions cached it
    paths.append(cache_dir() / "data" / info.file)
    return paths


def default_squad_path() -> Path:
    """The first existing SQuAD dev file (or the first place looked, when there is none)."""
    paths = _candidates("squad")
    return next((p for p in paths if p.exists()), paths[0])


def extract_bigbench_data(sdist: Path, dest_dir: Path) -> list[Path]:
    """Copy the five SQuAD-format files out of a bigbench sdist into ``dest_dir`` (atomically)."""
    dest_dir.mkdir(parents=True, exist_ok=True)
    wanted = {BIGBENCH_DIR + info.file: info.file for info in DATASETS.values()}
    written = []
    with tarfile.open(sdist) as tar:
        for member in tar.getmembers():
            inner = member.name.split("/", 1)[-1]  # drop the "bigbench-1.0.0/" root
            if inner in wanted:
                tmp = dest_dir / (wanted[inner] + ".tmp")
                tmp.write_bytes(tar.extractfile(member).read())
                os.replace(tmp, dest_dir / wanted[inner])
                written.append(dest_dir / wanted[inner])
    missing = sorted(set(wanted.values()) - {p.name for p in written})
    if missing:
        raise LazyRagError(f"{sdist} lacks {', '.join(missing)} under {BIGBENCH_DIR}; is it the {BIGBENCH_REQUIREMENT} sdist?")
    return written


def fetch_bigbench_data(dest_dir: Path | None = None) -> list[Path]:
    """Download the bigbench sdist once (358 MB; never installed: it pulls TensorFlow) and extract
    SQuAD dev and SQuADShifts into ``dest_dir`` (default: the cache's data folder)."""
    dest_dir = dest_dir or cache_dir() / "data"
    with tempfile.TemporaryDirectory() as tmp:
        subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:", "-d", tmp,
                        BIGBENCH_REQUIREMENT], check=True)
        return extract_bigbench_data(next(Path(tmp).glob("bigbench-1.0.0*")), dest_dir)


def resolve_dataset_path(name: str, path: Path | None = None, fetch: bool = False) -> Path:
    if path is not None:
        if not Path(path).exists():
            raise LazyRagError(f"Data file {path} does not exist; check the path (or drop --data to use --dataset).")
        return Path(path)
    if name not in DATASETS:
        raise LazyRagError(f"Unknown dataset {name!r}; choose one of {', '.join(DATASETS)} or pass --data FILE.")
    paths = _candidates(name)
    found = next((p for p in paths if p.exists()), None)
    if found:
        return found
    if fetch:
        fetch_bigbench_data()
        return cache_dir() / "data" / DATASETS[name].file
    raise LazyRagError(f"{DATASETS[name].description} not found (looked in {', '.join(map(str, paths))}). Add --fetch "
                       f"to extract it from the {BIGBENCH_REQUIREMENT} sdist on PyPI (358 MB, once), or pass --data FILE.")


def load_dataset(name: str = "squad", path: Path | None = None, fetch: bool = False) -> Dataset:
    """A SQuAD-format file as passages (one per paragraph, ids ``a<article>p<paragraph>``) and
    questions with their gold answers and split. ``path`` overrides the named dataset's file;
    a file that is not a known SQuADShifts set is split by article halves like SQuAD."""
    path = resolve_dataset_path(name, path, fetch)
    try:
        articles = json.loads(path.read_text())["data"]
    except (json.JSONDecodeError, KeyError, TypeError) as e:
        raise LazyRagError(f"{path} is not a SQuAD-format JSON file ({type(e).__name__}: {e}).") from e
    eval_only = DATASETS[name].eval_only if name in DATASETS else False
    half = len(articles) // 2
    passages, questions = [], []
    for a, article in enumerate(articles):
        split = "test" if eval_only or a >= half else "train"
        for p, para in enumerate(article["paragraphs"]):
            pid = f"a{a:03d}p{p:04d}"
            passages.append(Passage(pid, para["context"]))
            for qa in para["qas"]:
                questions.append(Question(qa["id"], qa["question"], tuple(x["text"] for x in qa["answers"]),
                                          tuple(int(x.get("answer_start", -1)) for x in qa["answers"]),
                                          pid, a, split))
    if not questions:
        raise LazyRagError(f"{path} holds no questions.")
    return Dataset(name, path, passages, questions)
