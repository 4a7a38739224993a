"""VectorIndex (lazy_rag/vector_index.py): exact below the threshold (checked against numpy), IVF
above it with recall@4 >= 0.98, add/remove by id, bytes that keep ids and tuning and reject
anything else (a pickle is never run), needs_rebuild, k larger than the index. Small synthetic
sets and small thresholds (``exact_below=``): seconds on 2 cores."""
import hashlib
import json
import pickle
import struct
import sys

import numpy as np
import pytest

faiss = pytest.importorskip("faiss")

from lazy_rag.errors import LazyIndexError  # noqa: E402
from lazy_rag.vector_index import MAGIC, VectorIndex, nlist_for, tuning_queries  # noqa: E402


def normalise(x):
    return (x / np.linalg.norm(x, axis=1, keepdims=True)).astype(np.float32)


def uniform(n, dim=32, seed=0):
    return normalise(np.random.default_rng(seed).standard_normal((n, dim), dtype=np.float32))


def clustered(n, dim=384, seed=0):
    """Shaped like sentence embeddings, hard for IVF as they are: benchmarks/vector_index.py's
    ``clustered`` (Gaussian clusters with a power-law spectrum around a shared direction)."""
    rng = np.random.default_rng(seed)
    scale = np.arange(1, dim + 1, dtype=np.float32) ** -0.35
    rot = np.linalg.qr(rng.standard_normal((dim, dim)))[0].astype(np.float32)

    def gauss(m):
        return (rng.standard_normal((m, dim), dtype=np.float32) * scale / np.linalg.norm(scale)) @ rot

    clusters = max(1, n // 50)
    centres = 0.3 * normalise(rng.standard_normal((1, dim), dtype=np.float32)) + 0.85 * gauss(clusters)
    width = np.exp(0.3 * rng.standard_normal((clusters, 1))).astype(np.float32)
    label = rng.integers(0, clusters, n)
    return normalise(centres[label] + width[label] * gauss(n))


def tight(n, dim=128, seed=0):
    """Well separated clusters of 50 (cosine ~0.9 to their centre): IVF pays off on these even at
    a few thousand vectors, so the update and bytes tests exercise it."""
    rng = np.random.default_rng(seed)
    centres = normalise(rng.standard_normal((max(1, n // 50), dim), dtype=np.float32))
    noise = normalise(rng.standard_normal((n, dim), dtype=np.float32))
    return normalise(centres[rng.integers(0, len(centres), n)] + 0.5 * noise)


def ids_for(n, seed=1):
    """Sparse, shuffled ids, like SQLite rowids after deletions."""
    return np.random.default_rng(seed).permutation(np.arange(n, dtype=np.int64) * 3 + 11)


def brute_force(ids, x, q, k):
    scores = q @ x.T
    order = np.argsort(-scores, axis=1, kind="stable")[:, :k]
    return np.take_along_axis(scores, order, 1), ids[order]


# -- exact and IVF ---------------------------------------------------------------------------------
def test_flat_below_threshold_is_brute_force():
    x, ids, q = uniform(2000), ids_for(2000), uniform(25, seed=5)
    index = VectorIndex.rebuild(ids, x, exact_below=5000)
    assert index.kind == "flat" and index.ntotal == 2000 and index.nprobe is None and not index.needs_rebuild()
    scores, found = index.search(q, 6)
    ref_scores, ref_ids = brute_force(ids, x, q, 6)
    np.testing.assert_array_equal(found, ref_ids)
    np.testing.assert_allclose(scores, ref_scores, atol=1e-5)


def test_ivf_above_threshold_is_tuned_and_described():
    x, ids = tight(6000), ids_for(6000)
    index = VectorIndex.rebuild(ids, x, exact_below=5000)
    d = index.describe()
    assert d["kind"] == "ivf" and d["ntotal"] == 6000 and d["nlist"] == nlist_for(6000) == 153
    assert d["trained_on"] == 6000 and d["threshold"] == 5000 and not d["needs_rebuild"] and d["ivf_declined"] is None
    assert 1 <= d["nprobe"] <= d["nlist"] and d["recall"]["recall_at_k"] >= 0.99 and d["recall"]["k"] == 4
    assert "synthetic" in d["recall"]["queries"] and d["recall"]["n_queries"] == 500
    # the curve it tuned on is monotone and stops at the first nprobe reaching the target
    curve = [d["recall"]["curve"][p] for p in sorted(d["recall"]["curve"], key=int)]
    assert curve == sorted(curve) and all(r < 0.99 for r in curve[:-1])


def test_ivf_recall_on_clustered_384d():
    x, ids = clustered(30_000), ids_for(30_000)
    index = VectorIndex.rebuild(ids, x, exact_below=5000)
    assert index.kind == "ivf" and index.recall["recall_at_k"] >= 0.99
    # fresh queries (another seed than tuning used), of the tuning kind and of self-retrieval
    m = index.measure_recall(ids, x, queries=tuning_queries(x, 400, seed=7))
    assert m["recall_at_k"] >= 0.98 and m["n_queries"] == 400 and m["queries"] == "400 given queries", m
    assert index.measure_recall(ids, x, queries=x[:300])["recall_at_k"] >= 0.98
    # on the default synthetic queries, and the result is kept for describe()
    m = index.measure_recall(ids, x, k=4, n_queries=200)
    assert m["recall_at_k"] >= 0.98 and index.describe()["recall"] == m
    with pytest.raises(ValueError, match="every stored vector"):
        index.measure_recall(ids[:-1], x[:-1])


def test_ivf_that_does_not_pay_off_stays_exact():
    """Uniform random vectors: IVF needs most of its lists for recall@4 0.99, no faster than exact
    search, so the index stays flat and says why; it tries IVF again after growing 4x."""
    x, ids = uniform(3000), ids_for(3000)
    index = VectorIndex.rebuild(ids, x, exact_below=1000)
    d = index.describe()
    assert d["kind"] == "flat" and d["nprobe"] is None and d["recall"] is None and not d["needs_rebuild"]
    assert d["ivf_declined"]["at"] == 3000 and d["ivf_declined"]["nlist"] == nlist_for(3000)
    assert d["ivf_declined"]["recall_at_k"] < 0.99 and max(map(int, d["ivf_declined"]["curve"])) <= nlist_for(3000) / 2
    np.testing.assert_array_equal(index.search(x[:5], 4)[1], brute_force(ids, x, x[:5], 4)[1])
    back = VectorIndex.from_bytes(index.to_bytes())
    assert back.describe() == d
    more = uniform(12_001, seed=9)[3000:]
    back.add(np.arange(len(more) - 1) + 10**9, more[:-1])
    assert back.ntotal == 12_000 and not back.needs_rebuild()  # 4x where IVF was declined: not yet
    back.add(np.array([5]), more[-1:])
    assert back.needs_rebuild()


def test_rebuild_is_deterministic():
    x, ids = tight(8000), ids_for(8000)
    a = VectorIndex.rebuild(ids, x, exact_below=1000)
    b = VectorIndex.rebuild(ids, x, exact_below=1000)
    assert a.kind == "ivf" and a.to_bytes() == b.to_bytes()


def test_tuning_queries_are_questions_not_copies():
    x = clustered(5000, dim=64)
    q = tuning_queries(x, 300)
    np.testing.assert_allclose(np.linalg.norm(q, axis=1), 1, atol=1e-5)
    best = (q @ x.T).max(1)
    assert (best >= 0.4 - 1e-5).all() and np.median(best) < 0.7  # cos 0.4 to its source, not on any vector
    np.testing.assert_array_equal(q, tuning_queries(x, 300))
    assert not np.array_equal(q, tuning_queries(x, 300, seed=8))


# -- updates ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("exact_below", [10_000, 1000], ids=["flat", "ivf"])
def test_add_and_remove_by_id(exact_below):
    x, ids = tight(4000), ids_for(4000)
    index = VectorIndex.rebuild(ids[:3000], x[:3000], exact_below=exact_below)
    assert index.kind == ("flat" if exact_below > 3000 else "ivf")
    index.add(ids[3000:], x[3000:])
    assert index.ntotal == 4000 and np.array_equal(index.ids(), np.sort(ids))
    _, found = index.search(x[3990:], 1)
    assert found[:, 0].tolist() == ids[3990:].tolist()  # a vector's nearest is itself, under its id

    gone = ids[[5, 3500, 3999]]
    assert index.remove(np.append(gone, 10**12)) == 3  # an absent id is ignored
    assert index.ntotal == 3997 and not np.isin(gone, index.ids()).any()
    _, found = index.search(x[[5, 3500, 3999]], 10)
    assert not np.isin(found, gone).any()
    assert index.remove(gone) == 0

    with pytest.raises(ValueError, match="already in the index"):
        index.add(ids[:2], x[:2])
    with pytest.raises(ValueError, match="repeat"):
        index.add(np.array([7, 7]), x[:2])
    with pytest.raises(ValueError, match=r"shape \(n, 128\)"):
        index.add(np.array([1]), x[:1, :16])
    with pytest.raises(ValueError, match=">= 0"):
        index.add(np.array([-1]), x[:1])
    index.add(gone, x[[5, 3500, 3999]])  # back under the same ids
    _, found = index.search(x[[5]], 1)
    assert found[0, 0] == gone[0]


def test_create_then_add_trains_ivf_on_first_batch():
    x, ids = tight(3000), ids_for(3000)
    index = VectorIndex.create(128, n_expected=50_000, exact_below=2000)
    assert index.kind == "ivf" and index.ntotal == 0 and index.nlist is None
    assert index.search(x[:2], 3)[1].tolist() == [[-1] * 3] * 2
    empty = VectorIndex.from_bytes(index.to_bytes())
    assert empty.kind == "ivf" and empty.ntotal == 0
    index.add(ids, x)
    assert index.trained_on == 3000 and index.nlist == nlist_for(3000) and index.recall["recall_at_k"] >= 0.99
    assert VectorIndex.create(128, n_expected=10).kind == "flat"


def test_needs_rebuild():
    x, ids = tight(9000), ids_for(9000)
    flat = VectorIndex.rebuild(ids[:900], x[:900], exact_below=1000)
    assert flat.kind == "flat" and not flat.needs_rebuild()
    flat.add(ids[900:1000], x[900:1000])
    assert flat.needs_rebuild()  # reached the threshold

    ivf = VectorIndex.rebuild(ids[:2000], x[:2000], exact_below=1000)
    assert ivf.kind == "ivf" and not ivf.needs_rebuild()
    ivf.add(ids[2000:8000], x[2000:8000])
    assert ivf.ntotal == 8000 and not ivf.needs_rebuild()  # exactly 4x: not yet
    ivf.add(ids[8000:8001], x[8000:8001])
    assert ivf.needs_rebuild()  # grew past 4x what it was trained on
    again = VectorIndex.rebuild(ids[:8001], x[:8001], exact_below=1000)
    assert again.trained_on == 8001 and not again.needs_rebuild()

    again.remove(ids[:6000])
    assert again.ntotal == 2001 and not again.needs_rebuild()
    again.remove(ids[6000:6001])
    assert again.needs_rebuild()  # shrank below 1/4

    ivf = VectorIndex.rebuild(ids[:2000], x[:2000], exact_below=1000)
    ivf.recall = {**ivf.recall, "recall_at_k": 0.9}  # a measurement below the project's 0.98
    assert ivf.needs_rebuild()


@pytest.mark.parametrize("exact_below", [10_000, 1000], ids=["flat", "ivf"])
def test_search_k_larger_than_ntotal(exact_below):
    x, ids = tight(2000), ids_for(2000)
    index = VectorIndex.rebuild(ids, x, exact_below=exact_below)
    assert index.kind == ("flat" if exact_below > 2000 else "ivf")
    index.remove(ids[3:])
    scores, found = index.search(x[:2], 10)
    assert scores.shape == found.shape == (2, 10)
    assert (found[:, 3:] == -1).all() and np.isneginf(scores[:, 3:]).all()
    if index.kind == "flat":
        assert sorted(found[0, :3].tolist()) == sorted(ids[:3].tolist()) and np.isfinite(scores[:, :3]).all()
    else:  # IVF finds only what lies in the lists it probes: the query's own vector at least
        assert found[:, 0].tolist() == ids[:2].tolist() and set(found[found >= 0].tolist()) <= set(ids[:3].tolist())
        assert (np.isfinite(scores) == (found >= 0)).all()
    with pytest.raises(ValueError, match="k must be"):
        index.search(x[:1], 0)


# -- bytes -----------------------------------------------------------------------------------------
@pytest.mark.parametrize("exact_below", [10_000, 1000], ids=["flat", "ivf"])
def test_bytes_round_trip_keeps_ids_and_tuning(exact_below):
    x, ids = tight(3000), ids_for(3000)
    index = VectorIndex.rebuild(ids, x, exact_below=exact_below)
    assert index.kind == ("flat" if exact_below > 3000 else "ivf")
    index.remove(ids[:10])
    data = index.to_bytes()
    assert data.startswith(MAGIC)
    back = VectorIndex.from_bytes(data)
    assert back.describe() == index.describe()
    assert np.array_equal(back.ids(), index.ids())
    q = tuning_queries(x, 50, seed=3)
    for a, b in zip(back.search(q, 4), index.search(q, 4)):
        np.testing.assert_array_equal(a, b)
    back.add(ids[:10], x[:10])  # it goes on updating by id
    assert back.ntotal == 3000 and back.to_bytes() != data
    assert VectorIndex.from_bytes(bytearray(data)).ntotal == 2990  # any bytes-like


def _with_header(data: bytes, **changes) -> bytes:
    (n,) = struct.unpack("<I", data[len(MAGIC):len(MAGIC) + 4])
    start = len(MAGIC) + 4
    header = json.loads(data[start:start + n])
    header.update(changes)
    head = json.dumps(header).encode()
    return MAGIC + struct.pack("<I", len(head)) + head + data[start + n:]


class _Boom:
    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):  # unpickling this would create the marker file
        return open, (str(self.marker), "w")


def test_malformed_bytes_are_rejected_with_a_reason(tmp_path):
    x, ids = tight(2000), ids_for(2000)
    flat = VectorIndex.rebuild(ids[:200], x[:200]).to_bytes()
    ivf = VectorIndex.rebuild(ids, x, exact_below=1000)
    assert ivf.kind == "ivf"
    ivf = ivf.to_bytes()

    marker = tmp_path / "pwned"
    payload = pickle.dumps(_Boom(marker))
    with pytest.raises(LazyIndexError, match="pickle, which is never loaded"):
        VectorIndex.from_bytes(payload)
    assert not marker.exists()
    # a pickle behind a valid-looking header does not reach pickle either
    start = len(MAGIC) + 4 + struct.unpack("<I", flat[len(MAGIC):len(MAGIC) + 4])[0]
    with pytest.raises(LazyIndexError, match="truncated or padded"):
        VectorIndex.from_bytes(flat[:start] + payload)
    assert not marker.exists()

    cases = {
        b"": "starts with",
        b"\x00" * 100: "Not a lazy-rag vector index",
        MAGIC: "truncated",
        MAGIC + struct.pack("<I", 10**6) + b"{}": "header length",
        MAGIC + struct.pack("<I", 5) + b"{oops": "not valid JSON",
        MAGIC + struct.pack("<I", 2) + b"[]": "JSON list, not an object",
        flat[:-7]: "truncated or padded",
        flat + b"\x00": "truncated or padded",
        flat[:-40] + bytes(40): "sha256",
        _with_header(flat, format=99): "format 99",
        _with_header(flat, kind="hnsw"): "kind 'hnsw'",
        _with_header(flat, dim="384"): "dim='384'",
        _with_header(flat, ntotal=-1): "ntotal=-1",
        _with_header(ivf, nprobe=None): "nprobe=None",
        _with_header(flat, ntotal=199): "ntotal=200.*ntotal=199",
        _with_header(flat, dim=16): "d=128.*dim=16",
    }
    for data, why in cases.items():
        with pytest.raises(LazyIndexError, match=why):
            VectorIndex.from_bytes(data)

    # the header says flat, the faiss bytes are an IVF (consistent checksum): the kinds disagree
    lying = _with_header(ivf, kind="flat", nlist=None, nprobe=None, trained_on=None)
    with pytest.raises(LazyIndexError, match="says flat, faiss holds a IndexIVFFlat"):
        VectorIndex.from_bytes(lying)
    # faiss bytes that faiss cannot parse, with a matching checksum
    junk = b"ZZZZ" + bytes(100)
    bad = _with_header(flat[:start] + junk, faiss_bytes=len(junk), faiss_sha256=hashlib.sha256(junk).hexdigest())
    with pytest.raises(LazyIndexError, match="faiss cannot read it"):
        VectorIndex.from_bytes(bad)


def test_faiss_is_imported_on_use(monkeypatch):
    import ast
    import lazy_rag.vector_index as module

    tree = ast.parse(open(module.__file__).read())
    top = [a.name for n in tree.body if isinstance(n, ast.Import) for a in n.names]
    top += [n.module for n in tree.body if isinstance(n, ast.ImportFrom) and n.module]
    assert "faiss" not in top, top
    monkeypatch.setitem(sys.modules, "faiss", None)  # as if not installed
    with pytest.raises(ImportError, match="pip install faiss-cpu"):
        VectorIndex.create(8)
