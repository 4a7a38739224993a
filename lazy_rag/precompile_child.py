"""The child process of ``build_precompile``: a one-layer model of the build's model config, with
random weights, runs the build's encode warm-up and calibration probes, so that the kernels they
compile land in Triton's cache on disk. It names its phase in the folder it is given
(``BuildPrecompile.PHASES``), atomically, for the build that waits on it.

    python -m lazy_rag.precompile_child FOLDER     # FOLDER/spec.json from BuildPrecompile
"""
from __future__ import annotations

import json
import os
import sys
from pathlib import Path

# the child's model: one layer, and a vocabulary this small (the warm-up's token ids are 1s), so
# that its weights are ~1/32 of an 8B model's and take no memory the real load needs
CHILD_VOCAB = 256


def one_layer_config(config):
    """A copy of ``config`` with one decoder layer and a small vocabulary: the same attention
    (heads, KV heads, head dim, RoPE) as the model's, so the same kernel variants."""
    cfg = config.__class__.from_dict(config.to_dict())
    cfg.num_hidden_layers = 1
    if getattr(cfg, "layer_types", None):
        cfg.layer_types = list(cfg.layer_types[:1])
    cfg.vocab_size = CHILD_VOCAB
    cfg.pad_token_id = None  # an embedding's padding row must lie inside the smaller vocabulary
    return cfg


def _set_phase(folder: Path, phase: str) -> None:
    tmp = folder / "phase.tmp"
    tmp.write_text(phase)
    os.replace(tmp, folder / "phase")


def main(folder: str) -> None:
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from .bench.random_models import IdTokenizer
    from .build_pipeline import EncodeWarmup
    from .llm import LazyLLM

    folder = Path(folder)
    spec = json.loads((folder / "spec.json").read_text())
    config = dict(spec["config"])
    cfg = one_layer_config(AutoConfig.for_model(config.pop("model_type"), **config))
    dtype = getattr(torch, spec["dtype"])
    kv_dtype = getattr(torch, spec["kv_dtype"])  # fp8 is torch.float8_e4m3fn (kernels.FP8)
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(spec["device"]):
            model = AutoModelForCausalLM.from_config(cfg).eval()
    finally:
        torch.set_default_dtype(previous)
    llm = LazyLLM(model, IdTokenizer(), **spec["engine"])
    _set_phase(folder, "warmup")
    warmup = EncodeWarmup(llm, [1] * spec["prefix_tokens"], None, kv_dtype)
    warmup.wait()
    if warmup.error is not None:
        raise warmup.error
    _set_phase(folder, "calibration")
    llm.engine.calibrate_read_or_encode()
    _set_phase(folder, "done")


if __name__ == "__main__":
    main(sys.argv[1])
