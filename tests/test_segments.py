"""lazy_rag.segments: which token lists assemble() accepts, and the exact plain-int ids it makes of them."""
import enum
import random

import numpy as np
import pytest

from lazy_rag import LazyRagError
from lazy_rag.segments import Chunk, assemble, chunk_token_ids


class Tok:
    """Characters as ids (100 + code point); BOS 1 only with add_special_tokens."""
    bos_token_id = 1

    def __call__(self, text, add_special_tokens=False):
        class Out:
            input_ids = ([1] if add_special_tokens else []) + [100 + ord(c) for c in text]
        return Out()


TOK = Tok()


class Colour(enum.IntEnum):
    RED = 7


class MyInt(int):
    def __int__(self):
        return 99


class PosingAsInt:
    """isinstance(x, int) is True through __class__ though its type is not int."""
    __class__ = property(lambda self: int)

    def __int__(self):
        return 5


# token lists assemble() accepts, and the ids they become (recorded from the per-token-loop code)
ACCEPTED = [
    ([1, 2, 3], [1, 2, 3]),
    ((1, 2, 3), [1, 2, 3]),
    ([True, False, 2], [1, 0, 2]),
    ([True], [1]),
    ([-5, 7], [-5, 7]),
    ([2**70, -(2**70)], [2**70, -(2**70)]),
    ([2**63 - 1, -2**63], [2**63 - 1, -2**63]),
    ([Colour.RED, 3], [7, 3]),
    ([MyInt(4)], [99]),      # int() of an int subclass: its own __int__
    ([PosingAsInt()], [5]),
]
# lists whose items are not Python ints: rejected
REJECTED_ITEMS = [
    [np.int64(3), 4], [np.int32(3)], [np.bool_(True)], [3.0], [1, 3.0], ["a"], [[1, 2]], [(1,), 2], [None],
]
# not a list or tuple: rejected whatever they hold
REJECTED_TYPES = [np.array([1, 2]), range(3), b"ab", bytearray(b"ab"), None, {1: 2}, {1}]


def _plain(ids):
    return [(type(t), t) for t in ids]


@pytest.mark.parametrize("seg,want", ACCEPTED)
def test_accepted_token_lists_become_plain_ints(seg, want):
    lay = assemble(TOK, ["q", seg, [9]])
    assert type(lay.token_ids) is list
    assert _plain(lay.token_ids) == _plain([1, 213, *want, 9])
    assert lay.uncached == list(range(len(want) + 3))
    span_ids = chunk_token_ids(TOK, Chunk(seg))
    assert type(span_ids) is tuple and _plain(span_ids) == _plain(want)
    lay = assemble(TOK, [[5], Chunk(seg, "c"), "x"], (5,), 2, ((90,), (91, 92)))
    (span,) = lay.spans
    assert type(span.token_ids) is tuple and _plain(span.token_ids) == _plain([90, *want, 91, 92])
    assert (span.start, span.chunk_id, span.skip) == (1, "c", 2)
    assert _plain(lay.token_ids) == _plain([5, 90, *want, 91, 92, 220])
    assert lay.uncached == [1, 2, len(want) + 4] and lay.prefix_len == 1
    bare = assemble(TOK, seg)  # a bare token list is the whole prompt
    assert _plain(bare.token_ids) == _plain(want) and bare.spans == []


@pytest.mark.parametrize("seg", REJECTED_ITEMS + REJECTED_TYPES, ids=repr)
def test_rejected_token_lists_give_the_same_errors(seg):
    name = type(seg).__name__
    with pytest.raises(LazyRagError, match=f"^Segment 1 has type {name}; use a str, a list of int token ids"):
        assemble(TOK, ["q", seg])
    with pytest.raises(LazyRagError, match=f"^Chunk content must be a str or a list of int token ids, got {name}$"):
        assemble(TOK, [Chunk(seg), "q"])
    with pytest.raises(LazyRagError, match=f"^Chunk content must be a str or a list of int token ids, got {name}$"):
        chunk_token_ids(TOK, Chunk(seg))


