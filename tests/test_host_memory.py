"""host_memory: chunk KV's host copies in registered memory of their own size, unregistered once
no tensor uses it, and before it is freed. On a CPU the CUDA calls are fakes that record what
they were asked (the GPU runs the real ones: the last test)."""
import collections
import gc
import logging
import weakref

import pytest
import torch

from lazy_rag import host_memory
from lazy_rag.chunk_kv import ChunkKV
from lazy_rag.engine.chunk_tiers import ChunkTiers
from lazy_rag.host_memory import PAGE, REGISTER_MIN_BYTES, hold_until, host_empty

MIB = 1 << 20


class FakeCuda:
    """The three calls host_memory makes, recorded; ``raws``: every buffer allocated, weakly."""

    def __init__(self, monkeypatch):
        self.registered, self.unregistered, self.torch_pinned, self.raws = {}, [], [], []
        self.register_rc = self.unregister_rc = 0
        self.freed_before_unregister = []
        allocate = host_memory._allocate

        def alloc(nbytes):
            raw = allocate(nbytes)
            self.raws.append(weakref.ref(raw))
            return raw

        def register(ptr, nbytes):
            if self.register_rc == 0:
                assert ptr not in self.registered
                self.registered[ptr] = nbytes
            return self.register_rc

        def unregister(ptr):
            # the buffer that holds ptr must still exist (not freed) while it is unregistered
            if not any(r() is not None and r().ctypes.data <= ptr < r().ctypes.data + r().nbytes for r in self.raws):
                self.freed_before_unregister.append(ptr)
            self.unregistered.append(ptr)
            return self.unregister_rc

        def pinned(shape, dtype):
            self.torch_pinned.append((shape, dtype))
            return torch.empty(shape, dtype=dtype)

        monkeypatch.setattr(host_memory, "_allocate", alloc)
        monkeypatch.setattr(host_memory, "_cuda_register", register)
        monkeypatch.setattr(host_memory, "_cuda_unregister", unregister)
        monkeypatch.setattr(host_memory, "_torch_pinned", pinned)
        monkeypatch.setattr(host_memory, "_failed", None)
        monkeypatch.setattr(host_memory, "_leaked", [])
        monkeypatch.setattr(host_memory, "_held", collections.deque())

    def alive(self) -> int:
        return sum(r() is not None for r in self.raws)


@pytest.fixture
def cuda(monkeypatch):
    return FakeCuda(monkeypatch)


DTYPES = [torch.bfloat16, torch.float16, torch.float32, torch.uint8]
if hasattr(torch, "float8_e4m3fn"):
    DTYPES.append(torch.float8_e4m3fn)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(2, 700, 3, 64), (REGISTER_MIN_BYTES,), (3, 1 << 18)])
