"""pinned_staging: an index build's reused host buffers (unpinned here: the logic is the same, and
the GPU runs pinned ones in tests/engine/test_encode_batches.py)."""
import threading

import pytest
import torch

from lazy_rag.pinned_staging import ALIGN, PinnedStaging


def test_a_lease_places_tensors_one_after_the_other_in_its_buffer():
    st = PinnedStaging(1, 4 * ALIGN, pin=False)
    lease = st.lease()
    assert lease.buf is None                          # taken at the first take
    a = lease.take((3, 5), torch.float16)
    b = lease.take((7,), torch.float32)
    a.copy_(torch.arange(15, dtype=torch.float16).view(3, 5))
    b.copy_(torch.arange(7, dtype=torch.float32))
    base = lease.buf.data_ptr()
    assert a.data_ptr() == base and b.data_ptr() == base + ALIGN
    assert a.flatten().tolist() == list(range(15)) and b.tolist() == list(range(7))
    big = lease.take((4 * ALIGN,), torch.uint8)     # more than is left: memory of its own
    assert lease.own_pins == 1 and not (base <= big.data_ptr() < base + 4 * ALIGN)
    lease.release()
    lease.release()                                   # twice is harmless
    again = st.lease()
    again.take((1,), torch.uint8)
    assert again.buf.data_ptr() == base and again.used == 1
    again.release()
    st.close()


def test_leases_wait_for_a_buffer_given_back():
    st = PinnedStaging(2, ALIGN, pin=False)
    first, second = st.lease(), st.lease()
    first.take((1,), torch.uint8)
    second.take((1,), torch.uint8)
    got = []

    def third():
        lease = st.lease()
        lease.take((1,), torch.uint8)   # a lease's buffer is taken at its first take
        got.append(lease)

    t = threading.Thread(target=third)
    t.start()
    t.join(0.2)
    assert t.is_alive() and not got            # both buffers leased: the third waits
    ptr = first.buf.data_ptr()
    first.release()
    t.join(5)
    assert got and got[0].buf.data_ptr() == ptr
    got[0].release()
    second.release()
    st.close()


def test_without_buffers_a_lease_allocates_per_tensor():
    """Allocation failed (here: a slot too large for any machine) or the staging closed: leases
    still work, each tensor in memory of its own."""
    st = PinnedStaging(1, 1 << 62, pin=False)
    lease = st.lease()
    x = lease.take((4, 4), torch.float32)
    assert lease.buf is None and x.shape == (4, 4) and lease.own_pins == 1
    lease.release()
    st.close()
    closed = PinnedStaging(3, ALIGN, pin=False)
    closed.close()
    late = closed.lease()
    late.take((2,), torch.uint8)
    assert late.buf is None and late.own_pins == 1


@pytest.mark.parametrize("dtype", [torch.float8_e4m3fn, torch.bfloat16, torch.float16])
def test_views_of_every_kv_dtype(dtype):
    st = PinnedStaging(1, 8 * ALIGN, pin=False)
    lease = st.lease()
    lease.take((3,), torch.uint8)
    x = lease.take((2, 64), dtype)
    assert x.dtype == dtype and x.shape == (2, 64) and x.data_ptr() - lease.buf.data_ptr() == ALIGN
    lease.release()
    st.close()


def test_buffers_are_pinned_for_the_creators_device_not_the_background_threads(monkeypatch):
    """The buffers are made and registered on a background thread, whose current CUDA device is
    0: they are registered, and unregistered, for the device current where the staging was made
    (here 3, faked: this machine has no GPU)."""
    from lazy_rag import pinned_staging

    calls = []
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 3)
    monkeypatch.setattr(pinned_staging, "_register",
                        lambda buf, device: calls.append(("register", device, threading.current_thread().name)))
    monkeypatch.setattr(pinned_staging, "_unregister", lambda buf, device: calls.append(("unregister", device)))
    st = PinnedStaging(2, ALIGN, pin=True)
    lease = st.lease()
    lease.take((1,), torch.uint8)
    lease.release()
    st.close()
    assert [c[:2] for c in calls] == [("register", 3), ("register", 3), ("unregister", 3), ("unregister", 3)]
    assert all(c[2] == "lazy-rag-pinned-staging" for c in calls if c[0] == "register")
