"""The processes of tensor parallelism: rank 0 is the caller's process, ranks 1..N-1 are workers
it spawns (``RankPool``), each running the same engine on its share of the model
(``tp_engine``). A worker does what rank 0's engine is told, in the same order: open or close an
engine, submit, step, abort, encode chunks, clear the cache (``worker_main``). Commands travel
over one pipe per worker; tensors inside them (a model's weights) travel as shared memory.

One pool per TP size serves every tensor-parallel engine of the process (spawning workers and
joining a process group costs seconds): its ``lock`` keeps each engine's command and its
collectives together, so that two engines stepping from two threads cannot interleave their
collectives differently on different ranks.

Faults: a worker that dies closes its connections, so rank 0's next collective fails at once and
``describe_failure`` names the rank, its exit code and the error it reported; a worker that
hangs is bounded by the collectives' timeout. Workers exit when rank 0 does (their pipe closes).
On GPUs (NCCL) a dead peer closes nothing a kernel sees: rank 0's all-reduce would wait on the GPU
forever. So there a thread of rank 0 watches the workers' processes and fails the group (aborting
its NCCL communicator, ``RankGroup.fail``) the moment one exits, and a thread of each worker ends
the worker when rank 0's process is gone; a rank that hangs is bounded by ``RankGroup.settle``.
"""
from __future__ import annotations

import contextlib
import gc
import itertools
import multiprocessing.connection as mp_connection
import multiprocessing.util as mp_util
import os
import threading
import time
import traceback
import weakref

import torch

from .rank_devices import rank_device
from .rank_group import COLLECTIVE_TIMEOUT_S, RankFailedError, RankGroup

_STORE_TIMEOUT_S = 120.0   # ranks joining the group at start (a worker imports torch and lazy_rag first)


class RankPool:
    _pools: dict[tuple[int, torch.device], "RankPool"] = {}
    _guard = threading.Lock()

    @classmethod
    def get(cls, size: int, device: torch.device = torch.device("cpu"),
            timeout_s: float = COLLECTIVE_TIMEOUT_S) -> "RankPool":
        """The live pool of ``size`` ranks whose rank 0 runs on ``device`` (one is started when
        there is none, or the last one failed)."""
        key = (size, torch.device(device))
        with cls._guard:
            pool = cls._pools.get(key)
            if pool is None or not pool.healthy():
                if pool is not None:
                    pool.shutdown()
                pool = cls._pools[key] = RankPool(size, timeout_s, device)
            return pool

    def __init__(self, size: int, timeout_s: float = COLLECTIVE_TIMEOUT_S, device: torch.device = torch.device("cpu")):
        import datetime

        import torch.distributed as dist
        import torch.multiprocessing as mp

        self.size, self.device = size, torch.device(device)
        self.closing = False
        self.lock = threading.RLock()
        self._ids = itertools.count()
        self._tier_keys: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
        self.errors: dict[int, str] = {}
        store = dist.TCPStore("127.0.0.1", 0, size, True, datetime.timedelta(seconds=_STORE_TIMEOUT_S),
                              wait_for_workers=False)
        ctx = mp.get_context("spawn")   # a fork would copy the caller's threads and CUDA state
        self.conns, self.procs = [], []
        for rank in range(1, size):
            ours, theirs = ctx.Pipe()
            proc = ctx.Process(target=worker_main, args=(rank, size, store.port, theirs, timeout_s,
                                                         torch.get_num_threads(), rank_device(self.device, rank)),
                               # daemonic unless rank 0 is (the server's engine process, which
                               # starts them through _children_allowed): they exit with rank 0's pipe
                               daemon=not mp.current_process().daemon, name=f"lazy-rag-tp-rank{rank}")
            with _children_allowed():
                proc.start()
            theirs.close()
            self.conns.append(ours)
            self.procs.append(proc)
        self.group = RankGroup(0, size, store, timeout_s, describe_failure=self.describe_failure, device=self.device)
        self._store = store   # (the workers' rendezvous: kept while they live)
        if self.group.nccl is not None:
            threading.Thread(target=self._watch_workers, name=f"lazy-rag-tp{size}-watch", daemon=True).start()
        # At exit, from multiprocessing's own exit handler, in this process and in one that
        # multiprocessing started (the server's engine process, which runs no atexit handler and
        # joins its non-daemonic children, the workers, who wait for this pipe to close): a
        # finalizer with an exit priority runs before that join.
        mp_util.Finalize(None, self.shutdown, exitpriority=10)

    def new_engine_id(self) -> int:
        return next(self._ids)

    def tiers_spec(self, tiers) -> tuple | None:
        """What a worker needs to give its engine a host tier shared like rank 0's ``tiers`` (a
        ``ChunkTiers`` several engines share, as the serving benchmark's engines share the chunks
        it encoded in its warm-up): (its key, bytes, pinned); None for an engine's own tier. Every
        rank must find the same chunks in its tier, or one would read what another encodes."""
        if tiers is None:
            return None
        key = self._tier_keys.get(tiers)
        if key is None:
            key = self._tier_keys[tiers] = next(self._ids)
            weakref.finalize(tiers, self._drop_tiers, key)
        return key, tiers.host.max_bytes, tiers.pin

    def _drop_tiers(self, key: int) -> None:
        with self.lock:
            try:
                self.send("drop_tiers", key)
            except RankFailedError:
                pass   # the workers are gone, and their tiers with them

    def healthy(self) -> bool:
        return self.group.broken is None and all(p.is_alive() for p in self.procs)

    def send(self, *command) -> None:
        """Send one command to every worker (the caller holds ``lock``)."""
        if self.group.broken is not None:
            raise self.group.broken
        t0 = time.perf_counter()
        for rank, conn in enumerate(self.conns, 1):
            try:
                conn.send(command)
            except (OSError, ValueError) as e:
                self.group.broken = RankFailedError(
                    f"Tensor-parallel rank {rank} of {self.size} cannot be reached ({self.describe_failure() or e}). "
                    "Requests fail; create the LazyLLM (or restart the server) again.")
                raise self.group.broken from e
        self.group.timers["send_s"] += time.perf_counter() - t0

    def describe_failure(self) -> str:
        """Which workers exited (rank, exit code, the error each reported), or ''."""
        out = []
        for rank, (conn, proc) in enumerate(zip(self.conns, self.procs), 1):
            try:
                while conn.poll():
                    kind, text = conn.recv()
                    self.errors[rank] = text
            except (OSError, EOFError):
                pass
            proc.join(timeout=0.5 if rank not in self.errors else 5.0)
            if not proc.is_alive():
                said = self.errors.get(rank)
                out.append(f"rank {rank} (pid {proc.pid}) exited with code {proc.exitcode}"
                           + (f" after an error: {said.strip().splitlines()[-1]}" if said else ""))
        return "; ".join(out)

    def _watch_workers(self) -> None:
        """Fail the group the moment a worker's process exits (NCCL would not notice; module docstring)."""
        mp_connection.wait([p.sentinel for p in self.procs])
        if not self.closing:
            self.group.fail(RankFailedError(
                f"A tensor-parallel rank of {self.size} exited ({self.describe_failure()}). "
                "Requests fail; create the LazyLLM (or restart the server) again."))

    def shutdown(self) -> None:
        self.closing = True
        for conn in self.conns:
            try:
                conn.send(("exit",))
                conn.close()
            except (OSError, ValueError):
                pass
        for proc in self.procs:
            proc.join(timeout=5)
            if proc.is_alive():
                proc.kill()
        self.procs = [p for p in self.procs if p.is_alive()]


