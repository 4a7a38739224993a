"""Which compiled attention kernel a piece of code launched: the benchmarks' register and
shared-memory report, and the tests that check a launch took the variant another one compiled.

The kernels keep no record of their launches (a global written per launch would cost every
production call); inside a ``with recorded_launches(...)`` block each given Triton JIT function's
launches go through a wrapper that keeps the compiled kernel, and the block's end takes it away.
"""
from __future__ import annotations

from contextlib import contextmanager


class Launched:
    """``last``: the compiled kernel of the latest launch recorded (None before one, and always
    under the Triton interpreter, which compiles nothing)."""

    def __init__(self):
        self.last = None


def attention_kernels() -> tuple:
    """The attention kernels' Triton JIT functions: the tiles kernel (decode) and the runs
    kernel (prefill)."""
    from lazy_rag.kernels import paged_attention, prefill_runs

    return paged_attention._paged_attn_kernel, prefill_runs._prefill_runs_kernel


@contextmanager
def recorded_launches(*jit_fns):
    """Record the launches of ``jit_fns`` (default: attention_kernels()) made inside the block,
    on any thread; yields a Launched. ``fn[grid](...)`` calls ``fn.run``, which returns the
    compiled kernel: an instance attribute shadows the method for the block's length."""
    launched = Launched()
    fns = jit_fns or attention_kernels()
    saved = []
    for fn in fns:
        saved.append((fn, vars(fn).get("run")))

        def run(*args, _run=fn.run, **kwargs):
            kernel = _run(*args, **kwargs)
            launched.last = kernel
            return kernel

        fn.run = run
    try:
        yield launched
    finally:
        for fn, own in reversed(saved):
            if own is None:
                del fn.run
            else:
                fn.run = own
