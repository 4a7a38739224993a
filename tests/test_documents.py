"""Reading source files: each format's text (PDF, HTML, DOCX, CSV, JSON, text in other encodings),
and every file that cannot be read named with why and what to do; an index of them answers from
their text; --encoding is checked before any model loads."""
import sys
from pathlib import Path

import pytest
from typer.testing import CliRunner

from sample_documents import docx_bytes, pdf_bytes
from lazy_rag import LazyIndex
from lazy_rag.chunking import discover_files
from lazy_rag.cli import app
from lazy_rag.documents import READERS, check_encoding, read_text
from lazy_rag.errors import LazyRagError


def write(folder: Path, name: str, data: bytes | str) -> Path:
    p = folder / name
    p.write_bytes(data if isinstance(data, bytes) else data.encode())
    return p


def test_each_format_is_read_as_its_text(tmp_path):
    pdf = write(tmp_path, "a.pdf", pdf_bytes([["The lighthouse (Marrow Point) was completed in 1871.", "A second line."],
                                              [], ["Page three."]]))
    assert read_text(pdf) == ("The lighthouse (Marrow Point) was completed in 1871.\nA second line.\n\nPage three.",
                              None, None)
    docx = write(tmp_path, "a.docx", docx_bytes(["The bakery opens at six.", "Tuesday to Sunday."],
                                                [["day", "hours"], ["Monday", "closed"]]))
    text = read_text(docx).text
    assert text.startswith("The bakery opens at six.\n\nTuesday to Sunday.") and "Monday" in text and "closed" in text
    # HTML: markdown of the body (headings, lists, tables); no scripts, styles, link targets or images;
    # the encoding its meta tag declares
    html = write(tmp_path, "a.htm", "<html><head><meta charset='windows-1252'><title>Ferries</title><style>p {}</style>"
                                    "<script>var x = 1;</script></head><body><h2>Caf\xe9 timetable</h2><p>The <a href="
                                    "'/vell'>ferry</a> takes <b>fifty</b> minutes.<img src='boat.png' alt='a boat'></p>"
                                    "<ul><li>Vell</li><li>Ost</li></ul><table><tr><th>from</th><th>at</th></tr><tr><td>"
                                    "Vell</td><td>9:00</td></tr></table></body></html>".encode("cp1252"))
    read = read_text(html)
    assert read.text == ("Ferries\n\n## Café timetable\n\nThe ferry takes **fifty** minutes.\n\n* Vell\n* Ost\n\n"
                         "| from | at |\n| --- | --- |\n| Vell | 9:00 |") and read.encoding == "windows-1252 (declared)"
    # CSV: a row a line, each value named by its column; the delimiter sniffed; a TSV by tabs
    csv = write(tmp_path, "a.csv", "name;role;year\nLidia;keeper;1871\n\nMira;cook;1890\n")
    assert read_text(csv).text == "name: Lidia; role: keeper; year: 1871\nname: Mira; role: cook; year: 1890"
    tsv = write(tmp_path, "a.tsv", "ferry\tminutes\nVell\t50\n")
    assert read_text(tsv).text == "ferry: Vell; minutes: 50"
    assert read_text(write(tmp_path, "a.json", '{"ferry": {"minutes": 50, "to": "Vell"}}')).text == \
        '{\n  "ferry": {\n    "minutes": 50,\n    "to": "Vell"\n  }\n}'
    assert read_text(write(tmp_path, "a.jsonl", '{"a": 1}\n\n{"b": "\\u00e9"}\n')).text == '{\n  "a": 1\n}\n\n{\n  "b": "é"\n}'
    assert read_text(write(tmp_path, "a.md", "# Title\n\nText.")) == ("# Title\n\nText.", None, None)


def test_text_in_another_encoding_is_decoded_and_says_how(tmp_path):
    french = "Le caf\xe9 cr\xe8me du matin co\xfbte deux euros \xe0 la gare. \xdcber die Br\xfccke gehen wir t\xe4glich."
    assert read_text(write(tmp_path, "fr.md", french.encode("latin-1"))) == (french, None, "cp1252 (detected)")
    russian = "Маяк на мысе был построен в 1871 году, и смотрители жили там до 1954 года."
    assert read_text(write(tmp_path, "ru.txt", russian.encode("cp1251"))) == (russian, None, "cp1251 (detected)")
    assert read_text(write(tmp_path, "u16.txt", "\ufeffUTF-16 text".encode("utf-16-le"))) == \
        ("UTF-16 text", None, "utf-16 (byte-order mark)")
    assert read_text(write(tmp_path, "bom.md", "\ufeffUTF-8 with a BOM".encode("utf-8"))).text == "UTF-8 with a BOM"
    short = write(tmp_path, "short.md", "caf\xe9 cr\xe8me".encode("latin-1"))
    read = read_text(short)
    assert read.text is None and read.skip.reason == "encoding unclear" and "--encoding NAME" in read.skip.fix
    assert read_text(short, "latin-1") == ("caf\xe9 cr\xe8me", None, "latin-1 (--encoding)")
    assert read_text(write(tmp_path, "utf8.md", "déjà vu"), "latin-1") == ("déjà vu", None, None)  # UTF-8 stays
    wrong = read_text(write(tmp_path, "ja.md", "灯台は完成した".encode("shift_jis")), "ascii")
    assert wrong.skip.reason == "not ascii" and "give its own encoding" in wrong.skip.fix
    assert check_encoding("auto") is None and check_encoding("CP1252") == "CP1252"
    with pytest.raises(LazyRagError, match=r"Unknown encoding 'nope' \(--encoding\).*cp1252"):
        check_encoding("nope")


