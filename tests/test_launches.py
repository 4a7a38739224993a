"""lazy_rag.bench.launches: a block records the compiled kernel of each launch made through
Triton's own ``fn[grid](...)`` syntax, and leaves the JIT function as it was after it."""
import pytest

jit = pytest.importorskip("triton.runtime.jit")

from lazy_rag.bench.launches import attention_kernels, recorded_launches  # noqa: E402


class FakeJIT(jit.KernelInterface):
    """A JIT function whose run returns a stand-in for the compiled kernel."""

    def __init__(self):
        self.calls = 0

    def run(self, *args, grid, warmup, **kwargs):
        self.calls += 1
        return ("compiled", self.calls, grid)


def test_a_block_records_its_launches_and_only_those():
    fn, other = FakeJIT(), FakeJIT()
    fn[(1,)](7)
    with recorded_launches(fn) as launched:
        assert launched.last is None
        fn[(2, 1)](8, x=1)
        assert launched.last == ("compiled", 2, (2, 1))
        other[(3,)](0)                       # not recorded: another function
        assert launched.last == ("compiled", 2, (2, 1))
        with recorded_launches(fn) as inner:
            fn[(4,)](9)
        assert inner.last == launched.last == ("compiled", 3, (4,))
    assert "run" not in vars(fn)
    fn[(5,)](9)
    assert launched.last == ("compiled", 3, (4,)) and fn.calls == 4


def test_the_attention_kernels_are_jit_functions_left_as_found():
    kernels = attention_kernels()
    assert len(kernels) == 2 and all(hasattr(k, "run") for k in kernels)
    before = [dict(vars(k)) for k in kernels]
    with recorded_launches():
        assert all("run" in vars(k) for k in kernels)
    assert [dict(vars(k)) for k in kernels] == before
