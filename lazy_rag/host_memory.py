"""Page-locked host memory for chunk KV: buffers of their own size, registered with CUDA.

Every host copy of chunk KV on a CUDA machine (the host tier's, ``ChunkTiers.to_host``; an
encode's, ``model_runner.chunk_major_on_host``) is a DMA target and later a DMA source, so it must
be page-locked. torch's pinned allocation (``torch.empty(..., pin_memory=True)``) rounds each
request up to a power of two (402 MB -> 512 MB) and maps, zeroes and pins it (cudaHostAlloc) under
the driver's lock. Measured on an H200, torch 2.11, allocating a host tensor and copying a GPU
tensor into it, median seconds per tensor of 134 / 402 / 805 MB: torch's pinned memory 0.121 /
0.205 / 0.407 (~2 GB/s: a warm-up that put 77 GiB of chunk KV in the host tier took 152 s); torch
with ``pinned_use_cuda_host_register`` 0.030 / 0.075 / 0.182; ordinary memory whose pages are
touched first and which is then registered at its exact size (``cudaHostRegister``, as
``pinned_staging`` does for a build's reused buffers) 0.016 / 0.049 / 0.094 (~8.8 GB/s, 4.3x the
default).

So ``host_empty`` gives a tensor of REGISTER_MIN_BYTES or more memory of its own, page-aligned and
rounded up to whole pages only (no two registrations share a page), touched, then registered.
Smaller tensors (an fp8 chunk's scales, a short chunk's KV) keep torch's pinned memory: see
REGISTER_MIN_BYTES. Without ``pin`` (a machine without CUDA) it is plain ``torch.empty``; if
registering fails once, that is logged and torch's pinned memory serves every later request.

Lifetime. A registered range must be unregistered before its memory is freed (the driver would
otherwise keep the pages pinned under an address a later allocation may reuse), and not while a
tensor may still copy to or from it. The memory is a numpy array (``raw``) that only this module
references; torch's storage holds a numpy view of it (``torch.from_numpy``: the storage keeps the
view alive until the last tensor or view over it is gone), and a ``weakref.finalize`` on that view
unregisters the range when the view is deallocated. The finalizer holds ``raw`` itself among its
arguments, so the memory cannot be freed before the unregistering has returned, whatever order
numpy's deallocation takes (numpy 2.4's ``array_dealloc`` calls weakref callbacks before it frees
an array's data, numpy 2.5's frees it first: a finalizer on the owning array would unregister
memory already freed there). If unregistering fails, ``raw`` is kept until exit (``_leaked``).

torch keeps its own pinned blocks alive until the copies queued on them are done (an event per
copy); memory of ours it does not know. ``hold_until`` keeps host tensors alive until a CUDA event:
whoever queues a ``non_blocking`` copy to or from one and may drop it before the copy ran must
hold it (``ChunkTiers.to_host(wait=False)``, ``ChunkTiers.place``).
"""
from __future__ import annotations

import collections
import ctypes
import logging
import math
import mmap
import os
import threading
import weakref

import numpy as np
import torch

log = logging.getLogger(__name__)

# Below this a tensor gets torch's pinned memory. Chosen, not measured on a GPU (this was written
# on a machine without one): a registered buffer costs up to two pages beyond its bytes (alignment
# and rounding: under 1% of 1 MiB), about 3 us of Python (measured on a CPU) and two driver calls
# (register, unregister: their fixed cost is unmeasured, likely tens of microseconds), besides its
# per-byte cost (touch, pin, copy: ~0.12 s/GB from the numbers above, ~0.12 ms for 1 MiB). From
# 1 MiB on the per-byte part dominates, and torch's is larger (~0.4 s/GB of bytes rounded up to a
# power of two, when fresh). Below it: an fp8 chunk's per-token scales, and chunks shorter than
# ~170 tokens of a 0.5B model (6 KB per token and tensor), which torch's cache serves from blocks
# freed earlier, with little rounding waste in bytes.
REGISTER_MIN_BYTES = 1 << 20
PAGE = mmap.PAGESIZE
_PORTABLE = 1   # cudaHostRegisterPortable: pinned for every device's context, not only the caller's

_lock = threading.Lock()
_failed: str | None = None             # why registering stopped (logged once)
_held: collections.deque = collections.deque()   # (event, tensors): ``hold_until``
_leaked: list = []                     # memory whose unregistering failed: never freed


# -- the CUDA calls (tests replace these three) -----------------------------------------------------

def _cuda_register(ptr: int, nbytes: int) -> int:
    return int(torch.cuda.cudart().cudaHostRegister(ptr, nbytes, _PORTABLE))


def _cuda_unregister(ptr: int) -> int:
    return int(torch.cuda.cudart().cudaHostUnregister(ptr))


def _torch_pinned(shape: tuple, dtype: torch.dtype) -> torch.Tensor:
    return torch.empty(shape, dtype=dtype, pin_memory=True)


