"""Reading a source file as text: plain text and markdown, PDF (pypdf), HTML (markdownify over
BeautifulSoup), DOCX (docx2txt), CSV and JSON (the standard library). Text that is not UTF-8 is
decoded in the encoding given (``--encoding``), else the one charset-normalizer detects; a file
that cannot be read is a ``Skip`` naming why and what to do about it."""
from __future__ import annotations

import codecs
import csv
import importlib
import io
import json
from pathlib import Path
from typing import Callable, NamedTuple

from .errors import LazyRagError

READ_ATTEMPTS = 5  # reads of one file that may disagree (it is being written) before the last is taken
AUTO = "auto"      # --encoding's value for "detect each file's encoding"


class Skip(NamedTuple):
    """Why a file was not indexed (short: reports count files by it) and what to do about it.
    ``keeps_chunks``: the file itself may be fine (a reader's package is missing), so an index
    keeps what it holds of it instead of dropping its chunks."""

    reason: str
    fix: str
    keeps_chunks: bool = False

    def __str__(self) -> str:
        return f"{self.reason}: {self.fix}"


class SourceText(NamedTuple):
    """A file read: its ``text``, or why not (``skip``); ``encoding``: how text that was not
    UTF-8 was decoded, e.g. "cp1252 (detected)" (None for UTF-8 and the binary formats)."""

    text: str | None
    skip: Skip | None = None
    encoding: str | None = None


class Unreadable(Exception):
    def __init__(self, skip: Skip):
        super().__init__(str(skip))
        self.skip = skip


def check_encoding(encoding: str | None) -> str | None:
    """``encoding`` as given (None and "auto": detect each file), refused early if Python has no
    codec of that name."""
    if encoding is None or encoding.lower() == AUTO:
        return None
    try:
        codecs.lookup(encoding)
    except LookupError:
        raise LazyRagError(f"Unknown encoding {encoding!r} (--encoding): give a Python codec name such as "
                           "cp1252, latin-1, utf-16, shift_jis or gb18030, or auto to detect each file's.") from None
    return encoding


def _package(module: str, requirement: str):
    try:
        return importlib.import_module(module)
    except ImportError:
        raise Unreadable(Skip(f"needs {requirement}", f"install it with: pip install {requirement}",
                              keeps_chunks=True)) from None


# -- text ------------------------------------------------------------------------------------------

_BOMS = ((codecs.BOM_UTF32_LE, "utf-32"), (codecs.BOM_UTF32_BE, "utf-32"), (codecs.BOM_UTF8, "utf-8-sig"),
         (codecs.BOM_UTF16_LE, "utf-16"), (codecs.BOM_UTF16_BE, "utf-16"))
FIX_ENCODING = "give its encoding with --encoding NAME (e.g. --encoding cp1252), or convert the file to UTF-8"


def decode(data: bytes, encoding: str | None = None, declared: str | None = None) -> tuple[str, str | None]:
    """(text, how it was decoded when not UTF-8) of a text file's bytes: a byte-order mark's
    encoding, else UTF-8, else the file's ``declared`` encoding (HTML's meta charset), else
    ``encoding``, else charset-normalizer's best guess where one decoding stands out. Raises
    ``Unreadable`` for binary data and text whose encoding cannot be told."""
    for bom, name in _BOMS:
        if data.startswith(bom):
            try:
                return data.decode(name), None if name == "utf-8-sig" else f"{name} (byte-order mark)"
            except UnicodeDecodeError:
                break
    if b"\x00" in data[:8192]:
        raise Unreadable(Skip("binary", "it is not text; convert it to text or leave it out"))
    try:
        return data.decode("utf-8"), None
    except UnicodeDecodeError:
        pass
    for name, how in ((declared, "declared"), (encoding, "--encoding")):
        if name:
            try:
                return data.decode(name), f"{name} ({how})"
            except (UnicodeDecodeError, LookupError):
                if how == "--encoding":
                    raise Unreadable(Skip(f"not {name}", f"neither UTF-8 nor {name} (--encoding); give its own "
                                                         "encoding, or convert it to UTF-8")) from None
    matches = list(_package("charset_normalizer", "charset-normalizer").from_bytes(data))
    if not matches:
        raise Unreadable(Skip("not text in a known encoding", f"not UTF-8, and no encoding fits; if it is text, "
                                                              f"{FIX_ENCODING}"))
    best = matches[0]
    ties = [m for m in matches if (m.chaos, m.coherence) == (best.chaos, best.coherence)]
    if len({str(m) for m in ties}) > 1:  # short or mixed text: several encodings fit equally well
        names = ", ".join(m.encoding for m in ties[:4]) + (", ..." if len(ties) > 4 else "")
        raise Unreadable(Skip("encoding unclear", f"not UTF-8, and it could be any of {names}; {FIX_ENCODING}"))
    return str(best), f"{best.encoding} (detected)"


