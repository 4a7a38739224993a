"""Shared fixtures: a tiny corpus and helpers to rebuild an integration's request by hand."""
import pytest

from lazy_rag import Chunk
from tests.helpers import torch_kernels


@pytest.fixture(scope="module", autouse=True)
def _torch_kernels():
    """(module-scoped, so that the servers and engine processes a module starts inherit it)"""
    with torch_kernels():
        yield


DOCS = {
    "bakery": ("Kestrel Street Bakery opens at six in the morning, Tuesday to Sunday, and closes on Mondays. "
               "Its best-known product is the harbour loaf, a rye sourdough baked in a wood-fired oven."),
    "lighthouse": ("The Grey Heron lighthouse stands on a granite spit north of Port Sallow. Its lamp was "
                   "electrified in 1931 and its beam can be seen from twenty-two nautical miles away."),
    "observatory": ("The Marrow Hill observatory houses a 60 centimetre reflecting telescope built in 1962. "
                    "Public viewing nights are held on the first Friday of every month."),
}


@pytest.fixture(scope="session")
def tiny_docs():
    """Three one-chunk documents: name -> text."""
    return dict(DOCS)


@pytest.fixture
def capture_prompts(monkeypatch):
    """Record every prompt string an integration hands to the runtime's span matcher."""

    def install(runtime):
        prompts = []
        original = runtime.plan_prompt

        def spy(prompt, *args, **kwargs):
            prompts.append(prompt)
            return original(prompt, *args, **kwargs)

        monkeypatch.setattr(runtime, "plan_prompt", spy)
        return prompts

    return install


def _segments_by_hand(prompt, chunks):
    spans = sorted((prompt.index(text), text, ids, cid) for text, ids, cid in chunks)
    segments, pos = [], 0
    for at, text, ids, cid in spans:
        if at > pos:
            segments.append(prompt[pos:at])
        segments.append(Chunk(list(ids), chunk_id=cid))
        pos = at + len(text)
    segments.append(prompt[pos:])
    return segments


@pytest.fixture
def segments_by_hand():
    """The request rebuilt without the matcher: ``chunks`` are (text, token_ids, chunk_id) that
    must each occur verbatim in ``prompt``; every other character stays uncached text."""
    return _segments_by_hand
