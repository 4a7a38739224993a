"""Answer quality of KV reuse against full re-encoding, on SQuAD-format data.

One module per job:

- ``data``        SQuAD dev and SQuADShifts files, the train/test split, the passages' content hash
- ``prompts``     the evaluation's prompt variants and the frozen one
- ``configs``     ``MODE[+option...]`` configurations, one table row per option
- ``tasks``       the chunks of each question: open retrieval (gold position forced or not), bridge
- ``retrieval``   ranked passages saved to / read from a file (evaluation without an embedder)
- ``runner``      every call into the lazy-rag runtime (models, indexes, generation)
- ``scoring``     EM, F1, contains, first-token KL
- ``statistics``  paired bootstrap intervals
- ``progress``    a live bar on a terminal, plain progress lines elsewhere
- ``evaluate``    one run: settings x configurations x questions, then the statistics
- ``report``      JSON records, per-question answers, the QUALITY.md section, a plot
"""
from importlib import import_module

# Exported lazily: `lazy-rag` reads the prompt names (``prompts``) for its --help, and ``evaluate``
# pulls in torch and transformers.
_EXPORTS = {"EvalOptions": "evaluate", "EvalRun": "evaluate", "precompute_retrieval": "evaluate",
            "run_eval": "evaluate", "write_report": "report"}
__all__ = list(_EXPORTS)


def __getattr__(name):
    if name in _EXPORTS:
        return getattr(import_module(f".{_EXPORTS[name]}", __name__), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