# -- documents -------------------------------------------------------------------------------------

def _pdf(data: bytes, encoding: str | None) -> tuple[str, None]:
    pypdf = _package("pypdf", "pypdf")
    try:
        reader = pypdf.PdfReader(io.BytesIO(data))
        if reader.is_encrypted and not reader.decrypt(""):
            raise Unreadable(Skip("encrypted PDF", "decrypt it first, e.g. qpdf --decrypt --password=... IN OUT"))
        pages = [page.extract_text() or "" for page in reader.pages]
    except Unreadable:
        raise
    except Exception as e:  # noqa: BLE001 - pypdf's errors for broken files are of many kinds
        raise Unreadable(Skip("not a readable PDF", f"pypdf: {type(e).__name__}: {e}; re-export or repair it "
                                                    "(e.g. qpdf IN OUT)")) from None
    text = "\n\n".join(p.strip() for p in pages if p.strip())
    if not text:
        raise Unreadable(Skip("PDF without text", "its pages are images (a scan?); add a text layer first, e.g. "
                                                   "ocrmypdf IN OUT"))
    return text, None


_NOT_TEXT_TAGS = ("script", "style", "noscript", "template", "svg", "canvas", "iframe", "object")


def _html(data: bytes, encoding: str | None) -> tuple[str, str | None]:
    bs4 = _package("bs4", "beautifulsoup4")
    markdownify = _package("markdownify", "markdownify")
    declared = bs4.dammit.EncodingDetector.find_declared_encoding(data, is_html=True, search_entire_document=False)
    text, how = decode(data, encoding, declared=declared)
    soup = bs4.BeautifulSoup(text, "html.parser")
    for tag in soup(_NOT_TEXT_TAGS):
        tag.decompose()
    # markdown keeps headings, lists and tables readable; links and images keep their text only
    md = markdownify.MarkdownConverter(heading_style="ATX", strip=["a", "img"]).convert_soup(soup)
    return md.strip(), how


def _docx(data: bytes, encoding: str | None) -> tuple[str, None]:
    docx2txt = _package("docx2txt", "docx2txt")
    try:
        text = docx2txt.process(io.BytesIO(data))
    except Exception as e:  # noqa: BLE001 - a damaged zip or XML
        raise Unreadable(Skip("not a readable DOCX", f"{type(e).__name__}: {e}; open and save it again in "
                                                     "a word processor")) from None
    return "\n".join(line.rstrip() for line in text.splitlines()).strip(), None


def _csv(data: bytes, encoding: str | None, delimiter: str | None = None) -> tuple[str, str | None]:
    """One line per row; with a header row, each value named by its column (a chunk cut from the
    middle of a table still says what its numbers are)."""
    text, how = decode(data, encoding)
    sample = text[:16384]
    try:
        dialect = csv.Sniffer().sniff(sample, delimiters=delimiter or ",;\t|")
        header = csv.Sniffer().has_header(sample)
    except csv.Error:  # one column, or too irregular to tell: read as the comma's
        dialect, header = csv.excel, False
    rows = [[cell.strip() for cell in row] for row in csv.reader(io.StringIO(text), dialect)]
    rows = [row for row in rows if any(row)]
    if header and len(rows) > 1:
        names, rows = rows[0], rows[1:]
        lines = ["; ".join(f"{names[i]}: {v}" if i < len(names) and names[i] else v
                           for i, v in enumerate(row) if v) for row in rows]
    else:
        lines = [", ".join(row) for row in rows]
    return "\n".join(lines), how