def test_every_file_not_read_is_named_with_why_and_the_fix(tmp_path):
    cases = {
        "scan.pdf": (pdf_bytes([[]]), "PDF without text", "ocrmypdf"),
        "broken.pdf": (b"%PDF-1.4 nothing else", "not a readable PDF", "pypdf: "),
        "broken.docx": (b"PK not a zip", "not a readable DOCX", "save it again"),
        "bad.json": ('{"ferry": 50,}', "invalid JSON", "line 1 column 14"),
        "bad.jsonl": ('{"a": 1}\n{"b": }\n', "invalid JSON", "line 2 column 7"),
        "blank.txt": ("  \n\n", "empty", "no text"),
        "bytes.md": (b"\x00\x01\x02 not text", "binary", "not text"),
        "noise.txt": (bytes(range(128, 256)) * 40, "not text in a known encoding", "--encoding NAME"),
    }
    for name, (data, reason, fix) in cases.items():
        read = read_text(write(tmp_path, name, data))
        assert read.text is None and read.skip.reason == reason and fix in read.skip.fix, (name, read)
    gone = read_text(tmp_path / "gone.md")
    assert gone.skip.reason == "unreadable (No such file or directory)"
    (tmp_path / "notes").mkdir()
    write(tmp_path / "notes", "report.doc", b"\xd0\xcf")
    write(tmp_path / "notes", "LICENSE", "text without a suffix")
    write(tmp_path / "notes", "plan.md", "The plan.")
    files, skipped = discover_files([tmp_path / "notes"])
    assert [f.name for f in files] == ["plan.md"]
    assert {f.name: (s.reason, s.fix.split(";")[0]) for f, s in skipped} == {
        "LICENSE": ("unsupported type (no suffix)", "if it is text, rename it with .txt (or .md) to index it"),
        "report.doc": ("unsupported type (.doc)", "save it as .docx to index it")}
    with pytest.raises(LazyRagError, match=r"No file lazy-rag reads found .*report\.doc: unsupported type .*PDF"):
        discover_files([tmp_path / "notes" / "report.doc"])
    assert set(READERS) >= {".txt", ".md", ".pdf", ".html", ".docx", ".csv", ".json"}


def test_a_missing_readers_package_is_named_and_keeps_the_files_chunks(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "pypdf", None)  # as if it were not installed
    read = read_text(write(tmp_path, "a.pdf", pdf_bytes([["text"]])))
    assert read.skip == ("needs pypdf", "install it with: pip install pypdf", True)


def test_an_index_of_every_format_answers_from_their_text(tmp_path, smollm2):
    from lazy_rag.embedder import Embedder

    src = tmp_path / "docs"
    src.mkdir()
    write(src, "lighthouse.pdf", pdf_bytes([["The Marrow Point Lighthouse was completed in 1871."]]))
    write(src, "bakery.docx", docx_bytes(["The Kestrel Street Bakery opens at six in the morning."]))
    write(src, "ferry.html", "<html><body><p>The ferry to Vell takes fifty minutes.</p></body></html>")
    write(src, "keepers.csv", "keeper,from,to\nLidia Varga,1871,1902\n")
    write(src, "tides.json", '{"harbour": "Port Sallow", "high tide": "04:12"}')
    write(src, "photo.jpg", b"\xff\xd8\xff")
    index, report = LazyIndex.build([src], tmp_path / "idx", llm=smollm2, embedder=Embedder(), chunk_size=64,
                                    chunk_overlap=0, progress=False)
    assert report.files_indexed == 5 and report.skipped == {"unsupported type (.jpg)": 1}
    assert {Path(r.source).name: r.text for r in index.records}["keepers.csv"] == "keeper: Lidia Varga; from: 1871; to: 1902"
    hit = index.retrieve("How long does the ferry to Vell take?", top_k=1)[0]
    assert Path(hit.source).name == "ferry.html" and hit.text == "The ferry to Vell takes fifty minutes."
    assert Path(index.retrieve("When was the lighthouse completed?", top_k=1)[0].source).name == "lighthouse.pdf"


def test_the_cli_refuses_an_unknown_encoding_before_loading_a_model(tmp_path, monkeypatch):
    import lazy_rag.index.build as build_mod

    monkeypatch.setattr(build_mod.LazyLLM, "from_pretrained", lambda *a, **k: pytest.fail("a model was loaded"))
    write(tmp_path, "a.md", "text")
    res = CliRunner().invoke(app, ["index", str(tmp_path / "a.md"), "--out", str(tmp_path / "idx"),
                                   "--encoding", "latin-9000"])
    assert res.exit_code == 2 and "Unknown encoding 'latin-9000'" in res.output, res.output
