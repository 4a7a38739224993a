"""Retrieval saved to a file: each question's ranked passage ids and scores, tied to the data.

Retrieval needs the embedder and faiss, which a GPU machine may lack; generation needs neither.
So retrieval can run once where they are installed (``lazy-rag eval retrieve``), and the
evaluation elsewhere reads the ranking from the file (``--retrieval FILE``). The file records the
content hash of the passages it ranked, and is refused for any other data.
"""
from __future__ import annotations

import datetime as _dt
import json
from pathlib import Path

from ..errors import LazyRagError

FORMAT = "lazy-rag-retrieval/1"


def save_retrieval(path: Path, ranked: dict[str, list[tuple[str, float]]], *, data_hash: str, dataset: str,
                   split: str, embedder: str, depth: int) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    doc = {"format": FORMAT, "dataset": dataset, "data_hash": data_hash, "split": split, "embedder": embedder,
           "depth": depth, "created": _dt.date.today().isoformat(),
           "questions": {q: [[pid, round(float(s), 5)] for pid, s in ranks] for q, ranks in ranked.items()}}
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(doc, separators=(",", ":")) + "\n")
    tmp.replace(path)
    return path


def load_retrieval(path: Path, *, data_hash: str, question_ids, depth: int) -> dict[str, list[tuple[str, float]]]:
    """The ranking of ``question_ids`` (at least ``depth`` deep), checked against the data."""
    path = Path(path)
    try:
        doc = json.loads(path.read_text())
    except FileNotFoundError:
        raise LazyRagError(f"Retrieval file {path} does not exist; make it with `lazy-rag eval retrieve --out {path}`.") from None
    except json.JSONDecodeError as e:
        raise LazyRagError(f"Retrieval file {path} is not valid JSON ({e}); make it again with `lazy-rag eval retrieve`.") from e
    if doc.get("format") != FORMAT:
        raise LazyRagError(f"{path} is not a lazy-rag retrieval file (format {doc.get('format')!r}, expected {FORMAT!r}).")
    if doc["data_hash"] != data_hash:
        raise LazyRagError(f"Retrieval file {path} ranked other passages (data hash {doc['data_hash'][:12]}, dataset "
                           f"{doc.get('dataset')!r}) than the data loaded now (hash {data_hash[:12]}); make it again "
                           "from this data with `lazy-rag eval retrieve`.")
    if doc["depth"] < depth:
        raise LazyRagError(f"Retrieval file {path} holds the top {doc['depth']} passages per question, but k={depth} "
                           f"is asked; make it again with `lazy-rag eval retrieve --depth {depth}`.")
    ranked = doc["questions"]
    missing = [q for q in question_ids if q not in ranked]
    if missing:
        raise LazyRagError(f"Retrieval file {path} (split {doc.get('split')!r}) has no ranking for {len(missing)} of the "
                           f"sampled questions (e.g. {missing[0]}); make it for this split with `lazy-rag eval retrieve`.")
    return {q: [(pid, float(s)) for pid, s in ranked[q]] for q in question_ids}