def test_a_tensor_of_its_own_size_and_dtype_in_registered_pages(cuda, dtype, shape):
    if dtype.itemsize * torch.Size(shape).numel() < REGISTER_MIN_BYTES:
        shape = (*shape[:-1], shape[-1] * 4)
    t = host_empty(shape, dtype)
    nbytes = t.numel() * dtype.itemsize
    assert t.shape == shape and t.dtype == dtype and t.is_contiguous() and t.device.type == "cpu"
    assert nbytes >= REGISTER_MIN_BYTES and not cuda.torch_pinned
    # registered: whole pages from its first byte, no more than the tensor rounded up to a page
    assert cuda.registered == {t.data_ptr(): -(-nbytes // PAGE) * PAGE}
    assert t.data_ptr() % PAGE == 0 and t.untyped_storage().nbytes() == nbytes
    x = torch.randn(shape).to(dtype)
    t.copy_(x)
    assert torch.equal(t.view(torch.uint8), x.view(torch.uint8))
    del t
    assert cuda.unregistered == list(cuda.registered) and not cuda.freed_before_unregister
    assert cuda.alive() == 0   # and then freed


def test_small_tensors_take_torchs_pinned_memory_and_no_pin_takes_none(cuda):
    small = host_empty((REGISTER_MIN_BYTES // 2 - 1,), torch.float16)
    assert cuda.torch_pinned == [((REGISTER_MIN_BYTES // 2 - 1,), torch.float16)] and not cuda.registered
    plain = host_empty((4, MIB), torch.bfloat16, pin=False)   # a machine without CUDA: as before
    assert plain.shape == (4, MIB) and plain.dtype == torch.bfloat16
    assert len(cuda.torch_pinned) == 1 and not cuda.registered and cuda.alive() == 0
    del small


def test_unregistered_once_and_only_after_the_last_view_is_gone(cuda):
    t = host_empty((4, MIB), torch.bfloat16)
    ptr = t.data_ptr()
    views = [t[1:2], t.view(torch.uint8), t.flatten()[5:], t.T]
    storage = t.untyped_storage()
    chunk_major = [t[i:i + 1].view(1, MIB) for i in range(4)]  # as chunk_major_on_host hands them out
    del t                                                    # the base first
    gc.collect()
    assert cuda.unregistered == [] and cuda.alive() == 1
    views.clear()
    del storage
    del chunk_major[:3]
    gc.collect()
    assert cuda.unregistered == [] and cuda.alive() == 1      # one chunk's view is still alive
    last = chunk_major.pop()
    last.fill_(1)                                            # still usable memory
    del last
    assert cuda.unregistered == [ptr] and cuda.alive() == 0 and not cuda.freed_before_unregister
    gc.collect()
    assert cuda.unregistered == [ptr]                        # once


def test_registration_failing_falls_back_to_torch_pinned_memory_and_says_so_once(cuda, caplog):
    cuda.register_rc = 2    # cudaErrorMemoryAllocation
    with caplog.at_level(logging.WARNING, logger="lazy_rag.host_memory"):
        a = host_empty((2, MIB), torch.bfloat16)
        b = host_empty((3, MIB), torch.float32)
    assert a.shape == (2, MIB) and a.dtype == torch.bfloat16 and b.shape == (3, MIB)
    assert cuda.torch_pinned == [((2, MIB), torch.bfloat16), ((3, MIB), torch.float32)]
    assert not cuda.registered and cuda.unregistered == [] and cuda.alive() == 0
    warnings = [r for r in caplog.records if "Registering host memory" in r.getMessage()]
    assert len(warnings) == 1 and "error 2" in warnings[0].getMessage()


def test_memory_that_cannot_be_unregistered_is_never_freed(cuda):
    cuda.unregister_rc = 1
    t = host_empty((MIB,), torch.float32)
    ptr = t.data_ptr()
    del t
    assert cuda.unregistered == [ptr] and cuda.alive() == 1
    assert host_memory._leaked and host_memory._leaked[0].ctypes.data <= ptr


class Event:
    def __init__(self):
        self.done = False

    def query(self):
        return self.done


def test_held_tensors_live_until_their_copy_has_completed(cuda):
    first, second = Event(), Event()
    a, b = host_empty((MIB,), torch.float32), host_empty((MIB,), torch.float32)
    hold_until(first, [a])
    hold_until(second, [b[:10]])
    del a, b
    assert cuda.unregistered == [] and cuda.alive() == 2
    second.done = True                         # in order: the first copy holds both
    host_empty((1,), torch.uint8)
    assert cuda.unregistered == []
    first.done = True
    hold_until(Event(), [])
    assert len(cuda.unregistered) == 2 and cuda.alive() == 0 and not cuda.freed_before_unregister


def _kv(dtype=torch.bfloat16, tokens=2100):   # 16-bit and fp8 k, v over REGISTER_MIN_BYTES
    g = torch.Generator().manual_seed(0)
    k = torch.randn(4, tokens, 2, 64, generator=g).to(dtype)
    v = torch.randn(4, tokens, 2, 64, generator=g).to(dtype)
    if dtype == torch.float8_e4m3fn:
        scales = torch.rand(4, tokens, 2, generator=g).half()
        return ChunkKV(k, v, scales, scales * 2)
    return ChunkKV(k, v)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, torch.float8_e4m3fn])
def test_to_host_copies_each_tensor_once_into_registered_memory(cuda, dtype):
    kv = _kv(dtype)
    host = ChunkTiers(pin=True).to_host(kv)
    for name, t in kv.tensors().items():
        h = host.tensors()[name]
        assert h.dtype == t.dtype and h.shape == t.shape and h.data_ptr() != t.data_ptr()
        assert torch.equal(h.view(torch.uint8), t.view(torch.uint8))
        assert (h.data_ptr() in cuda.registered) == (h.nbytes >= REGISTER_MIN_BYTES)
    # the big tensors registered, the fp8 scales from torch's pinned memory
    assert len(cuda.registered) == 2 and len(cuda.torch_pinned) == len(kv.tensors()) - 2
    del host, h
    assert sorted(cuda.unregistered) == sorted(cuda.registered) and cuda.alive() == 0


def test_to_host_without_pinning_hands_back_the_host_tensors_as_before(cuda):
    kv = _kv()
    host = ChunkTiers(pin=False).to_host(kv)
    assert host.k is not kv.k and host.k.data_ptr() == kv.k.data_ptr() and torch.equal(host.v, kv.v)
    assert not cuda.registered and not cuda.torch_pinned


@pytest.mark.skipif(not torch.cuda.is_available(), reason="cudaHostRegister needs CUDA")
@pytest.mark.parametrize("wait", [True, False])
def test_on_cuda_host_copies_are_registered_pinned_and_equal(wait):
    kv = ChunkKV(*(x.cuda() for x in _kv().tensors().values()))
    tiers = ChunkTiers()
    host = tiers.to_host(kv, wait=wait)
    torch.cuda.synchronize()
    for name, t in kv.tensors().items():
        h = host.tensors()[name]
        assert h.device.type == "cpu" and h.is_pinned() and h.data_ptr() % PAGE == 0
        assert torch.equal(h, t.cpu())
    assert host_memory._failed is None
    from lazy_rag.engine.model_runner import chunk_major_on_host

    spans = [(0, 300), (300, 2100)]
    for (a, b), chunk in zip(spans, chunk_major_on_host(tuple(kv.tensors().values()), spans)):
        assert chunk.k.is_pinned() and torch.equal(chunk.k, kv.k[:, a:b].cpu())
    del host, chunk
    gc.collect()
    assert not host_memory._leaked
