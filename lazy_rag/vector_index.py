"""``VectorIndex``: the nearest-neighbour index over chunk embeddings, keyed by stable int64 ids.

Exact (``kind == "flat"``: ``IndexIDMap2(IndexFlatIP)``) below ``EXACT_BELOW`` vectors; above it
approximate (``kind == "ivf"``: ``IndexIVFFlat``, inner product, the ids in the inverted lists)
where that pays. The vectors are L2-normalised embeddings (embedder.py): inner product = cosine.

The threshold (``benchmarks/vector_index.py``, results/vector_index_cpu.json: 384-d vectors shaped
like all-MiniLM-L6-v2's, this project's 2 shared cores, faiss 1.15.1). One exact query reads every
vector (1.5 KB each); its p50 is 0.3 / 8.5 / 21 / 117 ms at 10k / 100k / 300k / 1M with 1 thread,
and 14 ms at 100k with faiss's default 2 threads (which are 2-5x slower than 1 for a single query
here, worse when the cores are busy). So exact search is fast enough (< 10-20 ms) up to ~100k
vectors: ``EXACT_BELOW = 100_000``. Beyond, IVF at recall@4 >= 0.99 answers in 3.9 ms at 100k and
15 ms at 300k, but on embedding-like data it must scan 40-47% of its lists to get there (nprobe
512 of 1265, 1024 of 2191), so it beats exact search by 2.2x / 1.4x at 1 thread (3.6x / ~7x
at the default 2), not 100x, and costs a k-means at each rebuild (16 s at 100k, 55 s at 300k,
~4.6 min at 1M). Where the tuned nprobe would exceed ``MAX_PROBE_FRACTION`` of the lists, IVF is
no faster than exact: the index stays flat and says so (``ivf_declined``). At 1M such vectors
nprobe 1024 of 4000 gave recall 0.96 (one run, before the grid went past 1024).

How IVF is built (``rebuild``), deterministic for the same vectors and thread count:
- ``nlist = 4 sqrt(n)``, at most ``n / 39`` (faiss's minimum of 39 training points per list),
  trained by faiss's spherical k-means (10 iterations) on a seeded sample of ``40 nlist`` vectors.
- ``nprobe``: the smallest on ``NPROBE_GRID`` whose recall@4 against exact search, over
  ``TUNE_QUERIES`` queries, reaches ``TARGET_RECALL`` (0.99; the project asks >= 0.98).
- The queries: the caller's real question embeddings if it has them (``queries=``), else
  ``tuning_queries``: stored vectors turned by isotropic noise to cosine ``QUERY_COS`` = 0.4.
  Why: real questions are harder for IVF than anything drawn from the stored vectors. On 62,711
  SQuAD-family sentences embedded with all-MiniLM-L6-v2 (nlist 1002), recall@4 0.98 / 0.99 needs
  nprobe 192 / 384 for 3,000 real questions, 128 / 192 for self-retrieval (q = v), 64 / 128 for
  the mean of two stored vectors, 128 / 256 for noise at cosine 0.6, and 192 / 384 for noise at
  cosine 0.4, whose recall-vs-nprobe curve lies on or just under the real questions' (questions
  share a direction of their own: their mean is 0.2 away from the passages' mean, and the best
  passage of a question has cosine ~0.63, its 4th ~0.52). ``benchmarks/vector_index.py --real``.

Updates change only the vectors named: ``add`` and ``remove`` by id. IVF keeps the centroids it
was trained with, so once it holds more than ``GROWTH`` x (or less than 1/``GROWTH`` of) the
vectors it was trained on, or a flat index reaches the threshold, or a measured recall fell below
``MIN_RECALL``, ``needs_rebuild()`` says so and the caller calls ``rebuild`` with every vector.

Bytes (``to_bytes``/``from_bytes``): ``MAGIC``, a 4-byte little-endian header length, a JSON
header (kind, dim, ntotal, nlist, nprobe, trained_on, threshold, recall, ivf_declined, the faiss
bytes' length and sha256), then faiss's own serialisation. Nothing is unpickled; anything else is
rejected with a ``LazyIndexError`` naming what is wrong.

faiss is imported on use (the core runtime imports without it). Threads: faiss's OpenMP setting
(``faiss.omp_set_num_threads``), never changed here; a server answering one question at a time
gains 2-5x on exact search from setting it to 1 (see above). Searches may run concurrently with
each other, not with ``add``/``remove``/``measure_recall``.
"""
from __future__ import annotations

