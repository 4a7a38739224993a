"""Triton's once-per-process set-up, done on a thread of its own while the model loads.

The first launch of any Triton kernel in a process, even of a kernel whose binary is in Triton's
cache on disk, first computes Triton's own cache key (``triton.runtime.cache.triton_key``): a
SHA-256 over Triton's compiler and language sources and its shared library (hundreds of MB), with
imports of the packages it walks. On the H100 machine (triton 3.6) that was 0.45 s of the 0.87 s
an 8B model's first encode took with every kernel already compiled (`lazy-rag compile`), and an
index build's first write to disk waited on it. It depends only on the Triton install, so it
can run beside the weights' loading instead of in front of the first launch.

``start(device)``: begins it once per process on a CUDA device (nothing on a CPU, where kernels
run in the interpreter or as torch references). ``wait()``: joins it; the kernels' launch paths
call it (``page_table.use_triton``, the fp8 ``write_kv``), so that the first launch, on whichever
thread, does not compute the same key a second time beside it (``triton_key`` caches its value
but does not lock), and nothing else waits for it. A set-up that fails is left to the first
launch, which meets the same error.
"""
from __future__ import annotations

import logging
import threading

import torch

log = logging.getLogger(__name__)

_thread: threading.Thread | None = None
_done = False    # joined once: later launches skip the join
_guard = threading.Lock()


def _set_up() -> None:
    try:
        from triton.runtime.cache import triton_key

        triton_key()
    except Exception as e:  # noqa: BLE001 - the first launch computes it and raises what matters
        log.debug("Triton's set-up ahead of the first launch failed (%s: %s)", type(e).__name__, e)


def start(device) -> None:
    """Begins Triton's set-up on a daemon thread if ``device`` is a CUDA device (once per process)."""
    global _thread
    if torch.device(device).type != "cuda":
        return
    with _guard:
        if _thread is None:
            _thread = threading.Thread(target=_set_up, name="lazy-rag-triton-setup", daemon=True)
            _thread.start()


def wait() -> None:
    """Waits for a set-up begun by ``start`` (returns at once if none was, or once it was joined)."""
    global _done
    thread = _thread
    if _done or thread is None:
        return
    thread.join()
    _done = True
