"""The ranks' group: this process's place among the tensor-parallel ranks and the collectives
between them (NCCL for device tensors, gloo for host tensors and the control plane), with the
timeouts and failure handling that keep a dead or hung rank from hanging the others
(``RankGroup``). The sharding arithmetic that uses it: ``tensor_parallel``."""
from __future__ import annotations

import datetime
import logging
import os
import time
from collections import Counter, deque

import torch

from ..errors import LazyRagError

log = logging.getLogger(__name__)

# seconds a rank waits in one collective for the others before its requests fail (a rank that
# died is found at once, by its closed connection; this bounds a rank that hangs)
COLLECTIVE_TIMEOUT_S = 300.0


class RankFailedError(LazyRagError):
    """A tensor-parallel rank died, hung or left lockstep: the requests it was serving fail."""


class RankGroup:
    """This process's place among ``size`` tensor-parallel ranks and the collectives between them.
    ``describe_failure()``: what rank 0 knows about its workers when a collective fails (which one
    exited, with which code).

    On the CPU one gloo group carries everything. On CUDA (``device``: this rank's GPU,
    ``rank_devices``) the collectives over device tensors (the activations' all-reduces, KV
    gathers) go over NCCL and are only ordered on the GPU's stream, never waited for by the host
    (so a step has no host sync per all-reduce and can be captured in a CUDA graph); the
    collectives over CPU tensors (lockstep checks, agreements) go over gloo, as on the CPU. There a
    forward's lockstep check is compared after its kernels are enqueued, before its output is read
    (``check_lockstep``, ``check_pending_lockstep``).

    NCCL has no timeout of its own on the GPU: a peer that died leaves this rank's all-reduce
    kernel waiting. So the host bounds every CUDA step (``settle``: the step's work must finish
    within the timeout), and whoever finds a rank dead or hung calls ``fail``, which aborts the
    NCCL communicator: its waiting kernels return, and every later collective raises."""

    def __init__(self, rank: int, size: int, store, timeout_s: float = COLLECTIVE_TIMEOUT_S,
                 describe_failure=None, device: torch.device = torch.device("cpu")):
        import torch.distributed as dist

        self.rank, self.size, self.device = rank, size, torch.device(device)
        self.timeout = datetime.timedelta(seconds=timeout_s)
        self.describe_failure = describe_failure or (lambda: "")
        self.broken: RankFailedError | None = None
        # host seconds this rank spent waiting: in control-plane collectives for the other ranks'
        # hosts (control_s), for its steps' GPU work (settle_s), and sending commands (send_s, rank 0)
        self.timers: Counter = Counter()
        # process groups of their own, outside torch.distributed's default group: the user's
        # process may run its own torch.distributed, and several groups may coexist
        self.control = dist.ProcessGroupGloo(store, rank, size, self.timeout)
        self.nccl = nccl_group(store, rank, size, self.timeout, self.device) if self.device.type == "cuda" else None
        # whether a lockstep check's gather runs while the forward is enqueued (``check_lockstep``
        # says when that is safe), and those gathers, oldest first, not compared yet
        self.defer_lockstep = self.nccl is not None
        self.pending_lockstep: deque = deque()

    def _wait(self, work, what: str) -> None:
        if self.broken is not None:
            raise self.broken
        t0 = time.perf_counter()
        try:
            work.wait(self.timeout)
        except RuntimeError as e:
            why = self.describe_failure() or f"{type(e).__name__}: {str(e).splitlines()[0][:200]}"
            self.fail(RankFailedError(
                f"Tensor-parallel rank {self.rank} of {self.size} lost the other ranks during {what}: {why}. "
                "Requests in flight fail; create the LazyLLM (or restart the server) again."))
            raise self.broken from e
        finally:
            self.timers["control_s"] += time.perf_counter() - t0

    def _run(self, t: torch.Tensor, op, what: str) -> None:
        """Run the collective ``op(group)`` over the group of ``t``'s device. NCCL's work is
        ordered on the current stream (``wait()`` without a timeout: with one, the host would
        block until the GPU finished); gloo's is waited for, at most the timeout."""
        if self.broken is not None:
            raise self.broken
        if t.is_cuda:
            try:
                op(self.nccl).wait()
            except RuntimeError as e:   # the communicator was aborted (``fail``), or NCCL failed
                self.fail(RankFailedError(
                    f"Tensor-parallel rank {self.rank} of {self.size}: NCCL failed during {what}: "
                    f"{self.describe_failure() or str(e).splitlines()[0][:200]}. Requests in flight fail; "
                    "create the LazyLLM (or restart the server) again."))
                raise self.broken from e
        else:
            self._wait(op(self.control), what)

    def all_reduce(self, t: torch.Tensor) -> torch.Tensor:
        """Sum ``t`` over the ranks, in place."""
        self._run(t, lambda pg: pg.allreduce([t]), "an all-reduce")
        return t

    def all_gather(self, t: torch.Tensor) -> list[torch.Tensor]:
        out = [torch.empty_like(t) for _ in range(self.size)]
        t = t.contiguous()
        self._run(t, lambda pg: pg.allgather([out], [t]), "an all-gather")
        return out

    def check_lockstep(self, values: list[int], what: str) -> None:
        """Every rank must be about to run the same forward: compare ``values`` (token counts
        and id sums) with the other ranks' and fail, naming the ranks, if they differ. A rank
        out of lockstep would otherwise all-reduce tensors of other shapes, or hang.

        With ``defer_lockstep`` (CUDA) the gather is only started here, and compared by
        ``check_pending_lockstep`` (``settle``, or a read of a forward's output outside a step):
        the host enqueues the forward meanwhile instead of waiting for the other ranks' hosts.
        That is safe because the forward's NCCL collectives are only queued on the GPU: a
        forward out of lockstep leaves its kernels waiting there, the comparison fails the group
        before its output is read, and ``fail``'s abort lets those kernels return. On the CPU the
        forward's collectives go over gloo and the host waits for each: a forward out of lockstep
        would hang in, or fail, its first all-reduce before any comparison, so the check waits."""
        if self.broken is not None:
            raise self.broken
        mine = torch.tensor(values, dtype=torch.int64)
        gathered = [torch.empty_like(mine) for _ in range(self.size)]
        check = (self.control.allgather([gathered], [mine]), gathered, what)
        if self.defer_lockstep:
            self.pending_lockstep.append(check)
        else:
            self._compare_lockstep(*check)

    def check_pending_lockstep(self) -> None:
        """Compare the deferred lockstep checks (``check_lockstep``), every one in the order its
        forward was enqueued; fail as ``check_lockstep`` does where the ranks differ, or where a
        rank did not answer a gather within the timeout."""
        while self.pending_lockstep:
            self._compare_lockstep(*self.pending_lockstep.popleft())

    def _compare_lockstep(self, work, gathered: list[torch.Tensor], what: str) -> None:
        self._wait(work, f"the lockstep check before {what}")
        if any(not torch.equal(r, gathered[0]) for r in gathered):
            got = "; ".join(f"rank {i}: {r.tolist()}" for i, r in enumerate(gathered))
            self.fail(RankFailedError(f"Tensor-parallel ranks left lockstep before {what} ({got})."))
            raise self.broken

    def agree(self, ok: bool) -> bool:
        """True when ``ok`` on every rank (a control-plane collective): a choice one rank may
        fail to make (a CUDA graph's capture) is then made by all of them or by none."""
        return all(bool(r.item()) for r in self.all_gather(torch.tensor([int(ok)], dtype=torch.int64)))

    def settle(self) -> None:
        """Check the step's deferred lockstep checks (``check_pending_lockstep``); then, on CUDA,
        wait until this rank's queued work (a step's, with its NCCL all-reduces) has finished, at
        most the timeout; raise if a rank was found dead meanwhile (``fail``, whose abort lets the
        waiting kernels return) or the step outran the timeout (a hung rank). The step's tokens
        are then never read from a step the ranks did not all finish, nor from one out of
        lockstep. On the CPU every collective was waited for already.
        The lockstep checks come first: a step out of lockstep may be the one hanging on the GPU,
        and the failure they find aborts it at once instead of at the timeout."""
        self.check_pending_lockstep()
        if self.nccl is None:
            return
        done = torch.cuda.Event()
        done.record(torch.cuda.current_stream(self.device))
        t0 = time.perf_counter()
        deadline = time.monotonic() + self.timeout.total_seconds()
        while not done.query():
            if self.broken is not None:
                raise self.broken
            if time.monotonic() > deadline:
                self.fail(RankFailedError(
                    f"Tensor-parallel rank {self.rank} of {self.size}: a step did not finish within "
                    f"{self.timeout.total_seconds():.0f} s (a rank hung: {self.describe_failure() or 'none exited'}). "
                    "Requests in flight fail; create the LazyLLM (or restart the server) again."))
                raise self.broken
            time.sleep(0)   # (releases the GIL: the watcher thread may find a dead rank)
        self.timers["settle_s"] += time.perf_counter() - t0
        if self.broken is not None:
            raise self.broken

    def fail(self, error: RankFailedError) -> None:
        """Mark the group broken (the first error is kept) and abort the NCCL communicator, so
        that no kernel of this rank waits for a peer that will not come."""
        if self.broken is None:
            self.broken = error
        if self.nccl is not None:
            try:
                self.nccl.abort()
            except RuntimeError as e:   # (aborted already, or NCCL failed on its own)
                log.warning("Aborting the NCCL communicator of tensor-parallel rank %d: %s", self.rank, e)

    def share(self, n: int) -> slice:
        """This rank's slice of ``n`` things split evenly (checked by ``check_shardable``)."""
        return part(n, self.rank, self.size)