import hashlib
import json
import math
import struct

import numpy as np

from .deps import require
from .errors import LazyIndexError

EXACT_BELOW = 100_000      # flat below this many vectors, IVF from it (see the module docstring)
TARGET_RECALL = 0.99       # nprobe is tuned to reach this recall@TUNE_K
MIN_RECALL = 0.98          # the project's target: a measurement below it asks for a rebuild
TUNE_K = 4                 # the retriever's default top_k
TUNE_QUERIES = 500         # recall at 0.99 over 500 x 4 neighbours: standard error ~0.002
QUERY_COS = 0.4            # cosine of a tuning query to the stored vector it was made from
GROWTH = 4.0               # rebuild IVF beyond GROWTH x, or below 1/GROWTH of, its training size
NLIST_PER_SQRT_N = 4       # nlist = 4 sqrt(n): faiss's guideline for IVF up to ~1M vectors
MIN_POINTS_PER_LIST = 39   # faiss warns below 39 training points per list
TRAIN_POINTS_PER_LIST = 40  # k-means sample: 40 * nlist (faiss: 39 to 256); cost ~ sample * nlist
NPROBE_GRID = tuple(sorted({round(b * 2 ** e) for e in range(17) for b in (1, 1.5)}))  # 1, 2, 3, 4, 6, ... 98304
MAX_PROBE_FRACTION = 0.5  # an IVF that must scan more of its lists than this is no faster than exact: flat
SEED = 1234
KINDS = ("flat", "ivf")
MAGIC = b"LRVECIDX"
FORMAT_VERSION = 1
MAX_HEADER_BYTES = 1 << 20
_TIE_EPS = 1e-5            # a result scoring within this of the exact k-th counts as a hit (duplicates)


def _faiss():
    # imported on use: the core runtime (and the GPU image) works without faiss installed
    return require("faiss")


