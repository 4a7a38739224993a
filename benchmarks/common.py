"""Shared helpers for benchmark scripts: records, JSON output, environment description."""
from __future__ import annotations

import datetime as _dt
import json
import platform
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
RESULTS = HERE / "results"

# Python puts this folder first on sys.path when a script in it runs, and our kernels.py would then
# shadow the `kernels` package that transformers probes for (seen on the GPU image: importing
# LlamaConfig failed). Scripts import this module first; from here on the folder is off the path.
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != HERE]


def environment() -> dict:
    import torch
    import transformers

    dev = torch.cuda.get_device_name(0) if torch.cuda.is_available() else f"cpu ({torch.get_num_threads()} threads)"
    return {"device": dev, "torch": torch.__version__, "transformers": transformers.__version__,
            "python": platform.python_version(), "date": _dt.date.today().isoformat()}


def write_records(name: str, records: list[dict]) -> Path:
    """Write a list of flat records to benchmarks/results/<name>.json."""
    RESULTS.mkdir(parents=True, exist_ok=True)
    path = RESULTS / f"{name}.json"
    path.write_text(json.dumps(records, indent=1) + "\n")
    return path


def print_table(records: list[dict], columns: list[str]) -> None:
    widths = [max(len(c), *(len(_fmt(r.get(c))) for r in records)) for c in columns]
    print("  ".join(c.ljust(w) for c, w in zip(columns, widths)))
    for r in records:
        print("  ".join(_fmt(r.get(c)).ljust(w) for c, w in zip(columns, widths)))


def _fmt(v) -> str:
    if isinstance(v, float):
        return f"{v:.2f}" if abs(v) < 1000 else f"{v:.0f}"
    return str(v)


class IdTokenizer:
    """Prompts of token ids only: this stands in for a tokenizer (decode, EOS, vocab)."""

    bos_token_id = eos_token_id = unk_token_id = None
    all_special_tokens: list = []
    chat_template = None

    def get_vocab(self):
        return {}

    def decode(self, ids, skip_special_tokens=True):
        return " ".join(map(str, ids))


def random_llama31_8b(layers: int = 32, device: str = "cuda"):
    """Llama-3.1-8B's shape (llama3 RoPE) with random bf16 weights, built in place on the device,
    since the benchmark machine has no model hub."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(hidden_size=4096, intermediate_size=14336, num_hidden_layers=layers, num_attention_heads=32,
                      num_key_value_heads=8, vocab_size=128256, max_position_embeddings=131072,
                      rope_parameters={"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0,
                                       "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                       "original_max_position_embeddings": 8192})
    torch.manual_seed(0)
    torch.set_default_dtype(torch.bfloat16)  # build the 16 GB of weights in bf16 directly
    try:
        with torch.device(device):
            return LlamaForCausalLM(cfg).eval()
    finally:
        torch.set_default_dtype(torch.float32)
