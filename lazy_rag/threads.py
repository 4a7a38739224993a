"""How torch uses the CPU's cores: ``--threads``, else ``$LAZY_RAG_THREADS``, else the physical
cores this process may run on; one inter-op thread; OpenMP threads that sleep when idle.

Why not torch's defaults: torch starts one intra-op thread per logical CPU (hyper-threads
included) and as many inter-op threads again (lazy-rag runs no parallel graph of ops), and
libgomp's idle threads spin at every parallel region's barrier. When another process holds a
core, a spinning thread burns the time slice the thread it waits for needs. On 2 cores at load
~8 (benchmarks/cpu_threads.py), 2 threads decoded 0.4 tok/s where one thread decoded 2.1-2.5 and
2 threads with OMP_WAIT_POLICY=PASSIVE (idle threads sleep) 2.2.
"""
from __future__ import annotations

import math
import os
from pathlib import Path

from .errors import LazyRagError

ENV = "LAZY_RAG_THREADS"


def prefer_passive_waits() -> None:
    """Idle OpenMP threads sleep instead of spinning (``OMP_WAIT_POLICY=PASSIVE``), unless the
    variable is set already. libgomp reads it once, when torch loads it: call this before torch
    is imported (the command line does, first thing); later it changes nothing in this process
    but still reaches the processes it starts."""
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")


def _cgroup_cpu_limit() -> int | None:
    """The CPUs a cgroup v2 quota (a container's ``--cpus``) grants, rounded up; None if unlimited."""
    try:
        quota, period = Path("/sys/fs/cgroup/cpu.max").read_text().split()[:2]
    except (OSError, ValueError):
        return None
    if quota == "max":
        return None
    return max(1, math.ceil(int(quota) / int(period)))


def physical_cores() -> int:
    """Physical cores among the CPUs this process may run on (its affinity), at most the cgroup's
    quota; the logical CPU count where the topology cannot be read."""
    try:
        cpus = sorted(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        cpus = list(range(os.cpu_count() or 1))
    cores = set()
    for cpu in cpus:
        topo = Path(f"/sys/devices/system/cpu/cpu{cpu}/topology")
        try:
            cores.add((topo.joinpath("physical_package_id").read_text().strip(),
                       topo.joinpath("core_id").read_text().strip()))
        except OSError:
            cores.add(("cpu", str(cpu)))
    n = len(cores) or 1
    limit = _cgroup_cpu_limit()
    return min(n, limit) if limit else n


def resolve_threads(threads: int | None = None) -> int:
    """``threads``, else ``$LAZY_RAG_THREADS``, else ``physical_cores()``; a clear error for a bad value."""
    where = "--threads"
    if threads is None:
        text = os.environ.get(ENV, "").strip()
        if not text:
            return physical_cores()
        where = f"${ENV}"
        try:
            threads = int(text)
        except ValueError:
            raise LazyRagError(f"{where}={text!r} is not a whole number of threads; set it to e.g. 2, "
                               f"or unset it for the default ({physical_cores()}, the physical cores).") from None
    if threads < 1:
        raise LazyRagError(f"{where} must be >= 1 thread, got {threads}.")
    return threads


def configure_threads(threads: int | None = None) -> int:
    """Set torch's intra-op threads (``resolve_threads``) and one inter-op thread; return the count.

    The count is also written to ``$LAZY_RAG_THREADS`` so that a process started from this one (the
    server's engine process) uses the same. Call it before the first parallel op: torch fixes its
    inter-op pool then (a later call keeps the pool as it is)."""
    n = resolve_threads(threads)
    os.environ[ENV] = str(n)
    import torch

    torch.set_num_threads(n)
    try:
        torch.set_num_interop_threads(1)
    except RuntimeError:  # the pool exists already (torch ran parallel work in this process)
        pass
    return n
