"""CPU time of this machine's processes, grouped, from /proc (Linux): which process of a Ray
Serve application is busy while a benchmark runs (the HTTP proxy, the ingress replicas, the
engine replicas, the load generator). A group whose busiest process uses about one core is a
single Python interpreter at its limit, the likely ceiling of the throughput.

    before = process_cpu()
    ... run the load ...
    cores_by_group(before, process_cpu(), seconds, classify)
    # {"cpu_cores_proxy": 0.93, "cpu_cores_proxy_busiest": 0.93, "cpu_cores_engine": 1.6, ...}
"""
from __future__ import annotations

import os
from typing import Callable

_TICKS = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


def process_cpu() -> dict[int, tuple[str, float]]:
    """{pid: (command line, CPU seconds so far, user + system)} of every process this user can
    read; empty where there is no /proc."""
    out: dict[int, tuple[str, float]] = {}
    try:
        names = os.listdir("/proc")
    except OSError:
        return out
    for name in names:
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/stat", "rb") as f:
                stat = f.read()
            with open(f"/proc/{name}/cmdline", "rb") as f:
                cmd = f.read().replace(b"\0", b" ").decode("utf-8", "replace").strip()
        except OSError:  # the process ended meanwhile
            continue
        # the fields after "(comm)": the command name may hold spaces and parentheses
        fields = stat[stat.rfind(b")") + 2:].split()
        out[int(name)] = (cmd, (int(fields[11]) + int(fields[12])) / _TICKS)  # utime, stime: stat fields 14, 15
    return out


def cores_by_group(before: dict[int, tuple[str, float]], after: dict[int, tuple[str, float]], seconds: float,
                   classify: Callable[[int, str], str | None]) -> dict[str, float]:
    """The cores each group used over ``seconds`` (its processes' CPU time between the two
    snapshots, over the seconds), and its busiest process's: ``cpu_cores_<group>`` and
    ``cpu_cores_<group>_busiest``. ``classify(pid, command line)`` names a process's group, or
    None to leave it out; a process that started between the snapshots counts from zero."""
    if seconds <= 0:
        raise ValueError(f"seconds must be positive, got {seconds}")
    total: dict[str, float] = {}
    busiest: dict[str, float] = {}
    for pid, (cmd, cpu) in after.items():
        group = classify(pid, cmd)
        if group is None:
            continue
        earlier = before.get(pid)
        used = cpu - (earlier[1] if earlier is not None and earlier[0] == cmd else 0.0)
        total[group] = total.get(group, 0.0) + used
        busiest[group] = max(busiest.get(group, 0.0), used)
    out = {}
    for group in sorted(total):
        out[f"cpu_cores_{group}"] = round(total[group] / seconds, 2)
        out[f"cpu_cores_{group}_busiest"] = round(busiest[group] / seconds, 2)
    return out
