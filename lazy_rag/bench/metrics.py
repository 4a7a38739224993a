"""Per-point metrics: latency percentiles, throughput, chunk hit ratios per tier, memory."""
from __future__ import annotations

import numpy as np


def latency_summary(name: str, values_ms) -> dict:
    """{name_mean, name_p50, name_p99} in ms (linear-interpolated percentiles); None when empty."""
    v = np.asarray(list(values_ms), dtype=np.float64)
    if v.size == 0:
        return {f"{name}_mean": None, f"{name}_p50": None, f"{name}_p99": None}
    return {f"{name}_mean": round(float(v.mean()), 3), f"{name}_p50": round(float(np.percentile(v, 50)), 3),
            f"{name}_p99": round(float(np.percentile(v, 99)), 3)}


def throughput(num_requests: int, output_tokens: int, wall_s: float) -> dict:
    """Completed requests and generated tokens per second of the run's wall time (first arrival to
    last completion). At the offline point this is the system's saturation throughput."""
    if wall_s <= 0:
        return {"throughput_rps": None, "output_tokens_per_s": None}
    return {"throughput_rps": round(num_requests / wall_s, 4), "output_tokens_per_s": round(output_tokens / wall_s, 3)}


def _ratio(n: int, d: int) -> float | None:
    return round(n / d, 4) if d else None


def cache_metrics(engine_stats: dict, prompt_tokens: int) -> dict:
    """Where the requests' chunk KV came from, per engine admission (``KVPlanner`` counts each
    chunk of each admitted request once): the GPU pool (hit), else the host tier, the disk store,
    or encoded by the model. The four ratios sum to 1 over ``chunk_lookups``; None for modes that
    look no chunk up (prefix, full). ``prefix_hit_ratio``: prompt tokens reused by prefix caching."""
    s = engine_stats
    hits, misses = int(s.get("chunk_hits", 0)), int(s.get("chunk_misses", 0))
    looked = hits + misses
    host, disk, enc = (int(s.get(f"chunk_from_{t}", 0)) for t in ("host", "disk", "encoded"))
    prefix = int(s.get("prefix_hit_tokens", 0))
    return {"chunk_lookups": looked, "gpu_chunk_hits": hits, "gpu_chunk_misses": misses,
            "gpu_hit_ratio": _ratio(hits, looked), "host_hit_ratio": _ratio(host, looked),
            "disk_hit_ratio": _ratio(disk, looked), "encoded_ratio": _ratio(enc, looked),
            "prefix_hit_tokens": prefix, "prefix_hit_ratio": _ratio(prefix, prompt_tokens) if prefix else None,
            "evictions": int(s.get("evictions", 0)), "preemptions": int(s.get("preemptions", 0)),
            "pool_pages": s.get("pages_total"), "engine_steps": s.get("steps"),
            # where the steps' wall time went on rank 0: admission, then prefill and decode steps
            # (each up to its sampled tokens on the host); under tensor parallelism, rank 0's waits
            # in the control plane for the other ranks, for its steps' GPU work, and its sends
            **{f"engine_{t}": s.get(t) for t in ("schedule_s", "prefill_steps_s", "decode_steps_s",
                                                  "tp_control_s", "tp_settle_s", "tp_send_s")},
            # decode graphs are captured per engine (one per point) on first use of a batch shape
            "cuda_graphs_captured": s.get("graphs")}


def gib(n_bytes: int | None) -> float | None:
    return None if n_bytes is None else round(n_bytes / (1 << 30), 3)