@pytest.mark.parametrize("segs,err", [
    ([np.int64(3), 4], "Segment 0 has type int64;"), ([np.bool_(True)], "Segment 0 has type bool;"),
    ([3.0], "Segment 0 has type float;"), ([1, 3.0], "Segment 0 has type int;"), ([(1,), 2], "Segment 1 has type int;"),
    ([None], "Segment 0 has type NoneType;"), (range(3), "Segment 0 has type int;"),
], ids=repr)
def test_bare_sequence_of_non_ints_is_read_as_segments(segs, err):
    with pytest.raises(LazyRagError, match=f"^{err} use a str, a list of int token ids"):
        assemble(TOK, segs)
    assert assemble(TOK, ["a"]).token_ids == [1, 197] and assemble(TOK, [[1, 2]]).token_ids == [1, 2]


def test_empty_token_lists():
    assert chunk_token_ids(TOK, Chunk([])) == () and chunk_token_ids(TOK, Chunk(())) == ()
    lay = assemble(TOK, [[3], Chunk([]), [], Chunk([4]), [5]])
    assert lay.token_ids == [3, 4, 5] and lay.uncached == [0, 2] and [(s.start, s.token_ids) for s in lay.spans] == [(1, (4,))]
    with pytest.raises(LazyRagError, match="^The prompt tokenizes to zero tokens"):
        assemble(TOK, [Chunk([])])
    with pytest.raises(LazyRagError, match="^The prompt tokenizes to zero tokens"):
        assemble(TOK, [[]])
    with pytest.raises(LazyRagError, match="^The prompt is empty"):
        assemble(TOK, [])


def test_shared_prefix_drops_its_positions_from_uncached():
    lay = assemble(TOK, [[5, 6, 7], Chunk([1, 2, 3]), [8, 9]], (5, 6), 1)
    assert lay.token_ids == [5, 6, 7, 1, 2, 3, 8, 9] and lay.prefix_len == 2
    assert lay.uncached == [2, 3, 6, 7]
    lay = assemble(TOK, ["ab", Chunk([1, 2]), "c"], [1, 197], 5, ((3,), ()))
    assert lay.token_ids == [1, 197, 198, 3, 1, 2, 199] and lay.uncached == [2, 3, 4, 5, 6]
    for segs in ([[4], Chunk([1])], [Chunk([5, 6]), [7]]):
        with pytest.raises(LazyRagError, match="must start with exactly its 1 tokens"):
            assemble(TOK, segs, (5,))


def test_paper_sized_request_round_trips_exactly():
    rng = random.Random(0)
    chunks = [[rng.randrange(-2**40, 2**40) for _ in range(2048)] for _ in range(5)]
    chunks[2][7] = True   # a bool among plain ints: the slow path, still converted
    chunks[3][0] = 2**80  # beyond int64
    head, question = [rng.randrange(50000) for _ in range(20)], [rng.randrange(50000) for _ in range(20)]
    segs = [head, *[Chunk(c if i % 2 else tuple(c), f"c{i}") for i, c in enumerate(chunks)], question]
    lay = assemble(TOK, segs, head[:12], 4)
    want = [int(t) for t in head + [t for c in chunks for t in c] + question]
    assert _plain(lay.token_ids) == _plain(want)
    assert [(s.start, s.chunk_id, s.skip) for s in lay.spans] == [(20 + 2048 * i, f"c{i}", 4) for i in range(5)]
    for s, c in zip(lay.spans, chunks):
        assert type(s.token_ids) is tuple and _plain(s.token_ids) == _plain([int(t) for t in c])
    assert lay.uncached == [*range(12, 20), *(p for i in range(5) for p in range(20 + 2048 * i, 24 + 2048 * i)),
                            *range(20 + 2048 * 5, 40 + 2048 * 5)]
    chunks[1][0] = -1  # the layout holds copies, not the caller's lists
    assert lay.spans[1].token_ids[0] == want[20 + 2048]
