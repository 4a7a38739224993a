"""The KV store on its own (no model): records appended to segment files and read back by their
recorded (segment, offset, length), fp8 KV with its scales, a new segment past the size limit,
a writer killed mid-append (its bytes never read, cut off by the next writer), compaction of
sparse segments, writes from a writer thread while another thread reads, and a full disk."""
import errno
import os
import signal
import subprocess
import sys
import threading
import time
import zlib

import pytest
import torch

import lazy_rag.store as store_mod
from lazy_rag.chunk_kv import NOT_IN_MEMORY, ChunkKV
from lazy_rag.kv_record import RECORD_HEADER, record_metadata
from lazy_rag.store import ChunkStore, IndexDB, KVLocation, segment_name


def kv_of(i: int, tokens: int = 3, layers: int = 2) -> ChunkKV:
    g = torch.Generator().manual_seed(i)
    return ChunkKV(torch.randn(layers, tokens, 2, 8, generator=g), torch.randn(layers, tokens, 2, 8, generator=g))


def same(a: ChunkKV, b: ChunkKV) -> bool:
    return all(torch.equal(x.view(torch.uint8), y.view(torch.uint8)) for x, y in zip(a.tensors().values(),
                                                                                   b.tensors().values())) \
        and a.tensors().keys() == b.tensors().keys()


def commit_staged(store: ChunkStore) -> None:
    """A build's commit for a store used alone: rows for the staged records, the segments' lengths."""
    store.flush()
    with store.db.transaction() as cur:
        cur.executemany("INSERT OR REPLACE INTO chunks (id, kv_seg, kv_off, kv_len, kv_crc) VALUES (?, ?, ?, ?, ?)",
                        [(cid, loc.seg, loc.off, loc.length, loc.crc) for cid, loc in store.staged_items()])
        store.commit_build(cur)
    store.end_build(committed=True)


def committed_lengths(root) -> dict:
    db = IndexDB(root)
    try:
        return db.segments()
    finally:
        db.close()


def test_records_are_appended_to_segments_and_read_back_by_location(tmp_path):
    store = ChunkStore(tmp_path, "fp")
    kvs = {f"c{i}": kv_of(i, tokens=2 + i) for i in range(5)}
    spans = [store.write(cid, [i, i + 1], kv) for i, (cid, kv) in enumerate(kvs.items())]
    assert [p.name for p in (tmp_path / "kv").iterdir()] == [segment_name(1)]  # one file, not one per chunk
    assert (tmp_path / "kv" / segment_name(1)).stat().st_size == sum(spans)
    locs = [store.location(cid) for cid in kvs]
    assert [loc.off for loc in locs] == [sum(spans[:i]) + RECORD_HEADER.size for i in range(5)]
    fresh = ChunkStore(tmp_path, "fp")  # another process: the locations come from the chunk table
    for i, (cid, kv) in enumerate(kvs.items()):
        got, why = fresh.read(cid, [i, i + 1])
        assert why is None and same(got, kv)
    # a record describes itself: the chunk, the token-id hash, the fingerprint, each tensor's CRC
    body = os.pread(os.open(tmp_path / "kv" / segment_name(1), os.O_RDONLY), locs[2].length, locs[2].off)
    meta = record_metadata(body)
    assert meta["chunk"] == "c2" and meta["fingerprint"] == "fp" and {"k_crc32", "v_crc32"} <= set(meta)
    assert zlib.crc32(body) == locs[2].crc
    assert fresh.read("c1", [9, 9])[1] == "token ids differ"
    assert ChunkStore(tmp_path, "other-model").read("c1", [1, 2])[1].startswith("computed by another model")
    assert fresh.read("nope", [1])[1] == "missing"