def nlist_for(n: int) -> int:
    """Inverted lists for ``n`` vectors: 4 sqrt(n), at most n / 39, at least 1."""
    return max(1, min(round(NLIST_PER_SQRT_N * math.sqrt(n)), n // MIN_POINTS_PER_LIST))


def _as_ids(ids) -> np.ndarray:
    ids = np.asarray(ids)
    if ids.ndim != 1 or not (ids.size == 0 or np.issubdtype(ids.dtype, np.integer)):
        raise ValueError(f"ids must be a 1-D array of integers, got shape {ids.shape} dtype {ids.dtype}.")
    ids = np.ascontiguousarray(ids, dtype=np.int64)
    if ids.size and ids.min() < 0:
        raise ValueError(f"ids must be >= 0 (-1 means 'no result'), got {int(ids.min())}.")
    return ids


def _as_vecs(vecs, dim: int, what: str = "vecs") -> np.ndarray:
    vecs = np.asarray(vecs)
    if vecs.ndim != 2 or vecs.shape[1] != dim:
        raise ValueError(f"{what} must have shape (n, {dim}), got {vecs.shape}.")
    if not np.issubdtype(vecs.dtype, np.floating):
        raise ValueError(f"{what} must be floating point, got {vecs.dtype}.")
    vecs = np.ascontiguousarray(vecs, dtype=np.float32)
    if not np.isfinite(vecs).all():
        raise ValueError(f"{what} hold NaN or infinite values.")
    return vecs


def tuning_queries(vecs: np.ndarray, n_queries: int, seed: int = SEED, cos: float = QUERY_COS) -> np.ndarray:
    """Synthetic questions for ``vecs`` (see the module docstring): for a seeded sample of stored
    vectors ``v``, ``q = cos * v + sqrt(1 - cos**2) * r``, ``r`` a random unit vector orthogonal
    to ``v`` (so ``cos(q, v) = cos``, ``|q| = 1``)."""
    rng = np.random.default_rng(seed)
    v = vecs[np.sort(rng.choice(len(vecs), min(n_queries, len(vecs)), replace=False))]
    v = v / np.linalg.norm(v, axis=1, keepdims=True)
    r = rng.standard_normal(v.shape, dtype=np.float32)
    r -= np.sum(r * v, axis=1, keepdims=True) * v
    r /= np.linalg.norm(r, axis=1, keepdims=True)
    q = cos * v + math.sqrt(1 - cos ** 2) * r
    return np.ascontiguousarray(q / np.linalg.norm(q, axis=1, keepdims=True), dtype=np.float32)


def recall_at_k(exact_scores: np.ndarray, exact_ids: np.ndarray, scores: np.ndarray, ids: np.ndarray) -> float:
    """Mean over queries of the share of the exact top-k that a search found. A result counts if
    its id is in the exact top-k, or if it scores as high as the exact k-th (a tie: duplicates)."""
    k = exact_ids.shape[1]
    kth = exact_scores[:, -1:]
    found = (ids[:, :k, None] == exact_ids[:, None, :]).any(-1) | (scores[:, :k] >= kth - _TIE_EPS)
    found &= ids[:, :k] >= 0
    return float(found.sum() / exact_ids.size)


class VectorIndex:
    """See the module docstring. ``index`` is the faiss index (None: an IVF not trained yet)."""

    def __init__(self, index, kind: str, dim: int, *, threshold: int = EXACT_BELOW, nprobe: int | None = None,
                 trained_on: int | None = None, recall: dict | None = None, ids: np.ndarray | None = None,
                 ivf_declined: dict | None = None):
        self.index = index
        self.kind = kind
        self.dim = dim
        self.threshold = threshold
        self.nprobe = nprobe
        self.trained_on = trained_on
        self.recall = recall  # the last measurement (tuning or measure_recall), or None
        # a flat index at or above the threshold: the IVF tried at rebuild needed too large an nprobe
        self.ivf_declined = ivf_declined
        self._ids = np.zeros(0, np.int64) if ids is None else ids  # sorted: the stored ids

    # -- construction ---------------------------------------------------------------------------
    @classmethod
    def create(cls, dim: int, n_expected: int = 0, *, exact_below: int = EXACT_BELOW) -> "VectorIndex":
        """An empty index for about ``n_expected`` vectors: flat below ``exact_below``, else an IVF
        that trains (and tunes nprobe) on its first ``add``. From all vectors at once, ``rebuild``
        trains on a sample of all of them, which is better when the first batch is not typical."""
        if dim < 1 or exact_below < 1:
            raise ValueError(f"dim and exact_below must be >= 1, got {dim} and {exact_below}.")
        if n_expected >= exact_below:
            return cls(None, "ivf", dim, threshold=exact_below)
        return cls(cls._new_flat(dim), "flat", dim, threshold=exact_below)

    @classmethod
    def rebuild(cls, ids, vecs, *, exact_below: int = EXACT_BELOW, queries=None) -> "VectorIndex":
        """A new index over all of ``ids``/``vecs`` (row i has id ids[i]): flat below ``exact_below``,
        else IVF trained on a seeded sample and nprobe tuned on ``queries`` (real question
        embeddings) or, without them, on ``tuning_queries``."""
        vecs = np.asarray(vecs)
        if vecs.ndim != 2:
            raise ValueError(f"vecs must have shape (n, dim), got {vecs.shape}.")
        out = cls.create(vecs.shape[1], len(vecs), exact_below=exact_below)
        out.add(ids, vecs, queries=queries)
        return out

    @staticmethod
    def _new_flat(dim: int):
        faiss = _faiss()
        return faiss.IndexIDMap2(faiss.IndexFlatIP(dim))

    def _train(self, vecs: np.ndarray) -> None:
        faiss = _faiss()
        n = len(vecs)
        nlist = nlist_for(n)
        index = faiss.IndexIVFFlat(faiss.IndexFlatIP(self.dim), self.dim, nlist, faiss.METRIC_INNER_PRODUCT)
        m = min(n, TRAIN_POINTS_PER_LIST * nlist)
        sample = vecs if m == n else vecs[np.sort(np.random.default_rng(SEED).choice(n, m, replace=False))]
        index.cp.seed = SEED
        index.cp.spherical = True  # centroids on the sphere, like the vectors
        index.cp.min_points_per_centroid = 1  # nlist_for already keeps >= 39 points per list where it can
        index.cp.max_points_per_centroid = -(-m // nlist)  # the sample above is the sample: no second one
        index.train(sample)
        self.index, self.trained_on = index, n

    # -- updates --------------------------------------------------------------------------------
    @property
    def ntotal(self) -> int:
        return 0 if self.index is None else int(self.index.ntotal)

    @property
    def nlist(self) -> int | None:
        return int(self.index.nlist) if self.kind == "ivf" and self.index is not None else None

    def ids(self) -> np.ndarray:
        """The stored ids, sorted (a copy)."""
        return self._ids.copy()

    def add(self, ids, vecs, *, queries=None) -> None:
        """Add vectors under new ids (an id already stored, or twice in ``ids``, is an error: remove
        it first). An IVF not trained yet trains on this batch and tunes nprobe (on ``queries``)."""
        ids, vecs = _as_ids(ids), _as_vecs(vecs, self.dim)
        if len(ids) != len(vecs):
            raise ValueError(f"{len(ids)} ids for {len(vecs)} vectors.")
        if not len(ids):
            return
        new = np.sort(ids)
        if (new[1:] == new[:-1]).any():
            raise ValueError(f"ids repeat within one add: {np.unique(new[1:][new[1:] == new[:-1]])[:5].tolist()}.")
        pos = np.searchsorted(self._ids, new)
        present = new[(pos < len(self._ids)) & (self._ids[np.minimum(pos, len(self._ids) - 1)] == new)] \
            if len(self._ids) else new[:0]
        if len(present):
            raise ValueError(f"{len(present)} ids are already in the index (e.g. {present[:5].tolist()}); "
                             "remove them first.")
        first_training = self.index is None
        if first_training:
            self._train(vecs)
        self.index.add_with_ids(vecs, ids)
        self._ids = np.insert(self._ids, pos, new)
        if first_training:
            self._tune(ids, vecs, queries)
            if self.nprobe is None:  # IVF would be no faster than exact search at the target recall
                self.ivf_declined = {"at": self.ntotal, "nlist": self.nlist, **self.recall}
                self.index = self._new_flat(self.dim)
                self.index.add_with_ids(vecs, ids)
                self.kind, self.nprobe, self.trained_on, self.recall = "flat", None, None, None

    def remove(self, ids) -> int:
        """Remove the vectors with these ids (absent ids are ignored); returns how many were removed."""
        ids = _as_ids(ids)
        if not len(ids) or not self.ntotal:
            return 0
        removed = int(self.index.remove_ids(_faiss().IDSelectorBatch(ids)))
        self._ids = self._ids[~np.isin(self._ids, ids)]
        assert len(self._ids) == self.ntotal, (len(self._ids), self.ntotal)
        return removed

    def needs_rebuild(self) -> bool:
        """True when ``rebuild`` would build a better index: a flat index reached the threshold (or,
        where IVF was declined, grew GROWTH x since), an IVF holds more than GROWTH x or less than
        1/GROWTH of what it was trained on, or the last recall measured fell below MIN_RECALL."""
        if self.kind == "flat":
            if self.ivf_declined:  # IVF did not pay off at that size: try again once grown GROWTH x
                return self.ntotal > GROWTH * self.ivf_declined["at"]
            return self.ntotal >= self.threshold
        if self.index is None:
            return False
        if not self.trained_on / GROWTH <= self.ntotal <= self.trained_on * GROWTH:
            return True
        return bool(self.recall) and self.recall["recall_at_k"] < MIN_RECALL

    # -- search ---------------------------------------------------------------------------------
    def search(self, q, k: int) -> tuple[np.ndarray, np.ndarray]:
        """Top ``k`` of each query row: (scores, ids), each (m, k); an empty slot has id -1 and
        score -inf (k larger than ntotal)."""
        q = _as_vecs(q, self.dim, "q")
        if k < 1:
            raise ValueError(f"k must be at least 1, got {k}.")
        if not self.ntotal:
            return np.full((len(q), k), -np.inf, np.float32), np.full((len(q), k), -1, np.int64)
        scores, ids = self.index.search(q, k)
        scores[ids < 0] = -np.inf
        return scores, ids

    def _tune(self, ids: np.ndarray, vecs: np.ndarray, queries=None) -> None:
        """The smallest nprobe on NPROBE_GRID, up to MAX_PROBE_FRACTION of the lists, whose
        recall@TUNE_K reaches TARGET_RECALL; None (with the curve in ``recall``) if none does."""
        q, how = self._queries(vecs, TUNE_QUERIES, queries)
        exact_scores, exact_ids = self._exact(ids, vecs, q, TUNE_K)
        curve, chosen = {}, None
        for nprobe in [p for p in NPROBE_GRID if p <= max(1, MAX_PROBE_FRACTION * self.nlist)]:
            self.index.nprobe = nprobe
            scores, found = self.index.search(q, TUNE_K)
            curve[nprobe] = round(recall_at_k(exact_scores, exact_ids, scores, found), 4)
            if curve[nprobe] >= TARGET_RECALL:
                chosen = nprobe
                break
        self.nprobe = chosen
        self.recall = {"recall_at_k": curve[nprobe], "k": TUNE_K, "n_queries": len(q), "queries": how,
                       "nprobe": nprobe, "ntotal": self.ntotal, "target": TARGET_RECALL,
                       "curve": {str(p): r for p, r in curve.items()}}

    @staticmethod
    def _queries(vecs: np.ndarray, n_queries: int, queries) -> tuple[np.ndarray, str]:
        if queries is not None:
            q = _as_vecs(queries, vecs.shape[1], "queries")
            return q, f"{len(q)} given queries"
        return tuning_queries(vecs, n_queries), (f"synthetic: {min(n_queries, len(vecs))} stored vectors v turned "
                                                 f"by isotropic noise to cos(q, v) = {QUERY_COS}, seed {SEED}")

    @staticmethod
    def _exact(ids: np.ndarray, vecs: np.ndarray, q: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
        scores, rows = _faiss().knn(q, vecs, k, metric=_faiss().METRIC_INNER_PRODUCT)
        return scores, np.where(rows >= 0, ids[np.maximum(rows, 0)], -1)

    def measure_recall(self, ids, vecs, k: int = TUNE_K, n_queries: int = TUNE_QUERIES, *, queries=None) -> dict:
        """recall@k of this index against exact search over ``ids``/``vecs``, which must be every
        stored vector (the caller's copy, e.g. from SQLite); on ``queries`` if given, else on
        ``tuning_queries``. Kept in ``recall`` (``describe``, ``needs_rebuild``) and returned."""
        ids, vecs = _as_ids(ids), _as_vecs(vecs, self.dim)
        if len(ids) != len(vecs):
            raise ValueError(f"{len(ids)} ids for {len(vecs)} vectors.")
        if len(ids) != self.ntotal or not np.array_equal(np.sort(ids), self._ids):
            raise ValueError(f"measure_recall needs every stored vector: got {len(ids)} ids, the index holds "
                             f"{self.ntotal} (or the ids differ).")
        if not len(ids):
            raise ValueError("The index is empty: there is no recall to measure.")
        k = min(k, len(ids))
        q, how = self._queries(vecs, n_queries, queries)
        exact_scores, exact_ids = self._exact(ids, vecs, q, k)
        scores, found = self.search(q, k)
        self.recall = {"recall_at_k": round(recall_at_k(exact_scores, exact_ids, scores, found), 4), "k": k,
                       "n_queries": len(q), "queries": how, "nprobe": self.nprobe, "ntotal": self.ntotal}
        return dict(self.recall)

    def describe(self) -> dict:
        return {"kind": self.kind, "ntotal": self.ntotal, "dim": self.dim, "nlist": self.nlist,
                "nprobe": self.nprobe, "trained_on": self.trained_on, "recall": self.recall,
                "threshold": self.threshold, "ivf_declined": self.ivf_declined, "needs_rebuild": self.needs_rebuild()}

    # -- bytes ----------------------------------------------------------------------------------
    def to_bytes(self) -> bytes:
        payload = _faiss().serialize_index(self.index) if self.index is not None else np.zeros(0, np.uint8)
        header = {"format": FORMAT_VERSION, "kind": self.kind, "dim": self.dim, "ntotal": self.ntotal,
                  "nlist": self.nlist, "nprobe": self.nprobe, "trained_on": self.trained_on,
                  "threshold": self.threshold, "recall": self.recall, "ivf_declined": self.ivf_declined,
                  "faiss_bytes": int(payload.size), "faiss_sha256": hashlib.sha256(payload).hexdigest()}
        head = json.dumps(header, sort_keys=True).encode()
        return b"".join([MAGIC, struct.pack("<I", len(head)), head, payload])

    @classmethod
    def from_bytes(cls, data) -> "VectorIndex":
        """Read ``to_bytes``'s format; anything else raises ``LazyIndexError`` saying what is wrong."""
        view = memoryview(data).cast("B")
        start = len(MAGIC) + 4
        if bytes(view[:len(MAGIC)]) != MAGIC:
            head = bytes(view[:8])
            hint = " (it looks like a Python pickle, which is never loaded)" if head[:1] == b"\x80" else ""
            raise LazyIndexError(f"Not a lazy-rag vector index: it starts with {head!r}, not {MAGIC!r}{hint}.")
        if len(view) < start:
            raise LazyIndexError(f"Vector index truncated: {len(view)} bytes, shorter than its {start}-byte preamble.")
        (hlen,) = struct.unpack("<I", view[len(MAGIC):start])
        if hlen > MAX_HEADER_BYTES or start + hlen > len(view):
            raise LazyIndexError(f"Vector index header length {hlen} does not fit the {len(view)} bytes given "
                                 "(truncated or damaged).")
        try:
            header = json.loads(bytes(view[start:start + hlen]))
        except ValueError as e:
            raise LazyIndexError(f"Vector index header is not valid JSON ({e}).") from None
        h = _check_header(header)
        payload = view[start + hlen:]
        if len(payload) != h["faiss_bytes"]:
            raise LazyIndexError(f"Vector index truncated or padded: the header announces {h['faiss_bytes']} bytes "
                                 f"of faiss index, {len(payload)} follow.")
        if hashlib.sha256(payload).hexdigest() != h["faiss_sha256"]:
            raise LazyIndexError("Vector index damaged: the faiss bytes do not match the header's sha256.")
        index = None
        if len(payload):
            faiss = _faiss()
            try:
                index = faiss.deserialize_index(np.frombuffer(payload, dtype=np.uint8))
            except RuntimeError as e:
                raise LazyIndexError(f"Vector index damaged: faiss cannot read it ({str(e).splitlines()[0]}).") from e
            ids = _check_faiss_index(index, h)
            if h["nprobe"] is not None:
                index.nprobe = h["nprobe"]
        elif h["kind"] == "flat" or h["ntotal"]:
            raise LazyIndexError(f"Vector index damaged: a {h['kind']} index of {h['ntotal']} vectors without "
                                 "faiss bytes.")
        else:
            ids = np.zeros(0, np.int64)
        return cls(index, h["kind"], h["dim"], threshold=h["threshold"], nprobe=h["nprobe"],
                   trained_on=h["trained_on"], recall=h["recall"], ids=ids, ivf_declined=h.get("ivf_declined"))


def _check_header(h) -> dict:
    if not isinstance(h, dict):
        raise LazyIndexError(f"Vector index header is a JSON {type(h).__name__}, not an object.")
    if h.get("format") != FORMAT_VERSION:
        raise LazyIndexError(f"Vector index format {h.get('format')!r}; this lazy-rag reads format {FORMAT_VERSION} "
                             "(rebuild the index, or upgrade lazy-rag if a newer one wrote it).")
    if h.get("kind") not in KINDS:
        raise LazyIndexError(f"Vector index kind {h.get('kind')!r} is not one of {KINDS}.")

    def is_int(v, lo=0):
        return isinstance(v, int) and not isinstance(v, bool) and v >= lo

    ivf = h["kind"] == "ivf"
    trained = ivf and h.get("faiss_bytes")
    checks = {"dim": is_int(h.get("dim"), 1), "ntotal": is_int(h.get("ntotal")),
              "threshold": is_int(h.get("threshold"), 1), "faiss_bytes": is_int(h.get("faiss_bytes")),
              "faiss_sha256": isinstance(h.get("faiss_sha256"), str),
              "nlist": is_int(h.get("nlist"), 1) if trained else h.get("nlist") is None,
              "nprobe": is_int(h.get("nprobe"), 1) if trained else h.get("nprobe") is None,
              "trained_on": is_int(h.get("trained_on"), 1) if trained else h.get("trained_on") is None,
              "recall": h.get("recall") is None or (isinstance(h["recall"], dict)
                                                    and isinstance(h["recall"].get("recall_at_k"), (int, float))),
              "ivf_declined": h.get("ivf_declined") is None or (not ivf and isinstance(h["ivf_declined"], dict)
                                                                and is_int(h["ivf_declined"].get("at"), 1))}
    bad = [f"{k}={h.get(k)!r}" for k, ok in checks.items() if not ok]
    if bad:
        raise LazyIndexError(f"Vector index header ({h['kind']}) has missing or invalid fields: {', '.join(bad)}.")
    return h


def _check_faiss_index(index, h: dict) -> np.ndarray:
    """That the faiss index is the kind the header says, with its dim, size and lists; its ids, sorted."""
    faiss = _faiss()
    index = faiss.downcast_index(index)
    if h["kind"] == "flat":
        inner = faiss.downcast_index(index.index) if isinstance(index, faiss.IndexIDMap2) else None
        ok = isinstance(inner, faiss.IndexFlatIP)
        ids = faiss.vector_to_array(index.id_map) if ok else None
    else:
        ok = isinstance(index, faiss.IndexIVFFlat) and index.metric_type == faiss.METRIC_INNER_PRODUCT
        ids = np.concatenate([np.zeros(0, np.int64)] + [
            faiss.rev_swig_ptr(index.invlists.get_ids(i), index.invlists.list_size(i)).copy()
            for i in range(index.nlist) if index.invlists.list_size(i)]) if ok else None
    want = "IndexIDMap2(IndexFlatIP)" if h["kind"] == "flat" else "IndexIVFFlat (inner product)"
    if not ok:
        raise LazyIndexError(f"Vector index damaged: the header says {h['kind']}, faiss holds a "
                             f"{type(index).__name__}, not an {want}.")
    ivf = h["kind"] == "ivf"
    if index.d != h["dim"] or index.ntotal != h["ntotal"] or (ivf and index.nlist != h["nlist"]):
        have = f"d={index.d}, ntotal={index.ntotal}" + (f", nlist={index.nlist}" if ivf else "")
        said = f"dim={h['dim']}, ntotal={h['ntotal']}" + (f", nlist={h['nlist']}" if ivf else "")
        raise LazyIndexError(f"Vector index damaged: faiss holds {have}; the header says {said}.")
    ids = np.sort(ids.astype(np.int64))
    if len(ids) != index.ntotal or (ids[1:] == ids[:-1]).any() or (len(ids) and ids[0] < 0):
        raise LazyIndexError("Vector index damaged: its ids repeat or are negative.")
    return ids
