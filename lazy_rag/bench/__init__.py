"""The serving benchmark (``lazy-rag bench``): the paper's RAG workload through the engine in
every mode and through plain transformers, over request rates and KV budgets.

Modules, one job each: ``workload`` (documents, requests, arrivals), ``driver`` (runs one system
over one request list), ``metrics`` (latency percentiles, throughput, hit ratios), ``records``
(environment, JSON, tables), ``progress`` (progress bar), ``defaults`` (per-device settings and
``--preset`` workloads), ``runner`` (the sweep), ``plots`` (PNG figures; needs matplotlib, imported
only there), ``soak`` (the engine soak the tests and benchmarks/reliability_soak.py share);
for benchmarks/attention_kernels.py, ``block_attention`` (the Block-Attention baseline's kernel)
and ``launches`` (which compiled kernel a launch took). Models
with random weights of a named architecture are the core's (``lazy_rag.random_models``). The core
needs only torch, transformers and numpy.
"""
from importlib import import_module

# Exported lazily: `lazy-rag` imports the options' help from here at start-up, and the runner pulls
# in the engine and the kernels, which only a benchmark run needs.
_EXPORTS = {"BenchConfig": "runner", "run_bench": "runner", "load_llm": "runner", "defaults_for": "defaults",
            "CPU_DEFAULTS": "defaults", "GPU_DEFAULTS": "defaults", "PRESETS": "defaults",
            "WorkloadSpec": "workload", "make_workload": "workload", "arrival_times": "workload",
            "plot_results": "plots"}
__all__ = list(_EXPORTS)


def __getattr__(name):
    if name in _EXPORTS:
        return getattr(import_module(f".{_EXPORTS[name]}", __name__), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
