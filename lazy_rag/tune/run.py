"""The two tuning runs ``lazy-rag tune`` offers, as functions (the CLI and the GPU scripts call
these): a general wrapper for a model from SQuAD's train articles, and a wrapper for one index's
own chunks, written into the index with its KV re-encoded."""
from __future__ import annotations

import hashlib
from pathlib import Path

from ..errors import LazyRagError
from ..models import cache_dir
from .examples import gold_placement, index_examples, squad_examples
from .trainer import TuneOptions, train_wrapper


def _work_dir(llm, *parts) -> Path:
    key = hashlib.sha256("|".join(str(p) for p in (llm.fingerprint["id"], *parts)).encode()).hexdigest()[:12]
    return cache_dir() / "tune" / key


def _start_from(llm, init, current, options: TuneOptions):
    """The wrapper a run starts from: ``init`` "auto" means ``current`` (an index's wrapper) when
    it has the run's shape, "none" token embeddings, anything else a wrapper by name or path."""
    if str(init).lower() == "auto":
        fits = current is not None and (current.header, current.trailer) == (options.header, options.trailer)
        return current if fits else None
    return llm.host.resolve_wrapper(init)  # None for "none"


def tune_model(model: str, options: TuneOptions, out: Path | None = None, data: Path | None = None,
               examples: int = 512, k: int = 4, device: str = "auto", dtype: str = "auto",
               work_dir: Path | None = None, progress: str = "auto", log=print, llm=None, retrieval: Path | None = None,
               prompts: str = "mixed", init: str | None = "none", gold_position: str = "retrieved"):
    """Train a general wrapper for ``model`` (a bundled name, a folder or a .gguf) on prompts from
    SQuAD v1.1 dev's train articles (``retrieval``: their ranking file, for retrieved distractors;
    ``prompts``: mixed, frozen, default or longform; ``gold_position``: "retrieved" keeps the ranking's order,
    "random" places the gold paragraph anywhere; ``options.gold_weight``: add cross-entropy on SQuAD's
    gold answers); returns (wrapper, report). ``out`` default: ``wrapper-<model>.safetensors`` in
    the current folder. ``init``: a wrapper (name or path) to start from, or "none"."""
    from ..llm import LazyLLM

    llm = llm or LazyLLM.from_pretrained(model, device=device, dtype=dtype, wrapper="none")
    exs = squad_examples(llm.tokenizer, examples, k=k, seed=options.seed, data=data, retrieval=retrieval, prompts=prompts,
                         gold_position=gold_position)
    name = Path(model).stem
    out = Path(out) if out is not None else Path(f"wrapper-{name}.safetensors")
    placed = gold_placement(retrieval, gold_position)
    work = work_dir or _work_dir(llm, "squad", data, examples, k, options.seed, retrieval, prompts, placed)
    start = _start_from(llm, init, None, options)  # "auto": no index wrapper, so token embeddings
    layout = {"source": "squad_v1.1_dev train articles", "prompts": prompts, "k": k,
              "retrieval": Path(retrieval).name if retrieval is not None else None, "gold_position": placed}
    return train_wrapper(llm, exs, options, out, work, progress=progress, name=name, log=log, init=start, data=layout)


def tune_index(index_dir: Path, options: TuneOptions, examples: int = 256, k: int = 4, device: str = "auto",
               out: Path | None = None, work_dir: Path | None = None, progress: str = "auto", log=print,
               init: str | None = "auto", llm=None):
    """Train a wrapper for the index's own chunks (questions written by the model, no labels),
    then re-encode the index's KV inside it (one atomic commit). ``init`` "auto" starts from the
    wrapper the index has (the model's bundled one, by default) when its shape fits. Returns
    (wrapper, report)."""
    from ..index import LazyIndex

    if options.gold_weight > 0:
        raise LazyRagError("--gold-weight needs labelled answers; an index's own chunks have none (the questions are "
                           "written by the model). Tune an index with --gold-weight 0.")
    idx = LazyIndex.load(index_dir, device=device, llm=llm)
    log(f"writing questions for {examples} random chunks of {index_dir} ...")
    exs = index_examples(idx, examples, k=k, seed=options.seed)
    work = work_dir or _work_dir(idx.llm, "index", Path(index_dir).resolve(), examples, k, options.seed)
    start = _start_from(idx.llm, init, idx.wrapper, options)
    if start is not None:
        log(f"starting from the wrapper {start.name} ({start.digest})")
    wrapper, report = train_wrapper(idx.llm, exs, options, out or work / "wrapper.safetensors", work,
                                    progress=progress, name=f"tuned:{Path(index_dir).name}", log=log, init=start,
                                    data={"source": "index (questions written by the model)", "k": k})
    report["kv_bytes_written"] = idx.rewrap(wrapper, progress=progress)
    return wrapper, report