def test_fp8_kv_and_its_scales_round_trip(tmp_path):
    """Quantised KV (float8_e4m3fn k/v, float16 scales per layer, token and head) is stored as it is:
    never cast to the store's dtype, every byte back, each tensor under its own checksum."""
    g = torch.Generator().manual_seed(0)
    k = (torch.randn(2, 5, 2, 8, generator=g) * 3).to(torch.float8_e4m3fn)
    v = (torch.randn(2, 5, 2, 8, generator=g) * 3).to(torch.float8_e4m3fn)
    scales = (torch.rand(2, 5, 2, generator=g) + 0.5).half(), (torch.rand(2, 5, 2, generator=g) + 0.5).half()
    kv = ChunkKV(k, v, *scales)
    store = ChunkStore(tmp_path, "fp", kv_dtype=torch.bfloat16)  # the index's dtype applies to unquantised KV only
    store.write("q", [7, 8, 9, 10, 11], kv)
    got, why = ChunkStore(tmp_path, "fp").read("q", [7, 8, 9, 10, 11])
    assert why is None and got.quantized and got.k.dtype == torch.float8_e4m3fn and got.k_scale.dtype == torch.float16
    assert same(got, kv)
    loc = store.location("q")
    meta = record_metadata(store.read_body(loc)[0])
    assert {"k_crc32", "v_crc32", "k_scale_crc32", "v_scale_crc32"} <= set(meta) and meta["dtype"] == "float8_e4m3fn"
    # a flipped bit in a scale is caught (a wrong scale would silently rescale every value)
    plain = ChunkStore(tmp_path, "fp", kv_dtype=torch.bfloat16)
    plain.write("p", [1], kv_of(3))
    assert plain.read("p", [1])[0].k.dtype == torch.bfloat16
    path = tmp_path / "kv" / segment_name(loc.seg)
    data = bytearray(path.read_bytes())
    data[loc.off + loc.length - 2] ^= 0x01  # inside the last tensor's bytes
    path.write_bytes(bytes(data))
    assert ChunkStore(tmp_path, "fp").read("q", [7, 8, 9, 10, 11])[1] == "checksum mismatch (corrupt)"
    # the engine's read (record CRC only, no per-tensor pass) catches it too
    assert ChunkStore(tmp_path, "fp").read_nowait("q", [7, 8, 9, 10, 11], tensor_crcs=False)[1] in (
        "checksum mismatch (corrupt)", "not in memory")
    assert ChunkStore(tmp_path, "fp").read("q", [7, 8, 9, 10, 11], tensor_crcs=False)[1] == "checksum mismatch (corrupt)"


def test_a_read_is_one_buffer_whose_views_are_the_tensors(tmp_path):
    """``read`` copies a record once, into one uint8 buffer; the tensors are views of it (the
    engine's reads go straight to pinned memory this way), equal to what was written."""
    store = ChunkStore(tmp_path, "fp")
    kv = kv_of(3)
    store.write("a", [1, 2, 3], kv)
    got, why = store.read("a", [1, 2, 3], tensor_crcs=False)
    assert why is None and same(got, kv)
    assert got.k.untyped_storage().data_ptr() == got.v.untyped_storage().data_ptr()
    assert store.in_memory("missing") is None  # no record: nothing to tell


def test_a_new_segment_starts_past_the_size_limit(tmp_path, monkeypatch):
    span = ChunkStore(tmp_path / "x", "fp").pack("c0", [0], kv_of(0)).span
    monkeypatch.setattr(store_mod, "SEGMENT_BYTES", 3 * span)
    store = ChunkStore(tmp_path, "fp")
    for i in range(7):
        store.write(f"c{i}", [i], kv_of(i))  # ids of one digit: every record is the same size
    assert sorted(p.name for p in (tmp_path / "kv").iterdir()) == [segment_name(n) for n in (1, 2, 3)]
    assert [store.location(f"c{i}").seg for i in range(7)] == [1, 1, 1, 2, 2, 2, 3]
    assert committed_lengths(tmp_path) == {1: 3 * span, 2: 3 * span, 3: span}
    assert all(ChunkStore(tmp_path, "fp").read(f"c{i}", [i])[1] is None for i in range(7))


WRITER = """
import sys, torch
from lazy_rag.chunk_kv import ChunkKV
from lazy_rag.store import ChunkStore
store = ChunkStore(sys.argv[1], "fp")
store.begin_build()  # a build: records staged, committed only at its end (which never comes)
print("writing", flush=True)
i = 0
while True:
    store.write(f"s{i}", [i], ChunkKV(torch.randn(4, 64, 2, 32), torch.randn(4, 64, 2, 32)))
    i += 1
"""