def _tsv(data: bytes, encoding: str | None) -> tuple[str, str | None]:
    return _csv(data, encoding, delimiter="\t")


def _json_error(e: json.JSONDecodeError, line_offset: int = 0) -> Unreadable:
    return Unreadable(Skip("invalid JSON", f"line {e.lineno + line_offset} column {e.colno}: {e.msg}; fix it, or "
                                           "rename it to .txt to index it as plain text"))


def _json(data: bytes, encoding: str | None) -> tuple[str, str | None]:
    text, how = decode(data, encoding)
    try:
        value = json.loads(text)
    except json.JSONDecodeError as e:
        raise _json_error(e) from None
    return json.dumps(value, indent=2, ensure_ascii=False), how


def _jsonl(data: bytes, encoding: str | None) -> tuple[str, str | None]:
    text, how = decode(data, encoding)
    records = []
    for n, line in enumerate(text.splitlines()):
        if line.strip():
            try:
                records.append(json.dumps(json.loads(line), indent=2, ensure_ascii=False))
            except json.JSONDecodeError as e:
                raise _json_error(e, line_offset=n) from None
    return "\n\n".join(records), how


Reader = Callable[[bytes, "str | None"], "tuple[str, str | None]"]
READERS: dict[str, Reader] = {
    ".txt": decode, ".text": decode, ".md": decode, ".markdown": decode, ".rst": decode,
    ".pdf": _pdf, ".html": _html, ".htm": _html, ".xhtml": _html, ".docx": _docx,
    ".csv": _csv, ".tsv": _tsv, ".json": _json, ".jsonl": _jsonl, ".ndjson": _jsonl,
}
FORMATS = "text, markdown, PDF, HTML, DOCX, CSV and JSON"
# what to do with a file of a type no reader takes, by suffix
CONVERT = {".doc": "save it as .docx", ".rtf": "save it as .docx or .txt", ".odt": "save it as .docx",
           ".xlsx": "save it as .csv", ".xls": "save it as .csv", ".ods": "save it as .csv",
           ".pptx": "save it as PDF", ".ppt": "save it as PDF", ".epub": "convert it to HTML or text"}


def supported(path: Path) -> bool:
    return path.suffix.lower() in READERS


def unsupported(path: Path) -> Skip:
    suffix = path.suffix.lower()
    if not suffix:
        fix = "if it is text, rename it with .txt (or .md) to index it"
    else:
        fix = CONVERT.get(suffix, "convert it to one of the types read") + " to index it"
    return Skip(f"unsupported type ({suffix or 'no suffix'})", f"{fix}; lazy-rag reads {FORMATS} files")


def _read_bytes(path: Path) -> bytes:
    with open(path, "rb") as f:
        return f.read()


def read_text(path: Path, encoding: str | None = None) -> SourceText:
    """``path``'s text (``SourceText``) by its type's reader, or why it was skipped.

    The file is read until two reads in a row agree (at most ``READ_ATTEMPTS``): a write that lands
    while it is read does not yield a torn text, half one version and half the next. The caller
    chunks, hashes and records exactly the text returned, so what changes later is seen by the
    next run; a file that never holds still is taken as last read (``LazyIndex.build`` reports
    it as changed). ``encoding``: the encoding of text files that are not UTF-8 (None: detected)."""
    reader = READERS.get(path.suffix.lower())
    if reader is None:
        return SourceText(None, unsupported(path))
    data = None
    try:
        for _ in range(READ_ATTEMPTS):
            again = _read_bytes(path)
            if again == data:
                break
            data = again
    except OSError as e:  # unreadable, or gone while indexing
        return SourceText(None, Skip(f"unreadable ({e.strerror or type(e).__name__})",
                                     "check that it exists and that this user may read it"))
    try:
        text, how = reader(data, encoding)
    except Unreadable as e:
        return SourceText(None, e.skip)
    if not text.strip():
        return SourceText(None, Skip("empty", "it holds no text to index"))
    return SourceText(text, None, how)