@contextlib.contextmanager
def _children_allowed():
    """Let a daemonic process (the server's engine process) start the rank workers.
    ``Process.start`` refuses any child of a daemonic process (it would be orphaned when its
    parent is terminated); a rank worker is not: it exits as soon as its pipe to rank 0 closes,
    whichever way rank 0 ends."""
    import multiprocessing

    config = multiprocessing.current_process()._config
    daemon = config.pop("daemon", None)
    try:
        yield
    finally:
        if daemon is not None:
            config["daemon"] = daemon


def worker_main(rank: int, size: int, port: int, conn, timeout_s: float, threads: int,
                device: torch.device) -> None:
    """Rank ``rank``'s loop on ``device``: join the group, then run each command rank 0 sends
    until it says exit or its pipe closes. An error ends the worker after it reports it (rank 0's
    collectives then fail naming this rank)."""
    import datetime

    import torch.distributed as dist

    from .rank_worker import open_rank_engine, run_rank_command, worker_tiers

    torch.set_num_threads(threads)   # rank 0's: the same kernels, the same reductions
    if device.type == "cuda":
        # first: NCCL, the caching allocator and every kernel launch take the current device
        torch.cuda.set_device(device)
        threading.Thread(target=_exit_with_rank0, name="lazy-rag-tp-rank0-watch", daemon=True).start()
    store = dist.TCPStore("127.0.0.1", port, size, False, datetime.timedelta(seconds=_STORE_TIMEOUT_S))
    group = RankGroup(rank, size, store, timeout_s, device=device)
    engines: dict[int, object] = {}
    tiers: dict[int, object] = {}   # host tiers shared by engines (RankPool.tiers_spec)
    try:
        while True:
            try:
                command = conn.recv()
            except (EOFError, OSError):
                return   # rank 0 is gone
            op, *args = command
            if op == "exit":
                return
            if op == "open":
                eid, *spec, tiers_spec = args
                engines[eid] = open_rank_engine(group, *spec, tiers=worker_tiers(tiers, tiers_spec))
            elif op == "drop_tiers":
                tiers.pop(args[0], None)
            elif op == "close":
                engines.pop(args[0], None)
                if device.type == "cuda":   # its pool and graphs back to the GPU for the next engine (as rank 0 does)
                    gc.collect()
                    torch.cuda.empty_cache()
            else:
                run_rank_command(engines[args[0]], op, *args[1:])
    except BaseException:
        try:
            conn.send(("error", traceback.format_exc(limit=8)))
        except (OSError, ValueError):
            pass
        raise



def _exit_with_rank0() -> None:
    """End this worker when rank 0's process is gone: its main thread may be waiting on a GPU
    kernel for rank 0's half of an all-reduce, and would never read the closed pipe."""
    import multiprocessing

    mp_connection.wait([multiprocessing.parent_process().sentinel])
    os._exit(1)