def test_a_writer_killed_mid_append_leaves_bytes_that_are_never_read_and_cut_off(tmp_path):
    store = ChunkStore(tmp_path, "fp")
    store.write("a", [1], kv_of(1))
    seg = tmp_path / "kv" / segment_name(1)
    committed = seg.stat().st_size
    child = subprocess.Popen([sys.executable, "-c", WRITER, str(tmp_path)], stdout=subprocess.PIPE, text=True)
    try:
        assert child.stdout.readline().strip() == "writing"
        deadline = time.monotonic() + 60
        while seg.stat().st_size < committed + (1 << 20) and time.monotonic() < deadline:
            time.sleep(0.01)
    finally:
        child.send_signal(signal.SIGKILL)  # mid-append, very likely half-way through a record
        child.wait()
    assert seg.stat().st_size > committed  # the killed writer's bytes are there
    with open(seg, "ab") as f:
        f.write(b"LRKV" + b"\x00" * 7)  # and a record header cut short, to be sure
    assert committed_lengths(tmp_path) == {1: committed}  # none of them committed
    reader = ChunkStore(tmp_path, "fp")
    assert reader.read("a", [1])[1] is None and reader.read("s0", [0])[1] == "missing"
    nxt = ChunkStore(tmp_path, "fp")
    nxt.begin_build()  # the next writer starts at the committed length
    assert seg.stat().st_size == committed
    nxt.write("b", [2], kv_of(2))
    commit_staged(nxt)
    assert nxt.location("b").off == committed + RECORD_HEADER.size
    assert all(ChunkStore(tmp_path, "fp").read(c, [i])[1] is None for c, i in (("a", 1), ("b", 2)))


def test_compaction_copies_the_live_records_of_sparse_segments_and_deletes_them(tmp_path, monkeypatch):
    span = ChunkStore(tmp_path / "x", "fp").pack("c0", [0], kv_of(0)).span
    monkeypatch.setattr(store_mod, "SEGMENT_BYTES", 4 * span)
    store = ChunkStore(tmp_path, "fp")
    kvs = {f"c{i}": kv_of(i) for i in range(10)}
    for i, (cid, kv) in enumerate(kvs.items()):
        store.write(cid, [i], kv)
    assert committed_lengths(tmp_path) == {1: 4 * span, 2: 4 * span, 3: 2 * span}
    # a build drops c0, c1, c2 (segment 1: 1/4 live) and c4 (segment 2: 3/4 live)
    b = ChunkStore(tmp_path, "fp")
    b.begin_build()
    with b.db.transaction() as cur:
        cur.execute("DELETE FROM chunks WHERE id IN ('c0', 'c1', 'c2', 'c4')")
        moved = b.compact(cur)
        b.commit_build(cur)
    assert (tmp_path / "kv" / segment_name(1)).exists()  # deleted only once the commit is durable
    b.end_build(committed=True)
    assert moved == (1, span)  # c3 only; segment 2 is 3/4 live, segment 3 the tail and all live
    assert not (tmp_path / "kv" / segment_name(1)).exists()
    assert committed_lengths(tmp_path) == {2: 4 * span, 3: 3 * span}
    reader = ChunkStore(tmp_path, "fp")
    assert reader.location("c3").seg == 3
    for i, (cid, kv) in enumerate(kvs.items()):
        got, why = reader.read(cid, [i])
        assert (why == "missing") if cid in ("c0", "c1", "c2", "c4") else (why is None and same(got, kv))
    # the tail itself compacts too: a new segment is started for its live records
    b = ChunkStore(tmp_path, "fp")
    b.begin_build()
    with b.db.transaction() as cur:
        cur.execute("DELETE FROM chunks WHERE id IN ('c8', 'c9')")
        assert b.compact(cur) == (1, span)  # c3, out of segment 3 (1/3 live) into segment 4
        b.commit_build(cur)
    b.end_build(committed=True)
    assert sorted(committed_lengths(tmp_path)) == [2, 4] and ChunkStore(tmp_path, "fp").read("c3", [3])[1] is None


