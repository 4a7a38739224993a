"""A run's answers so far, on disk, so that an interrupted evaluation resumes where it stopped.

An evaluation of n = 1000 questions x 8 configurations is minutes on a GPU and hours on a CPU; a
GPU call that hits its time limit, a killed terminal or a full disk used to lose all of it. After
every engine batch the answers so far are rewritten (atomically: the previous checkpoint stays
whole until the new one replaces it); a run with the same *signature* (model, data, configurations,
and every setting's questions and chunks, so resumed answers are the answers this run would give)
starts from there. The signature includes a digest of lazy-rag's own source, so answers given by
other code are never resumed. The file is plain JSON (scores, predictions, timings): nothing is unpickled.
"""
from __future__ import annotations

import hashlib
import json
from pathlib import Path

from ..errors import LazyRagError
from ..tempfiles import atomic_write_bytes

VERSION = 1


def code_digest() -> str:
    """Digest of the installed lazy_rag package's Python files, its kernels included (an editable
    install maps ``lazy_rag.kernels`` to the repository's kernels/ folder)."""
    from .. import kernels

    package = Path(__file__).resolve().parents[1]
    roots = [package] + [r for r in [Path(kernels.__file__).resolve().parent] if not r.is_relative_to(package)]
    h = hashlib.sha256()
    for root in roots:
        for f in sorted(root.rglob("*.py")):
            h.update(f"{root.name}/{f.relative_to(root)}".encode())
            h.update(f.read_bytes())
    return h.hexdigest()[:16]


def signature_digest(signature: dict) -> str:
    return hashlib.sha256(json.dumps(signature, sort_keys=True).encode()).hexdigest()[:16]


class Checkpoint:
    """``state`` maps a setting's label to {"rows": {config: [row, ...]}, "seconds": quality-pass
    seconds so far, "ttft": {config: [ms, ...]} once its TTFT pass is done}."""

    def __init__(self, path: Path, signature: dict):
        self.path = Path(path)
        self.digest = signature_digest(signature)
        self.state: dict[str, dict] = {}

    def load(self) -> int:
        """Read the file if it exists; returns how many answers it holds. A file of another run is
        an error (resuming from it would mix two runs' answers)."""
        if not self.path.exists():
            return 0
        try:
            saved = json.loads(self.path.read_text())
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
            raise LazyRagError(f"Cannot read the evaluation checkpoint {self.path} ({e}); delete it to start over.") from e
        if not isinstance(saved, dict) or saved.get("version") != VERSION or saved.get("signature") != self.digest:
            raise LazyRagError(f"The evaluation checkpoint {self.path} belongs to another run (different model, data, "
                               "configurations or questions); delete it, or name another file with --checkpoint.")
        self.state = saved["settings"]
        return self.answers()

    def answers(self) -> int:
        return sum(len(rows) for s in self.state.values() for rows in s["rows"].values())

    def save(self) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        data = {"version": VERSION, "signature": self.digest, "settings": self.state}
        atomic_write_bytes(self.path, json.dumps(data, ensure_ascii=False).encode())

    def remove(self) -> None:
        self.path.unlink(missing_ok=True)