def _clear_last_error() -> None:
    """A failed runtime call stays the thread's last CUDA error, which torch's next kernel-launch
    check on this thread (``cudaGetLastError``) would raise as that kernel's own: read it now, from
    the libcudart torch loaded (torch binds no ``cudaGetLastError``). Best effort."""
    try:
        with open("/proc/self/maps") as f:
            paths = {line.split()[-1] for line in f if "/libcudart.so" in line}
        for path in paths:
            ctypes.CDLL(path).cudaGetLastError()
    except Exception:  # noqa: BLE001 - nothing to clear, or no way to: torch will report it
        pass


def _device_index(device) -> int:
    """The CUDA device index to register on (-1: none, on a machine without CUDA)."""
    index = torch.device(device).index if device is not None else None
    if index is None:
        index = torch.cuda.current_device() if torch.cuda.is_available() else -1
    return index


def register(ptr: int, nbytes: int, device=None) -> int:
    """Page-lock ``nbytes`` of host memory at ``ptr`` (``cudaHostRegister``, on ``device``'s
    context: default the current device); returns the device index to unregister on."""
    index = _device_index(device)
    with torch.cuda.device(index):
        rc = _cuda_register(ptr, nbytes)
    if rc != 0:
        _clear_last_error()
        raise RuntimeError(f"cudaHostRegister of {nbytes} bytes failed with CUDA error {rc}")
    return index


def unregister(ptr: int, device: int, owner) -> bool:
    """Make the range at ``ptr`` pageable again. If that fails, ``owner`` (what holds the memory)
    is kept until exit: freeing memory that is still registered is the one thing not to do."""
    # on the device it was registered on: a finalizer runs on whichever thread dropped the last
    # reference, whose current device may be another (or none yet)
    with torch.cuda.device(device):
        rc = _cuda_unregister(ptr)
    if rc == 0:
        return True
    _clear_last_error()
    _leaked.append(owner)
    log.warning("cudaHostUnregister failed with CUDA error %d; its memory is kept until exit.", rc)
    return False


# -- host tensors ----------------------------------------------------------------------------------

def host_empty(shape, dtype: torch.dtype, pin: bool = True, device=None) -> torch.Tensor:
    """An uninitialised contiguous host tensor of ``shape`` and ``dtype``; page-locked when ``pin``
    (which needs CUDA): memory of its own registered at its exact size (whole pages) from
    REGISTER_MIN_BYTES up, torch's pinned memory below that or once registering failed.
    ``device``: the CUDA device its copies go to or come from (default: the current one)."""
    shape = tuple(shape)
    if not pin:
        return torch.empty(shape, dtype=dtype)
    _drop_done()
    nbytes = math.prod(shape) * dtype.itemsize
    if nbytes >= REGISTER_MIN_BYTES and _failed is None:
        try:
            # bf16 and fp8 have no numpy dtype: bytes, viewed as the dtype by torch
            return _registered(nbytes, device).view(dtype).view(shape)
        except Exception as e:  # noqa: BLE001 - torch's pinned memory instead, as before
            _stop(e)
    return _torch_pinned(shape, dtype)


def _allocate(nbytes: int) -> np.ndarray:
    return np.empty(nbytes, dtype=np.uint8)


def _registered(nbytes: int, device) -> torch.Tensor:
    """``nbytes`` of registered memory as a uint8 tensor (see the module docstring: lifetime)."""
    size = -(-nbytes // PAGE) * PAGE
    raw = _allocate(size + PAGE)              # owns the memory; referenced by the finalizer only
    start = -raw.ctypes.data % PAGE
    view = raw[start:start + nbytes]          # what torch's storage holds: its death unregisters
    t = torch.from_numpy(view)
    t.fill_(0)   # the pages faulted in here, outside the driver's lock: registering only pins them
    ptr = raw.ctypes.data + start
    index = register(ptr, size, device)
    weakref.finalize(view, _release, ptr, index, raw, os.getpid())
    return t


def _release(ptr: int, device: int, raw: np.ndarray, pid: int) -> None:
    if os.getpid() == pid:   # a forked child's copy was never registered (nor can it call CUDA)
        unregister(ptr, device, raw)


def _stop(e: BaseException) -> None:
    global _failed
    with _lock:
        if _failed is not None:
            return
        _failed = f"{type(e).__name__}: {e}"
    log.warning("Registering host memory with CUDA failed (%s); host copies of chunk KV take torch's "
                "pinned memory from now on.", _failed)


def hold_until(event, tensors) -> None:
    """Keep ``tensors`` alive until ``event`` (a CUDA event recorded after the copies that read or
    write them) has completed; checked at each later ``hold_until`` and ``host_empty``."""
    _drop_done()
    with _lock:
        _held.append((event, tuple(tensors)))


def _drop_done() -> None:
    done = []
    with _lock:
        while _held and _held[0][0].query():   # in order: one side stream records them
            done.append(_held.popleft())
    del done   # outside the lock: the last reference may unregister (a driver call)
