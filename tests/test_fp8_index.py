"""An index whose chunk KV is stored in fp8 (`lazy-rag index --kv-dtype fp8`): each record holds
e4m3 values and one fp16 scale per (layer, token, KV head), exactly the quantisation of the KV
the model computes (kernels.kv_quant), at about half the bytes of 16-bit KV; it is read back
into any engine (a 16-bit pool dequantises on placement) and is never mixed with another dtype."""
import pytest
import torch

from lazy_rag import LazyIndex, LazyLLM
from lazy_rag.build_estimate import kv_bytes_per_token
from lazy_rag.errors import LazyIndexError
from lazy_rag.kernels.kv_quant import quantize_rows
from tests.tiny_models import tiny_model

TEXTS = ["The lighthouse at Marrow Point was completed in 1871 by Agnes Thorold.",
         "The bakery on Quay Street sells rye bread baked in a wood-fired oven every morning.",
         "Tides in the bay rise by four metres twice a day."]


@pytest.fixture()
def llm(tokenizer):
    m = tiny_model("llama", "llama3", seed=2, hidden_size=128).to(torch.bfloat16)
    return LazyLLM(m, tokenizer, page_size=4)


def test_fp8_records_are_the_quantised_kv_at_half_the_bytes(tmp_path, llm):
    ids = ["a", "b", "c"]
    plain = LazyIndex.from_texts(TEXTS, tmp_path / "bf16", llm=llm, ids=ids, split=False, vectors=False,
                                 progress=False)
    fp8 = LazyIndex.from_texts(TEXTS, tmp_path / "fp8", llm=llm, ids=ids, split=False, vectors=False,
                               kv_dtype="fp8", progress=False)
    assert fp8.manifest["kv_dtype"] == "float8_e4m3fn" and plain.manifest["kv_dtype"] == "bfloat16"
    # the short names are the long ones: a build, and the estimate of its bytes (`--dry-run`)
    short = LazyIndex.from_texts(TEXTS, tmp_path / "bf16-short", llm=llm, ids=ids, split=False, vectors=False,
                                 kv_dtype="bf16", progress=False)
    assert short.manifest["kv_dtype"] == "bfloat16"
    assert kv_bytes_per_token(llm, "bf16") == kv_bytes_per_token(llm, "bfloat16") == 2 * llm.shape.kv_bytes_per_token
    assert kv_bytes_per_token(llm, "float8_e4m3fn") == kv_bytes_per_token(llm, "fp8") > llm.shape.kv_bytes_per_token
    for r in fp8.records:
        kv, why = fp8.store.read(r.id, r.token_ids)
        ref, _ = plain.store.read(r.id, r.token_ids)
        assert why is None and kv.quantized and kv.k.dtype == torch.float8_e4m3fn
        assert kv.k_scale.dtype == torch.float16 and kv.k_scale.shape == kv.k.shape[:3]
        (k8, ks), (v8, vs) = quantize_rows(ref.k), quantize_rows(ref.v)
        for got, want in ((kv.k, k8), (kv.v, v8), (kv.k_scale, ks), (kv.v_scale, vs)):
            assert torch.equal(got.view(torch.uint8) if got.dtype == torch.float8_e4m3fn else got,
                               want.view(torch.uint8) if want.dtype == torch.float8_e4m3fn else want)
        # head_dim 32 here: 32 fp8 bytes + 2 scale bytes per row against 64 bf16 bytes
        assert kv.nbytes / ref.nbytes == pytest.approx(34 / 64)
    # a query over the fp8 index runs (its KV dequantised into the 16-bit pool) and reads the disk
    llm.engine.clear_cache()
    out = llm.generate(fp8.segments("Who built the lighthouse?", ["a", "c"]), max_new_tokens=4,
                       source=fp8.chunk_source)
    assert out.stats.chunk_sources == {"disk": 2}
    # the dtype is the index's: a rebuild that asks for another is refused, naming the fix
    with pytest.raises(LazyIndexError, match="kv_dtype"):
        LazyIndex.from_texts(TEXTS, tmp_path / "fp8", llm=llm, ids=ids, split=False, vectors=False, progress=False,
                             kv_dtype="bfloat16")
    with pytest.raises(LazyIndexError, match="Unknown KV dtype"):
        LazyIndex.from_texts(TEXTS, tmp_path / "x", llm=llm, ids=ids, split=False, vectors=False, kv_dtype="int3")


def test_an_fp8_build_that_fits_its_values_but_not_their_scales_is_refused(tmp_path, llm, monkeypatch):
    """The free-space check counts fp8's scale bytes (one fp16 per row: 2 of every 34 bytes at
    head_dim 32, ~1.5% at 128), as the store writes them."""
    import shutil

    import lazy_rag.index.build as index_mod

    plain = LazyIndex.from_texts(TEXTS, tmp_path / "bf16", llm=llm, split=False, vectors=False, progress=False)
    tokens = sum(len(r.token_ids) for r in plain.records)
    values, with_scales = tokens * llm.shape.kv_bytes_per_token, tokens * kv_bytes_per_token(llm, "fp8")
    assert values < with_scales
    free = int((values + with_scales) / 2 / 0.95)   # the check keeps 5% free
    monkeypatch.setattr(index_mod.shutil, "disk_usage", lambda p: shutil._ntuple_diskusage(10**12, 10**12 - free, free))
    per_token = f"{kv_bytes_per_token(llm, 'fp8'):,.0f}"
    with pytest.raises(LazyIndexError, match=rf"tokens x {per_token} bytes\) needs .* GiB free\. Index fewer files"):
        LazyIndex.from_texts(TEXTS, tmp_path / "fp8", llm=llm, split=False, vectors=False, kv_dtype="fp8",
                             progress=False)
    monkeypatch.setattr(index_mod.shutil, "disk_usage",
                        lambda p: shutil._ntuple_diskusage(10**12, 10**12 - 2 * free, 2 * free))
    LazyIndex.from_texts(TEXTS, tmp_path / "fp8", llm=llm, split=False, vectors=False, kv_dtype="fp8", progress=False)
    # a bf16 index is told of fp8, and that its own dtype stays: a new --out
    monkeypatch.setattr(index_mod.shutil, "disk_usage", lambda p: shutil._ntuple_diskusage(10**12, 10**12, 0))
    with pytest.raises(LazyIndexError, match=r"Store KV in fp8 \(--kv-dtype fp8: about half the bytes\) in a new "
                                             r"index \(another --out\), index fewer files"):
        LazyIndex.from_texts(TEXTS + ["A fourth document about the harbour."], tmp_path / "bf16", llm=llm,
                             split=False, vectors=False, progress=False)