@pytest.mark.parametrize("min_s,checkpointed", [(0.0, 6), (3600.0, 0)])
def test_checkpoints_are_rate_limited(tmp_path, monkeypatch, min_s, checkpointed):
    """A build checkpoints every CHECKPOINT_BYTES, but not again within CHECKPOINT_MIN_S of the
    last checkpoint (or of the build's start): each one waits for an fsync."""
    monkeypatch.setattr(store_mod, "CHECKPOINT_BYTES", 1)
    monkeypatch.setattr(store_mod, "CHECKPOINT_MIN_S", min_s)
    store = ChunkStore(tmp_path, "fp")
    store.write("first", [0], kv_of(0))
    store.begin_build()
    for i in range(checkpointed or 6):
        store.write(f"c{i}", [i], kv_of(i))
    pending = IndexDB(tmp_path)
    assert pending.one("SELECT count(*) FROM pending_kv")[0] == checkpointed
    pending.close()
    assert (store.checkpoint_s > 0) == bool(checkpointed)
    store.end_build(committed=False)
    store.begin_build()   # the next build's checkpoint time starts from zero
    assert store.checkpoint_s == 0.0
    store.end_build(committed=False)


def test_writes_from_a_writer_thread_while_another_thread_reads(tmp_path, monkeypatch):
    """A build's writer thread appends (and checkpoints) while the main thread reads what it
    staged; every record lands whole, at the location it was staged under."""
    span = ChunkStore(tmp_path / "x", "fp").pack("c00", [0], kv_of(0)).span
    monkeypatch.setattr(store_mod, "CHECKPOINT_BYTES", 5 * span)  # checkpoints commit from the writer thread
    monkeypatch.setattr(store_mod, "CHECKPOINT_MIN_S", 0.0)
    store = ChunkStore(tmp_path, "fp")
    store.write("first", [0], kv_of(0))  # the database exists, as in a build
    store.begin_build()
    kvs = {f"c{i:02d}": kv_of(i) for i in range(40)}
    failures = []

    def writer():
        try:
            for i, (cid, kv) in enumerate(kvs.items()):
                assert store.write(cid, [i], kv) == span
        except BaseException as e:  # surfaced below
            failures.append(e)

    t = threading.Thread(target=writer)
    t.start()
    reads = 0
    while t.is_alive() or reads == 0:
        for cid, loc in store.staged_items():
            i = int(cid[1:])
            got, why = store.read(cid, [i])
            assert why is None and same(got, kvs[cid]), (cid, why)
            reads += 1
    t.join()
    assert not failures and reads > 0
    pending = IndexDB(tmp_path)
    assert pending.one("SELECT count(*) FROM pending_kv")[0] >= 35  # checkpointed: a killed build resumes
    pending.close()
    commit_staged(store)
    fresh = ChunkStore(tmp_path, "fp")
    assert all(fresh.read(cid, [i])[1] is None for i, cid in enumerate(kvs))
    offsets = sorted(fresh.location(cid).off for cid in kvs)
    assert [b - a for a, b in zip(offsets, offsets[1:])] == [span] * 39  # back to back, none torn


def test_a_full_disk_during_an_append_is_an_oserror_and_leaves_no_partial_record(tmp_path, monkeypatch):
    store = ChunkStore(tmp_path, "fp")
    store.write("a", [1], kv_of(1))
    seg = tmp_path / "kv" / segment_name(1)
    size = seg.stat().st_size

    def full(fd, parts, off):
        os.pwrite(fd, bytes(parts[0]) + bytes(parts[1])[:100], off)  # part of the record, then no space
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(store_mod, "pwrite_all", full)
    with pytest.raises(OSError) as info:
        store.write("b", [2], kv_of(2))
    assert info.value.errno == errno.ENOSPC
    assert seg.stat().st_size == size and committed_lengths(tmp_path) == {1: size}
    assert ChunkStore(tmp_path, "fp").read("b", [2])[1] == "missing" and store.read("a", [1])[1] is None


def test_a_location_never_names_a_path(tmp_path):
    """Chunk ids live in rows and record metadata only: whatever an id says, the store writes
    its segments, named by number, in its KV folder."""
    store = ChunkStore(tmp_path / "idx", "fp")
    for i, cid in enumerate(["../../../escaped", "a/b", "/abs/path", "ok"]):
        store.write(cid, [i], kv_of(i))
        assert store.read(cid, [i])[1] is None
    made = sorted(p.relative_to(tmp_path).as_posix() for p in tmp_path.rglob("*") if p.is_file())
    assert [p for p in made if not p.startswith("idx/index.sqlite")] == [f"idx/kv/{segment_name(1)}"]
    assert isinstance(store.location("a/b"), KVLocation)


