"""MkDocs hook: links from the docs to files elsewhere in the repository.

A page under docs/ links to QUALITY.md as ``../QUALITY.md``, to a benchmark record as
``../benchmarks/results/NAME.json``: the path a reader of the repository follows. The site holds
only docs/, so MkDocs would call such a link broken. This hook publishes every repository file
the pages link to under ``repo/`` in the site (Markdown files as pages, whose own links are
followed in turn; links from them into docs/ lead back to the docs pages) and rewrites each link
to where the file lands. A link to a file that does not exist stays as written, and MkDocs'
validation reports it: the build checks these links like any other.
"""
from __future__ import annotations

import posixpath
import re
from pathlib import Path
from urllib.parse import unquote

from mkdocs.structure.files import File

PREFIX = "repo/"  # where files from outside docs/ land in the site

# An inline Markdown link or image target: ](target) or ](target "title").
_LINK = re.compile(r'(\]\()(<?)([^)\s>]+)(>?)((?:\s+"[^"]*")?\))')
_FENCE = re.compile(r"^\s*(```|~~~)")


def _repo_root(config) -> Path:
    return Path(config.config_file_path).resolve().parent


def _docs_rel(config) -> str:
    return Path(config.docs_dir).resolve().relative_to(_repo_root(config)).as_posix()


def _repo_path(src_uri: str, config) -> str:
    """The repository path of a site file (a docs page, or a file this hook published)."""
    if src_uri.startswith(PREFIX):
        return src_uri[len(PREFIX):]
    return f"{_docs_rel(config)}/{src_uri}"


def _site_uri(repo_path: str, config) -> str:
    docs = _docs_rel(config) + "/"
    return repo_path[len(docs):] if repo_path.startswith(docs) else PREFIX + repo_path


def _target(link: str, from_repo_path: str) -> tuple[str, str] | None:
    """(repository path, '#anchor' or '') of a relative link, or None when it is not one."""
    if not link or link.startswith(("#", "/")) or re.match(r"^[a-zA-Z][a-zA-Z0-9+.-]*:", link):
        return None
    path, hash_, anchor = link.partition("#")
    path = path.split("?", 1)[0]
    resolved = posixpath.normpath(posixpath.join(posixpath.dirname(from_repo_path), unquote(path)))
    if resolved.startswith(".."):
        return None  # outside the repository: left to MkDocs
    return resolved, hash_ + anchor


def _map_links(markdown: str, fn) -> str:
    """Apply fn(target) -> new target to every inline link outside code blocks and code spans
    (a code span may run over several lines of a paragraph, never past a blank line)."""
    out, block, fenced = [], [], False

    def flush():
        parts = "".join(block).split("`")
        for i in range(0, len(parts), 2):  # even parts are outside code spans
            parts[i] = _LINK.sub(lambda m: m.group(1) + m.group(2) + fn(m.group(3)) + m.group(4) + m.group(5),
                                 parts[i])
        out.append("`".join(parts))
        block.clear()

    for line in markdown.splitlines(keepends=True):
        if _FENCE.match(line) or fenced:
            flush()
            if _FENCE.match(line):
                fenced = not fenced
            out.append(line)
        elif not line.strip():
            flush()
            out.append(line)
        else:
            block.append(line)
    flush()
    return "".join(out)


def _linked_outside(markdown: str, from_repo_path: str, config) -> set[str]:
    found: set[str] = set()

    def note(link: str) -> str:
        target = _target(link, from_repo_path)
        if target and _site_uri(target[0], config).startswith(PREFIX):
            found.add(target[0])
        return link

    _map_links(markdown, note)
    return found


def on_files(files, config):
    root = _repo_root(config)
    todo = [(f.src_uri, Path(f.abs_src_path)) for f in files.documentation_pages()]
    seen: set[str] = set()
    while todo:
        src_uri, abs_path = todo.pop()
        for repo_path in _linked_outside(abs_path.read_text(encoding="utf-8"), _repo_path(src_uri, config), config):
            if repo_path in seen or not (root / repo_path).is_file():
                continue  # a missing file keeps its link, which MkDocs reports
            seen.add(repo_path)
            file = File.generated(config, PREFIX + repo_path, abs_src_path=str(root / repo_path))
            files.append(file)
            if repo_path.endswith(".md"):
                todo.append((file.src_uri, root / repo_path))
    return files


def on_page_markdown(markdown, page, config, files):
    here = _repo_path(page.file.src_uri, config)
    page_dir = posixpath.dirname(page.file.src_uri)

    def rewrite(link: str) -> str:
        target = _target(link, here)
        if target is None:
            return link
        repo_path, anchor = target
        site_uri = _site_uri(repo_path, config)
        if files.get_file_from_path(site_uri) is None:
            return link  # not published: MkDocs reports the link as written
        return posixpath.relpath(site_uri, page_dir or ".") + anchor

    return _map_links(markdown, rewrite)
