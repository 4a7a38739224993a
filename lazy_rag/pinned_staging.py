"""Pinned host buffers that an index build reuses batch after batch: where each encoded batch's KV
lands on the host (one DMA per tensor) and waits for the writer.

Why not torch's pinned allocations per batch: pinning memory maps and zeroes every page, a
fraction of a second per GB, under the CUDA driver's lock; torch's caching host allocator rounds
each request up to a power of two and can only hand a block back once nothing holds it, while an
index build keeps two or three batches alive at once (one encoding, the rest waiting for the
disk). On the H100 machine a bf16 8B build allocated anew for half of its batches, seconds in
all on the encoding thread.

So a build takes ``slots`` buffers of exactly ``slot_bytes``, made one by one on a background
thread from the moment the staging is created: ordinary host memory whose pages that thread
touches first (outside any CUDA call) and then registers with CUDA (``cudaHostRegister``), so
the driver's part is the pinning alone and the first batch's forward, which on a fresh process
also compiles its kernels, runs meanwhile. A batch holds a ``StagingLease``: its first ``take``
waits for a buffer (a free one, the next one made, or the first one given back), then carves the
batch's tensors out of it one after the other; ``release`` (once the writer has written the batch)
gives the buffer back. A tensor that does not fit what is left of the buffer, or a staging without
buffers (registering failed, or closed), gets pinned memory of its own, as before: correct,
only slower.
"""
from __future__ import annotations

import logging
import math
import threading
import time

import torch

log = logging.getLogger(__name__)

ALIGN = 512   # each tensor's offset in a buffer: DMA- and vector-friendly


def _register(buf: torch.Tensor, device: int) -> None:
    # on the staging creator's device: the background thread's current device is 0, and memory
    # registered there is pinned for GPU 0's context only (a build on another GPU would copy
    # into it as into pageable memory, after making a context on GPU 0)
    with torch.cuda.device(device):
        rc = int(torch.cuda.cudart().cudaHostRegister(buf.data_ptr(), buf.numel(), 0))
    if rc != 0:
        raise RuntimeError(f"cudaHostRegister of {buf.numel()} bytes failed with CUDA error {rc}")


def _unregister(buf: torch.Tensor, device: int) -> None:
    with torch.cuda.device(device):
        rc = int(torch.cuda.cudart().cudaHostUnregister(buf.data_ptr()))
    if rc != 0:
        log.warning("cudaHostUnregister failed with CUDA error %d; the buffer stays pinned until exit.", rc)


class PinnedStaging:
    def __init__(self, slots: int, slot_bytes: int, pin: bool = True):
        """``pin=False``: ordinary host memory (what a machine without CUDA can test)."""
        self.slots, self.slot_bytes, self.pin = int(slots), int(slot_bytes), pin
        self.device = torch.cuda.current_device() if pin else -1   # the one its buffers are pinned for
        self._free: list[torch.Tensor] = []
        self._error: BaseException | None = None
        self._closed = False
        self._cond = threading.Condition()
        self._thread = threading.Thread(target=self._allocate, name="lazy-rag-pinned-staging", daemon=True)
        self._thread.start()

    def _allocate(self) -> None:
        for _ in range(self.slots):
            with self._cond:
                if self._closed:
                    return
            try:
                buf = torch.empty(self.slot_bytes, dtype=torch.uint8)
                buf.fill_(0)   # the pages faulted in here, so that registering only pins them
                if self.pin:
                    _register(buf, self.device)
            except BaseException as e:  # noqa: BLE001 - leases fall back to pinning per tensor
                log.warning("Pinned staging buffers could not be made (%s: %s); each batch pins its own.",
                            type(e).__name__, e)
                with self._cond:
                    self._error = e
                    self._cond.notify_all()
                return
            with self._cond:
                if self._closed:
                    self._drop(buf)
                    return
                self._free.append(buf)
                self._cond.notify_all()

    def lease(self) -> "StagingLease":
        """One batch's lease; its buffer is taken at its first ``take``."""
        return StagingLease(self)

    def _acquire(self) -> torch.Tensor | None:
        """A free buffer, waiting for the next one made or given back; None without buffers."""
        with self._cond:
            while not self._free and self._error is None and not self._closed:
                self._cond.wait()
            return self._free.pop() if self._free else None

    def _give_back(self, buf: torch.Tensor) -> None:
        with self._cond:
            if self._closed:
                self._drop(buf)
            else:
                self._free.append(buf)
            self._cond.notify_all()

    def _drop(self, buf: torch.Tensor) -> None:
        if self.pin:
            _unregister(buf, self.device)

    def close(self) -> None:
        """Stop making buffers and drop (unpin) the free ones; a leased one goes when released."""
        with self._cond:
            self._closed = True
            self._cond.notify_all()
        self._thread.join()
        with self._cond:
            for buf in self._free:
                self._drop(buf)
            self._free.clear()


class StagingLease:
    """One batch's part of the staging: ``take`` places tensors in its buffer one after the other;
    ``release`` (once the batch is written, or dropped) gives the buffer back."""

    def __init__(self, staging: PinnedStaging):
        self.staging, self.buf, self.used = staging, None, 0
        self.own_pins = 0      # tensors that did not fit and got pinned memory of their own
        self.waited_s = 0.0    # waiting for a buffer (made or given back)
        self._asked = False

    def take(self, shape, dtype: torch.dtype) -> torch.Tensor:
        """An uninitialised pinned host tensor of ``shape`` and ``dtype``."""
        if not self._asked:
            self._asked = True
            t0 = time.perf_counter()
            self.buf = self.staging._acquire()
            self.waited_s = time.perf_counter() - t0
        nbytes = math.prod(shape) * dtype.itemsize
        start = -(-self.used // ALIGN) * ALIGN
        if self.buf is None or start + nbytes > self.buf.numel():
            self.own_pins += 1
            return torch.empty(shape, dtype=dtype, pin_memory=self.staging.pin)
        self.used = start + nbytes
        return self.buf[start:start + nbytes].view(dtype).view(shape)

    def release(self) -> None:
        if self.buf is not None:
            buf, self.buf = self.buf, None
            self.staging._give_back(buf)
