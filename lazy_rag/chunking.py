"""Finding source files, and splitting text into model-token-sized chunks."""
from __future__ import annotations

from pathlib import Path

from .deps import require
from .documents import FORMATS, READERS, Skip, supported, unsupported
from .errors import LazyRagError


def discover_files(sources) -> tuple[list[Path], list[tuple[Path, Skip]]]:
    """The files under ``sources`` (files or folders) of a type lazy-rag reads, and each other
    file with why it is skipped and what to do (hidden files and folders are passed over)."""
    files, skipped = [], []
    if not sources:
        raise LazyRagError("No sources given: pass at least one file or folder to index.")
    for src in sources:
        p = Path(src).expanduser()
        if not p.exists():
            raise LazyRagError(f"Source {p} does not exist; check the path.")
        candidates = [p] if p.is_file() else sorted(q for q in p.rglob("*") if q.is_file())
        for f in candidates:
            if any(part.startswith(".") for part in f.relative_to(p).parts if p.is_dir()):
                continue  # hidden files and folders (.git, editors' temp files)
            if supported(f):
                files.append(f.resolve())
            else:
                skipped.append((f.resolve(), unsupported(f)))
    files = sorted(set(files))
    if not files:
        detail = f" (skipped: {', '.join(f'{f.name}: {s.reason}' for f, s in skipped[:5])}" \
                 f"{', ...' if len(skipped) > 5 else ''})" if skipped else ""
        raise LazyRagError(
            f"No file lazy-rag reads found in {', '.join(map(str, sources))}{detail}; point lazy-rag at files or "
            f"folders of {FORMATS} ({', '.join(sorted(READERS))}).")
    return files, skipped


# the default chunk size and overlap, in model tokens (an index's, the CLI's, the integrations')
CHUNK_SIZE = 256
CHUNK_OVERLAP = 32
SECTION_CHARS = 1 << 16  # text handed to the sentence splitter at once (see sections)


def sections(text: str, limit: int = SECTION_CHARS) -> list[str]:
    """``text`` cut into pieces of at most ``limit`` characters, at the last paragraph break
    (else line break, else space) before the limit; joined, they are ``text``. The sentence
    splitter runs on each piece alone: NLTK's sentence tokenizer runs its regular expressions
    under a 5 s limit, which a whole large file (a 20 MB text took ~40 s) exceeds."""
    out, start = [], 0
    while len(text) - start > limit:
        window = text[start:start + limit]
        cut = max(window.rfind("\n\n"), 0) or max(window.rfind("\n"), 0) or max(window.rfind(" "), 0) or limit
        out.append(text[start:start + cut])
        start += cut
    out.append(text[start:])
    return out


class TokenChunker:
    """Sentence-aware splitting sized in the model's own tokens (llama-index's SentenceSplitter),
    a section of the text at a time (``sections``): a chunk never spans two sections, and a text
    shorter than one section is split as a whole."""

    def __init__(self, tokenizer, chunk_size: int = CHUNK_SIZE, chunk_overlap: int = CHUNK_OVERLAP):
        if chunk_size < 16:
            raise LazyRagError(f"chunk_size must be at least 16 tokens, got {chunk_size}.")
        if not 0 <= chunk_overlap < chunk_size:
            raise LazyRagError(f"chunk_overlap must be in [0, chunk_size), got {chunk_overlap}.")
        require("llama_index.core")  # the core runtime runs without llama-index; indexing needs it
        from llama_index.core.node_parser import SentenceSplitter

        self.tokenizer = tokenizer
        self.chunk_size, self.chunk_overlap = chunk_size, chunk_overlap
        self.section_chars = SECTION_CHARS
        self._splitter = SentenceSplitter(
            chunk_size=chunk_size, chunk_overlap=chunk_overlap,
            tokenizer=lambda s: tokenizer(s, add_special_tokens=False).input_ids,
        )

    def split(self, text: str) -> list[tuple[str, list[int]]]:
        """(chunk text, its token ids tokenized alone without BOS) for each chunk."""
        out = []
        for section in sections(text, self.section_chars):
            try:
                pieces = self._splitter.split_text(section)
            except TimeoutError:  # an OSError: it must not read as a disk failure
                raise LazyRagError(f"Splitting {len(section)} characters of this text into sentences ran past NLTK's "
                                   "time limit for a regular expression (a pathological line?); split the file into "
                                   "smaller files.") from None
            for piece in pieces:
                ids = self.tokenizer(piece, add_special_tokens=False).input_ids
                if ids:
                    out.append((piece, ids))
        return out