def test_read_nowait_reads_only_what_the_page_cache_holds(tmp_path):
    """The engine's read-or-encode choice asks whether a record would come from memory: a record
    just written is read at once; one whose pages the kernel dropped is "not in memory" (never a
    wait for the disk), and an ordinary read brings it back."""

    store = ChunkStore(tmp_path, "fp")
    kv = kv_of(1, tokens=300)
    store.write("a", [1], kv)
    got, why = store.read_nowait("a", [1])
    assert why is None and same(got, kv)
    assert store.stored_bytes("a") == store.location("a").length > kv.nbytes and store.stored_bytes("b") == 0
    assert store.read_nowait("b", [1]) == (None, "missing") and store.read_nowait("a", [2])[1] == "token ids differ"
    seg = tmp_path / "kv" / segment_name(1)
    fd = os.open(seg, os.O_RDONLY)
    try:
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        try:  # can this file system drop its pages at all (tmpfs cannot)?
            os.preadv(fd, [bytearray(4096)], 0, os.RWF_NOWAIT)
            pytest.skip(f"the page cache of {seg} cannot be dropped here")
        except BlockingIOError:
            pass
        # The probe's miss starts the kernel's readahead, which can bring the pages back before the
        # read below (it did on CI): wait for that I/O with an ordinary read of the whole file, then
        # drop the pages again, now clean and unlocked.
        while os.read(fd, 1 << 20):
            pass
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)
    cold = ChunkStore(tmp_path, "fp")
    assert cold.read_nowait("a", [1]) == (None, NOT_IN_MEMORY)
    assert cold.read("a", [1])[1] is None and same(cold.read_nowait("a", [1])[0], kv)


def fixed_kv(tokens: int = 3) -> ChunkKV:
    k = (torch.arange(2 * 3 * 2 * 4, dtype=torch.float32).reshape(2, 3, 2, 4) - 20) / 8
    return ChunkKV(k[:, :tokens], -k[:, :tokens] * 0.5)


# sha256 of a segment holding two fixed records (below), written by the store as of format 2: an
# index written before a change to the record code must read back, so its bytes never change
PINNED_SEGMENTS = {
    "float32": (1360, "b4d3ccfabeea45dc6bb67287e8b1dfc7c3c4351f6bb2ded642219948e39372ed"),
    "bfloat16": (1040, "8c1a82f878669be3fc8e87874a672d4ec5c8d859d60dd69bc5f49d7c6dcd13a4"),
    "fp8": (1352, "adda129c31106cb9ce134b7a38fc46e1fd766471b45ab674a6e7232f93889020"),
    "prefix_and_wrapper_slots": (1488, "7c8f0cc764be7b874b9d85936ae75c9e3a99432c5e4e6840715a2c9c230321b3"),
}


@pytest.mark.parametrize("case,kw", [("float32", {}), ("bfloat16", {"kv_dtype": torch.bfloat16}),
                                     ("fp8", {"kv_dtype": torch.float8_e4m3fn}),
                                     ("prefix_and_wrapper_slots", {"shared_prefix_ids": (7, 8), "vocab_rows": 100})])
def test_the_record_bytes_on_disk_are_pinned(tmp_path, case, kw):
    """The same records, byte for byte, in a segment and in the replicas' shared folder (one
    record a file): both are ``kv_record``'s format."""
    import hashlib
    from types import SimpleNamespace

    from lazy_rag.server.scaleout.shared_store import share_index_store

    store = ChunkStore(tmp_path / "index", "fp-1", **kw)
    store.write("doc.md#0", [1, 2, 3, 150], fixed_kv())
    store.write("doc.md#1", [4, 5], fixed_kv(tokens=2))
    data = (tmp_path / "index" / "kv" / segment_name(1)).read_bytes()
    assert (len(data), hashlib.sha256(data).hexdigest()) == PINNED_SEGMENTS[case]
    assert store.read("doc.md#1", [4, 5])[1] is None
    shared = share_index_store(SimpleNamespace(store=ChunkStore(tmp_path / "other", "fp-1", **kw),
                                               path=tmp_path / "other"), tmp_path / "shared")
    span = shared.write_back("doc.md#0", [1, 2, 3, 150], fixed_kv())
    assert shared.shared_path("doc.md#0").read_bytes() == data[:span]