# TORCH_NCCL_ASYNC_ERROR_HANDLING=2 (clean up only): when NCCL's own watchdog finds a collective
# past the timeout, it aborts the communicator and the error surfaces in the next collective;
# torch's default (3) ends the whole process, which for rank 0 is the caller's (a LazyLLM in a
# script, the server's engine process)
_NCCL_ENV = {"TORCH_NCCL_ASYNC_ERROR_HANDLING": "2"}


def nccl_group(store, rank: int, size: int, timeout: datetime.timedelta, device: torch.device):
    """An NCCL process group over ``store`` (keys apart from the gloo group's), its communicator
    made now, on ``device`` (every rank calls this at the same point)."""
    import torch.distributed as dist

    options = dist.ProcessGroupNCCL.Options()
    options._timeout = timeout
    options.is_high_priority_stream = False
    saved = {k: os.environ.get(k) for k in _NCCL_ENV}
    os.environ.update({k: os.environ.get(k) or v for k, v in _NCCL_ENV.items()})   # (a user's setting wins)
    try:   # (read as the group is constructed)
        pg = dist.ProcessGroupNCCL(dist.PrefixStore("nccl", store), rank, size, options)
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
    pg.eager_connect_single_device(device)
    return pg


def part(n: int, rank: int, size: int) -> slice:
    """Rank ``rank``'s slice of ``n`` things split evenly over ``size`` ranks."""
    k = n // size
    return slice(rank * k, (rank + 1) * k)
