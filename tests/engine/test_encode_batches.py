"""An index build encodes many chunks per forward (on CUDA, several fresh chunks share one Triton
prefill launch per layer instead of one SDPA call each): the KV must be the chunk's own, equal to
encoding it alone, with or without a shared prefix, whatever the chunks' lengths."""
import pytest
import torch

from lazy_rag import LazyLLM
from tests.tiny_models import tiny_model


def test_chunks_encoded_together_equal_each_encoded_alone(tokenizer, device):
    # head_dim 32: on CUDA the packed path runs the Triton kernel (head_dim 16 would take torch)
    model = tiny_model("llama", "llama3", seed=3, hidden_size=128).to(device)
    llm = LazyLLM(model, tokenizer, page_size=16)
    eng = llm.engine
    g = torch.Generator().manual_seed(0)
    lengths = [1, 5, 16, 17, 40, 131, 64, 3]  # partial pages, exact pages, a >128-token chunk
    chunks = [torch.randint(200, 4000, (n,), generator=g).tolist() for n in lengths]
    for prefix in ((), tuple(range(500, 520)), tuple(range(600, 740))):  # none, short, a >= 128-token tail
        together = eng.encode_chunks(chunks, prefix, cache=False)
        for ids, kv in zip(chunks, together):
            alone = eng.encode_chunks([ids], prefix, cache=False)[0]
            assert kv.num_tokens == len(ids)
            # fp32 on both paths: the kernel and SDPA differ in summation order only
            torch.testing.assert_close(kv.k, alone.k, rtol=1e-4, atol=1e-5)
            torch.testing.assert_close(kv.v, alone.v, rtol=1e-4, atol=1e-5)



def test_a_builds_host_kv_is_contiguous_per_chunk_and_equals_the_cached_encode(tokenizer, device):
    """``encode_chunks(cache=False)`` (an index build) hands each chunk's tensors to the store as
    contiguous host views of one batch copy, laid out chunk after chunk: the store writes them
    without copying. Their values are those of the cached path, bit for bit."""
    from lazy_rag.engine.model_runner import chunk_major_on_host

    model = tiny_model("llama", "llama3", seed=3, hidden_size=128).to(device)
    llm = LazyLLM(model, tokenizer, page_size=16)
    g = torch.Generator().manual_seed(1)
    chunks = [torch.randint(200, 4000, (n,), generator=g).tolist() for n in (7, 33, 1, 64)]
    for quantize in (None, "fp8"):
        built = llm.engine.encode_chunks(chunks, cache=False, quantize=quantize)
        for ids, kv in zip(chunks, built):
            assert kv.k.device.type == "cpu" and kv.quantized == (quantize == "fp8")
            for t in kv.tensors().values():
                assert t.is_contiguous() and t.shape[1] == len(ids)
        # one storage per tensor kind, the chunks back to back in it
        assert built[0].k.untyped_storage().data_ptr() == built[1].k.untyped_storage().data_ptr()
        assert built[1].k.data_ptr() == built[0].k.data_ptr() + built[0].k.nbytes
        if not quantize:
            plain = built
    for a, b in zip(plain, llm.engine.encode_chunks(chunks)):
        assert torch.equal(a.k, b.k.cpu()) and torch.equal(a.v, b.v.cpu())
    # the layout itself: each span of a layer-major batch, exactly
    t = torch.arange(3 * 10 * 2 * 4, dtype=torch.float32).view(3, 10, 2, 4)
    spans = [(0, 4), (4, 5), (5, 10)]
    for (a, b), kv in zip(spans, chunk_major_on_host((t, -t), spans)):
        assert kv.k.is_contiguous() and torch.equal(kv.k, t[:, a:b]) and torch.equal(kv.v, -t[:, a:b])


def test_a_builds_host_kv_lands_in_its_staging_buffer(tokenizer, device):
    """With ``host_alloc`` (an index build's ``PinnedStaging`` lease) every host tensor of a CUDA
    batch is carved out of the lease's one pinned buffer, with the values of the plain path, bit
    for bit, in both formats. (On a CPU the KV is on the host already: nothing is staged.)"""
    from lazy_rag.pinned_staging import PinnedStaging

    model = tiny_model("llama", "llama3", seed=3, hidden_size=128).to(device)
    llm = LazyLLM(model, tokenizer, page_size=16)
    g = torch.Generator().manual_seed(2)
    chunks = [torch.randint(200, 4000, (n,), generator=g).tolist() for n in (9, 70, 2)]
    cuda = device.type == "cuda" if isinstance(device, torch.device) else str(device).startswith("cuda")
    staging = PinnedStaging(1, 1 << 22, pin=cuda)
    for quantize in (None, "fp8", "int4"):
        plain = llm.engine.encode_chunks(chunks, cache=False, quantize=quantize)
        lease = staging.lease()
        staged = llm.engine.encode_chunks(chunks, cache=False, quantize=quantize, host_alloc=lease.take)
        assert lease.own_pins == 0
        if cuda:
            base, end = lease.buf.data_ptr(), lease.buf.data_ptr() + lease.buf.numel()
        for a, b in zip(plain, staged):
            for name, t in b.tensors().items():
                assert (base <= t.data_ptr() < end and t.is_pinned()) if cuda else lease.buf is None
                assert torch.equal(t.view(torch.uint8), a.tensors()[name].view(torch.uint8))
        lease.release()
    staging.close()


