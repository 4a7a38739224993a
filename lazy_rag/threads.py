"""How many CPU threads torch uses: ``--threads``, else ``$LAZY_RAG_THREADS``, else the physical
cores this process may run on.

Why not torch's default: torch starts one intra-op thread per logical CPU and as many inter-op
threads again. On a machine where another process also computes, or with hyper-threads, those
threads outnumber the cores and spin at every parallel region's barrier waiting for a thread that
is not running: decode then slows by ~10x (issue 65 measured 1.5 tok/s at load 3 against 11.6 with
one thread). One thread per physical core, and one inter-op thread (lazy-rag runs no parallel
graph of ops), avoids that; ``--threads`` lowers it further on a machine shared with other work.
"""
from __future__ import annotations

import math
import os
from pathlib import Path

from .errors import LazyRagError

ENV = "LAZY_RAG_THREADS"


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
