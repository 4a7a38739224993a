"""``triton`` and ``triton.language`` for the kernel modules, also where Triton is not installed.

Triton is ~1 GB installed and runs only on a GPU (or, slowly, in its CPU interpreter for the
tests). A CPU-only install leaves it out (pyproject.toml: CUDA torch brings it, the test extra
adds it for the interpreter), and there every kernel call dispatches to its torch reference
(``page_table.use_triton``). So that the kernel modules still import there, this module stands in
for the few names they use while being defined: ``@triton.jit`` (a kernel that, if it is ever
launched, raises an error naming the package to install), ``tl.constexpr(value)``, and the host
integer helpers ``triton.cdiv`` / ``triton.next_power_of_2`` that the launch planning also runs on
the CPU.
"""
from __future__ import annotations

import functools
from types import SimpleNamespace

try:
    import triton
    import triton.language as tl

    HAVE_TRITON = True
except ImportError:
    HAVE_TRITON = False

    def _missing():
        from lazy_rag.errors import MissingDependencyError

        return MissingDependencyError(
            "This runs a Triton kernel (a CUDA tensor, or TRITON_INTERPRET=1 on the CPU), which needs the package "
            "triton: pip install 'triton>=3.2' (a CUDA build of torch brings it; `bash install.sh --test` installs "
            "it for the interpreter tests), or unset TRITON_INTERPRET to run the torch references on the CPU.")

    class _AbsentKernel:
        """A ``@triton.jit`` function where Triton is not installed."""

        def __init__(self, fn):
            functools.update_wrapper(self, fn)

        def __getitem__(self, grid):
            raise _missing()

        def __call__(self, *args, **kwargs):
            raise _missing()

    def _jit(fn=None, **options):
        return _AbsentKernel(fn) if fn is not None else _AbsentKernel

    def _cdiv(x: int, y: int) -> int:
        return (x + y - 1) // y

    def _next_power_of_2(n: int) -> int:
        """Triton's definition (0 -> 0, 1 -> 1, 5 -> 8)."""
        n -= 1
        for shift in (1, 2, 4, 8, 16, 32):
            n |= n >> shift
        return n + 1

    triton = SimpleNamespace(jit=_jit, cdiv=_cdiv, next_power_of_2=_next_power_of_2)
    tl = SimpleNamespace(constexpr=lambda value: value)

__all__ = ["triton", "tl", "HAVE_TRITON"]