def test_a_small_encode_batch_runs_the_kernel_a_full_one_compiled(tokenizer, device):
    """On CUDA an update's few chunks take the build's tiles and split count
    (``prefill.encode_block_m``, one split): the very kernel a full batch compiled, not a variant
    of its own to compile on a machine's first update."""
    if torch.device(device).type != "cuda":
        pytest.skip("the Triton prefill kernel runs on CUDA only")
    from lazy_rag.bench.launches import recorded_launches

    model = tiny_model("llama", "llama3", seed=3, hidden_size=128).to(device)
    llm = LazyLLM(model, tokenizer, page_size=16)
    g = torch.Generator().manual_seed(2)
    kernels = []
    for n_chunks in (48, 2):
        chunks = [torch.randint(200, 4000, (131,), generator=g).tolist() for _ in range(n_chunks)]
        with recorded_launches() as launched:
            llm.engine.encode_chunks(chunks, cache=False)
        kernels.append(launched.last)
    assert kernels[0] is not None and kernels[0] is kernels[1]


def test_a_build_warms_its_encode_up_beside_its_chunking_and_writes_the_same_kv(tokenizer, device, tmp_path,
                                                                                monkeypatch):
    """A new index's build encodes two short chunks on a thread while it tokenizes (on CUDA, where
    the first batch compiled the prefill kernel; forced here on a CPU too): the stored KV is bit
    for bit that of a build without it, and no warm-up thread outlives the build. An update
    with chunks to encode warms up after comparing its documents."""
    import threading

    from lazy_rag import LazyIndex
    from lazy_rag.build_pipeline import EncodeWarmup

    model = tiny_model("llama", "llama3", seed=3, hidden_size=128).to(device)
    llm = LazyLLM(model, tokenizer, page_size=16)
    g = torch.Generator().manual_seed(4)
    texts = [" ".join(str(int(x)) for x in torch.randint(0, 10**6, (n,), generator=g)) for n in (40, 90, 7, 130)]

    def build(out, warm: bool, docs=texts):
        monkeypatch.setattr(EncodeWarmup, "wanted", staticmethod(lambda llm: warm))
        return LazyIndex.from_texts(docs, out, llm=llm, vectors=False, progress=False, wrapper="none", split=False)

    plain = build(tmp_path / "plain", False)
    warmed = build(tmp_path / "warmed", True)
    assert "warmup_s" in warmed.build_report.stages and "warmup_s" not in plain.build_report.stages
    assert not [t for t in threading.enumerate() if t.name == "lazy-rag-encode-warmup"]
    assert [r.token_ids for r in warmed.records] == [r.token_ids for r in plain.records]
    for a, b in zip(plain.records, warmed.records):
        ka, kb = plain.store.read(a.id, a.token_ids)[0], warmed.store.read(b.id, b.token_ids)[0]
        assert torch.equal(ka.k, kb.k) and torch.equal(ka.v, kb.v)
    updated = build(tmp_path / "warmed", True, texts + ["one more document of a few words"])
    assert "warmup_s" in updated.build_report.stages


def test_the_encode_warmup_compiles_the_kernel_a_build_batch_runs(tokenizer, device):
    """The warm-up's two short chunks launch the very kernel a build's batch of real chunks runs,
    so that the build finds it compiled."""
    if torch.device(device).type != "cuda":
        pytest.skip("the Triton prefill kernel runs on CUDA only")
    from lazy_rag.bench.launches import recorded_launches
    from lazy_rag.build_pipeline import EncodeWarmup

    model = tiny_model("llama", "llama3", seed=3, hidden_size=128).to(device)
    llm = LazyLLM(model, tokenizer, page_size=16)
    with recorded_launches() as warmup:
        EncodeWarmup(llm, (), None, model.dtype).wait()
    g = torch.Generator().manual_seed(5)
    lengths = torch.randint(150, 260, (40,), generator=g).tolist()
    with recorded_launches() as build:
        llm.engine.encode_chunks([torch.randint(200, 4000, (n,), generator=g).tolist() for n in lengths], cache=False)
    assert warmup.last is not None and build.last is warmup.last


def test_int4_encoded_on_the_engine_is_what_the_store_would_write(tokenizer, device):
    """``encode_chunks(cache=False, quantize="int4")`` (an int4 store's build off the CPU): each
    chunk quantised alone, its key groups starting at its first token, into the very records the
    store writes when it quantises unquantised KV itself."""
    from lazy_rag.kv_record import INT4, pack

    model = tiny_model("llama", "llama3", seed=3, hidden_size=128).to(device)
    llm = LazyLLM(model, tokenizer, page_size=16)
    g = torch.Generator().manual_seed(5)
    chunks = [torch.randint(200, 4000, (n,), generator=g).tolist() for n in (5, 130, 257)]
    plain = llm.engine.encode_chunks(chunks, cache=False)
    quant = llm.engine.encode_chunks(chunks, cache=False, quantize="int4")
    for ids, a, b in zip(chunks, plain, quant):
        assert b.int4 and b.k.device.type == "cpu" and b.k.shape[1] == len(ids)
        meta = dict(chunk_id="c", tokens_key="t", fingerprint="f", dtype=INT4)
        if torch.device(device).type == "cpu":
            assert pack(b, **meta).body_bytes() == pack(a, **meta).body_bytes()
        else:   # the range search's sums may round otherwise on the GPU: the same KV within a step
            from lazy_rag.chunk_kv import ChunkKV
            from lazy_rag.kv_int4 import KEY_GROUP, VALUE_GROUP, quantize_kv

            want = ChunkKV.from_tensors(quantize_kv(a.k, a.v), (KEY_GROUP, VALUE_GROUP))
            for x, y in zip(b.dequantized(torch.float32), want.dequantized(torch.float32)):
                assert (x - y).norm() <= 0.02 * y.norm()
